"""Shared test helpers: data makers and byte-exact comparison (the references live in
references.py). Test files import it by name: pytest puts this folder on sys.path."""

from __future__ import annotations

import contextlib

import pytest
import torch

import kvcache  # noqa: F401  (loads the operators)


def cuda_ready() -> bool:
    """A GPU is visible and this build of kvcache has CUDA kernels."""
    return torch.cuda.is_available() and kvcache.build_info()["with_cuda"]


# Tests of behaviour every device shares take a `device` argument (the fixture below, imported
# into the test module): CUDA cases skip without a GPU. CUDA-only semantics (-1 lengths, graphs,
# sync-free calls, copy units) live in test_cuda.py.
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not cuda_ready(), reason="needs a GPU and a CUDA build of kvcache")),
]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


@contextlib.contextmanager
def no_host_sync(device):
    """On CUDA, any synchronizing call inside raises (a hidden host read of a device value);
    on other devices, nothing."""
    if torch.device(device).type != "cuda":
        yield
        return
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)

ALL_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


def random_tensor(shape, dtype, device="cpu", seed=0):
    """Random data of any dtype (distinct values, so misplaced writes show)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=g).bool()
    elif dtype.is_complex:
        t = torch.complex(torch.randn(shape, generator=g), torch.randn(shape, generator=g)).to(dtype)
    elif dtype.is_floating_point:
        t = (torch.randn(shape, generator=g) * 4).to(dtype)
    else:
        t = torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)
    return t.to(device)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor: compares every dtype (NaNs, float8) exactly."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert torch.equal(as_bytes(a), as_bytes(b)), "tensors differ"


def filled_cache(b, h, t, d, dtype=torch.float32, device="cpu", seed=100):
    """A cache pre-filled with random data, so untouched regions are checked too."""
    cache = kvcache.init_kv_layer_cache(b, h, d, t, dtype, device=device)
    cache.keys.copy_(random_tensor((b, h, t, d), dtype, device, seed=seed))
    cache.values.copy_(random_tensor((b, h, t, d), dtype, device, seed=seed + 1))
    return cache


def random_kv(b, h, chunk, d, dtype=torch.float32, device="cpu", seed=0):
    """New keys and values (batch, heads, chunk, head_dim), different from each other."""
    return (
        random_tensor((b, h, chunk, d), dtype, device, seed=seed),
        random_tensor((b, h, chunk, d), dtype, device, seed=seed + 1),
    )
