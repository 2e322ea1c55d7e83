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


# ------------------------------------------------------- caches with canaries

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
GUARDED_SHAPE = (2, 3, 8, 4)  # (batch, heads, max_len, head_dim) of a Guarded cache by default


class Guarded:
    """A cache pair sliced out of larger random buffers: every byte around the
    cache is a canary. ``snapshot()``/``unchanged()`` compare every byte of the
    backing buffers (cache and canaries) and of any extra tensors."""

    def __init__(self, b=2, h=3, t=8, d=4, dtype=torch.float32, layout="bhtd", seed=0):
        self.extra = []
        if layout == "bhtd":  # padding on every side of every dimension
            kb = random_tensor((b + 2, h + 2, t + 3, d + 2), dtype, seed=seed)
            vb = random_tensor((b + 2, h + 2, t + 3, d + 2), dtype, seed=seed + 1)
            self.keys = kb[1 : b + 1, 1 : h + 1, 1 : t + 1, 1 : d + 1]
            self.values = vb[1 : b + 1, 1 : h + 1, 2 : t + 2, 1 : d + 1]
            self.bufs = [kb, vb]
        elif layout == "bthd":  # (batch, seq, heads, head_dim) memory, transposed
            kb = random_tensor((b, t + 2, h, d), dtype, seed=seed)
            vb = random_tensor((b, t + 2, h, d), dtype, seed=seed + 1)
            self.keys = kb[:, 1 : t + 1].transpose(1, 2)
            self.values = vb[:, 1 : t + 1].transpose(1, 2)
            self.bufs = [kb, vb]
        elif layout == "fused":  # one (batch, heads, max_len, 2, head_dim) buffer
            fb = random_tensor((b, h, t + 1, 2, d), dtype, seed=seed)
            self.keys = fb[:, :, :t, 0]
            self.values = fb[:, :, :t, 1]
            self.bufs = [fb]
        else:
            raise AssertionError(layout)
        self.length = torch.zeros((), dtype=torch.int32)
        self.snapshot()

    @property
    def cache(self):
        return kvcache.KVLayerCache(self.keys, self.values, self.length)

    def watch(self, *tensors):
        self.extra += list(tensors)
        self.snapshot()

    def snapshot(self):
        self._before = [t.clone() for t in self.bufs + self.extra]

    def unchanged(self):
        for before, now in zip(self._before, self.bufs + self.extra):
            assert_same(now, before)
        return True


def guarded_new_kv(chunk=1, b=2, h=3, d=4, dtype=torch.float32, seed=10):
    """New keys and values for a Guarded cache of the default shape."""
    return (
        random_tensor((b, h, chunk, d), dtype, seed=seed),
        random_tensor((b, h, chunk, d), dtype, seed=seed + 1),
    )


def raises_nothing_written(g, exc, match, fn):
    g.snapshot()
    with pytest.raises(exc, match=match):
        fn()
    assert g.unchanged()


# The operators that write a cache, called on a KVLayerCache c with new keys/values kn, vn.
WRITERS = {
    "update_": lambda c, kn, vn: torch.ops.kvcache.update_(c.keys, c.values, kn, vn, 1),
    "update_.Tensor": lambda c, kn, vn: torch.ops.kvcache.update_.Tensor(c.keys, c.values, kn, vn, torch.tensor([1, 2])),
    "append_": lambda c, kn, vn: torch.ops.kvcache.append_(c.keys, c.values, c.length, kn, vn),
    "select_rows_": lambda c, kn, vn: torch.ops.kvcache.select_rows_(c.keys, c.values, c.length, torch.tensor([1, 0])),
}


@contextlib.contextmanager
def forced_split():
    """CPU attend with helper threads and splits at any size: parallel_work 0, splits of one block
    (64 slots), 2 threads; the settings are restored after."""
    saved_tuning = kvcache._C.attend_cpu_tuning()
    saved_threads = torch.get_num_threads()
    kvcache._C.set_attend_cpu_tuning(parallel_work=0.0, min_split=1)
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(saved_threads)
        kvcache._C.set_attend_cpu_tuning(**saved_tuning)


def record_crops(monkeypatch, layer_cls) -> list:
    """The ``n`` of every ``layer_cls.crop(n)`` call from now on, as a list (the layers still crop):
    assisted-generation tests check that a draft was rejected (some ``n < 0``)."""
    crops = []
    crop = layer_cls.crop

    def spy(self, n):
        crops.append(int(n))
        crop(self, n)

    monkeypatch.setattr(layer_cls, "crop", spy)
    return crops
