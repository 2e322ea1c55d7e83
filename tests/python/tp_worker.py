"""One rank of tests/python/test_tensor_parallel.py (run under torchrun, gloo, CPU).

    torchrun --nproc-per-node 2 tests/python/tp_worker.py MODEL_DIR OUT_DIR

Loads the tiny model saved in MODEL_DIR with transformers' tensor-parallel
plan (``tp_plan="auto"``: the q/k/v projections are split by heads, so each
rank holds half the KV heads), generates greedily with kvcache.hf caches
(lazily allocated; allocated up front from the config; a compiled decode
loop) and with ``generate_batch`` over transformers' paged cache, and
writes the tokens of each to OUT_DIR/rank{R}.pt for the test to compare
with one process's tokens.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist


def main() -> int:
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    from transformers import AutoModelForCausalLM

    import kvcache.hf

    data = torch.load(os.path.join(model_dir, "inputs.pt"))
    ids, mask, new = data["input_ids"], data["attention_mask"], data["new_tokens"]
    max_len = ids.shape[1] + new + 4
    try:
        from transformers import DistributedConfig  # newer transformers: the config form
        kw = {"distributed_config": DistributedConfig(tp_plan="auto")}
    except ImportError:
        kw = {"tp_plan": "auto"}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="kvcache",
                                                 **kw).eval()
    arg = kvcache.hf.CACHE_ARG
    out = {"tp_size": model.tp_size}

    def generate(cache):
        with torch.no_grad():
            seq = model.generate(input_ids=ids, attention_mask=mask, **{arg: cache}, max_new_tokens=new,
                                 do_sample=False)
        return seq[:, ids.shape[1]:]

    lazy = kvcache.hf.KVCache(model.config, max_len)
    out["lazy"] = generate(lazy)
    out["lazy_heads"] = lazy.layers[0].keys.shape[1]

    pre = kvcache.hf.KVCache(model.config, max_len, batch_size=ids.shape[0], dtype=torch.float32, device="cpu")
    out["preallocated_heads"] = pre.layers[0].keys.shape[1]
    out["preallocated"] = generate(pre)

    # Compiled decode: transformers compiles the single-token step when the
    # cache is compileable (on CPU only when told); one graph for every step.
    backend = os.environ.get("KVCACHE_TP_COMPILE", "inductor")
    if backend != "none":
        from torch._dynamo.utils import counters
        from transformers import CompileConfig

        config = CompileConfig(fullgraph=True, backend=backend, mode=None)
        config._compile_all_devices = True
        model.generation_config.compile_config = config
        pre.reset()
        try:
            out["compiled"] = generate(pre)
            out["compiled_graphs"] = counters["stats"]["unique_graphs"]
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails with it
            out["compiled_error"] = f"{type(e).__name__}: {str(e)[:3000]}"

    # Continuous batching (generate_batch through paged|kvcache) over transformers' own pages, each
    # rank holding its half of the KV heads.
    try:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        model.set_attn_implementation("kvcache")
        gc = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        cb = ContinuousBatchingConfig(page_size=8, num_blocks=32, max_batch_tokens=16, allow_block_sharing=True)
        res = model.generate_batch(data["requests"], generation_config=gc, continuous_batching_config=cb,
                                   progress_bar=False)
        out["batch"] = [res[f"req_{i}"].generated_tokens for i in range(len(data["requests"]))]
    except Exception as e:  # noqa: BLE001 - reported to the test, which fails with it
        out["batch_error"] = f"{type(e).__name__}: {str(e)[:3000]}"

    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
