"""init_kv_layer_cache, init_decoder_kv_caches(_from_config), TransformerConfig."""

from __future__ import annotations

import pytest
import torch

import kvcache
from kvcache import TransformerConfig

from kv_testing import ALL_DTYPES, assert_same


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_init_layer_cache_zeros_shape_dtype(dtype):
    cache = kvcache.init_kv_layer_cache(2, 3, 8, 16, dtype)
    expected = torch.zeros(2, 3, 16, 8, dtype=dtype)
    for buf in (cache.keys, cache.values):
        assert buf.shape == (2, 3, 16, 8)
        assert buf.dtype == dtype
        assert buf.device.type == "cpu"
        assert buf.is_contiguous()
        assert_same(buf, expected)
    assert cache.length.dtype == torch.int32
    assert cache.length.shape == ()
    assert int(cache.length) == 0
    assert cache.max_len == 16
    assert isinstance(cache.max_len, int)


def test_keys_and_values_are_separate_storage():
    cache = kvcache.init_kv_layer_cache(1, 1, 4, 4, torch.float32)
    assert cache.keys.untyped_storage().data_ptr() != cache.values.untyped_storage().data_ptr()
    cache.keys.fill_(1.0)
    assert torch.count_nonzero(cache.values) == 0


def test_cache_is_frozen():
    cache = kvcache.init_kv_layer_cache(1, 1, 4, 4, torch.float32)
    with pytest.raises(Exception):
        cache.length = torch.tensor(3)  # type: ignore[misc]


def test_op_default_dtype_and_device():
    keys, values, length = torch.ops.kvcache.init_layer_cache(1, 2, 4, 8)
    assert keys.dtype == torch.get_default_dtype()
    assert keys.device == torch.device("cpu")
    assert values.shape == (1, 2, 8, 4)
    assert length.dtype == torch.int32 and int(length) == 0


def test_init_accepts_device_string():
    cache = kvcache.init_kv_layer_cache(1, 1, 2, 3, torch.float16, device="cpu")
    assert cache.keys.device == torch.device("cpu")
    assert cache.length.device == torch.device("cpu")


@pytest.mark.parametrize("name", ["batch_size", "num_kv_heads", "head_dim", "max_len"])
def test_init_negative_size_is_value_error(name):
    args = dict(batch_size=1, num_kv_heads=1, head_dim=2, max_len=3)
    args[name] = -1
    with pytest.raises(ValueError, match=f"{name} must be >= 0"):
        kvcache.init_kv_layer_cache(**args, dtype=torch.float32)


@pytest.mark.parametrize("name", ["batch_size", "max_len"])
def test_init_non_int_size_is_type_error(name):
    args = dict(batch_size=1, num_kv_heads=1, head_dim=2, max_len=3)
    args[name] = 2.5
    with pytest.raises(TypeError, match=name):
        kvcache.init_kv_layer_cache(**args, dtype=torch.float32)


def test_init_bad_dtype_is_type_error():
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        kvcache.init_kv_layer_cache(1, 1, 2, 3, "float32")


def test_init_decoder_kv_caches_distinct():
    caches = kvcache.init_decoder_kv_caches(
        num_layers=3, batch_size=2, num_kv_heads=2, head_dim=4, max_len=5, dtype=torch.bfloat16
    )
    assert isinstance(caches, tuple) and len(caches) == 3
    ptrs = set()
    for c in caches:
        assert c.keys.shape == (2, 2, 5, 4) and c.keys.dtype == torch.bfloat16
        ptrs.add(c.keys.data_ptr())
        ptrs.add(c.values.data_ptr())
    assert len(ptrs) == 6
    caches[0].keys.fill_(1)
    assert all(torch.count_nonzero(c.keys) == 0 for c in caches[1:])


def test_init_decoder_kv_caches_keyword_only():
    with pytest.raises(TypeError):
        kvcache.init_decoder_kv_caches(1, 1, 1, 1, 1, torch.float32)  # type: ignore[misc]


def test_init_decoder_kv_caches_negative_layers():
    with pytest.raises(ValueError, match="num_layers must be >= 0"):
        kvcache.init_decoder_kv_caches(
            num_layers=-1, batch_size=1, num_kv_heads=1, head_dim=1, max_len=1, dtype=torch.float32
        )


def test_from_config_grouped_query_attention():
    cfg = TransformerConfig(num_layers=2, num_heads=8, d_model=64, max_len=32, num_kv_heads=2)
    caches = kvcache.init_decoder_kv_caches_from_config(cfg, batch_size=3)
    assert len(caches) == 2
    assert caches[0].keys.shape == (3, 2, 32, 8)
    assert caches[0].keys.dtype == torch.float32


def test_from_config_defaults_and_overrides():
    cfg = TransformerConfig(num_layers=1, num_heads=4, d_model=32, max_len=100, kv_cache_max_len=40)
    (cache,) = kvcache.init_decoder_kv_caches_from_config(cfg, batch_size=1)
    assert cache.keys.shape == (1, 4, 40, 8)  # num_kv_heads defaults to num_heads
    (cache,) = kvcache.init_decoder_kv_caches_from_config(
        cfg, batch_size=1, max_len=7, dtype=torch.float16
    )
    assert cache.keys.shape == (1, 4, 7, 8) and cache.keys.dtype == torch.float16
    cfg2 = TransformerConfig(num_layers=1, num_heads=4, d_model=32, max_len=100)
    (cache,) = kvcache.init_decoder_kv_caches_from_config(cfg2, batch_size=1)
    assert cache.max_len == 100


def test_from_config_rejects_other_types():
    with pytest.raises(TypeError, match="config must be a TransformerConfig"):
        kvcache.init_decoder_kv_caches_from_config({"num_layers": 1}, batch_size=1)


def test_config_validation():
    with pytest.raises(ValueError, match="d_model .* divisible by num_heads"):
        TransformerConfig(num_layers=1, num_heads=3, d_model=32, max_len=8)
    with pytest.raises(ValueError, match="num_heads .* divisible by num_kv_heads"):
        TransformerConfig(num_layers=1, num_heads=4, d_model=32, max_len=8, num_kv_heads=3)
    with pytest.raises(ValueError, match="num_layers must be > 0"):
        TransformerConfig(num_layers=0, num_heads=4, d_model=32, max_len=8)
    with pytest.raises(TypeError, match="max_len must be an int"):
        TransformerConfig(num_layers=1, num_heads=4, d_model=32, max_len=8.0)
    cfg = TransformerConfig(num_layers=1, num_heads=4, d_model=32, max_len=8, num_kv_heads=2)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.kv_cache_max_len) == (2, 8, 8)
    # the optional fields hold their resolved value: one name per quantity
    mha = TransformerConfig(num_layers=1, num_heads=4, d_model=32, max_len=8)
    assert (mha.num_kv_heads, mha.kv_cache_max_len) == (4, 8)
    assert mha == TransformerConfig(num_layers=1, num_heads=4, d_model=32, max_len=8, num_kv_heads=4,
                                    kv_cache_max_len=8)
    with pytest.raises(Exception):
        cfg.num_layers = 3  # type: ignore[misc]


def test_library_path_and_build_info():
    import os

    assert os.path.isfile(kvcache.library_path())
    assert os.path.isfile(os.path.join(kvcache.include_path(), "kvcache", "kvcache.h"))
    info = kvcache.build_info()
    assert info["torch_version"].split("+")[0] == torch.__version__.split("+")[0]
    assert isinstance(info["with_cuda"], bool)
