"""Writes by format, not by op (issue 41, item 2): one schema per kind of position.

``update_``, ``update_.Tensor``, ``append_``, ``append_returning_`` and ``ring_update_`` take the
keyword-only optional ``k_scale`` / ``v_scale``: without them a write is plain (the new data has the
cache's dtype and is copied as it is), with them it is the quantized write of an int8 / float8_e4m3fn
cache. The old ``update_quantized_``, ``update_quantized_.Tensor``, ``append_quantized_`` and
``ring_update_quantized_`` stay one release as aliases that decompose into the new writes.

Checked here, against plain-PyTorch references (tests/python/references.py):
  * the new forms write exactly the bytes, scales, positions and lengths of the reference and of the
    deprecated aliases;
  * every mistake with the scales is a ValueError / TypeError naming the argument, with nothing
    written, eagerly and under torch.compile(fullgraph=True);
  * the aliases decompose into the new operator when traced (the graph holds only the new one).
"""

from __future__ import annotations

import pytest
import torch

import kvcache  # noqa: F401
from kv_testing import as_bytes, random_tensor
from references import quantized_update_reference, ring_update_reference, update_reference

ops = torch.ops.kvcache
KV_DTYPES = [torch.int8, torch.float8_e4m3fn]
NEW_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
B, H, T, D = 2, 2, 9, 8


def same_bytes(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bytes(a), as_bytes(b))


def qcache(kv_dtype, t=T, seed=3):
    """A quantized cache prefilled with random bytes and scales (slots not written are compared too)."""
    g = torch.Generator().manual_seed(seed)
    if kv_dtype == torch.int8:
        keys = torch.randint(-127, 128, (B, H, t, D), generator=g).to(torch.int8)
        values = torch.randint(-127, 128, (B, H, t, D), generator=g).to(torch.int8)
    else:
        keys = (torch.randn(B, H, t, D, generator=g) * 50).clamp(-448, 448).to(kv_dtype)
        values = (torch.randn(B, H, t, D, generator=g) * 50).clamp(-448, 448).to(kv_dtype)
    k_scale = torch.rand(B, H, t, generator=g) * 0.05 + 1e-3
    v_scale = torch.rand(B, H, t, generator=g) * 0.05 + 1e-3
    return [keys, values, k_scale, v_scale]


def clone_all(ts):
    return [t.clone() for t in ts]


# ------------------------------------------------- the contiguous writes ---

# form -> (call of the new write, call of the deprecated alias); both get (k, v, ks, vs, kn, vn, where) and
# return (the op's result, the lengths tensor it advanced or None).
STARTS = {"host": 3, "tensor": torch.tensor([1, 5]), "lengths": torch.tensor([2, 6], dtype=torch.int32)}


def _new(form, k, v, ks, vs, kn, vn, where):
    if form == "update_":
        return ops.update_(k, v, kn, vn, where, k_scale=ks, v_scale=vs), None
    if form == "update_.Tensor":
        return ops.update_.Tensor(k, v, kn, vn, where, k_scale=ks, v_scale=vs), None
    if form == "append_":
        ops.append_(k, v, where, kn, vn, k_scale=ks, v_scale=vs)
        return None, where
    assert form == "append_returning_"
    return ops.append_returning_(k, v, where, kn, vn, k_scale=ks, v_scale=vs), where


def _alias(form, k, v, ks, vs, kn, vn, where):
    if form == "update_":
        return ops.update_quantized_(k, v, ks, vs, kn, vn, where), None
    if form == "update_.Tensor":
        return ops.update_quantized_.Tensor(k, v, ks, vs, kn, vn, where), None
    # append_returning_ has no alias of its own: the lengths it returns are append_quantized_'s result.
    ops.append_quantized_(k, v, ks, vs, where, kn, vn)
    return None, where


FORMS = {"update_": "host", "update_.Tensor": "tensor", "append_": "lengths", "append_returning_": "lengths"}


