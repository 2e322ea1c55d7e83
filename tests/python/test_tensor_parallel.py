"""Tensor parallelism: kvcache.hf under transformers' tp_plan="auto", two gloo ranks on CPU.

The test saves a tiny random Llama (8 query heads, 4 KV heads: 2 per rank),
generates greedily in this process with transformers' DynamicCache + sdpa
(the reference: one process, the whole model), then runs
``torchrun --nproc-per-node 2 tests/python/tp_worker.py``: each rank loads
the sharded model and generates with a lazily allocated
``kvcache.hf.KVCache``, one allocated up front from the config, a
compiled decode on the latter, and ``generate_batch`` through ``paged|kvcache``
(against transformers' ``paged|sdpa`` in one process). Every rank's tokens
must equal the reference.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

import kvcache.hf as kh  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
NEW = 10
KV_HEADS = 4


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """(reference tokens, [rank 0's results, rank 1's results])."""
    folder = tmp_path_factory.mktemp("tp")
    model_dir, out_dir = folder / "model", folder / "out"
    out_dir.mkdir()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                      initializer_range=0.2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(model_dir)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # row 1 left-padded
    # generate_batch's requests: the rows without padding, and one sharing row 0's first 8 tokens.
    requests = [ids[0].tolist(), ids[1, 3:].tolist(), ids[0, :8].tolist() + [5, 6, 7]]
    torch.save({"input_ids": ids, "attention_mask": mask, "new_tokens": NEW, "requests": requests},
               model_dir / "inputs.pt")
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, **{kh.CACHE_ARG: DynamicCache(config=cfg)},
                             max_new_tokens=NEW, do_sample=False)[:, ids.shape[1]:]
    batch_ref = _generate_batch_one_process(model, requests)

    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", MASTER_ADDR="127.0.0.1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(HERE, "tp_worker.py"), str(model_dir), str(out_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return (ref, batch_ref), [torch.load(out_dir / f"rank{r}.pt") for r in range(2)]


def _generate_batch_one_process(model, requests):
    """transformers' own continuous batching (paged|sdpa) on the whole model, in this process."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gc = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=8, num_blocks=32, max_batch_tokens=16, allow_block_sharing=True)
    model.set_attn_implementation("sdpa")  # the manager switches it to transformers' paged sdpa
    res = model.generate_batch(requests, generation_config=gc, continuous_batching_config=cb, progress_bar=False)
    return [res[f"req_{i}"].generated_tokens for i in range(len(requests))]


def test_model_is_sharded(ranks):
    _, results = ranks
    for r in results:
        assert r["tp_size"] == 2
        assert r["lazy_heads"] == KV_HEADS // 2  # the local key states' heads


def test_lazy_cache_matches_one_process(ranks):
    (ref, _), results = ranks
    for r in results:
        assert torch.equal(r["lazy"], ref)


def test_preallocated_cache_sizes_from_local_heads(ranks):
    (ref, _), results = ranks
    for r in results:
        assert r["preallocated_heads"] == KV_HEADS // 2
        assert torch.equal(r["preallocated"], ref)


def test_compiled_decode_matches_one_process(ranks):
    (ref, _), results = ranks
    for r in results:
        assert "compiled_error" not in r, r["compiled_error"]
        assert torch.equal(r["compiled"], ref)
        assert r["compiled_graphs"] == 1  # every decode step ran one graph


def test_generate_batch_matches_one_process(ranks):
    """generate_batch through paged|kvcache on 2 ranks (each with half the KV heads in its pages)
    gives the tokens of transformers' paged|sdpa on the whole model in one process."""
    (_, batch_ref), results = ranks
    for r in results:
        assert "batch_error" not in r, r["batch_error"]
        assert r["batch"] == batch_ref


def test_tp_size_from_config():
    """Without a distributed config the cache sizes from num_key_value_heads; with tp_size 2, half."""
    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=8, num_key_value_heads=KV_HEADS)
    full = kh.KVCache(cfg, 16, batch_size=1, dtype=torch.float32, device="cpu")
    assert full.layers[0].keys.shape == (1, KV_HEADS, 16, 16)
    from transformers import DistributedConfig

    cfg.distributed_config = DistributedConfig(tp_size=2)
    half = kh.KVCache(cfg, 16, batch_size=1, dtype=torch.float32, device="cpu")
    assert half.layers[0].keys.shape == (1, KV_HEADS // 2, 16, 16)
    cfg.distributed_config = DistributedConfig(tp_size=3)
    with pytest.raises(ValueError, match="tp_size=3"):
        kh.KVCache(cfg, 16, batch_size=1, dtype=torch.float32, device="cpu")
