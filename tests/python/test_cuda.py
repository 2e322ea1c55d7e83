"""What only CUDA has, for every operator: skipped without a GPU.

Behaviour every device shares (results against the references, layouts, GQA, windows, padding)
is tested once, with a ``device`` parameter, in the subject's file (test_update.py,
test_attend.py, test_rows.py). Here: the -1 length convention for bad device values, CUDA
graphs and reduce-overhead compiles, copy units and alignment, 64-bit offsets, split-K rows,
several GPUs, and the paged ops (paged_write_ bit-exact as the CPU, paged_attend against the
CPU op and float64, under graph replay with changing metadata, bad metadata giving NaN).

Each test names the bug it would catch. Every op call runs under
``torch.cuda.set_sync_debug_mode("error")`` (``no_sync``), so a hidden host
sync (a device value read on the host) fails the test. Bad device values
(starts, lengths, n, index) must make a kernel write nothing but -1 into every
entry of the lengths it produces: the tests check both, with canary bytes
around the cache.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvcache

from kv_testing import ALL_DTYPES, as_bytes, assert_same, forced_split, no_host_sync, random_tensor
from references import assert_close, attention_reference, select_reference
from references import update_reference as reference_update
from test_paged import TOL as PAGED_TOL
from test_paged import dequantized, make_case
from test_paged import reference as paged_reference
from test_ring_update_quantized import quantize_ref

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and kvcache.build_info()["with_cuda"]),
    reason="needs a GPU and a CUDA build of kvcache",
)
DEV = torch.device("cuda")
ops = torch.ops.kvcache


# ----------------------------------------------------------------- helpers


def no_sync():
    """Any synchronizing CUDA call inside raises (a hidden host read of a device value)."""
    return no_host_sync(DEV)


def rand(shape, dtype, seed=0):
    return random_tensor(shape, dtype, DEV, seed=seed)


def ints(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=DEV)


class _Blob:
    """A CUDA array at any address (what from_blob and DLPack byte offsets allow)."""

    def __init__(self, owner, ptr, shape, strides, typestr):
        self._owner = owner  # keeps the memory alive
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "strides": tuple(strides),
            "typestr": typestr,
            "data": (ptr, False),
            "version": 2,
        }


_TYPESTR = {1: "|u1", 2: "<u2", 4: "<u4", 8: "<u8", 16: "<c16"}


def at_offset(shape, dtype, byte_offset, seed=0):
    """A contiguous tensor of `dtype` whose first byte is `byte_offset` bytes past a 256-byte
    boundary, filled with random bytes.

    Torch's own kernels may fault on an address that is not a multiple of the element
    size (or, for complex128, of 16), so the test reads and writes it through
    ``bytes_of(t)``, a uint8 view of the same memory.
    """
    item = torch.empty((), dtype=dtype).element_size()
    strides, acc = [], 1
    for n in reversed(shape):
        strides.insert(0, acc)
        acc *= n
    numel = math.prod(shape)
    owner = torch.randint(0, 256, (numel * item + byte_offset + 256,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(seed)).to(DEV)
    ptr = owner.data_ptr() + byte_offset
    t = torch.as_tensor(_Blob(owner, ptr, shape, [st * item for st in strides], _TYPESTR[item]), device=DEV)
    if dtype != torch.complex128:
        t = t.view(dtype)
    raw_shape = (*shape[:-1], shape[-1] * item)
    raw_strides = [st * item for st in strides[:-1]] + [1]
    t._raw = torch.as_tensor(_Blob(owner, ptr, raw_shape, raw_strides, "|u1"), device=DEV)
    assert t.data_ptr() % 256 == byte_offset % 256 and t._raw.data_ptr() == t.data_ptr()
    return t


def bytes_of(t):
    """The bytes of a (..., head_dim) tensor as (..., head_dim * itemsize) uint8, safe at any address."""
    return t._raw if hasattr(t, "_raw") else as_bytes(t).reshape(*t.shape[:-1], -1)


def with_canaries(b, h, t, d, dtype, seed=100, layout="bhtd"):
    """A cache sliced from the middle of a larger random buffer: (big, keys, values, cut).

    Any byte written outside the cache (before, after or between its rows)
    shows as a change in `big`. ``cut(x)`` takes the same (keys, values)
    slices of any tensor shaped like `big` (to build the expected buffer).
    """
    if layout == "bhtd":
        big = rand((2, b + 2, h + 1, t + 6, d + 3), dtype, seed)

        def cut(x):
            return x[0, 1 : b + 1, :h, 3 : t + 3, 1 : d + 1], x[1, 1 : b + 1, 1:, 3 : t + 3, 2 : d + 2]

    else:  # (batch, max_len, heads, head_dim) memory

        big = rand((2, b + 2, t + 6, h + 1, d + 3), dtype, seed)

        def cut(x):
            return (
                x[0, 1 : b + 1, 3 : t + 3, :h, 1 : d + 1].transpose(1, 2),
                x[1, 1 : b + 1, 3 : t + 3, 1:, 2 : d + 2].transpose(1, 2),
            )

    keys, values = cut(big)
    return big, keys, values, cut


def expected_big(big, cut, new_keys, new_values):
    """`big` with the cache region replaced: what the whole buffer must hold afterwards."""
    out = big.clone()
    k, v = cut(out)
    k.copy_(new_keys)
    v.copy_(new_values)
    return out


def test_build_info_reports_cuda():
    info = kvcache.build_info()
    assert info["with_cuda"] is True
    assert info["cuda_version"].split(".")[0] == torch.version.cuda.split(".")[0]
    archs = [a for a in info["cuda_archs"].split(";") if a]
    major, minor = torch.cuda.get_device_capability()
    # Machine code for this GPU, or PTX of an older target that the driver compiles.
    assert f"{major}.{minor}" in archs or any(float(a) <= major + minor / 10 for a in archs), archs


# ----------------------------------------------------------------- update_, update_.Tensor, append_


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("start,chunk", [(0, 1), (5, 3), (0, 64), (63, 1), (7, 0), (3, 37)])
def test_update_int_start_all_dtypes(dtype, start, chunk):
    """Host start: data, canaries, and the 0-D int32 length written by the copy kernel itself."""
    big, keys, values, cut = with_canaries(2, 3, 64, 24, dtype)
    kn, vn = rand((2, 3, chunk, 24), dtype, 1), rand((2, 3, chunk, 24), dtype, 2)
    eb = expected_big(big, cut, *reference_update(keys, values, kn, vn, start))
    with no_sync():
        length = ops.update_(keys, values, kn, vn, start)
    assert_same(big, eb)
    assert length.dtype == torch.int32 and length.shape == () and length.device == keys.device
    assert int(length) == start + chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2, torch.bool, torch.complex128])
@pytest.mark.parametrize("start_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("per_row", [False, True])
def test_update_tensor_start(dtype, start_dtype, per_row):
    """Device start, 0-D and per-row: data, canaries, lengths (validation pass + copy kernel)."""
    b = 4
    big, keys, values, cut = with_canaries(b, 2, 32, 16, dtype)
    kn, vn = rand((b, 2, 5, 16), dtype, 1), rand((b, 2, 5, 16), dtype, 2)
    starts = [0, 27, 13, 4] if per_row else [9] * b
    start = ints(starts if per_row else starts[0], start_dtype)
    eb = expected_big(big, cut, *reference_update(keys, values, kn, vn, starts))
    with no_sync():
        length = ops.update_.Tensor(keys, values, kn, vn, start)
    assert_same(big, eb)
    assert length.dtype == torch.int32 and length.shape == start.shape
    assert length.cpu().reshape(-1).tolist() == [s + 5 for s in (starts if per_row else starts[:1])]


@pytest.mark.parametrize("len_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("per_row", [False, True])
def test_append(len_dtype, per_row):
    """append_: writes at lengths, advances them in place (the start tensor is also the output)."""
    b = 3
    big, keys, values, cut = with_canaries(b, 4, 40, 32, torch.bfloat16, layout="bthd")
    starts = [3, 0, 31] if per_row else [7] * b
    lengths = ints(starts if per_row else starts[0], len_dtype)
    ptr = lengths.data_ptr()
    kn, vn = rand((b, 4, 6, 32), torch.bfloat16, 1), rand((b, 4, 6, 32), torch.bfloat16, 2)
    eb = expected_big(big, cut, *reference_update(keys, values, kn, vn, starts))
    with no_sync():
        ops.append_(keys, values, lengths, kn, vn)
    assert_same(big, eb)
    assert lengths.data_ptr() == ptr and lengths.dtype == len_dtype
    assert lengths.cpu().reshape(-1).tolist() == [s + 6 for s in (starts if per_row else starts[:1])]


# Copy units: 16 (fp32 hd 128), 8 (bf16 hd 4 / 12, fp32 hd 2 / 6), 4, 2, 1 bytes,
# and the element path (strided rows) for 1-, 2-, 4-, 8- and 16-byte elements.
UNIT_CASES = [
    (torch.float32, 128),
    (torch.bfloat16, 4),
    (torch.bfloat16, 12),
    (torch.float32, 2),
    (torch.float32, 6),
    (torch.float16, 2),
    (torch.float16, 7),
    (torch.int8, 3),
    (torch.bool, 16),
    (torch.float8_e4m3fn, 5),
    (torch.complex128, 3),
    (torch.float64, 1),
]


def make_operand(kind, shape, dtype, seed):
    """One tensor of the update in a given memory form."""
    b, h, t, d = shape
    item = torch.empty((), dtype=dtype).element_size()
    if kind == "dense":
        return rand(shape, dtype, seed)
    if kind == "misaligned":  # first byte off the element's own alignment (from_blob allows it)
        return at_offset(shape, dtype, item // 2, seed)
    if kind == "offset8":  # 8 bytes past a 16-byte boundary: 16-byte units impossible
        return at_offset(shape, dtype, 8, seed)
    if kind == "strided_rows":  # every other element: the element path
        return rand((b, h, t, 2 * d), dtype, seed)[..., ::2]
    if kind == "transposed":  # (batch, positions, heads, head_dim) memory
        return rand((b, t, h, d), dtype, seed).transpose(1, 2)
    raise ValueError(kind)


@pytest.mark.parametrize("dtype,head_dim", UNIT_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("odd", ["keys", "values", "keys_new", "values_new"])
@pytest.mark.parametrize("kind", ["misaligned", "offset8", "strided_rows", "transposed"])
def test_copy_units_one_tensor_at_a_time(dtype, head_dim, odd, kind):
    """One tensor misaligned or strided, the other three dense: every pair's unit is planned on
    its own, never wider than its addresses allow (a misaligned 16- or 8-byte access faults),
    and the element path moves elements of any size at any alignment."""
    item = torch.empty((), dtype=dtype).element_size()
    if kind == "misaligned" and item == 1:
        pytest.skip("a 1-byte element is never misaligned")
    b, h, t, chunk = 3, 2, 20, 5
    shapes = {"keys": (b, h, t, head_dim), "values": (b, h, t, head_dim),
              "keys_new": (b, h, chunk, head_dim), "values_new": (b, h, chunk, head_dim)}
    tensors = {
        name: make_operand(kind if name == odd else "dense", shape, dtype, seed)
        for seed, (name, shape) in enumerate(shapes.items())
    }
    keys, values, kn, vn = tensors["keys"], tensors["values"], tensors["keys_new"], tensors["values_new"]
    starts = [4, 15, 0]
    # The reference works on bytes (torch's own kernels may fault on a misaligned tensor).
    ek, ev = reference_update(bytes_of(keys), bytes_of(values), bytes_of(kn), bytes_of(vn), starts)
    start = ints(starts)
    with no_sync():
        ops.update_.Tensor(keys, values, kn, vn, start)
    torch.cuda.synchronize()  # a misaligned access surfaces here
    assert torch.equal(bytes_of(keys), ek)
    assert torch.equal(bytes_of(values), ev)


@pytest.mark.parametrize("op", ["update_.Tensor", "append_"])
@pytest.mark.parametrize("start_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
@pytest.mark.parametrize(
    "bad",
    [
        2**63 - 1,  # start + chunk overflows int64: one row before each slab
        2**63 - 3,
        -1,  # with chunk 1 the old length became 0, which looked valid
        -(2**63),
        2**32 + 5,  # truncates to a small valid-looking int32
        2**31,
        29,  # start + chunk = max_len + 1
    ],
)
def test_bad_starts_write_nothing(op, start_dtype, layout, bad):
    """Canaries around a cache sliced from a larger buffer: no byte changes anywhere, and every
    entry of the produced lengths is -1, so `(length >= 0).all()` is False."""
    if start_dtype == torch.int32 and not -(2**31) <= bad < 2**31:
        pytest.skip("not an int32 value")
    b, h, t, d, chunk = 4, 2, 32, 8, 4
    big, keys, values, _ = with_canaries(b, h, t, d, torch.float32, layout=layout)
    before = big.clone()
    kn, vn = rand((b, h, chunk, d), torch.float32, 1), rand((b, h, chunk, d), torch.float32, 2)
    for row in (0, b - 1, None):  # bad row first, last, or the 0-D start of every row
        starts = ints(bad, start_dtype) if row is None else ints([bad if r == row else 3 for r in range(b)], start_dtype)
        with no_sync():
            if op == "append_":
                ops.append_(keys, values, starts, kn, vn)
                produced = starts
            else:
                produced = ops.update_.Tensor(keys, values, kn, vn, starts)
        assert_same(big, before)
        assert not bool((produced >= 0).all())
        assert bool((produced == -1).all()), produced


@pytest.mark.parametrize("start_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("where", ["first", "middle", "last", "none"])
def test_all_or_nothing_many_blocks(start_dtype, where):
    """1024 slabs and several grid rows (chunk 64 > 8 rows per block): one bad row anywhere
    stops every block; with no bad row every row is written."""
    b, h, t, d, chunk = 64, 8, 160, 128, 64
    keys, values = rand((b, h, t, d), torch.float32, 1), rand((b, h, t, d), torch.float32, 2)
    kn, vn = rand((b, h, chunk, d), torch.float32, 3), rand((b, h, chunk, d), torch.float32, 4)
    starts = [(7 * r) % (t - chunk + 1) for r in range(b)]
    if where != "none":
        starts[{"first": 0, "middle": b // 2, "last": b - 1}[where]] = t - chunk + 1
    ek, ev = reference_update(keys, values, kn, vn, starts) if where == "none" else (keys.clone(), values.clone())
    start = ints(starts, start_dtype)
    with no_sync():
        length = ops.update_.Tensor(keys, values, kn, vn, start)
    assert_same(keys, ek)
    assert_same(values, ev)
    expected = [s + chunk for s in starts] if where == "none" else [-1] * b
    assert length.tolist() == expected


def test_large_cache_64bit_offsets():
    """A cache over 2**31 elements per buffer: writes near the end land exactly there, for a host
    and a device start, and the untouched region of both buffers stays zero."""
    b, h, t, d = 1, 16, 2**21 + 8, 64  # 2**31 + 8192 int8 elements per buffer (2 GiB each)
    keys = torch.zeros(b, h, t, d, dtype=torch.int8, device=DEV)
    values = torch.zeros_like(keys)
    kn = torch.randint(1, 100, (b, h, 2, d), dtype=torch.int8, device=DEV)
    vn = torch.randint(1, 100, (b, h, 2, d), dtype=torch.int8, device=DEV)
    start = ints(t - 4)
    with no_sync():
        ops.update_(keys, values, kn, vn, t - 2)
        ops.update_.Tensor(keys, values, kn.flip(-1), vn.flip(-1), start)
    assert torch.equal(keys[:, :, t - 2 :], kn) and torch.equal(values[:, :, t - 2 :], vn)
    assert torch.equal(keys[:, :, t - 4 : t - 2], kn.flip(-1)) and torch.equal(values[:, :, t - 4 : t - 2], vn.flip(-1))
    assert int(torch.count_nonzero(keys[:, :, : t - 4])) == 0
    assert int(torch.count_nonzero(values[:, :, : t - 4])) == 0
    del keys, values
    torch.cuda.empty_cache()


def test_large_cache_attend():
    """attend on a bf16 cache over 2**31 elements: the last slots of the last row lie past
    element 2**31; only slots [kv_start, length) are read (the rest is NaN)."""
    b, h, t, d = 2, 4, 2**21 + 64, 128  # 2**31 + 65536 elements per buffer (4 GiB each)
    keys = torch.full((b, h, t, d), float("nan"), dtype=torch.bfloat16, device=DEV)
    values = torch.full_like(keys, float("nan"))
    tail_k, tail_v = rand((b, h, 8, d), torch.bfloat16, 1), rand((b, h, 8, d), torch.bfloat16, 2)
    keys[:, :, t - 8 :] = tail_k
    values[:, :, t - 8 :] = tail_v
    q = rand((b, 8, 3, d), torch.bfloat16, 3)
    lengths = ints([t, t - 2], torch.int32)
    kv_start = ints([t - 8, t - 8], torch.int32)
    with no_sync():
        out = ops.attend(q, keys, values, lengths, kv_start=kv_start)
    ref = attention_reference(q, keys, values, lengths.cpu(), kv_start.cpu())
    assert_close(out, ref, torch.bfloat16)
    del keys, values
    torch.cuda.empty_cache()


# ----------------------------------------------------------------- CUDA graphs and torch.compile


def test_cuda_graph_update_tensor_and_attend_replayed():
    """One captured graph (update_.Tensor + attend) replayed with positions changing on the
    device: each replay writes at the new positions and attends over the new lengths."""
    b, h, kvh, t, d = 2, 4, 2, 512, 64  # few blocks, long rows: split-K and the combine kernel
    keys = torch.zeros(b, kvh, t, d, device=DEV)
    values = torch.zeros_like(keys)
    kn, vn = torch.empty(b, kvh, 1, d, device=DEV), torch.empty(b, kvh, 1, d, device=DEV)
    q = torch.empty(b, h, 1, d, device=DEV)
    pos = torch.zeros(b, dtype=torch.int64, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up outside capture
            length = ops.update_.Tensor(keys, values, kn, vn, pos)
            out = ops.attend(q, keys, values, length)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        length = ops.update_.Tensor(keys, values, kn, vn, pos)
        out = ops.attend(q, keys, values, length)
    keys.zero_()
    values.zero_()
    ref_k, ref_v = keys.clone(), values.clone()
    offsets = ints([0, 5])
    for step in list(range(20)) + [63, 64, 200, t - 6]:
        kn.copy_(rand((b, kvh, 1, d), torch.float32, 10 + step))
        vn.copy_(rand((b, kvh, 1, d), torch.float32, 1000 + step))
        q.copy_(rand((b, h, 1, d), torch.float32, 2000 + step))
        pos.copy_(offsets + step)
        graph.replay()
        for r, p in enumerate((step, step + 5)):
            ref_k[r, :, p] = kn[r, :, 0]
            ref_v[r, :, p] = vn[r, :, 0]
        assert torch.equal(keys, ref_k) and torch.equal(values, ref_v), step
        assert length.tolist() == [step + 1, step + 6]
        lens = torch.tensor([step + 1, step + 6])
        assert_close(out, attention_reference(q, ref_k, ref_v, lens), torch.float32)
    # Past the end inside the graph: nothing written, lengths -1, attend rows NaN.
    before_k, before_v = keys.clone(), values.clone()
    pos.copy_(ints([t, 0]))
    graph.replay()
    assert torch.equal(keys, before_k) and torch.equal(values, before_v)
    assert length.tolist() == [-1, -1]
    assert bool(out.isnan().all())


def test_cuda_graph_append_and_attend_replayed():
    """append_ advances the lengths in place inside a replayed graph (decode loop)."""
    b, h, kvh, t, d = 3, 8, 2, 40, 128
    keys = torch.zeros(b, kvh, t, d, dtype=torch.bfloat16, device=DEV)
    values = torch.zeros_like(keys)
    lengths = ints([0, 3, 10], torch.int32)
    kn = torch.empty(b, kvh, 1, d, dtype=torch.bfloat16, device=DEV)
    vn = torch.empty_like(kn)
    q = torch.empty(b, h, 1, d, dtype=torch.bfloat16, device=DEV)

    def step():
        ops.append_(keys, values, lengths, kn, vn)
        return ops.attend(q, keys, values, lengths)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    saved = lengths.clone()
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    lengths.copy_(saved)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    lengths.copy_(saved)
    keys.zero_()
    values.zero_()
    ref_k, ref_v = keys.clone(), values.clone()
    for i in range(25):
        kn.copy_(rand(kn.shape, torch.bfloat16, i))
        vn.copy_(rand(kn.shape, torch.bfloat16, 100 + i))
        q.copy_(rand(q.shape, torch.bfloat16, 200 + i))
        graph.replay()
        for r, start in enumerate(saved.tolist()):
            ref_k[r, :, start + i] = kn[r, :, 0]
            ref_v[r, :, start + i] = vn[r, :, 0]
        assert lengths.tolist() == [x + i + 1 for x in saved.tolist()]
        assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)
        assert_close(out, attention_reference(q, ref_k, ref_v, lengths.cpu()), torch.bfloat16)


@torch.no_grad()
def test_compile_reduce_overhead_decode_step_replays_graphs():
    """torch.compile(mode="reduce-overhead") of a decode step whose cache buffers are marked
    static: Inductor must not skip CUDA graphs (mutated inputs would make it), and the tokens
    equal eager greedy decoding."""
    from torch._dynamo.utils import counters

    from kvcache.models import Decoder, greedy_generate

    cfg = kvcache.TransformerConfig(num_layers=2, num_heads=8, d_model=64, max_len=64, num_kv_heads=2)
    model = Decoder(cfg, seed=0).to(DEV).eval()
    prompt = torch.randint(0, cfg.vocab_size, (2, 6), device=DEV)
    new = 12
    ref_tokens, _ = greedy_generate(
        model, prompt, new, list(kvcache.init_decoder_kv_caches_from_config(cfg, batch_size=2, device=DEV))
    )
    caches = []
    for c in kvcache.init_decoder_kv_caches_from_config(cfg, batch_size=2, device=DEV):
        lengths = torch.zeros(2, dtype=torch.int32, device=DEV)
        caches.append(kvcache.KVLayerCache(c.keys, c.values, lengths))
        for buf in (c.keys, c.values, lengths):
            torch._dynamo.mark_static_address(buf)

    def step(tokens):
        logits, _ = model(tokens, None, caches)  # append_: lengths advance in place
        return logits[:, -1].argmax(-1)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    tok = step(prompt)  # eager prefill
    tokens = [tok.clone()]
    for _ in range(new - 1):
        tok = compiled(tok[:, None]).clone()  # graph outputs are overwritten by the next replay
        tokens.append(tok)
    assert torch.equal(torch.stack(tokens, 1), ref_tokens)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    torch._dynamo.reset()


# ----------------------------------------------------------------- attend


def attend_case(dtype, batch, heads, kv_heads, head_dim, seq, lengths, max_len, seed=0, poison=True):
    """Random q and cache (unit scale: realistic logits); slots outside [0, length) hold NaN
    and Inf (must never be read)."""
    q = rand((batch, heads, seq, head_dim), dtype, seed) / 4
    keys = rand((batch, kv_heads, max_len, head_dim), dtype, seed + 1) / 4
    values = rand((batch, kv_heads, max_len, head_dim), dtype, seed + 2) / 4
    if poison:
        for r, length in enumerate(lengths):
            keys[r, :, length:] = float("nan")
            values[r, :, length:] = float("inf")
    return q, keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seq", [1, 5, 64])
def test_attend_kv_start_window_softcap_scale(dtype, seq):
    """Left padding (NaN before kv_start), sliding window, softcap and scale, with split-K
    (one long row per KV head) and without."""
    lengths = [4000, 70, 900]
    # The last row: its first query (at slot 900 - seq) sees no slot when seq > 1.
    kv_start = [100, 3, 900 - seq + (1 if seq > 1 else 0)]
    q, keys, values = attend_case(dtype, 3, 4, 1, 64, seq, lengths, 4096)
    for r, first in enumerate(kv_start):
        keys[r, :, :first] = float("nan")
        values[r, :, :first] = float("-inf")
    lens, firsts = ints(lengths), ints(kv_start, torch.int32)
    for window, softcap, scale in [(0, 0.0, None), (33, 0.0, None), (0, 30.0, 0.3), (200, 5.0, 0.05)]:
        with no_sync():
            out = ops.attend(q, keys, values, lens, kv_start=firsts, scale=scale, window=window, softcap=softcap)
        ref = attention_reference(q, keys, values, lens.cpu(), firsts.cpu(), scale, window, softcap)
        assert_close(out, ref, dtype)


@pytest.mark.parametrize("batch,kv_heads", [(2, 1), (64, 8)])  # split-K + combine, and one split
@pytest.mark.parametrize(
    "bad_len,bad_first",
    [(-1, 0), (0, 0), (4097, 0), (2**31, 0), (-(2**40), 0), (100, -1), (100, 101), (100, 2**40)],
)
def test_attend_bad_rows_get_nan_and_read_nothing(batch, kv_heads, bad_len, bad_first):
    """A length outside [seq, max_len] or kv_start outside [0, length]: that row is NaN, the
    others are exact; nothing out of bounds is read (the cache is a slice of a larger buffer
    whose surroundings are NaN: a stray read would poison other rows)."""
    seq, d, max_len = 2, 64, 4096
    big = torch.full((batch, kv_heads, max_len + 64, d), float("nan"), device=DEV)
    keys, values = big[:, :, 32 : 32 + max_len], big.clone()[:, :, 32 : 32 + max_len]
    keys.copy_(rand(keys.shape, torch.float32, 1))
    values.copy_(rand(values.shape, torch.float32, 2))
    q = rand((batch, kv_heads * 4, seq, d), torch.float32, 3)
    lengths = [max_len - 7 * r for r in range(batch)]
    firsts = [0] * batch
    bad = batch // 2
    lengths[bad], firsts[bad] = bad_len, bad_first
    lens, fst = ints(lengths), ints(firsts)
    with no_sync():
        out = ops.attend(q, keys, values, lens, kv_start=fst)
    assert bool(out[bad].isnan().all())
    good = [r for r in range(batch) if r != bad]
    ref = attention_reference(q[good], keys[good], values[good], lens[good].cpu(), fst[good].cpu())
    assert_close(out[good], ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_strided_transposed_and_misaligned(dtype):
    """Transposed q and cache, a strided head_dim (element loads) and a cache 4 bytes off a
    16-byte boundary (no 16-byte loads allowed): same results as the dense case."""
    b, h, kvh, s, d, t = 2, 8, 4, 3, 64, 200
    lengths = [150, 3]
    q, keys, values = attend_case(dtype, b, h, kvh, d, s, lengths, t, poison=False)
    ref = attention_reference(q, keys, values, torch.tensor(lengths))
    lens = ints(lengths)
    forms = {
        "transposed": lambda x: x.transpose(1, 2).contiguous().transpose(1, 2),
        "strided": lambda x: torch.stack([x, torch.full_like(x, float("nan"))], -1).flatten(-2)[..., ::2],
        "misaligned": lambda x: at_offset(tuple(x.shape), dtype, 4).copy_(x),
    }
    for name, form in forms.items():
        for which in ("q", "keys", "values"):
            args = {"q": q, "keys": keys, "values": values}
            args[which] = form(args[which])
            assert torch.equal(args[which], {"q": q, "keys": keys, "values": values}[which])
            with no_sync():
                out = ops.attend(args["q"], args["keys"], args["values"], lens)
            assert_close(out, ref, dtype)


def test_attend_matches_cpu_kernel():
    """The CUDA and CPU kernels (both float32 accumulation) agree closely."""
    lengths = [37, 512, 1]
    q, keys, values = attend_case(torch.float32, 3, 8, 2, 96, 1, lengths, 600, poison=False)
    lens = ints(lengths)
    with no_sync():
        out = ops.attend(q, keys, values, lens, window=100, softcap=20.0)
    cpu = ops.attend(q.cpu(), keys.cpu(), values.cpu(), torch.tensor(lengths), window=100, softcap=20.0)
    torch.testing.assert_close(out.cpu(), cpu, atol=1e-5, rtol=1e-5)


def nan_split_case(kind):
    """Two decode rows of 4000 slots, one KV head, 4 query heads: on CUDA each (row, KV head) is one
    block, so the row is split into many parts (up to 64, one per 64+ slots) and merged by
    attend_combine_kernel. Row 0 gets the bad value at slot 3000; row 1 stays clean.
    Returns (args, kwargs, (keys, values) as float64 for the reference)."""
    b, h, t, d = 2, 4, 4096, 64
    g = torch.Generator().manual_seed(21)
    q = torch.randn(b, h, 1, d, generator=g) / 4
    lengths = torch.tensor([4000, 3500])
    if kind == "nan-key-scale":
        keys = torch.randint(-127, 128, (b, 1, t, d), generator=g).to(torch.int8)
        values = torch.randint(-127, 128, (b, 1, t, d), generator=g).to(torch.int8)
        ks = torch.rand(b, 1, t, generator=g) * 0.02 + 1e-3
        vs = torch.rand(b, 1, t, generator=g) * 0.05 + 1e-3
        ks[0, 0, 3000] = float("nan")
        q = q.to(torch.bfloat16)
        deq = (keys.double() * ks.double()[..., None], values.double() * vs.double()[..., None])
        return (q, keys, values, lengths), dict(k_scale=ks, v_scale=vs), deq
    keys = torch.randn(b, 1, t, d, generator=g) / 4
    values = torch.randn(b, 1, t, d, generator=g)
    if kind == "nan-key":
        keys[0, 0, 3000, 7] = float("nan")
    elif kind == "nan-query":
        q[0, 1, 0, 7] = float("nan")
    elif kind == "inf-score":
        keys[0, 0, 3000] = float("inf")
        q[0] = q[0].abs()  # every head's score at slot 3000 is +inf
    else:
        assert kind == "none", kind
    return (q, keys, values, lengths), {}, (keys.double(), values.double())


@pytest.mark.parametrize("kind", ["nan-key", "nan-query", "inf-score", "nan-key-scale", "none"])
def test_attend_split_rows_keep_nan_as_the_cpu(kind):
    """A NaN in a visible key, a NaN query, a NaN key scale or a +inf score make a split row NaN
    exactly where the CPU (forced split, core/merge.h's rule) and float64 attention give NaN; the
    other elements match both. Before the fix the combine merged only parts whose sum was > 0, so
    a part with a NaN sum was dropped and the row came out finite."""
    args, kw, (k_ref, v_ref) = nan_split_case(kind)
    ref = attention_reference(args[0], k_ref, v_ref, args[3])
    nan = torch.isnan(ref)
    assert not nan[1].any() and (kind == "none") != bool(nan[0].any())  # the case is what it claims
    with forced_split():
        cpu = ops.attend(*args, **kw)
    dev_args = [x.to(DEV) for x in args]
    dev_kw = {k: v.to(DEV) for k, v in kw.items()}
    with no_sync():
        out = ops.attend(*dev_args, **dev_kw).cpu()
    assert torch.equal(torch.isnan(cpu), nan)
    assert torch.equal(torch.isnan(out), nan), (kind, int(torch.isnan(out).sum()), int(nan.sum()))
    tol = 1e-5 if args[0].dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[~nan].double(), ref[~nan], atol=tol, rtol=tol)
    torch.testing.assert_close(out[~nan], cpu[~nan], atol=tol, rtol=tol)


def test_attend_scale_bound_holds_on_cuda():
    """attend's scale bound (scale * log2(e) * head_dim <= FLT_MAX, csrc/ops/attend.cpp) is what the
    CUDA kernel needs too: just under it, with query and key elements at +-1, the output is finite
    and the one-hot float64 answer; over it (scale=1e38, which gave NaN) a ValueError."""
    d = 64
    g = torch.Generator().manual_seed(22)
    q = torch.randn(2, 4, 1, d, generator=g).sign()
    keys = (torch.rand(2, 2, 16, d, generator=g) * 2 - 1)
    keys[0, 0, 5] = q[0, 0, 0]
    values = torch.randn(2, 2, 16, d, generator=g)
    lengths = torch.tensor([16, 9])
    scale = 0.99 * torch.finfo(torch.float32).max / (1.4426950408889634 * d)
    with no_sync():
        out = ops.attend(q.to(DEV), keys.to(DEV), values.to(DEV), lengths.to(DEV), scale=scale)
    ref = attention_reference(q, keys, values, lengths, scale=scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"scale=1e\+38 makes scores overflow float32"):
        ops.attend(q.to(DEV), keys.to(DEV), values.to(DEV), lengths.to(DEV), scale=1e38)


# ------------------------------------------------------------------ rollback and select_rows_


@pytest.mark.parametrize("len_dtype", [torch.int32, torch.int64])
def test_rollback(len_dtype):
    lengths = ints([10, 7, 30, 0], len_dtype)
    n, first = ints([3, 7, 0, 0]), ints([2, 0, 5, 0])
    with no_sync():
        lengths = ops.rollback(lengths, n, kv_start=first)
    assert lengths.tolist() == [7, 0, 30, 0] and lengths.dtype == len_dtype
    two = ints(2, torch.int32)
    with no_sync():
        out = ops.rollback(lengths, two)  # a 0-D n for every row, but row 1 holds 0: all poisoned
    assert out.tolist() == [-1, -1, -1, -1]
    assert lengths.tolist() == [7, 0, 30, 0]  # the input is never written
    scalar, five = ints(12, len_dtype), ints(5)
    with no_sync():
        out = ops.rollback(scalar, five)
    assert out.shape == () and int(out) == 7


@pytest.mark.parametrize(
    "lengths,n,kv_start",
    [
        ([5, 5], [6, 0], None),  # more than the row holds
        ([5, 5], [0, -1], None),  # negative n
        ([-1, 5], [0, 0], None),  # negative length
        ([5, 5], [0, 3], [0, 3]),  # below kv_start
        ([5, 5], [0, 0], [0, 6]),  # kv_start past the length
        ([5, 5], [0, 0], [-1, 0]),
        ([5, 5], [0, 2**63 - 1], None),  # len - n would overflow
        ([5, 5], [-(2**63), 0], None),
    ],
)
def test_rollback_bad_values_poison_every_length(lengths, n, kv_start):
    ln = ints(lengths)
    firsts = None if kv_start is None else ints(kv_start)
    drop = ints(n)
    with no_sync():
        out = ops.rollback(ln, drop, kv_start=firsts)
    assert out.tolist() == [-1, -1]
    assert ln.tolist() == lengths


def test_rollback_0d_lengths_per_row_kv_start():
    """A shared length is checked against every row's kv_start (as attend takes the pair)."""
    with no_sync():
        ok = ops.rollback(ints(8, torch.int32), ints(2), kv_start=ints([0, 3, 5]))
        bad = ops.rollback(ints(8, torch.int32), ints(4), kv_start=ints([0, 3, 5]))  # row 2: 8 - 4 < 5
    assert ok.shape == () and int(ok) == 6 and ok.dtype == torch.int32
    assert bad.shape == () and int(bad) == -1


def test_rollback_empty_kv_start_with_0d_lengths_raises():
    """An empty kv_start with a 0-D lengths has no row to check the rollback against: the kernel
    read one entry past it. The shared host check refuses it (as on the CPU) before any launch."""
    for dtype in (torch.int64, torch.int32):
        with no_sync(), pytest.raises(ValueError, match=r"kv_start must be a 0-D tensor or have shape "
                                                        r"\(batch,\) with batch >= 1 .* got shape \[0\]"):
            ops.rollback(ints(8, dtype), ints(2), kv_start=ints([], dtype))


@pytest.mark.parametrize(
    "rows",
    [[True, False, True, False], [3, 1], [2, 2], 1, []],
    ids=["mask", "indices", "repeats", "0-d", "empty"],
)
@pytest.mark.parametrize("len_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("rows_dtype", [None, torch.int32])
def test_reset_rows(rows, len_dtype, rows_dtype):
    lengths = ints([3, 4, 5, 6], len_dtype)
    is_mask = isinstance(rows, list) and rows and isinstance(rows[0], bool)
    if is_mask and rows_dtype is not None:
        pytest.skip("a mask is bool")
    r = torch.tensor(rows, dtype=torch.bool if is_mask else (rows_dtype or torch.int64), device=DEV)
    expect = lengths.cpu().clone()
    if is_mask:
        expect[r.cpu()] = 0
    else:
        for i in r.cpu().reshape(-1).tolist():
            expect[i] = 0
    with no_sync():
        out = ops.reset_rows(lengths, r)
    assert out.cpu().tolist() == expect.tolist() and out.dtype == len_dtype
    assert lengths.tolist() == [3, 4, 5, 6]  # the input is never written


@pytest.mark.parametrize("rows", [[-1], [0, 4], [2**40]], ids=["negative", "past-batch", "huge"])
def test_reset_rows_bad_index_poisons_every_length(rows):
    lengths = ints([3, 4, 5, 6], torch.int32)
    with no_sync():
        out = ops.reset_rows(lengths, ints(rows))
    assert out.tolist() == [-1, -1, -1, -1]
    with pytest.raises(ValueError, match=r"rows \(a bool mask\) must have shape \(batch=4,\)"):
        ops.reset_rows(lengths, torch.tensor([True], device=DEV))  # a host-visible shape: raised


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex128, torch.bool])
@pytest.mark.parametrize(
    "index",
    [[1, 2, 3, 0], [0, 0, 0, 0], [3, 3, 1, 1], [0, 1, 2, 3], [2, 0, 2, 1]],
    ids=["permutation", "all-from-0", "repeats", "identity", "subset"],
)
@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
def test_select_rows(dtype, index, layout):
    """Permutations, repeats, subsets: only filled slots move; canaries stay."""
    big, keys, values, cut = with_canaries(4, 3, 50, 24, dtype, layout=layout)
    lengths = ints([50, 0, 17, 33], torch.int32)
    ek, ev, new = select_reference(keys, values, lengths.cpu(), index)
    eb = expected_big(big, cut, ek, ev)
    idx = ints(index)
    with no_sync():
        out = ops.select_rows_(keys, values, lengths, idx)
    assert_same(big, eb)
    assert out.tolist() == new.tolist() and lengths.tolist() == [50, 0, 17, 33]


