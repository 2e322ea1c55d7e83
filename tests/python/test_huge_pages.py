"""Cache buffers in transparent huge pages (csrc/core/memory.h).

On Linux the CPU buffers of init_kv_layer_cache (and so of every cache built on it: rings,
kvcache.hf's layers) and of init_paged_cache are advised into huge pages before they are filled.
What is checked here, from the kernel's own account of the process's memory (/proc/self/smaps):
the advice reached the mapping that holds the buffer (its VmFlags carry "hg", which only
madvise(MADV_HUGEPAGE) sets), KVCACHE_HUGE_PAGES=0 leaves it off, and the buffers are what
torch.zeros gives (shape, dtype, contiguity, zeros) whatever their size. The buffers checked for
the flag are 64 MB: glibc maps an allocation that large afresh (its mmap threshold is at most
32 MB), so the flag cannot come from an earlier buffer's advice on reused heap memory.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kvcache
from kvcache import _C
from kvcache.paged import init_paged_cache

MB = 1 << 20
THP = "/sys/kernel/mm/transparent_hugepage/enabled"

needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.path.exists(THP),
    reason="transparent huge pages are a Linux feature (and this kernel has none)",
)


def _vm_flags(t: torch.Tensor) -> set:
    """The VmFlags of the mapping that holds the middle byte of ``t``."""
    addr = t.data_ptr() + t.nbytes // 2
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds address {addr:#x}")


@needs_thp
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_linear_cache_buffers_are_advised(kv_dtype):
    cache = kvcache.init_kv_layer_cache(64, 4, 64, 4096, torch.bfloat16, kv_dtype=kv_dtype)  # 64 MB (int8) each
    for buf in (cache.keys, cache.values):
        assert buf.nbytes >= 64 * MB
        assert "hg" in _vm_flags(buf)


@needs_thp
def test_ring_buffers_are_advised():
    ring = kvcache.init_ring_layer_cache(32, 4, 64, 4096, torch.float32)  # 128 MB each
    assert "hg" in _vm_flags(ring.keys) and "hg" in _vm_flags(ring.values)


@needs_thp
@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
def test_page_pools_are_advised(kv_dtype):
    pages = init_paged_cache(16384, 16, 4, 64, torch.bfloat16, kv_dtype=kv_dtype)  # 64 MB (fp8) each
    for buf in (pages.key_pages, pages.value_pages):
        assert buf.nbytes >= 64 * MB
        assert "hg" in _vm_flags(buf)


@needs_thp
def test_switch_off_leaves_4k_pages():
    # A fresh process: the setting is read from the environment at each allocation.
    code = (
        "import torch, kvcache, sys\n"
        "sys.path.insert(0, %r)\n"
        "from test_huge_pages import _vm_flags\n"
        "from kvcache.paged import init_paged_cache\n"
        "c = kvcache.init_kv_layer_cache(64, 4, 64, 4096, torch.float32)\n"
        "p = init_paged_cache(16384, 16, 4, 64, torch.float32)\n"
        "print(sorted({'hg' in _vm_flags(t) for t in (c.keys, c.values, p.key_pages, p.value_pages)}))\n"
    ) % os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, KVCACHE_HUGE_PAGES="0")
    env.pop("THP_MEM_ALLOC_ENABLE", None)  # torch's own switch advises every large allocation
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[False]", out.stdout + out.stderr


@pytest.mark.parametrize("shape", [(0,), (3, 5), (1, 1, MB // 4 + 7), (3, 2 * MB + 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.float8_e4m3fn])
def test_cache_zeros_is_torch_zeros(shape, dtype):
    # Sizes below, at and past 2 MB, and not a whole number of huge pages: the advice covers only
    # the aligned part, the buffer is all of it.
    t = _C.cache_zeros(list(shape), dtype)
    ref = torch.zeros(shape, dtype=dtype)
    assert t.shape == ref.shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t, ref.view(torch.uint8)
                       if ref.element_size() == 1 else ref)
    assert t.storage_offset() == 0 and t.untyped_storage().nbytes() == ref.untyped_storage().nbytes()


def test_meta_device_has_no_memory_to_advise():
    cache = kvcache.init_kv_layer_cache(2, 4, 64, 4096, torch.float32, device="meta")
    assert cache.keys.device.type == "meta" and cache.keys.shape == (2, 4, 4096, 64)


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_page_pools_follow_the_default_device(kv_dtype):
    # device=None is torch's default device, as torch.zeros takes it: pages and scales together.
    with torch.device("meta"):
        pages = init_paged_cache(4, 16, 2, 8, torch.float32, kv_dtype=kv_dtype)
    bufs = [pages.key_pages, pages.value_pages] + ([pages.key_scales, pages.value_scales] if kv_dtype else [])
    assert {b.device.type for b in bufs} == {"meta"}


def test_page_pools_init_compiles():
    # In compiled code the pools are torch.zeros (the allocation advice is eager-only).
    f = torch.compile(lambda: init_paged_cache(4, 16, 2, 8, torch.float32).key_pages.sum(), fullgraph=True,
                      backend="eager")
    assert f().item() == 0