@pytest.mark.parametrize("new_dtype", NEW_DTYPES, ids=str)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("form", list(FORMS))
def test_quantized_write_matches_reference_and_alias(form, kv_dtype, new_dtype):
    kn = random_tensor((B, H, 3, D), new_dtype, seed=11)
    vn = random_tensor((B, H, 3, D), new_dtype, seed=12)
    start = STARTS[FORMS[form]]
    starts = start if isinstance(start, int) else start.tolist()
    want = quantized_update_reference(*qcache(kv_dtype), kn, vn, starts)

    new_bufs, alias_bufs = qcache(kv_dtype), qcache(kv_dtype)
    where_new = start if isinstance(start, int) else start.clone()
    where_alias = start if isinstance(start, int) else start.clone()
    got_new, lengths_new = _new(form, *new_bufs, kn, vn, where_new)
    got_alias, lengths_alias = _alias(form, *alias_bufs, kn, vn, where_alias)

    for got, ref, alias in zip(new_bufs, want, alias_bufs):
        assert same_bytes(got, ref)
        assert same_bytes(got, alias)
    expected_len = torch.tensor(starts) + 3
    if form == "append_returning_":
        assert torch.equal(got_new, expected_len.to(where_new.dtype))
        assert torch.equal(lengths_new, start)  # returned, not written
        assert torch.equal(lengths_alias, got_new)
    elif form == "append_":
        assert torch.equal(lengths_new, expected_len.to(lengths_new.dtype))
        assert torch.equal(lengths_new, lengths_alias)
    else:
        assert got_new.dtype == torch.int32 and torch.equal(got_new, expected_len.to(torch.int32))
        assert torch.equal(got_new, got_alias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("form", list(FORMS))
def test_plain_write_without_scales_copies_the_data(form, dtype):
    """No scales: the plain write of any dtype (an int8 / fp8 cache without scales stores what it is given)."""
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(B, H, T, D, generator=g).to(dtype)
    values = torch.randn(B, H, T, D, generator=g).to(dtype)
    kn = torch.randn(B, H, 2, D, generator=g).to(dtype)
    vn = torch.randn(B, H, 2, D, generator=g).to(dtype)
    start = STARTS[FORMS[form]]
    starts = start if isinstance(start, int) else start.tolist()
    want_k, want_v = update_reference(keys, values, kn, vn, starts)
    where = start if isinstance(start, int) else start.clone()
    _new(form, keys, values, None, None, kn, vn, where)
    assert same_bytes(keys, want_k) and same_bytes(values, want_v)


# ------------------------------------------------------------- the ring ---


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("chunk,start", [(1, [3, 3]), (3, [5, 0]), (11, [1, 8])])
def test_ring_update_with_scales_matches_reference_and_alias(kv_dtype, chunk, start):
    cap, sinks = 7, 2
    kn = random_tensor((B, H, chunk, D), torch.bfloat16, seed=21)
    vn = random_tensor((B, H, chunk, D), torch.bfloat16, seed=22)
    pos = torch.full((B, cap), -1, dtype=torch.int32)
    k, v, ks, vs = qcache(kv_dtype, t=cap)
    want = ring_update_reference(k, v, pos, kn, vn, start, sinks, ks, vs)
    new = [*clone_all([k, v, pos]), ks.clone(), vs.clone()]
    alias = clone_all([k, v, ks, vs, pos])
    old = [*clone_all([k, v, pos]), ks.clone(), vs.clone()]
    s = torch.tensor(start, dtype=torch.int32)
    # The one write with a device start: a ring's when given its positions.
    got = ops.update_.Tensor(new[0], new[1], kn, vn, s, k_scale=new[3], v_scale=new[4], positions=new[2],
                             sinks=sinks)
    got_old = ops.ring_update_(old[0], old[1], old[2], kn, vn, s, sinks=sinks, k_scale=old[3], v_scale=old[4])
    got_alias = ops.ring_update_quantized_(*alias, kn, vn, s, sinks=sinks)
    alias = [alias[0], alias[1], alias[4], alias[2], alias[3]]  # keys, values, positions, k_scale, v_scale
    for a, b, c, d in zip(new, want, alias, old):
        assert same_bytes(a, b) and same_bytes(a, c) and same_bytes(a, d)
    assert torch.equal(got, (s + chunk).to(torch.int32)) and torch.equal(got, got_alias)
    assert torch.equal(got, got_old)


def test_sinks_without_positions_refused_before_any_write():
    """sinks belong to a ring: update_.Tensor without positions refuses sinks != 0, with nothing
    written (traced: test_error_parity's update_.Tensor/sinks-without-positions)."""
    k, v = torch.zeros(B, H, T, D), torch.zeros(B, H, T, D)
    kn, vn = random_tensor((B, H, 2, D), torch.float32, seed=1), random_tensor((B, H, 2, D), torch.float32, seed=2)

    def write(k, v, kn, vn, s):
        return ops.update_.Tensor(k, v, kn, vn, s, sinks=2)

    with pytest.raises(ValueError, match=r"sinks apply to a ring \(positions given\): a write without "
                                         r"positions takes sinks=0, got sinks=2"):
        write(k, v, kn, vn, torch.tensor([0, 1]))
    assert torch.count_nonzero(k) == 0 and torch.count_nonzero(v) == 0


def test_ring_update_without_scales_is_the_plain_write():
    cap, sinks = 7, 1
    kn, vn = random_tensor((B, H, 4, D), torch.float32, seed=1), random_tensor((B, H, 4, D), torch.float32, seed=2)
    k, v = random_tensor((B, H, cap, D), torch.float32, seed=3), random_tensor((B, H, cap, D), torch.float32, seed=4)
    pos = torch.full((B, cap), -1, dtype=torch.int32)
    want = ring_update_reference(k, v, pos, kn, vn, [6, 2], sinks)
    ops.ring_update_(k, v, pos, kn, vn, torch.tensor([6, 2]), sinks=sinks)
    for a, b in zip((k, v, pos), want[:3]):
        assert same_bytes(a, b)


# ---------------------------------------------------------- the mistakes ---


def _float_cache():
    return [random_tensor((B, H, T, D), torch.float32, seed=7), random_tensor((B, H, T, D), torch.float32, seed=8)]


def _scales(shape=(B, H, T), dtype=torch.float32):
    return [torch.ones(shape, dtype=dtype), torch.ones(shape, dtype=dtype)]


def _kn(dtype=torch.float32, chunk=2):
    return [random_tensor((B, H, chunk, D), dtype, seed=9), random_tensor((B, H, chunk, D), dtype, seed=10)]


def _scale_views_keys():
    k, v, _, vs = qcache(torch.int8)
    ks = k.view(torch.float32)[..., :1].reshape(B, H, T)  # (B, H, T) float32 view of the keys' bytes
    return k, v, ks, vs


def _new_views_scale():
    k, v, ks, vs = qcache(torch.int8)
    kn = torch.as_strided(ks, (B, H, 2, D), (H * T, T, 1, 0))  # new keys read from k_scale's bytes
    return k, v, ks, vs, kn


# Each mistake: (id, exception, message (a regex naming the argument), builder of (cache, scales, new data)).
# The builders return (keys, values, k_scale, v_scale, keys_new, values_new); None: the argument left out.
MISTAKES = [
    ("scales-for-float-cache", TypeError, r"when k_scale and v_scale are given, got torch\.float32",
     lambda: (*_float_cache(), *_scales(), *_kn())),
    ("scales-missing-for-int8-cache", TypeError, r"keys_new is torch\.float32 but keys are torch\.int8: pass k_scale",
     lambda: (*qcache(torch.int8)[:2], None, None, *_kn())),
    ("scales-missing-for-fp8-cache", TypeError, r"keys_new is torch\.bfloat16 but keys are torch\.float8_e4m3fn",
     lambda: (*qcache(torch.float8_e4m3fn)[:2], None, None, *_kn(torch.bfloat16))),
    ("k_scale-alone", ValueError, r"v_scale is None but k_scale is given",
     lambda: (*qcache(torch.int8)[:3], None, *_kn())),
    ("v_scale-alone", ValueError, r"k_scale is None but v_scale is given",
     lambda: (*qcache(torch.int8)[:2], None, qcache(torch.int8)[3], *_kn())),
    ("k_scale-shape", ValueError, r"k_scale must have shape \(batch=2, num_kv_heads=2, max_len=9\)",
     lambda: (*qcache(torch.int8)[:2], torch.ones(B, H, T + 1), torch.ones(B, H, T), *_kn())),
    ("v_scale-dtype", TypeError, r"v_scale must have the scale dtype",
     lambda: (*qcache(torch.int8)[:2], torch.ones(B, H, T), torch.ones(B, H, T, dtype=torch.float16), *_kn())),
    ("scales-share", ValueError, r"k_scale and v_scale must not share memory",
     lambda: (lambda s: (*qcache(torch.int8)[:2], s, s, *_kn()))(torch.ones(B, H, T))),
    ("k_scale-views-keys", ValueError, r"k_scale must not share memory with keys or values",
     lambda: (*_scale_views_keys(), *_kn())),
    ("keys_new-views-k_scale", ValueError, r"keys_new and values_new must not share memory with k_scale",
     lambda: (*_new_views_scale(), _kn()[1])),
    # int8 data with fp8 scales, scales that overlap in part, an expand()ed scale, a negative-bit view,
    # a scale of the wrong rank or device, int8 / float64 / mixed new data for a quantized write.
    ("fp8-scales", TypeError, r"k_scale must have the scale dtype torch\.float32 .*got torch\.float8_e4m3fn",
     lambda: (*qcache(torch.int8)[:2], *_scales(dtype=torch.float8_e4m3fn), *_kn())),
    ("scales-overlap-in-part", ValueError, r"k_scale and v_scale must not share memory",
     lambda: (lambda buf: (*qcache(torch.int8)[:2], buf[..., :T], buf[..., 1:], *_kn()))(torch.ones(B, H, T + 1))),
    ("k_scale-expanded", ValueError, r"k_scale must not have internally overlapping memory",
     lambda: (*qcache(torch.int8)[:2], torch.ones(B, H, 1).expand(B, H, T), torch.ones(B, H, T), *_kn())),
    ("k_scale-neg-bit", ValueError, r"k_scale must not have the negative bit set",
     lambda: (*qcache(torch.int8)[:2], torch._neg_view(torch.ones(B, H, T)), torch.ones(B, H, T), *_kn())),
    ("k_scale-rank", ValueError, r"k_scale must be a 3-D tensor",
     lambda: (*qcache(torch.int8)[:2], torch.ones(B, H, T, 1), torch.ones(B, H, T), *_kn())),
    ("v_scale-device", ValueError, r"v_scale must be on the cache's device",
     lambda: (*qcache(torch.int8)[:2], torch.ones(B, H, T), torch.ones(B, H, T, device="meta"), *_kn())),
    ("int8-new-data", TypeError, r"keys_new must be a torch\.float32, torch\.bfloat16 or torch\.float16 tensor",
     lambda: (*qcache(torch.int8), *[t.to(torch.int8) for t in _kn()])),
    ("float64-new-data", TypeError, r"keys_new must be a torch\.float32, torch\.bfloat16 or torch\.float16 tensor",
     lambda: (*qcache(torch.float8_e4m3fn), *_kn(torch.float64))),
    ("mixed-new-data", TypeError, r"values_new must have the dtype of keys_new",
     lambda: (*qcache(torch.int8), _kn()[0], _kn(torch.float16)[1])),
]


def _call(form, k, v, ks, vs, kn, vn):
    kw = {}
    if ks is not None:
        kw["k_scale"] = ks
    if vs is not None:
        kw["v_scale"] = vs
    if form == "update_":
        return ops.update_(k, v, kn, vn, 1, **kw)
    if form == "update_.Tensor":
        return ops.update_.Tensor(k, v, kn, vn, torch.tensor([0, 3]), **kw)
    if form == "append_":
        return ops.append_(k, v, torch.tensor([1, 2], dtype=torch.int32), kn, vn, **kw)
    if form == "append_returning_":
        return ops.append_returning_(k, v, torch.tensor([1, 2], dtype=torch.int32), kn, vn, **kw)
    assert form == "ring_update_"
    pos = torch.full((B, T), -1, dtype=torch.int32)
    return ops.ring_update_(k, v, pos, kn, vn, torch.tensor(4), sinks=1, **kw)


WRITE_FORMS = ["update_", "update_.Tensor", "append_", "append_returning_", "ring_update_"]


def _raises_nothing_written(fn, args, exc, match, compiled):
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.raises(Exception) as info:
        fn(*args)
    got = info.value
    if compiled and isinstance(got, torch._dynamo.exc.TorchRuntimeError):
        # Dynamo wraps an exception raised while tracing, quoting it (see test_error_parity.py).
        assert f"got {exc.__name__}(" in str(got), got
    else:
        assert isinstance(got, exc), repr(got)
    import re

    assert re.search(match, str(got)), str(got)
    for a, b in zip(args, before):
        if isinstance(a, torch.Tensor) and a.device.type != "meta":
            a, b = a.resolve_neg(), b.resolve_neg()
            assert same_bytes(a, b), "written despite the error"


@pytest.mark.parametrize("mode", ["eager", "compile"])
@pytest.mark.parametrize("form", WRITE_FORMS)
@pytest.mark.parametrize("mistake", MISTAKES, ids=lambda m: m[0])
def test_scale_mistakes_raise_naming_the_argument_and_write_nothing(mistake, form, mode):
    _, exc, match, build = mistake
    args = build()
    fn = lambda *a: _call(form, *a)  # noqa: E731
    if mode == "compile":
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    _raises_nothing_written(fn, args, exc, match, mode == "compile")


# ---------------------------------------------- the aliases when traced ---


def test_aliases_decompose_into_the_new_writes_when_traced():
    """torch.compile sees the alias call; AOT tracing decomposes it into the write it names, so the graph
    (and Inductor) hold only the new operator, with its fake kernel, re-inplacing and no-copy rules."""
    from torch._functorch.aot_autograd import aot_function

    graphs = []

    def compiler(gm, _):
        graphs.append(str(gm.graph))
        return gm

    def step(k, v, ks, vs, pos, kn, vn, s):
        n = ops.update_quantized_(k, v, ks, vs, kn, vn, 1)
        m = ops.update_quantized_.Tensor(k, v, ks, vs, kn, vn, s)
        ops.append_quantized_(k, v, ks, vs, s, kn, vn)
        r = ops.ring_update_quantized_(k, v, ks, vs, pos, kn, vn, s)
        return n, m, r

    k, v, ks, vs = qcache(torch.int8)
    pos = torch.full((B, T), -1, dtype=torch.int32)
    kn, vn = _kn()
    aot_function(step, fw_compiler=compiler)(k, v, ks, vs, pos, kn, vn, torch.tensor([0, 2]))
    graph = "\n".join(graphs)
    assert "quantized" not in graph and "ring_update" not in graph, graph
    for name in ("kvcache.update_.default", "kvcache.update_.Tensor", "kvcache.append_.default"):
        assert name in graph, (name, graph)
    # update_quantized_.Tensor and the ring alias: both update_.Tensor, the ring's with its positions
    assert graph.count("kvcache.update_.Tensor") == 2 and "_positions_base_index" in graph, graph


def test_compiled_new_write_matches_eager():
    """torch.compile(fullgraph=True) of the new quantized writes: the same bytes as eager, no graph break."""

    def step(k, v, ks, vs, lengths, kn, vn):
        ops.append_(k, v, lengths, kn, vn, k_scale=ks, v_scale=vs)
        return ops.update_(k, v, kn, vn, 6, k_scale=ks, v_scale=vs)

    kn, vn = _kn(torch.bfloat16)
    eager = [*qcache(torch.float8_e4m3fn), torch.tensor([0, 4], dtype=torch.int32)]
    compiled = clone_all(eager)
    want = step(*eager, kn, vn)
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True)(*compiled, kn, vn)
    assert torch.equal(got, want)
    for a, b in zip(compiled, eager):
        assert same_bytes(a, b)


