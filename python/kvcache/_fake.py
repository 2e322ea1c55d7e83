"""Fake kernels: what torch.compile / torch.export see while tracing.

Each fake runs the operator's own C++ checks (``csrc/ops/*``, through
``kvcache._C.check_<id>``) on the fake tensors, then allocates outputs of the
right shape, dtype, device and strides. The checks read sizes as symbols, so
a traced program raises the same exception, with the same message, as eager
code (under FakeTensorMode and non-strict torch.export as it is; torch.compile
and strict torch.export wrap it in their own RuntimeError subclass, whose
text carries the message). Values that only exist at run time (the entries of a device start or
lengths tensor) are checked by the kernels when the program runs.

The operators come from the one list in ``csrc/ops/operators.h``
(``kvcache._C.operators``): an operator there without an output rule here,
or a rule here for no operator, fails the import. The deprecated aliases
(kind ``Alias``: ``update_quantized_``, ``append_quantized_``, ``ring_update_``, ...) get no
fake kernel: their CompositeImplicitAutograd kernels decompose into the
write they name, whose fake kernel runs (PyTorch refuses a fake kernel for
an operator with a CompositeImplicitAutograd kernel).
"""

from __future__ import annotations

import torch

from . import _C


def _init_layer_cache(batch_size, num_kv_heads, head_dim, max_len, *, dtype=None, device=None):
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    device = device if device is not None else torch.device("cpu")
    shape = (batch_size, num_kv_heads, max_len, head_dim)
    keys = torch.empty(shape, dtype=dtype, device=device)
    values = torch.empty(shape, dtype=dtype, device=device)
    return keys, values, torch.empty((), dtype=torch.int32, device=device)


def _update(keys, values, keys_new, values_new, start, *, k_scale=None, v_scale=None):
    return keys.new_empty((), dtype=torch.int32)


def _update_tensor(keys, values, keys_new, values_new, start, *, k_scale=None, v_scale=None, positions=None,
                   sinks=0):
    return keys.new_empty(start.shape, dtype=torch.int32)


def _attend(
    q, keys, values, lengths, *, kv_start=None, scale=None, window=0, softcap=0.0, positions=None, sinks=0,
    k_scale=None, v_scale=None, sink_logits=None
):
    b, h, s, d = q.shape
    # (batch, seq, heads, head_dim) memory, as the kernels allocate it.
    return q.new_empty((b, s, h, d)).transpose(1, 2)


def _new_lengths(lengths, *args, **kwargs):
    return torch.empty_like(lengths, memory_format=torch.contiguous_format)


def _select_rows(keys, values, lengths, index):
    return _new_lengths(lengths)


def _none(*args, **kwargs):
    return None


# Outputs of each operator, by the id in csrc/ops/operators.h.
_OUTPUTS = {
    "init_layer_cache": _init_layer_cache,
    "update_": _update,
    "update_tensor_": _update_tensor,
    "append_": _none,
    "attend": _attend,
    "rollback": _new_lengths,
    "select_rows_": _select_rows,
    "append_returning_": lambda keys, values, lengths, keys_new, values_new, **scales: _new_lengths(lengths),
    "reset_rows": _new_lengths,
    "check_lengths_writable": _none,
    "paged_write_": _none,
    "paged_attend": lambda q, key_pages, value_pages, block_table, context_lens, cu_seqlens_q, **kw: q.new_empty(
        q.shape
    ),
}


def _fake(name: str, check, outputs):
    op, _, overload = name.partition(".")
    schema = getattr(getattr(torch.ops.kvcache, op), overload or "default")._schema
    # (name, default) of every argument after the positional ones given.
    arguments = [(a.name, a.default_value) for a in schema.arguments]

    def fake(*args, **kwargs):
        # The C++ checks take every schema argument positionally, in order.
        full = list(args) + [kwargs.get(n, d) for n, d in arguments[len(args):]]
        check(*full)
        return outputs(*args, **kwargs)

    return fake


def _register() -> None:
    ids = [op["id"] for op in _C.operators if op["kind"] != "Alias"]
    missing = sorted(set(ids) - set(_OUTPUTS))
    extra = sorted(set(_OUTPUTS) - set(ids))
    if missing or extra:
        raise RuntimeError(
            f"kvcache._fake is out of step with csrc/ops/operators.h: no output rule for {missing}, "
            f"rules for unknown operators {extra}"
        )
    for op in _C.operators:
        if op["kind"] == "Alias":
            continue
        check = getattr(_C, "check_" + op["id"])
        torch.library.register_fake("kvcache::" + op["name"])(_fake(op["name"], check, _OUTPUTS[op["id"]]))


_register()