def test_select_rows_0d_lengths_and_misaligned():
    keys = at_offset((3, 2, 20, 3), torch.complex128, 8, seed=1)  # 8-byte units only
    values = rand((3, 2, 20, 6), torch.complex128, 2)[..., ::2]  # element path
    lengths = ints(11)
    index = [2, 2, 0]
    ek, _, _ = select_reference(bytes_of(keys), bytes_of(keys), lengths.cpu(), index)
    _, ev, _ = select_reference(values, values, lengths.cpu(), index)
    idx = ints(index, torch.int32)
    with no_sync():
        out = ops.select_rows_(keys, values, lengths, idx)
    torch.cuda.synchronize()
    assert torch.equal(bytes_of(keys), ek)
    assert_same(values, ev)
    assert out.shape == () and int(out) == 11


def test_select_rows_several_scratch_rounds():
    """Buffers of 1 GiB: the moved slots go through the scratch in several rounds."""
    b, h, t, d = 8, 8, 16384, 128
    keys, values = rand((b, h, t, d), torch.float32, 1), rand((b, h, t, d), torch.float32, 2)
    lengths = ints([16384, 9000, 100, 0, 8193, 8192, 1, 16000], torch.int64)
    index = [7, 0, 0, 4, 1, 5, 3, 6]
    ek, ev, new = select_reference(keys, values, lengths.cpu(), index)
    idx = ints(index)
    with no_sync():
        out = ops.select_rows_(keys, values, lengths, idx)
    assert torch.equal(keys, ek) and torch.equal(values, ev)
    assert out.tolist() == new.tolist()


