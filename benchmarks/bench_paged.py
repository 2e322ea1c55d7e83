"""Paged attend against contiguous attend over the same sequences: what the page indirection costs.

``python benchmarks/bench_paged.py [--device cpu] [--threads 1 0] [--dtypes float32 bfloat16] [--block-sizes 16 64 256]
[--batch 16 32 64] [--q-len 1] [--packed-sdpa] [--json F]``

A decode step (one query per sequence) over a batch of sequences whose lengths spread from 1/8 of
``--max-len`` to ``--max-len`` (SmolLM2's attention geometry by default: 9 query heads, 3 KV heads,
head_dim 64), timed three ways in interleaved rounds: ``kvcache.attend`` over a contiguous
``(batch, kv_heads, max_len, head_dim)`` cache holding the sequences, ``attend_pages`` over the same
tokens in shuffled pages of each block size, and ``paged/contiguous``, the ratio (the issue's bar:
<= 1.15). ``token_major_us`` times contiguous ``attend`` over the same tokens in token-major memory
(``(batch, max_len, kv_heads, head_dim)``, each slot's KV heads side by side as in a page, no block
table), and ``vs_token_major`` is paged over it: what the block table itself costs, apart from the
slot layout that transformers' and vLLM's pages share. With several ``--batch`` sizes (the same lengths repeated), ``vs_first_batch`` is each
paged time over the first batch's: decode attention over pages grows with the total context, so
twice the sequences should cost about twice the time. ``--packed-sdpa`` also times what
transformers' ``paged|sdpa`` does per layer: gather every sequence's context into one packed
tensor and run SDPA over all queries against all keys under a block-diagonal mask (its work grows
with the square of the batch). Prints the CPU model and the kernel's ISA path; a figure holds only
with them. ``--q-len N`` makes each sequence's last N tokens its queries (a prefill chunk, the GEMM
loops: pages smaller than the kernel's 64-slot block are gathered a block at a time) instead of one.
"""

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import kvcache  # noqa: E402
from kvcache.paged import attend_pages  # noqa: E402


def _zeros(shape, dtype, device):
    """A cache buffer allocated as kvcache's inits allocate theirs (``kvcache._C.cache_zeros``: on
    the CPU in transparent huge pages unless KVCACHE_HUGE_PAGES=0)."""
    return kvcache._C.cache_zeros(list(shape), dtype, torch.device(device))


def _buffer(src):
    """``src`` copied into a buffer from :func:`_zeros`."""
    return _zeros(src.shape, src.dtype, src.device).copy_(src)