@pytest.mark.parametrize("form", WRITE_FORMS)
def test_strided_scales_are_written_in_place(form):
    """Scales that are views with any strides (a (batch, max_len, heads) buffer transposed, a
    permuted one) take exactly the reference's scales at the written slots, in place."""
    k, v, ks, vs = qcache(torch.int8)
    ks_t = ks.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, T) over (B, T, H) memory
    vs_t = vs.permute(1, 0, 2).contiguous().permute(1, 0, 2)  # (B, H, T) over (H, B, T) memory
    assert not ks_t.is_contiguous() and not vs_t.is_contiguous()
    kn, vn = _kn(torch.bfloat16)
    want_k, want_v, want_ks, want_vs = k.clone(), v.clone(), ks.clone(), vs.clone()
    _call(form, want_k, want_v, want_ks, want_vs, kn, vn)  # contiguous scales: checked against the reference above
    if form != "ring_update_":
        starts = {"update_": 1, "update_.Tensor": [0, 3], "append_": [1, 2], "append_returning_": [1, 2]}[form]
        ref = quantized_update_reference(k, v, ks, vs, kn, vn, starts)
        for got, exp in zip((want_k, want_v, want_ks, want_vs), ref):
            assert same_bytes(got, exp)
    _call(form, k, v, ks_t, vs_t, kn, vn)
    assert same_bytes(k, want_k) and same_bytes(v, want_v)
    assert torch.equal(ks_t, want_ks) and torch.equal(vs_t, want_vs)