@pytest.mark.parametrize("len_dtype", [torch.int32, torch.int64])
def test_select_rows_batch_0_returns_the_0d_length(len_dtype):
    """Batch 0 with a 0-D lengths: nothing moves and the shared length comes back, as on the CPU.
    Before the fix the CUDA launcher returned at once and the result was uninitialised memory."""
    for value in (7, 0, 3):
        keys = torch.zeros(0, 2, 8, 4, device=DEV)
        values = torch.zeros_like(keys)
        lengths = ints(value, len_dtype)
        index = ints([])
        with no_sync():
            out = ops.select_rows_(keys, values, lengths, index)
        cpu = ops.select_rows_(keys.cpu(), values.cpu(), lengths.cpu(), index.cpu())
        assert out.shape == () and out.dtype == len_dtype and int(out) == value
        assert int(cpu) == value and int(lengths) == value


@pytest.mark.parametrize(
    "lengths,index",
    [
        ([5, 5, 5], [0, 3, 1]),  # index == batch
        ([5, 5, 5], [-1, 0, 1]),
        ([5, 5, 5], [0, 2**40, 1]),
        ([5, 51, 5], [0, 0, 0]),  # a length past max_len (even one not selected)
        ([5, -1, 5], [2, 2, 2]),
    ],
)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_select_rows_bad_values_write_nothing(lengths, index, index_dtype):
    if index_dtype == torch.int32 and max(abs(i) for i in index) >= 2**31:
        pytest.skip("not an int32 value")
    big, keys, values, _ = with_canaries(3, 2, 50, 8, torch.float32)
    before = big.clone()
    ln = ints(lengths)
    idx = ints(index, index_dtype)
    with no_sync():
        out = ops.select_rows_(keys, values, ln, idx)
    assert_same(big, before)
    assert out.tolist() == [-1, -1, -1] and ln.tolist() == lengths


