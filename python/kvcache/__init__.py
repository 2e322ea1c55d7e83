"""kvcache: KV-cache operators for PyTorch.

Importing the package loads the compiled operators (``torch.ops.kvcache.*``)
and registers their fake kernels for ``torch.compile`` and ``torch.export``.
"""

import torch  # noqa: F401  (loads libtorch before the op library)

from . import _library

_library.load()  # refuses (ImportError) a torch other than the build's major.minor

from . import _fake  # noqa: E402,F401  (registers the fake kernels)
from ._library import include_path, library_path  # noqa: E402
from .cache import (  # noqa: E402
    KVLayerCache,
    append_kv_layer_cache,
    attend,
    init_decoder_kv_caches,
    init_decoder_kv_caches_from_config,
    init_kv_layer_cache,
    update_kv_layer_cache,
)
from .config import TransformerConfig  # noqa: E402
from .ring import (  # noqa: E402
    RingKV,
    RingLayerCache,
    append_ring_layer_cache,
    attend_ring,
    init_ring_layer_cache,
    update_ring_layer_cache,
    write_ring_layer_cache,
)
from .rows import (  # noqa: E402
    reset_kv_layer_cache_rows,
    reset_rows_kv_layer_cache,
    reset_rows_ring_layer_cache,
    rollback_kv_layer_cache,
    rollback_ring_layer_cache,
    select_kv_layer_cache_rows,
    select_rows_kv_layer_cache,
    select_rows_ring_layer_cache,
)
from . import paged  # noqa: E402  (kvcache.paged: pages for continuous batching)
from .block_allocator import BlockAllocator, UnknownSequenceError  # noqa: E402
from .paged import PagedKVCache, attend_pages, init_paged_cache, write_pages  # noqa: E402


def build_info() -> dict:
    """Returns how the loaded op library was built.

    Returns:
        dict with ``with_cuda`` (bool), ``torch_version``, ``cuda_version``
        and ``cuda_archs``.
    """
    from . import _C

    return _C.build_info()


__all__ = [
    "BlockAllocator",
    "PagedKVCache",
    "attend_pages",
    "init_paged_cache",
    "UnknownSequenceError",
    "write_pages",
    "KVLayerCache",
    "RingKV",
    "RingLayerCache",
    "TransformerConfig",
    "append_ring_layer_cache",
    "attend_ring",
    "init_ring_layer_cache",
    "reset_rows_ring_layer_cache",
    "rollback_ring_layer_cache",
    "select_rows_ring_layer_cache",
    "update_ring_layer_cache",
    "write_ring_layer_cache",
    "append_kv_layer_cache",
    "attend",
    "build_info",
    "include_path",
    "init_decoder_kv_caches",
    "init_decoder_kv_caches_from_config",
    "init_kv_layer_cache",
    "library_path",
    "reset_rows_kv_layer_cache",
    "rollback_kv_layer_cache",
    "select_rows_kv_layer_cache",
    "update_kv_layer_cache",
]
# The build's version with its backend (0.1.0+cpu, 0.1.0+cu130), recorded
# by setup.py; the base version lives in cmake/build_settings.json.
__version__ = _library.version()
