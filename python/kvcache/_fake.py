"""Fake (meta) kernels: shapes and checks for torch.compile / torch.export.

They mirror the metadata checks of ``csrc/validate.cpp`` so that a traced
program raises the same errors as eager; values of device positions cannot be
checked while tracing (there are none), so those are checked by the kernels.
"""

from __future__ import annotations

import torch

_INT_POS_DTYPES = (torch.int32, torch.int64)


def _check_update_meta(keys, values, keys_new, values_new) -> None:
    for name, t in (
        ("keys", keys),
        ("values", values),
        ("keys_new", keys_new),
        ("values_new", values_new),
    ):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be a 4-D tensor, got {t.dim()}-D shape {tuple(t.shape)}"
            )
    if values.shape != keys.shape:
        raise ValueError(
            f"values must have the same shape as keys {tuple(keys.shape)}, "
            f"got {tuple(values.shape)}"
        )
    b, h, _, d = keys.shape
    if keys_new.shape[0] != b or keys_new.shape[1] != h or keys_new.shape[3] != d:
        raise ValueError(
            f"keys_new must have shape (batch={b}, num_kv_heads={h}, chunk, "
            f"head_dim={d}) to match the cache, got {tuple(keys_new.shape)}"
        )
    if values_new.shape != keys_new.shape:
        raise ValueError(
            "values_new must have the same shape as keys_new "
            f"{tuple(keys_new.shape)}, got {tuple(values_new.shape)}"
        )
    for name, t in (("values", values), ("keys_new", keys_new), ("values_new", values_new)):
        if t.dtype != keys.dtype:
            raise TypeError(
                f"{name} must have the cache dtype {keys.dtype} (no implicit "
                f"casts), got {t.dtype}"
            )
        if t.device != keys.device:
            raise ValueError(
                f"{name} must be on the cache's device ({keys.device}), got {t.device}"
            )


@torch.library.register_fake("kvcache::init_layer_cache")
def _init_layer_cache_fake(batch_size, num_kv_heads, head_dim, max_len, *, dtype=None, device=None):
    for name, v in (
        ("batch_size", batch_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("max_len", max_len),
    ):
        torch._check_with(ValueError, v >= 0, lambda n=name, x=v: f"{n} must be >= 0, got {x}")
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    device = device if device is not None else torch.device("cpu")
    shape = (batch_size, num_kv_heads, max_len, head_dim)
    keys = torch.empty(shape, dtype=dtype, device=device)
    values = torch.empty(shape, dtype=dtype, device=device)
    length = torch.empty((), dtype=torch.int32, device=device)
    return keys, values, length


@torch.library.register_fake("kvcache::update_")
def _update_fake(keys, values, keys_new, values_new, start):
    _check_update_meta(keys, values, keys_new, values_new)
    torch._check_with(ValueError, start >= 0, lambda: f"start must be >= 0, got {start}")
    end = start + keys_new.shape[2]
    torch._check_with(
        ValueError,
        end <= keys.shape[2],
        lambda: f"KV cache overflow: end={end} exceeds max_len={keys.shape[2]}",
    )
    return torch.empty((), dtype=torch.int32, device=keys.device)


@torch.library.register_fake("kvcache::update_at_")
def _update_at_fake(keys, values, keys_new, values_new, positions):
    _check_update_meta(keys, values, keys_new, values_new)
    if positions.dtype not in _INT_POS_DTYPES:
        raise TypeError(
            f"positions must be an int32 or int64 tensor, got dtype {positions.dtype}"
        )
    if not (positions.dim() == 0 or (positions.dim() == 1 and positions.shape[0] == keys.shape[0])):
        raise ValueError(
            "positions must be a 0-D tensor (one start for every row) or have "
            f"shape (batch={keys.shape[0]},), got shape {tuple(positions.shape)}"
        )
    if positions.device != keys.device:
        raise ValueError(
            f"positions must be on the cache's device ({keys.device}), got {positions.device}"
        )
    return torch.empty(positions.shape, dtype=torch.int32, device=keys.device)