# ----------------------------------------------------------------- ring_update_


def ring_write_reference(keys, values, positions, keys_new, values_new, starts, sinks):
    """Plain PyTorch: the ring after writing positions [start, start + chunk) of each row. A ring of
    capacity C keeps the sinks and the last C - sinks positions of the write (earlier ones would be
    overwritten by later ones); position p lives at slot p (p < sinks) or
    sinks + (p - sinks) % (C - sinks)."""
    k, v, pos = keys.clone(), values.clone(), positions.clone()
    cap, chunk = keys.shape[2], keys_new.shape[2]
    for b, start in enumerate(starts):
        p = torch.arange(start, start + chunk)
        end = start + chunk
        kept = (p < sinks) | (p >= end - (cap - sinks))
        p = p[kept]
        slot = torch.where(p < sinks, p, sinks + (p - sinks) % (cap - sinks))
        k[b][:, slot] = keys_new[b][:, kept]
        v[b][:, slot] = values_new[b][:, kept]
        pos[b, slot] = p.to(pos.dtype)
    return k, v, pos


@pytest.mark.parametrize("sinks", [0, 4])
def test_ring_update_chunk_longer_than_one_grid(sinks):
    """A 600,000-token chunk (75,000 tiles of 8 tokens: more than the grid's y limit of 65535, which
    made CUDA refuse chunks above 524,280 tokens) into a ring of 64 slots: the kept tokens land where
    the slot rule puts them, every other byte unchanged, as the CPU writes them."""
    b, h, cap, d, chunk = 2, 2, 64, 8, 600_000
    starts = [0, 1000]
    keys, values = rand((b, h, cap, d), torch.float32, 31), rand((b, h, cap, d), torch.float32, 32)
    positions = torch.full((b, cap), -1, dtype=torch.int32, device=DEV)
    kn, vn = rand((b, h, chunk, d), torch.float32, 33), rand((b, h, chunk, d), torch.float32, 34)
    ek, ev, epos = ring_write_reference(keys.cpu(), values.cpu(), positions.cpu(), kn.cpu(), vn.cpu(), starts, sinks)
    ck, cv, cpos = keys.cpu(), values.cpu(), positions.cpu()
    cpu_len = ops.ring_update_(ck, cv, cpos, kn.cpu(), vn.cpu(), torch.tensor(starts), sinks=sinks)
    with no_sync():
        length = ops.ring_update_(keys, values, positions, kn, vn, ints(starts), sinks=sinks)
    assert length.tolist() == [s + chunk for s in starts] == cpu_len.tolist()
    assert torch.equal(keys.cpu(), ek) and torch.equal(values.cpu(), ev) and torch.equal(positions.cpu(), epos)
    assert torch.equal(keys.cpu(), ck) and torch.equal(values.cpu(), cv) and torch.equal(positions.cpu(), cpos)


