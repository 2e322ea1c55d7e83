"""Keys buffer -> layer: how the ``"kvcache"`` attention finds a layer's lengths.

transformers passes the attention function the keys and values ``Cache.update`` returned, not the
cache. A layer registers itself whenever it gets new buffers (allocation, the first update of a
lazily allocated cache, a batch that grows, a deepcopy), keyed by ``id()`` of its keys buffer,
through a weak reference (the table never keeps a cache alive; an entry goes with its buffer).
The attention never writes the table, and accepts an entry only for the very tensors the layer
holds, so two caches in flight cannot see each other's state (docs/hf.md).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

_LAYERS: "dict[int, weakref.ref]" = {}


def register(layer) -> None:
    """Makes ``layer`` findable from its current ``keys``/``values`` buffers."""
    key = id(layer.keys)
    _LAYERS[key] = weakref.ref(layer)
    # Drop the entry when the buffer object dies (its id may then be reused).
    weakref.finalize(layer.keys, _LAYERS.pop, key, None)


def layer_of(key: torch.Tensor, value: torch.Tensor):
    """The layer whose buffers are exactly ``key`` and ``value``, or ``None``."""
    ref = _LAYERS.get(id(key))
    layer: Optional[object] = ref() if ref is not None else None
    if layer is not None and layer.keys is key and layer.values is value:
        return layer
    return None
