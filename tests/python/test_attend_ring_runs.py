"""attend over rings whose visible slots are runs of consecutive slots (read in place) with gaps
(the blocks across a gap are gathered): against the float64 reference on the recorded positions,
with every slot no query sees poisoned with NaN."""

from __future__ import annotations

import pytest
import torch

import kvcache
from references import assert_close
from references import attention_reference as reference

ATTEND = torch.ops.kvcache.attend.default
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def ring_positions(written: int, capacity: int, sinks: int) -> torch.Tensor:
    """Logical position per slot after writing positions [0, written) one by one (-1: empty)."""
    pos = torch.full((capacity,), -1, dtype=torch.int32)
    for p in range(written):
        slot = p if p < sinks else sinks + (p - sinks) % (capacity - sinks)
        pos[slot] = p
    return pos


def run(b, h, kvh, seq, d, window, sinks, written, dtype, lengths=None, kv_start=None, max_step=8, seed=0):
    capacity = sinks + window + max_step - 1
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, seq, d, generator=g).to(dtype)
    keys = torch.randn(b, kvh, capacity, d, generator=g).to(dtype)
    values = torch.randn(b, kvh, capacity, d, generator=g).to(dtype)
    positions = torch.stack([ring_positions(n, capacity, sinks) for n in written])
    lengths = torch.tensor(written if lengths is None else lengths, dtype=torch.int32)
    kv_start_t = None if kv_start is None else torch.tensor(kv_start, dtype=torch.int64)
    kw = dict(kv_start=kv_start_t, window=window, positions=positions, sinks=sinks)
    expected = reference(q, keys, values, lengths, kv_start=kv_start_t, window=window, positions=positions,
                         sinks=sinks)
    # Poison every slot no query of its row sees (stale, empty, out of the window).
    for r in range(b):
        first = 0 if kv_start is None else kv_start[r]
        seen = torch.zeros(capacity, dtype=torch.bool)
        for i in range(seq):
            qp = int(lengths[r]) - seq + i
            p = positions[r].long()
            seen |= (p >= first) & (p <= qp) & (p >= 0) & ((qp - p < window) | (p < sinks))
        keys[r][:, ~seen] = float("nan")
        values[r][:, ~seen] = float("nan")
    out = ATTEND(q, keys, values, lengths, **kw)
    assert torch.isfinite(out).all()
    assert_close(out, expected, dtype)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seq", [1, 4])
def test_wrapped_ring_runs_and_gaps(dtype, seq):
    # window 200, sinks 4: sinks, then the run up to the write point, then the run after it.
    run(1, 8, 2, seq, 128, 200, 4, [1000], dtype)
    run(2, 8, 2, seq, 64, 300, 0, [1000, 5000], dtype)  # no sinks: two runs
    run(1, 4, 1, seq, 128, 100, 3, [150], dtype)  # wrapped once, a short ring (blocks < 64)


def test_ring_not_yet_wrapped_is_one_run():
    run(1, 8, 2, 1, 128, 500, 4, [300], torch.float32)


def test_ring_runs_with_stale_slots_after_rollback():
    # Written to 1006, rolled back to 1000: six stale slots inside the run, poisoned.
    run(1, 8, 2, 1, 128, 200, 4, [1006], torch.float32, lengths=[1000])
    run(1, 8, 2, 4, 128, 200, 4, [1006], torch.bfloat16, lengths=[1003])


def test_ring_runs_head_dim_not_multiple_of_8_and_left_padding():
    run(1, 8, 2, 1, 20, 200, 4, [1000], torch.float32)  # packed path only
    run(2, 4, 2, 2, 64, 200, 4, [1000, 900], torch.float32, kv_start=[850, 0])


def test_ring_runs_split_across_threads():
    saved_tuning = kvcache._C.attend_cpu_tuning()
    saved = torch.get_num_threads()
    kvcache._C.set_attend_cpu_tuning(parallel_work=0.0, min_split=1)
    torch.set_num_threads(2)
    try:
        run(1, 8, 1, 1, 128, 500, 4, [3000], torch.float32)
        run(1, 8, 1, 1, 128, 500, 4, [3000], torch.bfloat16)
    finally:
        torch.set_num_threads(saved)
        kvcache._C.set_attend_cpu_tuning(**saved_tuning)