# ----------------------------------------------------------------- paged_write_, paged_attend

PAGE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn]
QUANTIZED = (torch.int8, torch.float8_e4m3fn)


def paged_write_case(page_dtype, n, slot_dtype=torch.int64, nb=40, bs=16, kvh=3, d=64, seed=0):
    """Random pages (and scales for int8/fp8 pages), n tokens of bf16 (quantized pages) or the pages'
    dtype, value with strided heads, n distinct random slots with every 7th token skipped (-1)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.bfloat16 if page_dtype in QUANTIZED else page_dtype
    kp = random_tensor((nb, bs, kvh, d), page_dtype, seed=seed)
    vp = random_tensor((nb, bs, kvh, d), page_dtype, seed=seed + 1)
    scales = {}
    if page_dtype in QUANTIZED:
        scales = dict(key_scales=torch.rand(nb, bs, kvh, generator=g) + 0.5,
                      value_scales=torch.rand(nb, bs, kvh, generator=g) + 0.5)
    key = (torch.randn(n, kvh, d, generator=g) * 3).to(src)
    value = torch.randn(n, 2 * kvh, d, generator=g).to(src)[:, ::2]
    slots = torch.randperm(nb * bs, generator=g)[:n]
    slots[3::7] = -1
    return kp, vp, key, value, slots.to(slot_dtype), scales


def on_dev(*xs):
    return [x.to(DEV) for x in xs]


@pytest.mark.parametrize("page_dtype", PAGE_DTYPES)
@pytest.mark.parametrize("n", [1, 37, 600])  # 600: past the in-block check (the check kernel's path)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_paged_write_bit_exact_as_cpu(page_dtype, n, slot_dtype):
    """Every byte of the pages and scales equals the CPU kernel's (plain copies and the shared
    quantizer of core/quant.h), with no host sync; skipped tokens and other slots untouched."""
    kp, vp, key, value, slots, scales = paged_write_case(page_dtype, n, slot_dtype)
    dk, dv, dkey, dval, dslots = on_dev(kp, vp, key, value, slots)
    dscales = {k: v.to(DEV) for k, v in scales.items()}
    ops.paged_write_(kp, vp, key, value, slots, **scales)
    with no_sync():
        ops.paged_write_(dk, dv, dkey, dval, dslots, **dscales)
    assert_same(dk.cpu(), kp)
    assert_same(dv.cpu(), vp)
    for name in scales:
        assert_same(dscales[name].cpu(), scales[name])


@pytest.mark.parametrize("n", [5, 600])
@pytest.mark.parametrize("bad", ["past-end", "below-minus-one", "duplicate", "huge"])
@pytest.mark.parametrize("page_dtype", [torch.bfloat16, torch.int8])
def test_paged_write_bad_slots_write_nothing(n, bad, page_dtype):
    """A slot outside [-1, num_blocks * block_size) or given twice: the CPU raises ValueError and
    CUDA writes nothing at all (no page byte, no scale), without a host sync."""
    kp, vp, key, value, slots, scales = paged_write_case(page_dtype, n)
    total = kp.shape[0] * kp.shape[1]
    if bad == "past-end":
        slots[n // 2] = total
    elif bad == "below-minus-one":
        slots[-1] = -2
    elif bad == "duplicate":
        slots[-1] = slots[0]
    else:
        slots[n // 2] = 2**40
    with pytest.raises(ValueError):
        ops.paged_write_(kp.clone(), vp.clone(), key, value, slots,
                         **{k: v.clone() for k, v in scales.items()})
    dk, dv, dkey, dval, dslots = on_dev(kp, vp, key, value, slots)
    dscales = {k: v.to(DEV) for k, v in scales.items()}
    with no_sync():
        ops.paged_write_(dk, dv, dkey, dval, dslots, **dscales)
    assert_same(dk.cpu(), kp)
    assert_same(dv.cpu(), vp)
    for name in scales:
        assert_same(dscales[name].cpu(), scales[name])


# (ctx, qlens, heads, kv_heads, head_dim, block_size): decode rows split over the slots (few
# blocks, long contexts: partials and paged_combine_kernel), a mixed batch (row slices), one
# long prefill (many row tiles per block), MHA over one-slot pages (R = 1).
PAGED_LAYOUTS = {
    "decode-split": ([3000, 17, 1200], [1, 1, 1], 8, 2, 64, 16),
    "mixed": ([37, 1, 200, 130, 0], [37, 1, 1, 9, 0], 4, 2, 32, 16),
    "prefill": ([700], [700], 4, 1, 128, 64),
    "mha-bs1": ([50, 80], [1, 2], 4, 4, 16, 1),
}


def paged_attend_case(layout, dtype, kv_dtype=None, seed=0):
    ctx, qlens, h, kvh, d, bs = PAGED_LAYOUTS[layout]
    q, kp, vp, table, lens, cu = make_case(ctx, qlens, heads=h, kv_heads=kvh, dim=d, block_size=bs,
                                           dtype=torch.float32 if kv_dtype else dtype, seed=seed)
    q = q / 4
    scales, deq = {}, (kp.double(), vp.double())
    if kv_dtype is not None:
        kp, ks = quantize_ref(kp, kv_dtype)
        vp, vs = quantize_ref(vp, kv_dtype)
        scales = dict(key_scales=ks, value_scales=vs)
        deq = (dequantized(kp, ks).double(), dequantized(vp, vs).double())
    return q.to(dtype), kp, vp, table, lens, cu, scales, deq


@pytest.mark.parametrize("layout", list(PAGED_LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("opts", [{}, dict(window=45, softcap=8.0, scale=0.2, sink_logits=True)],
                         ids=["plain", "window-softcap-sinks"])
def test_paged_attend_matches_cpu_and_reference(layout, dtype, kv_dtype, opts):
    """The CUDA kernel against the CPU op on the same inputs and the float64 reference over each
    sequence's gathered (dequantized) slots: GQA, window, softcap, learned sinks, int8/fp8 pages,
    float32/bf16/fp16 queries, decode splits and row slices, no host sync."""
    q, kp, vp, table, lens, cu, scales, (kref, vref) = paged_attend_case(layout, dtype, kv_dtype)
    opts = dict(opts)
    if opts.pop("sink_logits", False):
        opts["sink_logits"] = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(9))
    cpu = ops.paged_attend(q, kp, vp, table, lens, cu, **scales, **opts)
    dev_opts = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in opts.items()}
    with no_sync():
        out = ops.paged_attend(*on_dev(q, kp, vp, table, lens, cu),
                               **{k: v.to(DEV) for k, v in scales.items()}, **dev_opts)
    assert out.shape == q.shape and out.dtype == dtype
    ref = paged_reference(q, kref, vref, table, lens, cu, **opts)
    tol = PAGED_TOL[dtype] if kv_dtype is None else (2e-5 if dtype == torch.float32 else 2e-2)
    assert not ref.isnan().any()
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(out.cpu(), cpu, atol=tol, rtol=tol)


@pytest.mark.parametrize("layout", ["decode-split", "mixed"])
def test_paged_attend_window_reads_only_visible_pages(layout):
    """Pages that slid out of the window are freed (-1 in the table) and hold NaN: never read."""
    q, kp, vp, table, lens, cu, _, _ = paged_attend_case(layout, torch.float32)
    window = 20
    ref = paged_reference(q, kp.double(), vp.double(), table, lens, cu, window=window)
    bs = kp.shape[1]
    for s in range(len(lens)):
        first = max(0, int(lens[s]) - int(cu[s + 1] - cu[s]) - window + 1)
        for j in range(first // bs):
            kp[table[s, j]] = float("nan")
            vp[table[s, j]] = float("nan")
            table[s, j] = -1
    with no_sync():
        out = ops.paged_attend(*on_dev(q, kp, vp, table, lens, cu), window=window)
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-5, rtol=2e-5)


# 4: decode-like (slot splits + combine); 48: row slices; 600: the write's check kernel (memset,
# check, write: three captured nodes)
@pytest.mark.parametrize("total_q", [4, 48, 600])
def test_paged_cuda_graph_replayed_with_changing_metadata(total_q):
    """One captured graph (paged_write_ + paged_attend) replayed while the slot mapping, block
    table, context lengths and query offsets change on the device (fixed shapes: num_seqs,
    total_q, max_blocks): each replay writes and attends as the CPU ops do with those values; a
    replay with a bad slot writes nothing and one with a context past the table gives NaN rows."""
    bs, kvh, h, d, seqs, steps = 16, 2, 8, 64, 3, 6
    width = -(-steps * total_q // bs) + 1  # table columns: room for every step's tokens
    nb = seqs * width
    kp = torch.zeros(nb, bs, kvh, d, device=DEV)
    vp = torch.zeros_like(kp)
    key = torch.zeros(total_q, kvh, d, device=DEV)
    value = torch.zeros_like(key)
    q = torch.zeros(total_q, h, d, device=DEV)
    slots = torch.full((total_q,), -1, dtype=torch.int64, device=DEV)
    table = torch.full((seqs, width), -1, dtype=torch.int32, device=DEV)
    ctx = torch.zeros(seqs, dtype=torch.int32, device=DEV)
    cu = torch.tensor([0, total_q, total_q, total_q], dtype=torch.int32, device=DEV)
    ctx[0] = total_q
    table[0, : -(-total_q // bs)] = torch.arange(-(-total_q // bs), dtype=torch.int32)

    def step():
        ops.paged_write_(kp, vp, key, value, slots)
        return ops.paged_attend(q, kp, vp, table, ctx, cu)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    kp.zero_()
    vp.zero_()
    ckp, cvp = kp.cpu(), vp.cpu()

    rng = torch.Generator().manual_seed(5)
    free = list(range(nb))[::-1]
    pages = [[] for _ in range(seqs)]
    lens = [0] * seqs
    for it in range(steps):
        # This step's query counts (summing to total_q), e.g. a prefill chunk and decodes.
        cut = sorted(torch.randint(0, total_q + 1, (seqs - 1,), generator=rng).tolist())
        qlens = [b - a for a, b in zip([0] + cut, cut + [total_q])]
        slot_list = []
        for sq in range(seqs):
            for _ in range(qlens[sq]):
                if lens[sq] % bs == 0:
                    pages[sq].append(free.pop())
                slot_list.append(pages[sq][-1] * bs + lens[sq] % bs)
                lens[sq] += 1
        tab = torch.full((seqs, width), -1, dtype=torch.int32)
        for sq in range(seqs):
            tab[sq, : len(pages[sq])] = torch.tensor(pages[sq], dtype=torch.int32)
        cu_h = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
        k_h = torch.randn(total_q, kvh, d, generator=rng)
        v_h = torch.randn(total_q, kvh, d, generator=rng)
        q_h = torch.randn(total_q, h, d, generator=rng) / 4
        slots_h = torch.tensor(slot_list, dtype=torch.int64)
        ctx_h = torch.tensor(lens, dtype=torch.int32)
        for dst, src in ((key, k_h), (value, v_h), (q, q_h), (slots, slots_h), (table, tab),
                         (ctx, ctx_h), (cu, cu_h)):
            dst.copy_(src)
        graph.replay()
        ops.paged_write_(ckp, cvp, k_h, v_h, slots_h)
        want = ops.paged_attend(q_h, ckp, cvp, tab, ctx_h, cu_h)
        assert torch.equal(kp.cpu(), ckp) and torch.equal(vp.cpu(), cvp), it
        torch.testing.assert_close(out.cpu(), want, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(out.cpu().double(), paged_reference(q_h, ckp.double(), cvp.double(), tab,
                                                                       ctx_h, cu_h), atol=2e-5, rtol=2e-5)
    # Bad values inside the graph: a duplicated slot writes nothing; a context past the table's
    # capacity makes that sequence's rows NaN (and reads nothing past the table).
    before_k, before_v = kp.clone(), vp.clone()
    slots.copy_(torch.tensor([slot_list[0]] * total_q))
    bad = max(range(seqs), key=lambda i: qlens[i])  # a sequence with queries this step
    ctx.copy_(torch.tensor([width * bs + 1 if i == bad else lens[i] for i in range(seqs)],
                           dtype=torch.int32))
    graph.replay()
    assert torch.equal(kp, before_k) and torch.equal(vp, before_v)
    a, e = int(cu_h[bad]), int(cu_h[bad + 1])
    assert e > a
    assert bool(out[a:e].isnan().all())
    assert not bool(out[:a].isnan().any()) and not bool(out[e:].isnan().any())


BAD_META = ["page-past-end", "page-huge", "page-negative", "ctx-below-qlen", "ctx-past-capacity",
            "ctx-negative", "cu-decreasing", "cu-end", "cu-start"]


@pytest.mark.parametrize("layout", ["decode", "mixed"])  # slot splits + combine; row slices
@pytest.mark.parametrize("bad", BAD_META)
def test_paged_attend_bad_metadata_gives_nan_and_reads_nothing(layout, bad):
    """Metadata the CPU refuses (ValueError) gives NaN on CUDA instead, without a host sync or an
    out-of-bounds read: a bad page a query needs or a bad context length -> that sequence's rows
    NaN, the other rows exact; cu_seqlens_q that does not tile [0, total_q) -> every row NaN. The
    pages are a slice of a larger NaN buffer, and a page index of 2**30 would fault if read."""
    ctx, qlens = [300, 90, 500], ([1, 1, 1] if layout == "decode" else [20, 1, 30])
    q, kp, vp, table, lens, cu = make_case(ctx, qlens, heads=8, kv_heads=2, dim=64, block_size=16,
                                           seed=4)
    q = q / 4
    ref = paged_reference(q, kp.double(), vp.double(), table, lens, cu)
    nb = kp.shape[0]
    big_k = torch.full((nb + 2, *kp.shape[1:]), float("nan"))
    big_v = big_k.clone()
    big_k[1 : nb + 1], big_v[1 : nb + 1] = kp, vp
    table, lens, cu = table.clone(), lens.clone(), cu.clone()
    everything = bad.startswith("cu-")
    if bad == "page-past-end":
        table[1, 2] = nb
    elif bad == "page-huge":
        table[1, 0] = 2**30
    elif bad == "page-negative":
        table[1, (90 - 1) // 16] = -1
    elif bad == "ctx-below-qlen":
        lens[1] = 0
    elif bad == "ctx-past-capacity":
        lens[1] = table.shape[1] * 16 + 1
    elif bad == "ctx-negative":
        lens[1] = -5
    elif bad == "cu-decreasing":
        cu[1], cu[2] = cu[2].clone(), cu[1].clone()
        if cu[1] == cu[2]:
            cu[1] += 1
    elif bad == "cu-end":
        cu[-1] += 1  # past total_q (ending before it is a padded batch)
    else:
        cu[0] = 1
    with pytest.raises(ValueError):
        ops.paged_attend(q, kp, vp, table, lens, cu)
    big_kd, big_vd = big_k.to(DEV), big_v.to(DEV)
    with no_sync():
        out = ops.paged_attend(q.to(DEV), big_kd[1 : nb + 1], big_vd[1 : nb + 1],
                               *on_dev(table, lens, cu))
    torch.cuda.synchronize()  # a fault would surface here
    out = out.cpu()
    if everything:
        assert bool(out.isnan().all())
        return
    a, e = int(cu[1]), int(cu[2])
    assert bool(out[a:e].isnan().all())
    good = torch.ones(out.shape[0], dtype=torch.bool)
    good[a:e] = False
    torch.testing.assert_close(out[good].double(), ref[good], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("start", [0, 1])
def test_paged_attend_no_sequences(start):
    """num_seqs = 0 with queries: cu_seqlens_q = [0] makes every row padding (0, as on the CPU);
    [1] is a bad batch (the CPU's ValueError) and every row NaN. No host sync."""
    q = rand((3, 4, 16), torch.float32)
    kp = rand((2, 4, 2, 16), torch.float32, 1)
    table = torch.zeros((0, 2), dtype=torch.int32, device=DEV)
    lens = torch.zeros(0, dtype=torch.int32, device=DEV)
    cu = torch.full((1,), start, dtype=torch.int32, device=DEV)
    with no_sync():
        out = ops.paged_attend(q, kp, kp.clone(), table, lens, cu)
    if start == 0:
        assert bool((out == 0).all())
        cpu = ops.paged_attend(q.cpu(), kp.cpu(), kp.cpu(), table.cpu(), lens.cpu(), cu.cpu())
        assert bool((cpu == 0).all())
    else:
        assert bool(out.isnan().all())


@pytest.mark.parametrize("layout", ["decode", "prefill"])
def test_paged_attend_padded_batch_as_the_cpu(layout):
    """q padded past cu_seqlens_q[-1] (transformers' compiled / CUDA-graph steps): the padding rows
    are 0 on both devices, with one split and with split rows (decode over long contexts), the
    others as the float64 reference."""
    ctx, qlens = [3000, 90, 500, 0], ([1, 1, 1, 0] if layout == "decode" else [20, 1, 30, 0])
    q, kp, vp, table, lens, cu = make_case(ctx, qlens, heads=8, kv_heads=2, dim=64, block_size=16,
                                           seed=5)
    q = q / 4
    qp = torch.cat([q, torch.full((7, *q.shape[1:]), 1e30)])
    ref = paged_reference(q, kp.double(), vp.double(), table, lens, cu)
    with no_sync():
        out = ops.paged_attend(qp.to(DEV), *on_dev(kp, vp, table, lens, cu)).cpu()
    cpu = ops.paged_attend(qp, kp, vp, table, lens, cu)
    n = q.shape[0]
    assert bool((out[n:] == 0).all()) and bool((cpu[n:] == 0).all())
    torch.testing.assert_close(out[:n].double(), ref, atol=2e-5, rtol=2e-5)


# ----------------------------------------------------------------- misc


def test_sparse_cuda_inputs_raise_value_error():
    keys = torch.zeros(1, 1, 4, 2, device=DEV)
    sparse = torch.zeros(1, 1, 1, 2, device=DEV).to_sparse()
    with pytest.raises(ValueError):
        ops.update_(keys, keys.clone(), sparse, sparse, 0)


def test_host_checks_still_raise_on_cuda():
    keys = torch.zeros(2, 3, 16, 8, device=DEV)
    values = torch.zeros_like(keys)
    kn = torch.zeros(2, 3, 4, 8, device=DEV)
    with pytest.raises(ValueError, match="KV cache overflow: end=17 exceeds max_len=16"):
        ops.update_(keys, values, kn, kn.clone(), 13)
    with pytest.raises(ValueError, match="must be on the cache's device"):
        ops.update_.Tensor(keys, values, kn, kn.clone(), torch.tensor(0))
    with pytest.raises(ValueError):  # a start that aliases the cache buffers
        ops.update_.Tensor(keys, values, kn, kn.clone(), keys.view(torch.int32)[0, 0, 0, 0])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_runs_on_the_tensors_device():
    """The kernels set their device from the tensors, not from the current device."""
    dev1 = torch.device("cuda", 1)
    keys = torch.zeros(2, 2, 8, 4, device=dev1)
    values = torch.zeros_like(keys)
    kn = torch.randn(2, 2, 3, 4, device=dev1)
    with torch.cuda.device(0):
        length = ops.update_.Tensor(keys, values, kn, kn + 1, torch.tensor([0, 2], device=dev1))
        out = ops.attend(torch.randn(2, 4, 1, 4, device=dev1), keys, values, length)
    assert length.device == dev1 and length.tolist() == [3, 5]
    assert torch.equal(keys[1, :, 2:5], kn[1]) and out.device == dev1


def opcheck_samples():
    keys = torch.zeros(2, 3, 16, 8, device=DEV, dtype=torch.bfloat16)
    values = torch.zeros_like(keys)
    kn = rand((2, 3, 4, 8), torch.bfloat16, 1)
    vn = rand((2, 3, 4, 8), torch.bfloat16, 2)
    q = rand((2, 6, 4, 8), torch.bfloat16, 3)
    filled_k, filled_v = rand(keys.shape, torch.bfloat16, 4), rand(keys.shape, torch.bfloat16, 5)
    yield "update_", ops.update_.default, (keys, values, kn, vn, 5), {}
    yield "update_.Tensor", ops.update_.Tensor, (keys, values, kn, vn, ints([1, 9])), {}
    yield "append_", ops.append_.default, (keys, values, ints([2, 0], torch.int32), kn, vn), {}
    yield "attend", ops.attend.default, (q, filled_k, filled_v, ints([9, 16])), {"kv_start": ints([0, 3]), "window": 5}
    yield "rollback", ops.rollback.default, (ints([9, 16]), ints([2, 1])), {}
    yield "select_rows_", ops.select_rows_.default, (filled_k, filled_v, ints([9, 16]), ints([1, 1])), {}
    yield "append_returning_", ops.append_returning_.default, (keys, values, ints([2, 0], torch.int32), kn, vn), {}
    yield "reset_rows", ops.reset_rows.default, (ints([9, 16]), ints([1])), {}
    pq, pk, pv, ptable, plens, pcu = make_case([20, 9], [2, 1], block_size=8)
    pk, pv = pk.to(DEV), pv.to(DEV)
    yield "paged_attend", ops.paged_attend.default, (*on_dev(pq, pk, pv, ptable, plens, pcu),), {}
    yield "paged_write_", ops.paged_write_.default, (pk, pv, rand((2, 2, 16), torch.float32, 6),
                                                     rand((2, 2, 16), torch.float32, 7), ints([0, 9])), {}


@pytest.mark.parametrize("name,op,args,kwargs", list(opcheck_samples()) if torch.cuda.is_available() else [],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_opcheck_cuda(name, op, args, kwargs):
    from torch.library import opcheck

    result = opcheck(op, args, kwargs)
    assert all(v == "SUCCESS" for v in result.values()), result
