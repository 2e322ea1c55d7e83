"""attend's sink_logits (learned per-head attention sinks, gpt-oss) against float64 references.

The reference appends each head's sink logit as one more score column, takes the softmax and drops
that column (transformers' eager gpt-oss attention). Every kernel path that normalizes an output
is covered: one task per row, rows split across threads (forced), rings, quantized caches, the
edge cases of a sink far above or below every score, and rows that see no slot.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import kvcache
from kv_testing import forced_split, random_tensor
from references import attention_reference as reference

ops = torch.ops.kvcache


def _case(b, h, kvh, s, d, t, dtype=torch.float32, seed=0):
    k = random_tensor((b, kvh, t, d), torch.float32, seed=seed).to(dtype)
    v = random_tensor((b, kvh, t, d), torch.float32, seed=seed + 1).to(dtype)
    # Scores of order 1 and sinks of order 1-3: the sink takes a visible share of each softmax.
    q = (random_tensor((b, h, s, d), torch.float32, seed=seed + 2) * (0.5 / d**0.5)).to(dtype)
    sink = random_tensor((h,), torch.float32, seed=seed + 3).abs() + 1.0
    return q, k, v, sink


TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.mark.parametrize("split", [False, True], ids=["one-task", "split-rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "shape,lengths,kw",
    [
        ((1, 4, 4, 1, 16, 300), [300], {}),  # decode, MHA
        ((2, 8, 2, 1, 64, 700), [700, 129], {"kv_start": [0, 5]}),  # GQA, ragged, left padding
        ((2, 6, 3, 5, 8, 200), [200, 60], {"window": 17, "softcap": 4.0, "scale": 0.3}),  # chunk
    ],
    ids=["decode", "gqa-ragged", "chunk-window-softcap"],
)
def test_sink_logits_match_the_appended_column_reference(split, dtype, shape, lengths, kw):
    b, h, kvh, s, d, t = shape
    q, k, v, sink = _case(b, h, kvh, s, d, t, dtype)
    lengths = torch.tensor(lengths, dtype=torch.int32)
    kw = dict(kw)
    if "kv_start" in kw:
        kw["kv_start"] = torch.tensor(kw["kv_start"])
    with forced_split() if split else contextlib.nullcontext():
        out = ops.attend(q, k, v, lengths, sink_logits=sink, **kw)
    ref = reference(q, k, v, lengths, sink_logits=sink, **kw)
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])
    # The sinks matter: without them the result is measurably different.
    plain = reference(q, k, v, lengths, **kw)
    assert (plain - ref).abs().max() > 1e-3


def test_sink_logits_edge_values():
    q, k, v, _ = _case(2, 4, 2, 1, 8, 32)
    lengths = torch.tensor([32, 0 + 1], dtype=torch.int32)
    # -inf: no sink at all; a sink far above every score takes all the weight: zeros, never NaN.
    none = ops.attend(q, k, v, lengths)
    torch.testing.assert_close(ops.attend(q, k, v, lengths, sink_logits=torch.full((4,), -float("inf"))), none)
    huge = ops.attend(q, k, v, lengths, sink_logits=torch.full((4,), 1e30))
    assert torch.equal(huge, torch.zeros_like(huge))
    # A row whose query sees no slot (kv_start == length) gets zeros, as without sinks.
    ks = torch.tensor([0, 1])
    out = ops.attend(q, k, v, lengths, kv_start=ks, sink_logits=torch.ones(4))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out.double(), reference(q, k, v, lengths, kv_start=ks, sink_logits=torch.ones(4)),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("split", [False, True], ids=["one-task", "split-rows"])
def test_sink_logits_on_a_ring(split):
    # A wrapped ring with StreamingLLM sink tokens and learned sink logits at once.
    b, kvh, h, d, window = 2, 2, 4, 16, 40
    ring = kvcache.init_ring_layer_cache(b, kvh, d, window, torch.float32, sinks=2, max_step=3)
    kn = random_tensor((b, kvh, 150, d), torch.float32, seed=1)
    vn = random_tensor((b, kvh, 150, d), torch.float32, seed=2)
    kvcache.update_ring_layer_cache(ring, kn, vn, 0)
    q = random_tensor((b, h, 1, d), torch.float32, seed=3)
    sink = torch.tensor([1.0, -2.0, 3.0, 0.5])
    length = torch.tensor(150, dtype=torch.int32)
    with forced_split() if split else contextlib.nullcontext():
        out = ops.attend(q, ring.keys, ring.values, length, window=window, positions=ring.positions, sinks=2,
                         sink_logits=sink)
    pos = torch.arange(150, dtype=torch.int32).expand(b, 150)
    ref = reference(q, kn, vn, length, window=window, positions=pos, sinks=2, sink_logits=sink)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_sink_logits_on_a_quantized_cache(kv_dtype):
    c = kvcache.init_kv_layer_cache(1, 2, 32, 256, torch.float32, kv_dtype=kv_dtype)
    kn = random_tensor((1, 2, 200, 32), torch.float32, seed=4)
    vn = random_tensor((1, 2, 200, 32), torch.float32, seed=5)
    kvcache.append_kv_layer_cache(c, kn, vn)
    q = random_tensor((1, 6, 1, 32), torch.float32, seed=6)
    sink = torch.tensor([0.0, 1.0, 2.0, -1.0, 4.0, 0.5])
    out = kvcache.attend(q, c, sink_logits=sink)
    deq_k = c.keys.double() * c.k_scale.double()[..., None]
    deq_v = c.values.double() * c.v_scale.double()[..., None]
    ref = reference(q, deq_k, deq_v, c.length, sink_logits=sink)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


def test_sink_logits_bad_arguments_raise():
    q, k, v, _ = _case(1, 4, 2, 1, 8, 16)
    lengths = torch.tensor([16], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"sink_logits must have shape \(num_heads=4,\)"):
        ops.attend(q, k, v, lengths, sink_logits=torch.zeros(2))
    with pytest.raises(ValueError, match="sink_logits must have shape"):
        ops.attend(q, k, v, lengths, sink_logits=torch.zeros(1, 4))
    with pytest.raises(TypeError, match="sink_logits must be a torch.float32"):
        ops.attend(q, k, v, lengths, sink_logits=torch.zeros(4, dtype=torch.bfloat16))


def test_sink_logits_compile_without_recompiles():
    q, k, v, sink = _case(1, 4, 2, 1, 8, 64)
    f = torch.compile(lambda q, lengths, sink: ops.attend(q, k, v, lengths, sink_logits=sink), fullgraph=True)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    for n in (10, 20, 30):
        lengths = torch.tensor([n], dtype=torch.int32)
        torch.testing.assert_close(f(q, lengths, sink).double(), reference(q, k, v, lengths, sink_logits=sink),
                                   atol=2e-5, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1
