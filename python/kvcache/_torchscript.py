"""Lets TorchScript compile the frozen dataclass :class:`KVLayerCache`.

TorchScript synthesizes the methods that ``dataclasses`` generates
(``__init__``, ``__eq__``, ...), but before it does, it reads the source of
every function in the class to resolve type-hint names, and generated
functions have none: ``torch.jit.script`` fails with "Failed to get source
for <function KVLayerCache.__init__>". A frozen dataclass also generates
``__setattr__`` / ``__delattr__``, which TorchScript cannot compile.

``make_scriptable`` gives TorchScript's source loader the same synthesized
source it would build itself, and marks the two frozen-instance guards as
dropped from the TorchScript class (they only guard Python code).
"""

from __future__ import annotations


def make_scriptable(cls) -> None:
    try:
        from torch._jit_internal import FunctionModifiers, loader
        from torch.jit._dataclass_impls import DATACLASS_MAGIC_METHODS
    except ImportError:  # TorchScript removed or reorganized: Python use is unaffected
        return
    for name, synthesize in DATACLASS_MAGIC_METHODS.items():
        fn = cls.__dict__.get(name)
        if fn is not None and loader.get_source(fn) is None:
            loader.cache(fn, synthesize(cls).source)
    for name, signature in (("__setattr__", "(self, name, value)"), ("__delattr__", "(self, name)")):
        fn = cls.__dict__.get(name)
        if fn is not None:
            fn._torchscript_modifier = FunctionModifiers._DROP
            loader.cache(fn, f"def {name}{signature}:\n  pass\n")