def case(batch, heads, kv_heads, dim, max_len, block_size, dtype, seed=0, device="cpu", q_len=1):
    g = torch.Generator().manual_seed(seed)
    # Lengths from max_len / 8 to max_len over (at most) 16 sequences, repeated: batches of 32 and
    # 64 hold the 16-sequence batch's lengths twice and four times.
    n = min(batch, 16)
    lens = torch.linspace(max_len // 8, max_len, n).round().to(torch.int32).repeat(-(-batch // n))[:batch]
    keys = torch.randn(batch, kv_heads, max_len, dim, generator=g).to(dtype)
    values = torch.randn(batch, kv_heads, max_len, dim, generator=g).to(dtype)
    per = -(-max_len // block_size)
    nb = batch * per
    table = torch.randperm(nb, generator=g)[: batch * per].view(batch, per).to(torch.int32)
    pos = torch.arange(max_len)
    slots = (table.long()[:, pos // block_size] * block_size + pos % block_size).reshape(-1)
    # Every cache buffer is allocated on the device as the inits allocate theirs (_buffer).
    kp = _zeros((nb, block_size, kv_heads, dim), dtype, device)
    vp = _zeros((nb, block_size, kv_heads, dim), dtype, device)
    kp.view(-1, kv_heads, dim)[slots.to(device)] = keys.permute(0, 2, 1, 3).reshape(-1, kv_heads, dim).to(device)
    vp.view(-1, kv_heads, dim)[slots.to(device)] = values.permute(0, 2, 1, 3).reshape(-1, kv_heads, dim).to(device)
    lens = lens.clamp(min=q_len)
    q = torch.randn(batch, heads, q_len, dim, generator=g).to(dtype)
    keys, values, lens, table, q = (t.to(device) for t in (keys, values, lens, table, q))
    cache = kvcache.KVLayerCache(_buffer(keys), _buffer(values), lens)
    # The same tokens in token-major memory ((batch, max_len, kv_heads, head_dim), each slot's
    # heads side by side as in a page), viewed head-major: no pages, the pages' slot layout.
    token_major = kvcache.KVLayerCache(_buffer(keys.transpose(1, 2)).transpose(1, 2),
                                       _buffer(values.transpose(1, 2)).transpose(1, 2), lens)
    # Each sequence's queries are its last q_len tokens, in both calls.
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device) * q_len
    q3 = q.transpose(1, 2).reshape(batch * q_len, heads, dim).contiguous()
    as_paged = lambda out: out.transpose(1, 2).reshape(batch * q_len, heads, dim)  # noqa: E731
    contiguous = lambda: kvcache.attend(q, cache)  # noqa: E731
    contiguous_tm = lambda: kvcache.attend(q, token_major)  # noqa: E731
    paged = lambda: attend_pages(q3, kp, vp, table, lens, cu)  # noqa: E731
    torch.testing.assert_close(paged(), as_paged(contiguous()), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(contiguous_tm(), contiguous(), atol=2e-2, rtol=2e-2)

    # transformers' paged|sdpa: every context gathered into one packed (1, kv_heads, total, dim),
    # all queries against all keys, a block-diagonal mask keeping each query to its sequence.
    flat_slots = torch.cat([slots.view(batch, max_len)[b, : int(lens[b])] for b in range(batch)])
    owner = torch.repeat_interleave(torch.arange(batch, device=device), lens.long().to(device))
    mask = owner[None, :] == torch.arange(batch, device=device)[:, None]
    flat_slots = flat_slots.to(device)

    def packed_sdpa():
        k = kp.view(-1, kv_heads, dim).index_select(0, flat_slots).transpose(0, 1)[None]
        v = vp.view(-1, kv_heads, dim).index_select(0, flat_slots).transpose(0, 1)[None]
        qq = q3.transpose(0, 1)[None]
        return torch.nn.functional.scaled_dot_product_attention(qq, k, v, attn_mask=mask, enable_gqa=True)

    # The stand-in computes what paged attend does (checked where cheap).
    if q_len == 1 and batch * max_len <= 1 << 16:
        torch.testing.assert_close(packed_sdpa()[0].transpose(0, 1), paged(), atol=2e-2, rtol=2e-2)
    return contiguous, contiguous_tm, paged, packed_sdpa


@contextlib.contextmanager
def _huge_pages(on: bool):
    """Allocations inside get huge pages (kvcache's default) or 4 KB pages (KVCACHE_HUGE_PAGES=0,
    read at each allocation)."""
    old = os.environ.get("KVCACHE_HUGE_PAGES")
    os.environ["KVCACHE_HUGE_PAGES"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["KVCACHE_HUGE_PAGES"]
        else:
            os.environ["KVCACHE_HUGE_PAGES"] = old


def main(argv=None):
    p = argparse.ArgumentParser(prog="python benchmarks/bench_paged.py", description=__doc__.splitlines()[0])
    common.add_common_args(p)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--batch", type=int, nargs="+", default=[16])
    p.add_argument("--packed-sdpa", action="store_true", help="also time paged|sdpa's packed SDPA (slow; decode only)")
    p.add_argument("--q-len", type=int, default=1,
                   help="queries per sequence (its last tokens): 1 decodes, more time prefill chunks (the GEMM loops)")
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median reported)")
    p.add_argument("--huge-pages", choices=["on", "off", "both"], default="on",
                   help="CPU cache buffers in transparent huge pages, as kvcache's inits allocate them (on), in "
                        "4 KB pages (off: KVCACHE_HUGE_PAGES=0), or both in the same rounds (both: adds "
                        "contiguous_4k_us, paged_4k_us and huge_gain = paged_4k_us / paged_us)")
    args = p.parse_args(argv)
    time_sdpa = args.packed_sdpa and args.q_len == 1  # the packed SDPA stand-in is a decode step
    device = torch.device(args.device)
    env = common.environment(device)
    print(f"CPU: {env['cpu_model']} | attend ISA path: {env['attend_isa']} | torch {env['torch']}"
          + (f" | GPU: {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""))
    rows = []
    for threads in common.thread_settings(args.threads):
        with common.num_threads(threads):
            for dt in args.dtypes:
                dtype = getattr(torch, dt)
                for bs in args.block_sizes:
                    first = {}
                    for batch in args.batch:
                        geometry = (batch, args.heads, args.kv_heads, args.head_dim, args.max_len, bs, dtype)
                        with _huge_pages(args.huge_pages != "off"):
                            contiguous, token_major, paged, packed = case(*geometry, device=device,
                                                                          q_len=args.q_len)
                        fns = {"contiguous": contiguous, "token_major": token_major, "paged": paged}
                        if args.huge_pages == "both":
                            with _huge_pages(False):
                                fns["contiguous_4k"], _, fns["paged_4k"], _ = case(*geometry, device=device,
                                                                                   q_len=args.q_len)
                        if time_sdpa:
                            fns["packed_sdpa"] = packed
                        t = common.measure_many(fns, device, args.min_time, args.rounds)
                        c_us, p_us = t["contiguous"]["median_us"], t["paged"]["median_us"]
                        tm_us = t["token_major"]["median_us"]
                        first = first or {"batch": batch, "paged": p_us,
                                          "sdpa": t.get("packed_sdpa", {}).get("median_us")}
                        row = dict(threads=torch.get_num_threads(), dtype=dt, block_size=bs, batch=batch,
                                   q_len=args.q_len,
                                   max_len=args.max_len, contiguous_us=c_us, token_major_us=tm_us,
                                   paged_us=p_us, ratio=p_us / c_us, vs_token_major=p_us / tm_us,
                                   paged_spread=common.spread(t["paged"]), vs_first_batch=p_us / first["paged"])
                        if args.huge_pages == "both":
                            p4 = t["paged_4k"]["median_us"]
                            row.update(contiguous_4k_us=t["contiguous_4k"]["median_us"], paged_4k_us=p4,
                                       huge_gain=p4 / p_us)
                        if time_sdpa:
                            s_us = t["packed_sdpa"]["median_us"]
                            row.update(packed_sdpa_us=s_us, sdpa_vs_first_batch=s_us / first["sdpa"])
                        rows.append(row)
    cols = ["threads", "dtype", "block_size", "batch", "q_len", "max_len", "contiguous_us", "token_major_us",
            "paged_us",
            "paged_spread", "ratio", "vs_token_major", "vs_first_batch"]
    if args.huge_pages == "both":
        cols += ["contiguous_4k_us", "paged_4k_us", "huge_gain"]
    if time_sdpa:
        cols += ["packed_sdpa_us", "sdpa_vs_first_batch"]
    what = "decode" if args.q_len == 1 else f"{args.q_len}-token chunk"
    common.print_table(f"{what} attend: paged vs contiguous (median of interleaved rounds)", rows, cols)
    common.write_json(args.json, env, args, rows)


if __name__ == "__main__":
    main()
