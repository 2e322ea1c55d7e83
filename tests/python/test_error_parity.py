"""Traced code raises what eager code raises: one table of bad-argument cases.

Every case is run eagerly (the reference), then:

  fake            under FakeTensorMode (the fake kernels, through kvcache._C)
  export          torch.export.export of a module that makes the call
  compile         torch.compile(fullgraph=True, backend="eager")
  compile_dynamic the same with dynamic=True (symbolic sizes in the checks)
  inductor        torch.compile(fullgraph=True) (the default backend)

and must raise the same exception type with the same message. One
exception is PyTorch's, not ours: while Dynamo (torch.compile) traces, it
wraps any exception raised by fake-tensor propagation, for every operator,
in torch._dynamo.exc.TorchRuntimeError, whose message quotes the original
as "got ValueError('...')". Under torch.compile the test therefore accepts
either the exception itself or that wrapper quoting it exactly (type and
message); under FakeTensorMode and torch.export (which do not wrap) only the
exception itself.

Cases marked RUNTIME depend on the values of a tensor (a start, lengths, n,
index or kv_start entry), which do not exist while tracing: they are checked
by the kernel when the program runs. FakeTensorMode has no values, so they
run eagerly only there; compiled and exported programs run the kernel, so
they must raise the same exception when called.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kvcache  # noqa: F401

ops = torch.ops.kvcache
B, H, T, D = 2, 2, 8, 4
INT64_MAX = 2**63 - 1


@dataclass
class Case:
    id: str
    fn: Callable
    args: Callable[[], tuple]  # fresh tensors for every mode
    runtime: bool = False  # the error depends on tensor values (see module doc)
    skip: dict = field(default_factory=dict)  # mode -> reason
    xfail: dict = field(default_factory=dict)  # mode -> reason (strict: passing fails, remove the mark)


def cache():
    return torch.randn(B, H, T, D), torch.randn(B, H, T, D)


def new(chunk=2, d=D, dtype=torch.float32):
    return torch.randn(B, H, chunk, d).to(dtype), torch.randn(B, H, chunk, d).to(dtype)


def upd(start):
    return lambda k, v, kn, vn: ops.update_(k, v, kn, vn, start)


def upd_t(k, v, kn, vn, s):
    return ops.update_.Tensor(k, v, kn, vn, s)


def app(k, v, lengths, kn, vn):
    ops.append_(k, v, lengths, kn, vn)


def att(**kw):
    return lambda q, k, v, lengths: ops.attend(q, k, v, lengths, **kw)


def att_ks(q, k, v, lengths, ks):
    return ops.attend(q, k, v, lengths, kv_start=ks)


def att_sl(q, k, v, lengths, sink_logits):
    return ops.attend(q, k, v, lengths, sink_logits=sink_logits)


# rollback and select_rows_ return new lengths: the cases return them, so
# that a compiler cannot drop the call (and its run-time checks) as dead code.
def rb(lengths, n):
    return ops.rollback(lengths, n)


def rb_ks(lengths, n, ks):
    return ops.rollback(lengths, n, kv_start=ks)


def sel(k, v, lengths, index):
    return ops.select_rows_(k, v, lengths, index)


def app_r(k, v, lengths, kn, vn):
    return ops.append_returning_(k, v, lengths, kn, vn)


def rst(lengths, rows):
    return ops.reset_rows(lengths, rows)


# The Python API's wrappers: they write cache.length themselves (copy_ of an
# op's new lengths; traced append: append_returning_ + copy_), so their own
# writes are in the table too. Each returns a new tensor so that the call is
# not dead code.
def w_append(k, v, length, kn, vn):
    return kvcache.append_kv_layer_cache(kvcache.KVLayerCache(k, v, length), kn, vn).length + 0


def w_rollback(k, v, length, n):
    return kvcache.rollback_kv_layer_cache(kvcache.KVLayerCache(k, v, length), n).length + 0


def w_rollback_ks(k, v, length, n, ks):
    return kvcache.rollback_kv_layer_cache(kvcache.KVLayerCache(k, v, length), n, kv_start=ks).length + 0


def w_select(k, v, length, index):
    return kvcache.select_rows_kv_layer_cache(kvcache.KVLayerCache(k, v, length), index).length + 0


def w_reset(k, v, length, rows):
    return kvcache.reset_rows_kv_layer_cache(kvcache.KVLayerCache(k, v, length), rows).length + 0


def expanded_length(dtype=torch.int64, value=1):
    return torch.tensor(value, dtype=dtype).expand(B)
def ring(k, v, pos, kn, vn, s, sinks=0):
    return ops.ring_update_(k, v, pos, kn, vn, s, sinks=sinks)


def ring_t(k, v, pos, kn, vn, s, *sc, sinks=0):
    # The ring's write as the one device-start write takes it: update_.Tensor with positions.
    return ops.update_.Tensor(k, v, kn, vn, s, positions=pos, sinks=sinks, **_scale_kw(sc, None) if sc else {})


def ring_t_sinks(sinks):
    return lambda k, v, pos, kn, vn, s: ring_t(k, v, pos, kn, vn, s, sinks=sinks)


def upd_t_sinks(k, v, kn, vn, s):
    return ops.update_.Tensor(k, v, kn, vn, s, sinks=1)


def pw(kp, vp, key, value, slots, *sc, only=None):
    kw = {}
    if sc:
        kw = {"key_scales": sc[0], "value_scales": sc[1]} if only is None else {only: sc[0]}
    return ops.paged_write_(kp, vp, key, value, slots, **kw)


def pages(dtype=torch.float32, blocks=6, bs=4):
    return torch.randn(blocks, bs, H, D).to(dtype), torch.randn(blocks, bs, H, D).to(dtype)


def tokens(n=3, heads=H, dim=D, dtype=torch.float32):
    return torch.randn(n, heads, dim).to(dtype), torch.randn(n, heads, dim).to(dtype)


def ring_sinks(sinks):
    return lambda k, v, pos, kn, vn, s: ops.ring_update_(k, v, pos, kn, vn, s, sinks=sinks)


def ring_pos(shape=(B, T), dtype=torch.int32):
    return torch.full(shape, -1, dtype=dtype)


def att_ring(q, k, v, lengths, pos, sinks=0, window=4):
    return ops.attend(q, k, v, lengths, window=window, positions=pos, sinks=sinks)


def ring_pos_in_keys():
    k, v = torch.zeros(B, H, T, D, dtype=torch.int32), torch.zeros(B, H, T, D, dtype=torch.int32)
    one = torch.ones(B, H, 1, D, dtype=torch.int32)
    return (k, v, k[:, 0, :, 0], one, one.clone(), torch.tensor(0))


def init(*sizes, dtype=None):
    return lambda: ops.init_layer_cache(*sizes, dtype=dtype)


def int_cache():
    return torch.zeros(B, H, T, D, dtype=torch.int64), torch.zeros(B, H, T, D, dtype=torch.int64)


def same_buffer():
    k, _ = cache()
    return (k, k, *new())


def aliasing_rows():
    k, v = cache()
    return (k, v, k[:, :, 3:5], torch.randn(B, H, 2, D))


def aliasing_unwritten_rows():
    k, v = cache()
    return (k, v, k[:, :, 0:2], v[:, :, 0:2], torch.tensor(4))


def start_in_cache():
    k, v = int_cache()
    return (k, v, torch.ones(B, H, 1, D, dtype=torch.int64), torch.ones(B, H, 1, D, dtype=torch.int64), k[:, 0, 0, 0])


def lengths_aliasing_new():
    k, v = cache()
    kn, vn = new(1)
    kn[:, 0, 0, 0] = 1e30  # as int32 bits: a start far past max_len, so eager also has a bad value to report
    return (k, v, kn[:, 0, 0, 0].view(torch.int32), kn, vn)


def append_lengths_in_cache():
    k, v = int_cache()
    one = torch.ones(B, H, 1, D, dtype=torch.int64)
    return (k, v, k[:, 0, 0, 0], one, one.clone())


def lengths_in_cache():
    k, v = int_cache()
    return (k, v, v[:, 0, 0, 0], torch.tensor([1, 0]))


def huge_cache():
    big = torch.zeros(1, 1, 1, 1).expand(1, 1, 2**31, 1)
    return (big, torch.zeros(1, 1, 1, 1).expand(1, 1, 2**31, 1), torch.ones(1, 1, 1, 1), torch.ones(1, 1, 1, 1))


def grad(i, t_args):
    args = list(t_args())
    args[i] = args[i].clone().requires_grad_(True)
    return tuple(args)


def conj_cache():
    k = torch.randn(B, H, T, D, dtype=torch.complex64)
    v = torch.randn(B, H, T, D, dtype=torch.complex64)
    kn, vn = new(1, dtype=torch.complex64)
    return (k.conj(), v, kn, vn)


def q_(heads=H, seq=1, d=D, dtype=torch.float32):
    return torch.randn(B, heads, seq, d).to(dtype)


# Quantized caches: int8 / float8_e4m3fn data and float32 (B, H, T) scales.
def qcache(dtype=torch.int8):
    return torch.zeros(B, H, T, D, dtype=dtype), torch.zeros(B, H, T, D, dtype=dtype)


def scales(shape=(B, H, T), dtype=torch.float32):
    return torch.ones(shape, dtype=dtype), torch.ones(shape, dtype=dtype)


def qall(dtype=torch.int8, chunk=2):
    return (*qcache(dtype), *scales(), *new(chunk))


def qupd(start):
    return lambda k, v, ks, vs, kn, vn: ops.update_quantized_(k, v, ks, vs, kn, vn, start)


def qupd_t(k, v, ks, vs, kn, vn, s):
    return ops.update_quantized_.Tensor(k, v, ks, vs, kn, vn, s)


def qapp(k, v, ks, vs, lengths, kn, vn):
    ops.append_quantized_(k, v, ks, vs, lengths, kn, vn)


def qatt(q, k, v, lengths, ks, vs):
    return ops.attend(q, k, v, lengths, k_scale=ks, v_scale=vs)


def scale_aliases_keys():
    k, v = qcache()
    ks = k.view(torch.float32)[..., :1].reshape(B, H, T)  # (B, H, T) float32 view of the keys' bytes
    return (k, v, ks, torch.ones(B, H, T), *new(1))


def scales_share():
    s = torch.ones(B, H, T)
    return (*qcache(), s, s, *new(1))


def new_aliases_scale():
    ks, vs = scales()
    kn = torch.as_strided(ks, (B, H, 1, D), (H * T, T, 1, 0))  # new keys read from k_scale's bytes
    return (*qcache(), ks, vs, kn, torch.randn(B, H, 1, D))


# The writes with their keyword-only scales (k_scale / v_scale; one of them left out where the
# function takes one): (keys, values, ..., keys_new, values_new, [start,] k_scale, v_scale).
def s_upd(start, only=None):
    def call(k, v, kn, vn, *sc):
        return ops.update_(k, v, kn, vn, start, **_scale_kw(sc, only))

    return call


def s_upd_t(only=None):
    return lambda k, v, kn, vn, s, *sc: ops.update_.Tensor(k, v, kn, vn, s, **_scale_kw(sc, only))


def s_app(only=None):
    def call(k, v, lengths, kn, vn, *sc):
        ops.append_(k, v, lengths, kn, vn, **_scale_kw(sc, only))

    return call


def s_app_r(only=None):
    return lambda k, v, lengths, kn, vn, *sc: ops.append_returning_(k, v, lengths, kn, vn, **_scale_kw(sc, only))


def s_ring(only=None):
    return lambda k, v, pos, kn, vn, s, *sc: ops.ring_update_(k, v, pos, kn, vn, s, **_scale_kw(sc, only))


def _scale_kw(sc, only):
    # sc: (k_scale, v_scale), or the one scale named by `only`.
    if only is not None:
        return {only: sc[0]}
    return {"k_scale": sc[0], "v_scale": sc[1]}


def s_scale_views_keys():
    k, v = qcache()
    ks = k.view(torch.float32)[..., :1].reshape(B, H, T)  # (B, H, T) float32 view of the keys' bytes
    return (k, v, *new(1), ks, torch.ones(B, H, T))


def s_lengths_in_scale():
    ks, vs = scales()
    return (*qcache(), ks[:, 0, 0].view(torch.int32), *new(1), ks, vs)


# ring_update_quantized_: (keys, values, k_scale, v_scale, positions, keys_new, values_new, start).
def qring(k, v, ks, vs, pos, kn, vn, s):
    return ops.ring_update_quantized_(k, v, ks, vs, pos, kn, vn, s)


def qring_sinks(sinks):
    return lambda k, v, ks, vs, pos, kn, vn, s: ops.ring_update_quantized_(k, v, ks, vs, pos, kn, vn, s, sinks=sinks)


def qring_args(dtype=torch.int8, chunk=1, start=0, pos=None, sc=None, nd=torch.float32):
    k, v = qcache(dtype)
    ks, vs = sc if sc is not None else scales()
    return (k, v, ks, vs, ring_pos() if pos is None else pos, *new(chunk, dtype=nd),
            start if isinstance(start, torch.Tensor) else torch.tensor(start))


def qring_pos_in_scale():
    ks, vs = scales()
    return (*qcache(), ks, vs, ks[:, 0, :].view(torch.int32).reshape(B, T), *new(1), torch.tensor(0))


def qring_start_in_scale():
    ks, vs = scales()
    return (*qcache(), ks, vs, ring_pos(), *new(1), vs[0, 0, :2].view(torch.int32))


def lengths_in_scale():
    ks, vs = scales()
    return (*qcache(), ks, vs, ks[:, 0, 0].view(torch.int32), *new(1))



CASES = [
    # --- update_ (host start) ---
    Case("update_/keys_new-3d", upd(0), lambda: (*cache(), torch.randn(B, H, 2), torch.randn(B, H, 2))),
    Case("update_/keys_new-head_dim", upd(0), lambda: (*cache(), *new(2, D + 1))),
    Case("update_/values_new-shape", upd(0), lambda: (*cache(), new(2)[0], new(3)[0])),
    Case("update_/keys_new-dtype", upd(0), lambda: (*cache(), new(2)[0].double(), new(2)[1])),
    Case("update_/values-dtype", upd(0), lambda: (cache()[0], cache()[1].half(), *new(2))),
    Case("update_/values-shape", upd(0), lambda: (cache()[0], torch.zeros(B, H, T + 1, D), *new(2))),
    Case("update_/keys-3d", upd(0), lambda: (torch.zeros(B, H, T), torch.zeros(B, H, T), *new(2))),
    Case("update_/keys_new-device", upd(0), lambda: (*cache(), new(2)[0].to("meta"), new(2)[1])),
    Case("update_/start-negative", upd(-1), lambda: (*cache(), *new(2))),
    Case("update_/start-overflow", upd(T - 1), lambda: (*cache(), *new(2))),
    Case("update_/start-int64-max", upd(INT64_MAX), lambda: (*cache(), *new(2))),
    Case("update_/chunk-over-max_len", upd(0), lambda: (*cache(), *new(T + 1))),
    Case("update_/same-buffer", upd(0), same_buffer),
    Case("update_/expanded-keys", upd(0), lambda: (torch.zeros(1, H, T, D).expand(B, H, T, D), cache()[1], *new(1))),
    Case("update_/keys_new-aliases-written-rows", upd(4), aliasing_rows),
    Case("update_/keys_new-sparse", upd(0), lambda: (*cache(), new(1)[0].to_sparse(), new(1)[1]),
         skip={m: "Dynamo refuses sparse inputs itself (Unsupported: torch.compile does not support sparse Tensors)"
               for m in ("compile", "compile_dynamic", "inductor")}),
    Case("update_/keys-requires-grad", upd(0), lambda: grad(0, lambda: (*cache(), *new(1)))),
    Case("update_/keys_new-requires-grad", upd(0), lambda: grad(2, lambda: (*cache(), *new(1)))),
    Case("update_/keys-conj", upd(0), conj_cache),
    Case("update_/max_len-2^31", upd(0), huge_cache),
    # --- update_.Tensor (start tensor) ---
    Case("update_.Tensor/start-float", upd_t, lambda: (*cache(), *new(1), torch.tensor(1.0))),
    Case("update_.Tensor/start-shape", upd_t, lambda: (*cache(), *new(1), torch.zeros(B + 1, dtype=torch.int64))),
    Case("update_.Tensor/start-device", upd_t, lambda: (*cache(), *new(1), torch.tensor(0, device="meta"))),
    Case("update_.Tensor/start-in-cache", upd_t, start_in_cache),
    Case("update_.Tensor/new-data-reads-the-cache", upd_t, aliasing_unwritten_rows),
    Case("update_.Tensor/start-negative", upd_t, lambda: (*cache(), *new(1), torch.tensor([0, -1])), runtime=True),
    Case("update_.Tensor/start-int64-max", upd_t, lambda: (*cache(), *new(1), torch.tensor([0, INT64_MAX])),
         runtime=True),
    Case("update_.Tensor/start-int32-overflow", upd_t,
         lambda: (*cache(), *new(2), torch.tensor(T - 1, dtype=torch.int32)), runtime=True),
    # --- append_ ---
    Case("append_/lengths-float", app, lambda: (*cache(), torch.tensor(0.0), *new(1))),
    Case("append_/lengths-expanded", app, lambda: (*cache(), torch.zeros(1, dtype=torch.int64).expand(B), *new(1))),
    Case("append_/lengths-shape", app, lambda: (*cache(), torch.zeros(B, 1, dtype=torch.int64), *new(1))),
    Case("append_/lengths-aliases-keys_new", app, lengths_aliasing_new),
    Case("append_/lengths-in-cache", app, append_lengths_in_cache),
    Case("append_/lengths-overflow", app, lambda: (*cache(), torch.tensor([T, 0]), *new(1)), runtime=True),
    Case("append_/lengths-int64-max", app, lambda: (*cache(), torch.tensor(INT64_MAX), *new(1)), runtime=True),
    # --- append_returning_ (traced append: append_'s checks and messages) ---
    Case("append_returning_/lengths-float", app_r, lambda: (*cache(), torch.tensor(0.0), *new(1))),
    Case("append_returning_/lengths-int16", app_r, lambda: (*cache(), torch.tensor(0, dtype=torch.int16), *new(1))),
    Case("append_returning_/lengths-expanded", app_r, lambda: (*cache(), expanded_length(), *new(1))),
    Case("append_returning_/lengths-aliases-keys_new", app_r, lengths_aliasing_new),
    Case("append_returning_/lengths-in-cache", app_r, append_lengths_in_cache),
    Case("append_returning_/lengths-overflow", app_r, lambda: (*cache(), torch.tensor([T, 7]), *new(2)),
         runtime=True),
    Case("append_returning_/lengths-negative", app_r, lambda: (*cache(), torch.tensor([0, -1]), *new(1)),
         runtime=True),
    # --- the Python API's wrappers (their own length writes included) ---
    Case("append_kv_layer_cache/lengths-overflow", w_append, lambda: (*cache(), torch.tensor([0, 7]), *new(2)),
         runtime=True),
    Case("append_kv_layer_cache/lengths-negative", w_append, lambda: (*cache(), torch.tensor([0, -1]), *new(1)),
         runtime=True),
    Case("append_kv_layer_cache/lengths-int16", w_append,
         lambda: (*cache(), torch.tensor(0, dtype=torch.int16), *new(1))),
    Case("append_kv_layer_cache/lengths-expanded", w_append, lambda: (*cache(), expanded_length(), *new(1))),
    Case("append_kv_layer_cache/lengths-in-cache", w_append, append_lengths_in_cache),
    Case("append_kv_layer_cache/keys_new-aliases-lengths", w_append, lengths_aliasing_new),
    Case("append_kv_layer_cache/keys_new-dtype", w_append,
         lambda: (*cache(), torch.tensor([0, 0]), new(1)[0].double(), new(1)[1])),
    Case("rollback_kv_layer_cache/lengths-expanded", w_rollback, lambda: (*cache(), expanded_length(), torch.tensor(1))),
    Case("rollback_kv_layer_cache/n-float", w_rollback, lambda: (*cache(), torch.tensor([3, 4]), torch.tensor(1.0))),
    Case("rollback_kv_layer_cache/n-over-lengths", w_rollback,
         lambda: (*cache(), torch.tensor([3, 4]), torch.tensor([1, 5])), runtime=True),
    Case("rollback_kv_layer_cache/0d-lengths-kv_start-over", w_rollback_ks,
         lambda: (*cache(), torch.tensor(4), torch.tensor(2), torch.tensor([0, 3])), runtime=True),
    Case("select_rows_kv_layer_cache/lengths-expanded", w_select,
         lambda: (*cache(), expanded_length(), torch.tensor([1, 0]))),
    Case("select_rows_kv_layer_cache/index-float", w_select,
         lambda: (*cache(), torch.tensor([1, 1]), torch.tensor([0.0, 1.0]))),
    Case("select_rows_kv_layer_cache/index-out-of-range", w_select,
         lambda: (*cache(), torch.tensor([1, 1]), torch.tensor([0, 2])), runtime=True),
    Case("reset_rows_kv_layer_cache/lengths-expanded", w_reset,
         lambda: (*cache(), expanded_length(), torch.tensor([0]))),
    Case("reset_rows_kv_layer_cache/lengths-0d", w_reset, lambda: (*cache(), torch.tensor(3), torch.tensor([0]))),
    Case("reset_rows_kv_layer_cache/mask-short", w_reset,
         lambda: (*cache(), torch.tensor([3, 4]), torch.tensor([True]))),
    Case("reset_rows_kv_layer_cache/rows-int16", w_reset,
         lambda: (*cache(), torch.tensor([3, 4]), torch.tensor([0], dtype=torch.int16))),
    Case("reset_rows_kv_layer_cache/rows-negative", w_reset,
         lambda: (*cache(), torch.tensor([3, 4]), torch.tensor([-1])), runtime=True),
    Case("reset_rows_kv_layer_cache/rows-out-of-range", w_reset,
         lambda: (*cache(), torch.tensor([3, 4]), torch.tensor([0, 9])), runtime=True),
    # --- attend ---
    Case("attend/q-3d", att(), lambda: (torch.randn(B, H, D), *cache(), torch.tensor(3))),
    Case("attend/q-head_dim", att(), lambda: (q_(d=D + 1), *cache(), torch.tensor(3))),
    Case("attend/values-shape", att(), lambda: (q_(), cache()[0], torch.zeros(B, H, T + 1, D), torch.tensor(3))),
    Case("attend/q-heads-not-multiple", att(), lambda: (q_(heads=3), *cache(), torch.tensor(3))),
    Case("attend/q-dtype-int", att(), lambda: (q_().to(torch.int32), *cache(), torch.tensor(3))),
    Case("attend/keys-dtype", att(), lambda: (q_(), cache()[0].half(), cache()[1], torch.tensor(3))),
    Case("attend/scale-zero", att(scale=0.0), lambda: (q_(), *cache(), torch.tensor(3))),
    Case("attend/scale-nan", att(scale=float("nan")), lambda: (q_(), *cache(), torch.tensor(3))),
    Case("attend/window-negative", att(window=-1), lambda: (q_(), *cache(), torch.tensor(3))),
    Case("attend/softcap-inf", att(softcap=float("inf")), lambda: (q_(), *cache(), torch.tensor(3))),
    Case("attend/scale-over-float32", att(scale=1e39), lambda: (q_(), *cache(), torch.tensor(3))),
    Case("attend/scale-under-float32", att(scale=1e-46), lambda: (q_(), *cache(), torch.tensor(3))),
    Case("attend/softcap-over-float32", att(softcap=1e39), lambda: (q_(), *cache(), torch.tensor(3))),
    Case("attend/softcap-under-float32", att(softcap=1e-46), lambda: (q_(), *cache(), torch.tensor(3))),
    Case("attend/scale-overflows-scores", att(scale=1e38), lambda: (q_(), *cache(), torch.tensor(3))),
    Case("attend/softcap-overflows-capped-scores", att(softcap=3e38), lambda: (q_(), *cache(), torch.tensor(3))),
    Case("attend/lengths-float", att(), lambda: (q_(), *cache(), torch.tensor(3.0))),
    Case("attend/sink_logits-shape", att_sl, lambda: (q_(), *cache(), torch.tensor(3), torch.zeros(H + 1))),
    Case("attend/sink_logits-dtype", att_sl,
         lambda: (q_(), *cache(), torch.tensor(3), torch.zeros(H, dtype=torch.float64))),
    Case("attend/kv_start-shape", att_ks, lambda: (q_(), *cache(), torch.tensor(3), torch.zeros(B + 1, dtype=torch.int64))),
    Case("attend/q-requires-grad", att(), lambda: grad(0, lambda: (q_(), *cache(), torch.tensor(3)))),
    Case("attend/max_len-2^31", att(), lambda: (torch.ones(1, 1, 1, 1), *huge_cache()[:2], torch.tensor(1))),
    Case("attend/lengths-below-seq", att(), lambda: (q_(seq=3), *cache(), torch.tensor([3, 2])), runtime=True),
    Case("attend/lengths-over-max_len", att(), lambda: (q_(), *cache(), torch.tensor(T + 1)), runtime=True),
    Case("attend/kv_start-over-lengths", att_ks, lambda: (q_(), *cache(), torch.tensor(3), torch.tensor([0, 4])),
         runtime=True),
    # --- update_quantized_ / update_quantized_.Tensor / append_quantized_ ---
    Case("update_quantized_/keys-float-cache", qupd(0), lambda: (*cache(), *scales(), *new(1))),
    Case("update_quantized_/keys_new-int", qupd(0), lambda: (*qcache(), *scales(), *(t.to(torch.int32) for t in new(1)))),
    Case("update_quantized_/values_new-dtype", qupd(0), lambda: (*qcache(), *scales(), new(1)[0], new(1)[1].half())),
    Case("update_quantized_/values-format", qupd(0),
         lambda: (qcache()[0], qcache(torch.float8_e4m3fn)[1], *scales(), *new(1))),
    Case("update_quantized_/k_scale-shape", qupd(0), lambda: (*qcache(), torch.ones(B, H, T + 1), torch.ones(B, H, T), *new(1))),
    Case("update_quantized_/k_scale-4d", qupd(0), lambda: (*qcache(), torch.ones(B, H, T, 1), torch.ones(B, H, T), *new(1))),
    Case("update_quantized_/v_scale-dtype", qupd(0), lambda: (*qcache(), torch.ones(B, H, T), torch.ones(B, H, T).half(), *new(1))),
    Case("update_quantized_/k_scale-device", qupd(0), lambda: (*qcache(), torch.ones(B, H, T, device="meta"), torch.ones(B, H, T), *new(1))),
    Case("update_quantized_/k_scale-expanded", qupd(0),
         lambda: (*qcache(), torch.ones(1, H, T).expand(B, H, T), torch.ones(B, H, T), *new(1))),
    Case("update_quantized_/k_scale-aliases-keys", qupd(0), scale_aliases_keys),
    Case("update_quantized_/scales-share", qupd(0), scales_share),
    Case("update_quantized_/keys_new-aliases-k_scale", qupd(0), new_aliases_scale),
    Case("update_quantized_/start-overflow", qupd(T - 1), lambda: qall(chunk=2)),
    Case("update_quantized_/start-negative", qupd(-1), lambda: qall(torch.float8_e4m3fn, chunk=1)),
    Case("update_quantized_.Tensor/start-negative", qupd_t, lambda: (*qall(chunk=1), torch.tensor([0, -1])), runtime=True),
    Case("update_quantized_.Tensor/start-float", qupd_t, lambda: (*qall(chunk=1), torch.tensor(1.0))),
    Case("append_quantized_/lengths-overflow", qapp,
         lambda: (*qcache(), *scales(), torch.tensor([T, 0]), *new(1)), runtime=True),
    Case("append_quantized_/lengths-in-k_scale", qapp, lengths_in_scale),
    Case("append_quantized_/v_scale-shape", qapp,
         lambda: (*qcache(), torch.ones(B, H, T), torch.ones(B, H + 1, T), torch.tensor(0), *new(1))),
    # --- the same writes by format: update_ / update_.Tensor / append_ / append_returning_ / ring_update_ with
    # k_scale / v_scale (the aliases above decompose into these) ---
    Case("update_/scales-on-float-cache", s_upd(0), lambda: (*cache(), *new(1), *scales())),
    Case("update_/no-scales-int8-float-data", upd(0), lambda: (*qcache(), *new(1))),
    Case("update_/no-scales-fp8-half-data", upd(0), lambda: (*qcache(torch.float8_e4m3fn), *new(1, dtype=torch.half))),
    Case("update_/k_scale-alone", s_upd(0, "k_scale"), lambda: (*qcache(), *new(1), torch.ones(B, H, T))),
    Case("update_/v_scale-alone", s_upd(0, "v_scale"), lambda: (*qcache(), *new(1), torch.ones(B, H, T))),
    Case("update_/k_scale-shape", s_upd(0), lambda: (*qcache(), *new(1), torch.ones(B, H, T + 1), torch.ones(B, H, T))),
    Case("update_/v_scale-dtype", s_upd(0), lambda: (*qcache(), *new(1), torch.ones(B, H, T), torch.ones(B, H, T).half())),
    Case("update_/scales-share", s_upd(0), lambda: (lambda sc: (*qcache(), *new(1), sc, sc))(torch.ones(B, H, T))),
    Case("update_/k_scale-aliases-keys", s_upd(0), s_scale_views_keys),
    Case("update_/scaled-start-overflow", s_upd(T - 1), lambda: (*qcache(), *new(2), *scales())),
    Case("update_.Tensor/scales-on-float-cache", s_upd_t(), lambda: (*cache(), *new(1), torch.tensor(0), *scales())),
    Case("update_.Tensor/v_scale-alone", s_upd_t("v_scale"), lambda: (*qcache(), *new(1), torch.tensor(0),
                                                                    torch.ones(B, H, T))),
    Case("update_.Tensor/scaled-start-negative", s_upd_t(), lambda: (*qcache(), *new(1), torch.tensor([0, -1]),
                                                                     *scales()), runtime=True),
    Case("append_/scales-on-float-cache", s_app(), lambda: (*cache(), torch.tensor(0), *new(1), *scales())),
    Case("append_/no-scales-int8-float-data", app, lambda: (*qcache(), torch.tensor(0), *new(1))),
    Case("append_/lengths-in-k_scale", s_app(), s_lengths_in_scale),
    Case("append_/k_scale-alone", s_app("k_scale"), lambda: (*qcache(), torch.tensor(0), *new(1), torch.ones(B, H, T))),
    Case("append_returning_/scales-on-float-cache", s_app_r(), lambda: (*cache(), torch.tensor(0), *new(1), *scales())),
    Case("append_returning_/v_scale-shape", s_app_r(), lambda: (*qcache(), torch.tensor(0), *new(1), torch.ones(B, H, T),
                                                                torch.ones(B, H + 1, T))),
    Case("append_returning_/scaled-lengths-overflow", s_app_r(), lambda: (*qcache(), torch.tensor([T, 0]), *new(1),
                                                                          *scales()), runtime=True),
    Case("ring_update_/scales-on-float-cache", s_ring(), lambda: (*cache(), ring_pos(), *new(1), torch.tensor(0),
                                                                  *scales())),
    Case("ring_update_/no-scales-int8-float-data", ring, lambda: (*qcache(), ring_pos(), *new(1), torch.tensor(0))),
    Case("ring_update_/k_scale-alone", s_ring("k_scale"), lambda: (*qcache(), ring_pos(), *new(1), torch.tensor(0),
                                                                   torch.ones(B, H, T))),
    Case("ring_update_/positions-in-k_scale", s_ring(), lambda: (lambda ks, vs: (
        *qcache(), ks[:, 0, :].view(torch.int32).reshape(B, T), *new(1), torch.tensor(0), ks, vs))(*scales())),
    # --- attend on a quantized cache ---
    Case("attend/quantized-no-scales", att(), lambda: (q_(), *qcache(), torch.tensor(3))),
    Case("attend/scales-on-float-cache", qatt, lambda: (q_(), *cache(), torch.tensor(3), *scales())),
    Case("attend/quantized-formats-differ", qatt,
         lambda: (q_(), qcache()[0], qcache(torch.float8_e4m3fn)[1], torch.tensor(3), *scales())),
    Case("attend/k_scale-shape", qatt, lambda: (q_(), *qcache(), torch.tensor(3), torch.ones(B, H, T - 1), torch.ones(B, H, T))),
    Case("attend/v_scale-dtype", qatt, lambda: (q_(), *qcache(), torch.tensor(3), torch.ones(B, H, T), torch.ones(B, H, T).double())),
    Case("attend/quantized-q-int", qatt, lambda: (q_().to(torch.int8), *qcache(), torch.tensor(3), *scales())),
    Case("attend/quantized-lengths-over-max_len", qatt, lambda: (q_(), *qcache(), torch.tensor(T + 1), *scales()),
         runtime=True),
    # --- rollback ---
    Case("rollback_/lengths-float", rb, lambda: (torch.tensor([3.0, 4.0]), torch.tensor(1))),
    Case("rollback_/lengths-2d", rb, lambda: (torch.zeros(2, 2, dtype=torch.int64), torch.tensor(1))),
    Case("rollback_/n-shape", rb, lambda: (torch.tensor([3, 4]), torch.tensor([1, 1, 1]))),
    Case("rollback_/kv_start-float", rb_ks, lambda: (torch.tensor([3, 4]), torch.tensor(1), torch.tensor([0.0, 0.0]))),
    Case("rollback_/n-over-lengths", rb, lambda: (torch.tensor([3, 4]), torch.tensor([1, 5])), runtime=True),
    Case("rollback_/n-negative", rb, lambda: (torch.tensor([3, 4]), torch.tensor(-1)), runtime=True),
    Case("rollback_/kv_start-over-lengths", rb_ks, lambda: (torch.tensor([3, 4]), torch.tensor(0), torch.tensor([0, 9])),
         runtime=True),
    Case("rollback_/0d-lengths-kv_start-2d", rb_ks,
         lambda: (torch.tensor(4), torch.tensor(1), torch.zeros(1, 2, dtype=torch.int64))),
    Case("rollback_/0d-lengths-kv_start-over", rb_ks, lambda: (torch.tensor(4), torch.tensor(2), torch.tensor([0, 3])),
         runtime=True),
    Case("rollback_/0d-lengths-kv_start-empty", rb_ks,
         lambda: (torch.tensor(4), torch.tensor(1), torch.zeros(0, dtype=torch.int64))),
    # --- select_rows_ ---
    Case("select_rows_/index-0d", sel, lambda: (*cache(), torch.tensor([1, 1]), torch.tensor(0))),
    Case("select_rows_/index-float", sel, lambda: (*cache(), torch.tensor([1, 1]), torch.tensor([0.0, 1.0]))),
    Case("select_rows_/lengths-shape", sel, lambda: (*cache(), torch.tensor([1, 1, 1]), torch.tensor([0, 1]))),
    Case("select_rows_/lengths-in-cache", sel, lengths_in_cache),
    Case("select_rows_/index-out-of-range", sel, lambda: (*cache(), torch.tensor([1, 1]), torch.tensor([0, 2])),
         runtime=True),
    Case("select_rows_/lengths-over-max_len", sel, lambda: (*cache(), torch.tensor([1, T + 1]), torch.tensor([1, 0])),
         runtime=True),
    # --- reset_rows ---
    Case("reset_rows/lengths-0d", rst, lambda: (torch.tensor(3), torch.tensor([0]))),
    Case("reset_rows/lengths-float", rst, lambda: (torch.tensor([3.0, 4.0]), torch.tensor([0]))),
    Case("reset_rows/mask-short", rst, lambda: (torch.tensor([3, 4]), torch.tensor([True]))),
    Case("reset_rows/mask-long", rst, lambda: (torch.tensor([3, 4]), torch.tensor([True, False, True]))),
    Case("reset_rows/rows-2d", rst, lambda: (torch.tensor([3, 4]), torch.tensor([[0]]))),
    Case("reset_rows/rows-int16", rst, lambda: (torch.tensor([3, 4]), torch.tensor([0], dtype=torch.int16))),
    Case("reset_rows/rows-float", rst, lambda: (torch.tensor([3, 4]), torch.tensor([0.0]))),
    Case("reset_rows/rows-device", rst, lambda: (torch.tensor([3, 4]), torch.tensor([0], device="meta"))),
    Case("reset_rows/rows-negative", rst, lambda: (torch.tensor([3, 4]), torch.tensor([-1])), runtime=True),
    Case("reset_rows/rows-out-of-range", rst, lambda: (torch.tensor([3, 4]), torch.tensor([0, 2])), runtime=True),
    # --- ring_update_ ---
    Case("ring_update_/positions-int64", ring, lambda: (*cache(), ring_pos(dtype=torch.int64), *new(1), torch.tensor(0))),
    Case("ring_update_/positions-shape", ring, lambda: (*cache(), ring_pos((B, T + 1)), *new(1), torch.tensor(0))),
    Case("ring_update_/positions-in-keys", ring, ring_pos_in_keys),
    Case("ring_update_/keys_new-head_dim", ring, lambda: (*cache(), ring_pos(), *new(1, D + 1), torch.tensor(0))),
    Case("ring_update_/start-float", ring, lambda: (*cache(), ring_pos(), *new(1), torch.tensor(0.0))),
    Case("ring_update_/sinks-negative", ring_sinks(-1), lambda: (*cache(), ring_pos(), *new(1), torch.tensor(0))),
    Case("ring_update_/sinks-capacity", ring_sinks(T), lambda: (*cache(), ring_pos(), *new(1), torch.tensor(0))),
    Case("ring_update_/start-negative", ring, lambda: (*cache(), ring_pos(), *new(1), torch.tensor([0, -1])),
         runtime=True),
    Case("ring_update_/start-int32-overflow", ring,
         lambda: (*cache(), ring_pos(), *new(2), torch.tensor(2**31 - 2)), runtime=True),
    # --- the ring's write as update_.Tensor with positions (what ring_update_ decomposes into) ---
    Case("update_.Tensor/ring-positions-int64", ring_t,
         lambda: (*cache(), ring_pos(dtype=torch.int64), *new(1), torch.tensor(0))),
    Case("update_.Tensor/ring-positions-shape", ring_t, lambda: (*cache(), ring_pos((B, T + 1)), *new(1), torch.tensor(0))),
    Case("update_.Tensor/ring-positions-in-keys", ring_t, ring_pos_in_keys),
    Case("update_.Tensor/ring-sinks-capacity", ring_t_sinks(T), lambda: (*cache(), ring_pos(), *new(1), torch.tensor(0))),
    Case("update_.Tensor/ring-scales-on-float-cache", ring_t, lambda: (*cache(), ring_pos(), *new(1), torch.tensor(0),
                                                                      *scales())),
    Case("update_.Tensor/ring-start-negative", ring_t, lambda: (*cache(), ring_pos(), *new(1), torch.tensor([0, -1])),
         runtime=True),
    Case("update_.Tensor/sinks-without-positions", upd_t_sinks, lambda: (*cache(), *new(1), torch.tensor(0))),
    # --- paged_write_ (a slot mapping; the slots' values are checked by the kernel when traced) ---
    Case("paged_write_/key-dtype", pw, lambda: (*pages(), tokens()[0].half(), tokens()[1], torch.tensor([1, 2, 3]))),
    Case("paged_write_/key-shape", pw, lambda: (*pages(), *tokens(heads=H + 1), torch.tensor([1, 2, 3]))),
    Case("paged_write_/slots-shape", pw, lambda: (*pages(), *tokens(), torch.tensor([1, 2]))),
    Case("paged_write_/slots-float", pw, lambda: (*pages(), *tokens(), torch.tensor([1.0, 2.0, 3.0]))),
    Case("paged_write_/key-in-pages", pw,
         lambda: (lambda kp, vp: (kp, vp, kp[0, :3], tokens()[1], torch.tensor([1, 2, 3])))(*pages())),
    Case("paged_write_/int8-pages-no-scales", pw, lambda: (*pages(torch.int8), *tokens(), torch.tensor([1, 2, 3]))),
    Case("paged_write_/scales-on-float-pages", pw,
         lambda: (*pages(), *tokens(), torch.tensor([1, 2, 3]), torch.ones(6, 4, H), torch.ones(6, 4, H))),
    Case("paged_write_/key_scales-alone", lambda *a: pw(*a, only="key_scales"),
         lambda: (*pages(torch.int8), *tokens(), torch.tensor([1, 2, 3]), torch.ones(6, 4, H))),
    Case("paged_write_/slot-past-end", pw, lambda: (*pages(), *tokens(), torch.tensor([1, 2, 24])), runtime=True),
    Case("paged_write_/slot-twice", pw, lambda: (*pages(), *tokens(), torch.tensor([5, 2, 5])), runtime=True),
    # --- ring_update_quantized_ ---
    Case("ring_update_quantized_/keys-float-cache", qring,
         lambda: (*cache(), *scales(), ring_pos(), *new(1), torch.tensor(0))),
    Case("ring_update_quantized_/keys_new-int", qring, lambda: qring_args(nd=torch.int32)),
    Case("ring_update_quantized_/values_new-dtype", qring,
         lambda: (*qring_args()[:6], new(1)[1].half(), torch.tensor(0))),
    Case("ring_update_quantized_/k_scale-shape", qring,
         lambda: qring_args(sc=(torch.ones(B, H, T + 1), torch.ones(B, H, T)))),
    Case("ring_update_quantized_/v_scale-dtype", qring,
         lambda: qring_args(sc=(torch.ones(B, H, T), torch.ones(B, H, T).half()))),
    Case("ring_update_quantized_/scales-share", qring, lambda: qring_args(sc=(lambda s: (s, s))(torch.ones(B, H, T)))),
    Case("ring_update_quantized_/positions-int64", qring, lambda: qring_args(pos=ring_pos(dtype=torch.int64))),
    Case("ring_update_quantized_/positions-shape", qring, lambda: qring_args(pos=ring_pos((B, T + 1)))),
    Case("ring_update_quantized_/positions-in-k_scale", qring, qring_pos_in_scale),
    Case("ring_update_quantized_/start-in-v_scale", qring, qring_start_in_scale),
    Case("ring_update_quantized_/start-float", qring, lambda: qring_args(start=torch.tensor(0.0))),
    Case("ring_update_quantized_/sinks-negative", qring_sinks(-1), lambda: qring_args()),
    Case("ring_update_quantized_/sinks-capacity", qring_sinks(T), lambda: qring_args(torch.float8_e4m3fn)),
    Case("ring_update_quantized_/start-negative", qring, lambda: qring_args(start=torch.tensor([0, -1])),
         runtime=True),
    Case("ring_update_quantized_/start-int32-overflow", qring, lambda: qring_args(chunk=2, start=2**31 - 2),
         runtime=True),
    # --- attend over a ring ---
    Case("attend/positions-shape", att_ring, lambda: (q_(), *cache(), torch.tensor(3), ring_pos((B, T - 1)))),
    Case("attend/positions-int64", att_ring, lambda: (q_(), *cache(), torch.tensor(3), ring_pos(dtype=torch.int64))),
    Case("attend/sinks-without-positions", att(sinks=2), lambda: (q_(), *cache(), torch.tensor(3))),
    Case("attend/ring-lengths-over-int32", att_ring, lambda: (q_(), *cache(), torch.tensor(2**31), ring_pos()),
         runtime=True),
    # --- init_layer_cache ---
    Case("init_layer_cache/negative-batch", init(-1, 2, 4, 8), lambda: ()),
    Case("init_layer_cache/max_len-2^31", init(1, 1, 1, 2**31), lambda: ()),
    Case("init_layer_cache/quantized-dtype", init(1, 1, 1, 1, dtype=torch.qint8), lambda: ()),
    Case("init_layer_cache/bytes-overflow", init(2**20, 2**20, 2**20, 2**10), lambda: ()),
]

MODES = ["fake", "export", "compile", "compile_dynamic", "inductor"]


def run_eager(case):
    args = case.args()
    with pytest.raises(Exception) as info:
        case.fn(*args)
    return info.value


def run_mode(case, mode):
    args = case.args()
    if mode == "fake":
        with FakeTensorMode(allow_non_fake_inputs=False) as m:
            fakes = [m.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            case.fn(*fakes)
        return
    if mode == "export":

        class M(torch.nn.Module):
            def forward(self, *xs):
                return case.fn(*xs)

        ep = torch.export.export(M(), tuple(args))
        ep.module()(*case.args())  # RUNTIME cases raise here
        return
    torch._dynamo.reset()
    kw = dict(fullgraph=True)
    if mode == "compile":
        kw["backend"] = "eager"
    elif mode == "compile_dynamic":
        kw.update(backend="eager", dynamic=True)
    torch.compile(case.fn, **kw)(*args)


def same_error(ref: BaseException, got: BaseException, mode: str) -> bool:
    if type(got) is type(ref) and str(got) == str(ref):
        return True
    # Dynamo's wrapper (see the module docstring): exact type and message quoted.
    return mode.startswith(("compile", "inductor")) and isinstance(got, torch._dynamo.exc.TorchRuntimeError) and (
        f"got {ref!r}" in str(got)
    )


def _params():
    for case in CASES:
        for mode in MODES:
            marks = [pytest.mark.xfail(strict=True, reason=case.xfail[mode])] if mode in case.xfail else []
            yield pytest.param(case, mode, id=f"{case.id}-{mode}", marks=marks)


@pytest.mark.parametrize("case,mode", list(_params()))
def test_traced_error_is_eager_error(case, mode):
    if mode in case.skip:
        pytest.skip(case.skip[mode])

    if mode == "fake" and case.runtime:
        pytest.skip("RUNTIME: the values do not exist under FakeTensorMode (checked by the kernel at run time)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = run_eager(case)
        assert isinstance(ref, (ValueError, TypeError, RuntimeError)), ref
        with pytest.raises(Exception) as info:
            run_mode(case, mode)
    got = info.value
    assert same_error(ref, got, mode), f"eager: {type(ref).__name__}({ref})\n{mode}: {type(got).__name__}({got})"


def test_table_covers_every_operator():
    names = {c.id.split("/")[0] for c in CASES}
    assert names == {"update_", "update_.Tensor", "append_", "append_returning_", "attend", "rollback_",
                     "select_rows_", "reset_rows", "init_layer_cache", "ring_update_", "ring_update_quantized_",
                     "append_kv_layer_cache",
                     "rollback_kv_layer_cache", "select_rows_kv_layer_cache", "reset_rows_kv_layer_cache",
                     "update_quantized_", "update_quantized_.Tensor", "append_quantized_", "paged_write_"}
    assert all(isinstance(run_eager(c), (ValueError, TypeError)) for c in CASES if "requires-grad" not in c.id)


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


def test_compiled_changing_start_may_read_rows_not_written():
    """update_ with a host start may read cache rows it does not write (eager allows it). Under
    torch.compile the start becomes symbolic after it changes (automatic dynamic): the fake kernel
    must still decide on the rows (not refuse every view of the cache)."""
    k, v = cache()

    def step(k, v, start):
        return ops.update_(k, v, k[:, :, 0:1], v[:, :, 0:1], start)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    for start in (2, 3, 4, 5):
        ek, ev = k.clone(), v.clone()
        ek[:, :, start] = ek[:, :, 0]
        ev[:, :, start] = ev[:, :, 0]
        compiled(k, v, start)
        assert torch.equal(k, ek) and torch.equal(v, ev)
    with pytest.raises(Exception, match="keys_new must not share memory with the rows of keys that it is written to"):
        compiled(k, v, 0)  # row 0 is read and written: refused, as eagerly
