"""Paged caches in the deployment paths: a continuous-batching layer step (write the step's keys and
values at their slots, attend over each sequence's pages) with its pages held as module buffers,
scripted with TorchScript (saved and loaded), exported with torch.export (saved and loaded),
compiled with AOTInductor and with torch.compile. Each serves steps in which requests join and
leave (the token count, the sequence count and the table width change, one token and one
sequence included) against the float64 reference over every sequence's keys and values as given
(plain pages), and the same as eager (int8 pages); bad metadata is refused as in eager, before
anything is read."""

import warnings
from typing import Optional

import pytest
import torch

from kvcache.paged import BlockAllocator, PagedKVCache, init_paged_cache
from references import attention_reference

NUM_BLOCKS, BLOCK_SIZE, HEADS, KV_HEADS, DIM, WINDOW = 24, 4, 4, 2, 16, 6


class PagedStep(torch.nn.Module):
    """One attention layer's continuous-batching step over pages held as buffers."""

    def __init__(self, kv_dtype=None):
        super().__init__()
        c = init_paged_cache(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, DIM, torch.float32, kv_dtype=kv_dtype)
        self.register_buffer("key_pages", c.key_pages)
        self.register_buffer("value_pages", c.value_pages)
        self.register_buffer("key_scales", c.key_scales)
        self.register_buffer("value_scales", c.value_scales)
        self.window = WINDOW

    def forward(self, q, k, v, slots, table, lens, cu):
        cache = PagedKVCache(self.key_pages, self.value_pages, self.key_scales, self.value_scales)
        cache.write(k, v, slots)
        return cache.attend(q, table, lens, cu, window=self.window)


def steps():
    """Continuous-batching steps over a BlockAllocator: requests join (a prefill) and leave
    between steps, so the token count, the sequence count and the table width change every step
    (one token and one sequence included). Returns each step's args and each of its sequences'
    keys and values so far (for the reference), fresh tensors each call."""
    plan = [{"a": 6, "b": 3}, {"a": 1, "b": 1, "c": 4}, {"a": 1}, {"a": 1, "c": 1, "d": 9},
            {"d": 1}, {"a": 2, "d": 1, "e": 3}]
    g = torch.Generator().manual_seed(9)
    alloc = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE)
    history, out = {}, []
    for step in plan:
        for gone in [r for r in history if r not in step]:
            alloc.free(gone)
            del history[gone]
        seqs = list(step)
        slots = torch.cat([alloc.append(r, step[r]) for r in seqs])
        total = len(slots)
        q = torch.randn(total, HEADS, DIM, generator=g)
        k = torch.randn(total, KV_HEADS, DIM, generator=g)
        v = torch.randn(total, KV_HEADS, DIM, generator=g)
        cu = torch.tensor([0] + torch.tensor([step[r] for r in seqs]).cumsum(0).tolist(), dtype=torch.int32)
        for i, r in enumerate(seqs):
            ks, vs = history.get(r, (k[:0], v[:0]))
            history[r] = (torch.cat([ks, k[cu[i]:cu[i + 1]]]), torch.cat([vs, v[cu[i]:cu[i + 1]]]))
        out.append(((q, k, v, slots, alloc.block_table(seqs), alloc.context_lens(seqs), cu),
                    [history[r] for r in seqs]))
    return out


def reference(args, kv):
    q, _, _, _, _, lens, cu = args
    ref = torch.zeros(q.shape, dtype=torch.float64)
    for s, (keys, values) in enumerate(kv):
        a, e = int(cu[s]), int(cu[s + 1])
        keys, values = keys.permute(1, 0, 2)[None], values.permute(1, 0, 2)[None]
        ref[a:e] = attention_reference(q[a:e].permute(1, 0, 2)[None], keys, values, lens[s], window=WINDOW)[0] \
            .permute(1, 0, 2)
    return ref


def script(module):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript is deprecated in recent torch
        return torch.jit.script(module)


