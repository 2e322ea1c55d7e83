"""Traced code raises what eager code raises.

A start computed from tensor data is an unbacked SymInt while tracing: its
checks are left to the kernel, which raises eager's exception when the
compiled program runs.
"""

from __future__ import annotations

import pytest
import torch

import kvcache  # noqa: F401

ops = torch.ops.kvcache
B, H, T, D = 2, 2, 8, 4
INT64_MAX = 2**63 - 1


def cache():
    return torch.randn(B, H, T, D), torch.randn(B, H, T, D)


def new(chunk=2, d=D, dtype=torch.float32):
    return torch.randn(B, H, chunk, d).to(dtype), torch.randn(B, H, chunk, d).to(dtype)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("start", [T - 1, -1])
def test_data_dependent_start_raises_eager_error(backend, start):
    """A start computed from tensor data (an unbacked SymInt while tracing) is checked by the kernel
    when the program runs, with eager's exception: no "Runtime assertion failed for expression u0 <= 6"."""
    k, v = cache()
    kn, vn = new(2)

    def step(k, v, kn, vn, s):
        return ops.update_(k, v, kn, vn, (s + 0).sum().item())

    with pytest.raises(Exception) as ref:
        step(k, v, kn, vn, torch.tensor([start]))
    torch._dynamo.reset()
    before = k.clone()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(step, fullgraph=True, backend=backend)
        with pytest.raises(type(ref.value)) as got:
            compiled(k, v, kn, vn, torch.tensor([start]))
        assert str(got.value) == str(ref.value)
        assert torch.equal(k, before)
        compiled(k, v, kn, vn, torch.tensor([3]))  # the same program, a valid start
    assert torch.equal(k[:, :, 3:5], kn)
