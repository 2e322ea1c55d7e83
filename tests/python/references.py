"""Independent references for the tests: plain PyTorch, float64 where numerics matter, reading
only what the operator may read, and the one tolerance table.

Every test compares an operator against these, never against numbers the operators produced.
Imported by name (pytest puts this folder on sys.path), as kv_testing is.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

# Tolerances of a low-precision output against the float64 reference: (atol, rtol), the values
# of PyTorch's own SDPA tests (test/test_transformers.py: default_atol / default_rtol). atol is
# applied relative to the reference's scale (1 + max |ref|): a masking, GQA or softmax mistake
# moves outputs by O(that scale), rounding by far less.
TOLERANCES = {
    torch.float32: (1e-5, 1.3e-6),
    torch.bfloat16: (1e-3, 1.6e-2),
    torch.float16: (1e-3, 1e-3),
}


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: Optional[torch.dtype] = None) -> None:
    """out (any dtype) is within TOLERANCES[dtype] of the float64 reference ref."""
    dtype = out.dtype if dtype is None else dtype
    assert out.shape == ref.shape, (out.shape, ref.shape)
    atol, rtol = TOLERANCES[dtype]
    scale = 1.0 + (float(ref.abs().max()) if ref.numel() else 0.0)
    torch.testing.assert_close(out.double(), ref.double().to(out.device), atol=atol * scale, rtol=rtol)


def _per_row(t: Optional[torch.Tensor], batch: int, default: int = 0) -> list:
    if t is None:
        return [default] * batch
    t = t.expand(batch) if t.dim() == 0 else t
    return [int(x) for x in t.tolist()]


def visible_slots(
    length: int,
    query_pos: int,
    max_len: int,
    first: int = 0,
    window: int = 0,
    positions: Optional[torch.Tensor] = None,
    sinks: int = 0,
) -> torch.Tensor:
    """Slot indices a query at logical position query_pos may see, in slot order.

    Linear cache (positions None): slot j holds position j; the query sees first <= j <= query_pos
    (< length), and with window > 0 only query_pos - j < window (the window counts the query).
    Ring (positions: (max_len,) logical position per slot, -1 empty): the same rule applied to the
    recorded positions, with positions < sinks always visible (above first).
    """
    pos = torch.arange(max_len) if positions is None else positions.cpu().long()
    ok = (pos >= 0) & (pos >= first) & (pos <= query_pos)
    if positions is None:
        ok &= pos < length
    if window > 0:
        ok &= (query_pos - pos < window) | (pos < sinks)
    return ok.nonzero().flatten()


def attention_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    kv_start: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    window: int = 0,
    softcap: float = 0.0,
    positions: Optional[torch.Tensor] = None,
    sinks: int = 0,
    sink_logits: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """float64 softmax attention over exactly the slots each query may see (gathered, so whatever
    the other slots hold, NaN included, cannot reach the result).

    Args:
        q: (batch, num_heads, seq, head_dim); query i of row b sits at logical position
            lengths[b] - seq + i.
        keys, values: (batch, num_kv_heads, max_len, head_dim); num_heads % num_kv_heads == 0.
        lengths, kv_start: 0-D or (batch,) integer tensors.
        positions: None (a linear cache) or (batch, max_len) logical position per slot (rings).
        sink_logits: None or (num_heads,) learned sink logits: a column of that score is appended to
            each head's scores before the softmax and dropped after it (transformers' eager gpt-oss).

    Returns:
        (batch, num_heads, seq, head_dim) float64 on q's device; a query that sees nothing gets 0.
    """
    b, h, s, d = q.shape
    kv_heads = keys.shape[1]
    group = h // kv_heads if kv_heads else 1
    scale = d**-0.5 if scale is None else scale
    lens = _per_row(lengths, b)
    firsts = _per_row(kv_start, b)
    out = torch.zeros(b, h, s, d, dtype=torch.float64)
    q64 = q.detach().cpu().double()
    for r in range(b):
        for i in range(s):
            p = lens[r] - s + i
            idx = visible_slots(lens[r], p, keys.shape[2], firsts[r], window,
                                None if positions is None else positions[r], sinks)
            if idx.numel() == 0:
                continue
            k = keys[r][:, idx.to(keys.device)].detach().cpu().double().repeat_interleave(group, 0)
            v = values[r][:, idx.to(values.device)].detach().cpu().double().repeat_interleave(group, 0)
            sc = torch.einsum("hd,hnd->hn", q64[r, :, i], k) * scale
            if softcap > 0:
                sc = softcap * torch.tanh(sc / softcap)
            if sink_logits is not None:
                col = sink_logits.detach().cpu().double().view(h, 1)
                w = torch.softmax(torch.cat([sc, col], -1), -1)[:, :-1]
            else:
                w = torch.softmax(sc, -1)
            out[r, :, i] = torch.einsum("hn,hnd->hd", w, v)
    return out.to(q.device)


def update_reference(keys, values, keys_new, values_new, starts: Union[int, Sequence[int]]):
    """Plain slicing on copies: the expected cache after an update.

    Args:
        starts: an int (every row) or a sequence of per-row ints.
    """
    keys, values = keys.clone(), values.clone()
    chunk = keys_new.shape[2]
    batch = keys.shape[0]
    if isinstance(starts, int):
        starts = [starts] * batch
    for b, s in enumerate(starts):
        keys[b, :, s : s + chunk] = keys_new[b]
        values[b, :, s : s + chunk] = values_new[b]
    return keys, values


#: The largest magnitude of each quantized format (README "Quantized caches").
QUANT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize_reference(x: torch.Tensor, kv_dtype: torch.dtype):
    """``(..., head_dim)`` float data -> ``(quantized, float32 scale (...))`` by the formats' definition.

    scale = absmax / qmax (float32, floored at the smallest normal float32, NaN read as 0; an infinite
    element makes it infinite), data / scale with NaN read as 0, clamped to [-qmax, qmax]; int8 rounds
    half away from zero (exact in float64), float8_e4m3fn to nearest even.
    """
    x = x.float()
    qmax = QUANT_MAX[kv_dtype]
    absmax = torch.where(x.isnan(), 0.0, x).abs().amax(-1)  # not nan_to_num: it makes inf finite
    scale = torch.clamp(absmax / qmax, min=torch.finfo(torch.float32).tiny)
    y = x / scale[..., None]
    y = torch.where(y.isnan(), 0.0, y).clamp(-qmax, qmax)
    if kv_dtype == torch.int8:
        q = (y.sign().double() * (y.abs().double() + 0.5).floor()).to(torch.int8)
    else:
        q = y.to(torch.float8_e4m3fn)
    return q, scale


def quantized_update_reference(keys, values, k_scale, v_scale, keys_new, values_new, starts):
    """Copies of a quantized cache after a write of keys_new / values_new at ``starts`` (an int or one per
    row): each (row, head, slot) quantized by :func:`quantize_reference` and placed by slicing."""
    qk, sk = quantize_reference(keys_new, keys.dtype)
    qv, sv = quantize_reference(values_new, keys.dtype)
    keys, values = update_reference(keys, values, qk, qv, starts)
    k_scale, v_scale = update_reference(k_scale[..., None], v_scale[..., None], sk[..., None], sv[..., None], starts)
    return keys, values, k_scale[..., 0], v_scale[..., 0]


def ring_update_reference(keys, values, positions, keys_new, values_new, starts, sinks, k_scale=None, v_scale=None):
    """Copies of a ring after a write at the logical positions [start_b, start_b + chunk) of each row.

    Position p goes to slot p if p < sinks, else sinks + (p - sinks) % (capacity - sinks); of the chunk only
    what the ring keeps is placed (the sinks and the last capacity - sinks positions). With scales (a
    quantized ring) the data is quantized by :func:`quantize_reference` first. Returns (keys, values,
    positions, k_scale, v_scale) (scales None for a plain ring).
    """
    keys, values, positions = keys.clone(), values.clone(), positions.clone()
    kn, vn, sk, sv = keys_new, values_new, None, None
    if k_scale is not None:
        k_scale, v_scale = k_scale.clone(), v_scale.clone()
        kn, sk = quantize_reference(keys_new, keys.dtype)
        vn, sv = quantize_reference(values_new, keys.dtype)
    batch, _, capacity, _ = keys.shape
    chunk = keys_new.shape[2]
    if isinstance(starts, int):
        starts = [starts] * batch
    for b, start in enumerate(starts):
        end = start + chunk
        for t in range(chunk):
            p = start + t
            if not (p < sinks or p >= end - (capacity - sinks)):
                continue
            slot = p if p < sinks else sinks + (p - sinks) % (capacity - sinks)
            keys[b, :, slot] = kn[b, :, t]
            values[b, :, slot] = vn[b, :, t]
            positions[b, slot] = p
            if sk is not None:
                k_scale[b, :, slot] = sk[b, :, t]
                v_scale[b, :, slot] = sv[b, :, t]
    return keys, values, positions, k_scale, v_scale


def select_reference(keys, values, lengths, index):
    """The buffers after row b takes row index[b]'s filled slots (cloned); beyond them, row b keeps
    its own bytes.

    Args:
        index: a sequence or 1-D tensor of source rows.

    Returns:
        (keys, values, new_lengths): copies of the whole buffers, and lengths[index] as a tensor of
        lengths' dtype (0-D lengths: unchanged).
    """
    k, v = keys.clone(), values.clone()
    lens = _per_row(lengths, keys.shape[0])
    src_rows = [int(i) for i in (index.tolist() if isinstance(index, torch.Tensor) else index)]
    for b, src in enumerate(src_rows):
        n = lens[src]
        k[b, :, :n] = keys[src, :, :n]
        v[b, :, :n] = values[src, :, :n]
    if lengths.dim() == 0:
        new_lengths = lengths.clone()
    else:
        new_lengths = torch.tensor([lens[s] for s in src_rows], dtype=lengths.dtype, device=lengths.device)
    return k, v, new_lengths