def bad_table(args):
    """The step with sequence 1's last page out of range."""
    q, k, v, slots, table, lens, cu = args
    table = table.clone()
    table[1, (int(lens[1]) - 1) // BLOCK_SIZE] = NUM_BLOCKS
    return (q, k, v, slots, table, lens, cu)


def scripted(module, tmp_path):
    path = tmp_path / "paged_step.pt"
    script(module).save(str(path))
    return torch.jit.load(str(path))


def export(module):
    """The step exported for any token count, sequence count and table width: one program."""
    tokens = torch.export.Dim("tokens", min=1, max=4096)
    seqs = torch.export.Dim("seqs", min=1, max=256)
    width = torch.export.Dim("width", min=1, max=1024)
    dims = ({0: tokens},) * 4 + ({0: seqs, 1: width}, {0: seqs}, {0: seqs + 1})
    return torch.export.export(module, steps()[0][0], dynamic_shapes=dims)


def exported(module, tmp_path):
    path = tmp_path / "paged_step.pt2"
    torch.export.save(export(module), path)
    return torch.export.load(path).module()


def aoti(module, tmp_path):
    ep = export(module)
    package = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "paged_step_aoti.pt2"))
    return torch._inductor.aoti_load_package(package)


PATHS = {"script": scripted, "export": exported, "aoti": aoti}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_deployed_step_matches_the_reference(path, tmp_path):
    """Each path's step (AOTInductor: compiled to C++, the ops called through the dispatcher)."""
    module = PATHS[path](PagedStep(), tmp_path)
    with torch.no_grad():
        for args, kv in steps():
            torch.testing.assert_close(module(*args).double(), reference(args, kv), atol=2e-5, rtol=2e-5)


def padded(args, extra):
    """The step padded to a fixed token count, as a compiled or CUDA-graph step is: `extra` more
    rows of q, k and v (random, so a read of them would show) whose slots are -1."""
    q, k, v, slots, table, lens, cu = args
    g = torch.Generator().manual_seed(extra)
    pad = [torch.randn((extra,) + x.shape[1:], generator=g) for x in (q, k, v)]
    slots = torch.cat([slots, torch.full((extra,), -1, dtype=slots.dtype)])
    return (torch.cat([q, pad[0]]), torch.cat([k, pad[1]]), torch.cat([v, pad[2]]), slots, table, lens, cu)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_deployed_step_serves_padded_batches(path, tmp_path):
    """Steps padded past cu_seqlens_q[-1] (q, k, v and slot_mapping alike, the export's one token
    Dim): the sequences' rows as the reference, the padding rows 0, nothing of them written (the
    later steps still match the reference over the real tokens alone)."""
    eager = PagedStep()
    module = PATHS[path](PagedStep(), tmp_path)
    with torch.no_grad():
        for i, (args, kv) in enumerate(steps()):
            total = int(args[6][-1])
            out = module(*padded(args, 1 + i % 3))
            torch.testing.assert_close(out[:total].double(), reference(args, kv), atol=2e-5, rtol=2e-5)
            assert torch.equal(out[total:], torch.zeros_like(out[total:]))
            eager(*args)
    if path != "aoti":  # AOTInductor's runner keeps its pages to itself
        for name, buf in eager.named_buffers():  # the real tokens alone: as the unpadded eager steps
            assert torch.equal(dict(module.named_buffers())[name], buf), name


@pytest.mark.parametrize("path", ["export", "script"])  # AOTInductor's runner keeps its pages to itself
def test_deployed_int8_step_equals_eager(path, tmp_path):
    eager = PagedStep("int8")
    module = PATHS[path](PagedStep("int8"), tmp_path)
    with torch.no_grad():
        for args, kv in steps():
            out = module(*args)
            assert torch.equal(out, eager(*args))
            # int8 pages: within the quantization's error of the reference
            torch.testing.assert_close(out.double(), reference(args, kv), atol=0.05, rtol=0.05)
    for name, buf in eager.named_buffers():
        assert torch.equal(dict(module.named_buffers())[name], buf), name


def test_exported_step_mutates_exactly_the_pages():
    ep = export(PagedStep("int8"))
    ops = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert any("kvcache.paged_write_" in o for o in ops) and any("kvcache.paged_attend" in o for o in ops)
    mutated = ep.run_decompositions().graph_signature.buffers_to_mutate
    assert sorted(mutated.values()) == ["key_pages", "key_scales", "value_pages", "value_scales"]


