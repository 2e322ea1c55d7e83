"""Fake kernels: what torch.compile / torch.export see while tracing.

Each fake runs the operator's own C++ checks (``csrc/ops/*``, through
``kvcache._C``) on the fake tensors, then allocates outputs of the right
shape, dtype, device and strides. The checks read sizes as symbols, so a
traced program raises the same exception, with the same message, as eager
code. Values that only exist at run time (the entries of a device start or
lengths tensor) are checked by the kernels when the program runs.
"""

from __future__ import annotations

import torch

from . import _C

_lib = "kvcache::"


@torch.library.register_fake(_lib + "init_layer_cache")
def _init_layer_cache_fake(batch_size, num_kv_heads, head_dim, max_len, *, dtype=None, device=None):
    _C.check_init(batch_size, num_kv_heads, head_dim, max_len, dtype)
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    device = device if device is not None else torch.device("cpu")
    shape = (batch_size, num_kv_heads, max_len, head_dim)
    keys = torch.empty(shape, dtype=dtype, device=device)
    values = torch.empty(shape, dtype=dtype, device=device)
    return keys, values, torch.empty((), dtype=torch.int32, device=device)


@torch.library.register_fake(_lib + "update_")
def _update_fake(keys, values, keys_new, values_new, start):
    _C.check_update(keys, values, keys_new, values_new, start)
    return keys.new_empty((), dtype=torch.int32)


@torch.library.register_fake(_lib + "update_.Tensor")
def _update_tensor_fake(keys, values, keys_new, values_new, start):
    _C.check_update_tensor(keys, values, keys_new, values_new, start)
    return keys.new_empty(start.shape, dtype=torch.int32)


@torch.library.register_fake(_lib + "append_")
def _append_fake(keys, values, lengths, keys_new, values_new):
    _C.check_append(keys, values, lengths, keys_new, values_new)


@torch.library.register_fake(_lib + "attend")
def _attend_fake(q, keys, values, lengths, *, kv_start=None, scale=None, window=0, softcap=0.0, positions=None,
                 sinks=0):
    _C.check_attend(q, keys, values, lengths, kv_start, scale, window, softcap, positions, sinks)
    b, h, s, d = q.shape
    # (batch, seq, heads, head_dim) memory, as the kernels allocate it.
    return q.new_empty((b, s, h, d)).transpose(1, 2)


@torch.library.register_fake(_lib + "rollback")
def _rollback_fake(lengths, n, *, kv_start=None):
    _C.check_rollback(lengths, n, kv_start)
    return torch.empty_like(lengths, memory_format=torch.contiguous_format)


@torch.library.register_fake(_lib + "select_rows_")
def _select_rows_fake(keys, values, lengths, index):
    _C.check_select_rows(keys, values, lengths, index)
    return torch.empty_like(lengths, memory_format=torch.contiguous_format)


@torch.library.register_fake(_lib + "ring_update_")
def _ring_update_fake(keys, values, positions, keys_new, values_new, start, *, sinks=0):
    _C.check_ring_update(keys, values, positions, keys_new, values_new, start, sinks)
    return keys.new_empty(start.shape, dtype=torch.int32)