# What each path raises for an op's ValueError: TorchScript's interpreter and AOTInductor's proxy
# executor re-raise every op error as a RuntimeError carrying the op's message.
RAISES = {"script": RuntimeError, "export": ValueError, "aoti": RuntimeError}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_deployed_step_refuses_bad_metadata_as_eager(path, tmp_path):
    """A page index out of range: the attend raises eager's error before reading anything (the
    step's write, a separate op, ran before it, as in eager)."""
    (prefill, _), (step, kv) = steps()[:2]
    eager = PagedStep()
    module = PATHS[path](PagedStep(), tmp_path)
    with torch.no_grad():
        eager(*prefill)
        module(*prefill)
        with pytest.raises(ValueError) as expected:
            eager(*bad_table(step))
        with pytest.raises(RAISES[path]) as got:
            module(*bad_table(step))
    assert "block_table" in str(expected.value)
    assert str(expected.value).splitlines()[0] in str(got.value)
    # The refused step left the pages as eager's: the good step still gives the reference.
    with torch.no_grad():
        torch.testing.assert_close(module(*step).double(), reference(step, kv), atol=1e-4, rtol=1e-4)


def test_scripted_paged_wrappers_call_the_ops():
    from kvcache.paged import attend_pages, write_pages

    assert "kvcache::paged_write_" in str(script(write_pages).graph)
    assert "kvcache::paged_attend" in str(script(attend_pages).graph)


def test_scripted_attend_takes_no_window_as_none():
    from kvcache.paged import attend_pages

    def step(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
             cu: torch.Tensor, window: Optional[int]) -> torch.Tensor:
        return attend_pages(q, kp, vp, table, lens, cu, window=window)

    (prefill, _), *_ = steps()
    module = PagedStep()
    with torch.no_grad():
        module(*prefill)
    q, _, _, _, table, lens, cu = prefill
    fn = script(step)
    out = fn(q, module.key_pages, module.value_pages, table, lens, cu, None)
    assert torch.equal(out, attend_pages(q, module.key_pages, module.value_pages, table, lens, cu))


def test_compiled_step_serves_changing_batches_without_recompiling():
    """torch.compile(fullgraph=True) of the step with the sizes that change between steps marked
    unbacked (the token count, the sequence count, the table width): one compilation serves every
    step, one token or one sequence included (fail_on_recompile after the first), and each step
    attends as the float64 reference. Unbacked, not mark_dynamic: a dynamic size is specialized
    at 0 and 1, so a one-token step recompiled and a one-sequence step failed (cu_seqlens_q's
    size 2 made a constant). Nor dynamic=True: every size becomes a symbol, and duck sizing ties
    sizes equal in the first step together (its 2 sequences with the 2 KV heads)."""
    module = PagedStep()
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True)
    # (argument, dim) of each size that varies: q, k, v, slots by tokens; table, lens, cu by sequences.
    varying = [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (4, 1), (5, 0), (6, 0)]
    for i, (args, kv) in enumerate(steps()):
        for a, d in varying:
            torch._dynamo.decorators.mark_unbacked(args[a], d)
        with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            out = compiled(*args)
        torch.testing.assert_close(out.double(), reference(args, kv), atol=2e-5, rtol=2e-5, msg=f"step {i}")


@torch.no_grad()
def test_inductor_writes_the_module_pages_in_place():
    """The generated code hands the module's own pages to the write: no page-sized buffer is
    allocated, nothing is cloned, and the step's keys land in the module's pages."""
    from torch._inductor.utils import run_and_get_code

    module = PagedStep("int8")
    pages = (module.key_pages.data_ptr(), module.value_pages.data_ptr())
    torch._dynamo.reset()
    (args, _), *_ = steps()
    _, codes = run_and_get_code(torch.compile(module, fullgraph=True), *args)
    code = "\n".join(codes)
    assert "torch.ops.kvcache.paged_write_" in code and "torch.ops.kvcache.paged_attend" in code, code
    page_shape = f"({NUM_BLOCKS}, {BLOCK_SIZE}, {KV_HEADS}, {DIM})"
    assert not [line for line in code.splitlines() if "empty_strided" in line and page_shape in line]
    assert "aten.clone" not in code and ".clone(" not in code
    assert (module.key_pages.data_ptr(), module.value_pages.data_ptr()) == pages
    slots = args[3]
    assert torch.count_nonzero(module.key_pages.view(-1, KV_HEADS, DIM)[slots]) > 0
