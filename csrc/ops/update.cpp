#include "update.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>

#include "../core/checks.h"
#include "../core/overlap.h"
#include "../core/rules.h"
#include "../core/tensor_params.h"
#include "../core/typed_op.h"
#include "kvcache/kvcache.h"
#include "ring.h"

namespace kvcache {
namespace detail {

DeviceStub<UpdateFn> update_stub;
DeviceStub<QuantUpdateFn> quant_update_stub;

namespace {

// Exact start + chunk for a message, even where int64 would overflow.
std::string exact_end(int64_t start, int64_t chunk) {
  int64_t end = 0;
  if (!__builtin_add_overflow(start, chunk, &end)) {
    return std::to_string(end);
  }
  unsigned __int128 v = static_cast<unsigned __int128>(
      static_cast<__int128>(start) + chunk);  // positive: start, chunk >= 0
  std::string s;
  while (v > 0) {
    s.insert(s.begin(), static_cast<char>('0' + static_cast<int>(v % 10)));
    v /= 10;
  }
  return s;
}

struct Shape {
  c10::SymInt batch, heads, chunk, head_dim, max_len;
};

// The scale tensors of a quantized write (nullptr: a plain write).
struct Scales {
  const at::Tensor& k;
  const at::Tensor& v;
};

void check_scales(const at::Tensor& keys, const at::Tensor& values,
                  const at::Tensor& keys_new, const at::Tensor& values_new,
                  const Scales& sc, const Shape& g) {
  for (const auto& [t, name] :
       {std::pair<const at::Tensor&, const char*>{sc.k, "k_scale"},
        {sc.v, "v_scale"}}) {
    check_writable(t, name);
    check_scale_tensor(t, name, keys);
    TORCH_CHECK_VALUE(!self_overlaps(t), name,
                      " must not have internally overlapping memory (for "
                      "example an expand()ed tensor)");
    const Box b = box_of(t);
    TORCH_CHECK_VALUE(!overlaps(b, box_of(keys)) && !overlaps(b, box_of(values)),
                      name, " must not share memory with keys or values");
    TORCH_CHECK_VALUE(
        !overlaps(b, box_of(keys_new)) && !overlaps(b, box_of(values_new)),
        "keys_new and values_new must not share memory with ", name);
  }
  TORCH_CHECK_VALUE(!overlaps(box_of(sc.k), box_of(sc.v)),
                    "k_scale and v_scale must not share memory: give each "
                    "its own buffer");
}

// Everything about the four tensors that does not depend on the start.
Shape check_tensors(const at::Tensor& keys, const at::Tensor& values,
                    const at::Tensor& keys_new, const at::Tensor& values_new,
                    const Scales* sc = nullptr) {
  check_cache(keys, values);
  check_dense(keys_new, "keys_new");
  check_dense(values_new, "values_new");
  check_rank(keys_new, 4, "keys_new", "(batch, num_kv_heads, chunk, head_dim)");
  check_rank(values_new, 4, "values_new",
             "(batch, num_kv_heads, chunk, head_dim)");

  const auto ks = keys.sym_sizes();
  Shape g{ks[0], ks[1], keys_new.sym_size(2), ks[3], ks[2]};
  TORCH_CHECK_VALUE(holds(keys_new.sym_size(0).sym_eq(g.batch)) &&
                        holds(keys_new.sym_size(1).sym_eq(g.heads)) &&
                        holds(keys_new.sym_size(3).sym_eq(g.head_dim)),
                    "keys_new must have shape (batch=", shown(g.batch),
                    ", num_kv_heads=", shown(g.heads), ", chunk, head_dim=",
                    shown(g.head_dim), ") to match the cache, got ",
                    shape_str(keys_new));
  TORCH_CHECK_VALUE(
      same_sizes(values_new, keys_new),
      "values_new must have the same shape as keys_new ", shape_str(keys_new),
      ", got ", shape_str(values_new));

  if (sc == nullptr) {
    // A plain write into an int8 / fp8 cache copies stored values: float
    // data there is a quantized write whose scales were left out.
    TORCH_CHECK_TYPE(format_of(keys.scalar_type()) == KvFormat::kPlain ||
                         !is_float_dtype(keys_new.scalar_type()),
                     "keys_new is ", py_dtype(keys_new.scalar_type()),
                     " but keys are ", py_dtype(keys.scalar_type()),
                     ": pass k_scale and v_scale to quantize it into the "
                     "cache (a quantized write), or keys_new of ",
                     py_dtype(keys.scalar_type()),
                     " to copy stored values (a plain write)");
    // No implicit casts: a cast would hide a model/cache dtype mismatch and
    // cost an extra pass over the data.
    check_dtype(keys_new, keys.scalar_type(), "keys_new", "the cache dtype");
    check_dtype(values_new, keys.scalar_type(), "values_new", "the cache dtype");
  } else {
    TORCH_CHECK_TYPE(format_of(keys.scalar_type()) != KvFormat::kPlain,
                     "keys must be a torch.int8 or torch.float8_e4m3fn tensor "
                     "(a quantized cache) when k_scale and v_scale are given, "
                     "got ",
                     py_dtype(keys.scalar_type()),
                     " (write a plain cache without k_scale / v_scale)");
    TORCH_CHECK_TYPE(is_float_dtype(keys_new.scalar_type()),
                     "keys_new must be a torch.float32, torch.bfloat16 or "
                     "torch.float16 tensor (it is quantized to ",
                     py_dtype(keys.scalar_type()), "), got ",
                     py_dtype(keys_new.scalar_type()));
    check_dtype(values_new, keys_new.scalar_type(), "values_new",
                "the dtype of keys_new");
  }

  const auto dev = keys.device();
  check_device(keys_new, dev, "keys_new", "the cache's device");
  check_device(values_new, dev, "values_new", "the cache's device");
  if (sc != nullptr) check_scales(keys, values, keys_new, values_new, *sc, g);

  return g;
}

// The rows a call writes: one start for every row (update_, whose start is
// a host integer), or any row. With a start tensor (update_.Tensor,
// append_) the rows are only known when the kernel runs (on CUDA, only on
// the device), so new data may not view keys or values at all: one rule on
// every device, eagerly and in traced code alike.
struct Written {
  enum Kind { kAny, kShared } kind = kAny;
  int64_t start = 0;
  int64_t chunk = 0;
};

// Whether any of keys_new / values_new shares a byte with keys or values.
bool new_data_views_cache(const at::Tensor& keys, const at::Tensor& values,
                          const at::Tensor& keys_new,
                          const at::Tensor& values_new) {
  for (const at::Tensor* dst : {&keys, &values}) {
    const Box whole = box_of(*dst);
    if (overlaps(whole, box_of(keys_new)) ||
        overlaps(whole, box_of(values_new))) {
      return true;
    }
  }
  return false;
}

// New data may be read from rows of the cache that are not written (moving
// cached rows), never from the rows being written: raise if `src` shares a
// byte with the rows of `dst` that this call writes.
void check_not_written(const at::Tensor& dst, const char* dst_name,
                       const at::Tensor& src, const char* src_name,
                       const Written& w) {
  const Box whole = box_of(dst);
  const Box from = box_of(src);
  bool hit = false;
  if (overlaps(whole, from)) {
    hit = w.kind == Written::kAny ||
          overlaps(slice_box(whole, 2, w.start, w.chunk), from);
  }
  TORCH_CHECK_VALUE(!hit, src_name, " must not share memory with the rows of ",
                    dst_name, " that it is written to",
                    w.kind == Written::kAny
                        ? " (with a start tensor the rows written are only "
                          "known when the kernel runs, so new data must not "
                          "view the cache at all)"
                        : "");
}

void check_sources(const at::Tensor& keys, const at::Tensor& values,
                   const at::Tensor& keys_new, const at::Tensor& values_new,
                   const Written& w) {
  for (const auto& [dst, dst_name] :
       {std::pair<const at::Tensor&, const char*>{keys, "keys"},
        {values, "values"}}) {
    check_not_written(dst, dst_name, keys_new, "keys_new", w);
    check_not_written(dst, dst_name, values_new, "values_new", w);
  }
}

// A per-row integer tensor must not alias the buffers: the kernels read it
// while (on CUDA) other blocks write the cache.
void check_int_rows_apart(const at::Tensor& t, const char* name,
                          const at::Tensor& keys, const at::Tensor& values) {
  const Box b = box_of(t);
  TORCH_CHECK_VALUE(!overlaps(b, box_of(keys)) && !overlaps(b, box_of(values)),
                    name, " must not share memory with keys or values");
}

void check_start_value(int64_t s, int64_t chunk, int64_t max_len,
                       const char* name, const at::Tensor* rows, int64_t b) {
  // The rule (core/rules.h, shared with the CUDA kernel); below, the
  // message for the part of it that failed.
  if (start_fits(s, chunk, max_len)) return;
  if (rows == nullptr) {
    TORCH_CHECK_VALUE(s >= 0, name, " must be >= 0, got ", s);
    TORCH_CHECK_VALUE(s <= max_len - chunk, "KV cache overflow: end=",
                      exact_end(s, chunk), " exceeds max_len=", max_len);
    return;
  }
  const bool shared = rows->dim() == 0;
  TORCH_CHECK_VALUE(s >= 0, name, " must be >= 0, got ", s,
                    shared ? "" : " at index ", shared ? "" : std::to_string(b));
  TORCH_CHECK_VALUE(s <= max_len - chunk, "KV cache overflow: end=",
                    exact_end(s, chunk), " exceeds max_len=", max_len, " (",
                    name, shared ? "" : "[", shared ? "" : std::to_string(b),
                    shared ? "" : "]", "=", s, ", chunk=", chunk, ")");
}

// Checks a start tensor's metadata: everything that traced code knows too.
void check_start_meta(const at::Tensor& keys, const at::Tensor& values,
                      const at::Tensor& keys_new, const at::Tensor& values_new,
                      const at::Tensor& rows, const char* name,
                      const Shape& g, const Scales* sc = nullptr) {
  check_row_ints(rows, name, g.batch, keys.device());
  check_int_rows_apart(rows, name, keys, values);
  if (sc != nullptr) {
    const Box b = box_of(rows);
    TORCH_CHECK_VALUE(!overlaps(b, box_of(sc->k)) && !overlaps(b, box_of(sc->v)),
                      name, " must not share memory with k_scale or v_scale");
  }
  Written w;  // kAny: see Written
  check_sources(keys, values, keys_new, values_new, w);
}

// Reads and checks a start tensor's values, after every metadata check (so
// that eager code, which knows the values, raises what traced code raises
// when both a value and the metadata are wrong). Returns the starts (one for
// a 0-D tensor, else one per row); empty when the values are not known on
// the host (tracing, or a device tensor: the kernel checks them).
std::vector<int64_t> check_start_values(const at::Tensor& rows,
                                        const char* name, const Shape& g,
                                        bool values_known) {
  std::vector<int64_t> starts;
  if (values_known && rows.device().is_cpu()) {
    const int64_t chunk = g.chunk.expect_int();
    const int64_t max_len = g.max_len.expect_int();
    starts.resize(static_cast<size_t>(rows.numel()));
    for (int64_t b = 0; b < rows.numel(); ++b) {
      starts[b] = row_value(rows, b);
      check_start_value(starts[b], chunk, max_len, name, &rows, b);
    }
  }
  return starts;
}

}  // namespace

namespace {

void check_update_impl(const at::Tensor& keys, const at::Tensor& values,
                       const at::Tensor& keys_new, const at::Tensor& values_new,
                       const c10::SymInt& start, const Scales* sc) {
  const Shape g = check_tensors(keys, values, keys_new, values_new, sc);
  TORCH_CHECK_VALUE(holds(start.sym_ge(0)), "start must be >= 0, got ",
                    shown(start));
  // Never start + chunk > max_len: that sum overflows for a start near 2^63.
  TORCH_CHECK_VALUE(holds(start.sym_le(g.max_len - g.chunk)),
                    "KV cache overflow: end=",
                    exact_end(shown(start), shown(g.chunk)),
                    " exceeds max_len=", shown(g.max_len));
  Written w;
  if (new_data_views_cache(keys, values, keys_new, values_new)) {
    // Only new data that views the cache needs the rows. A symbolic start
    // or chunk (a changing start under torch.compile) is then guarded on its
    // hint, as eager code knows it: a recompile per start for such calls
    // only. A data-dependent one (no hint) is left to the kernel, which
    // checks the concrete rows when the program runs (see holds()).
    auto concrete = [](const c10::SymInt& v) -> std::optional<int64_t> {
      if (auto i = v.maybe_as_int()) return i;
      if (v.has_hint()) return v.guard_int(__FILE__, __LINE__);
      return std::nullopt;
    };
    const auto s = concrete(start);
    const auto chunk = concrete(g.chunk);
    if (!s || !chunk) {
      return;
    }
    w.kind = Written::kShared;
    w.start = *s;
    w.chunk = *chunk;
  }
  check_sources(keys, values, keys_new, values_new, w);
}

std::vector<int64_t> check_update_tensor_impl(
    const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& keys_new, const at::Tensor& values_new,
    const at::Tensor& start, bool values_known, const Scales* sc) {
  const Shape g = check_tensors(keys, values, keys_new, values_new, sc);
  check_start_meta(keys, values, keys_new, values_new, start, "start", g, sc);
  return check_start_values(start, "start", g, values_known);
}

std::vector<int64_t> check_append_impl(const at::Tensor& keys,
                                       const at::Tensor& values,
                                       const at::Tensor& lengths,
                                       const at::Tensor& keys_new,
                                       const at::Tensor& values_new,
                                       bool values_known, const Scales* sc) {
  const Shape g = check_tensors(keys, values, keys_new, values_new, sc);
  check_written_rows(lengths, "lengths");
  check_start_meta(keys, values, keys_new, values_new, lengths, "lengths", g,
                   sc);
  // lengths is written too: it must not alias what the call reads.
  const Box lb = box_of(lengths);
  TORCH_CHECK_VALUE(!overlaps(lb, box_of(keys_new)) &&
                        !overlaps(lb, box_of(values_new)),
                    "lengths must not share memory with keys_new or "
                    "values_new");
  return check_start_values(lengths, "lengths", g, values_known);
}

}  // namespace

namespace {

// The scales of a write: both absent (nullopt: a plain write) or both given
// (a quantized write). Only one of them is a mistake, named here.
std::optional<Scales> scales_of(const std::optional<at::Tensor>& k_scale,
                                const std::optional<at::Tensor>& v_scale) {
  if (k_scale.has_value() != v_scale.has_value()) {
    const char* have = k_scale.has_value() ? "k_scale" : "v_scale";
    const char* missing = k_scale.has_value() ? "v_scale" : "k_scale";
    TORCH_CHECK_VALUE(false, missing, " is None but ", have,
                      " is given: a quantized write needs both k_scale and "
                      "v_scale, a plain write neither");
  }
  if (!k_scale.has_value()) return std::nullopt;
  return Scales{*k_scale, *v_scale};
}

const Scales* ptr(const std::optional<Scales>& sc) {
  return sc.has_value() ? &*sc : nullptr;
}

}  // namespace

void check_update(const at::Tensor& keys, const at::Tensor& values,
                  const at::Tensor& keys_new, const at::Tensor& values_new,
                  const c10::SymInt& start,
                  const std::optional<at::Tensor>& k_scale,
                  const std::optional<at::Tensor>& v_scale) {
  const auto sc = scales_of(k_scale, v_scale);
  check_update_impl(keys, values, keys_new, values_new, start, ptr(sc));
}

std::vector<int64_t> check_update_tensor(
    const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& keys_new, const at::Tensor& values_new,
    const at::Tensor& start, bool values_known,
    const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale) {
  const auto sc = scales_of(k_scale, v_scale);
  return check_update_tensor_impl(keys, values, keys_new, values_new, start,
                                  values_known, ptr(sc));
}

std::vector<int64_t> check_append(
    const at::Tensor& keys, const at::Tensor& values, const at::Tensor& lengths,
    const at::Tensor& keys_new, const at::Tensor& values_new, bool values_known,
    const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale) {
  const auto sc = scales_of(k_scale, v_scale);
  return check_append_impl(keys, values, lengths, keys_new, values_new,
                           values_known, ptr(sc));
}

}  // namespace detail

namespace ops {

namespace {

// Runs a checked write: the plain stub with `p`, or (scales given) the
// quantized stub with `p` as its base and the scales' fields. The start
// fields of `p` are already set by the caller.
void run_write(const detail::UpdateParams& p, const at::Tensor& keys,
               const at::Tensor& keys_new,
               const std::optional<at::Tensor>& k_scale,
               const std::optional<at::Tensor>& v_scale, const char* op) {
  if (!k_scale.has_value()) {
    detail::update_stub.get(keys.device().type(), op)(p);
    return;
  }
  detail::QuantUpdateParams q;
  q.base = p;
  q.base.elem = static_cast<int64_t>(keys_new.element_size());  // source elements
  detail::fill_quant_fields(q, keys, keys_new, *k_scale, *v_scale);
  detail::quant_update_stub.get(keys.device().type(), op)(q);
}

}  // namespace

at::Tensor update_(at::Tensor& keys, at::Tensor& values,
                   const at::Tensor& keys_new, const at::Tensor& values_new,
                   int64_t start, const std::optional<at::Tensor>& k_scale,
                   const std::optional<at::Tensor>& v_scale) {
  detail::check_update(keys, values, keys_new, values_new, start, k_scale,
                       v_scale);
  at::Tensor length = at::empty({}, keys.options().dtype(at::kInt));
  auto p = detail::update_params(keys, values, keys_new, values_new);
  p.start = start;
  p.host_starts = &start;
  p.lengths_out = detail::int_rows(length);
  run_write(p, keys, keys_new, k_scale, v_scale, "update_");
  return length;
}

at::Tensor update_tensor_(at::Tensor& keys, at::Tensor& values,
                          const at::Tensor& keys_new,
                          const at::Tensor& values_new, const at::Tensor& start,
                          const std::optional<at::Tensor>& k_scale,
                          const std::optional<at::Tensor>& v_scale,
                          const std::optional<at::Tensor>& positions,
                          int64_t sinks) {
  if (positions.has_value()) {
    return detail::ring_write(keys, values, *positions, keys_new, values_new,
                              start, sinks, k_scale, v_scale);
  }
  const auto starts = detail::check_device_start_write(
      keys, values, keys_new, values_new, start, true, k_scale, v_scale,
      positions, sinks);
  at::Tensor length = at::empty(start.sizes(), keys.options().dtype(at::kInt));
  auto p = detail::update_params(keys, values, keys_new, values_new);
  p.starts = detail::int_rows(start);
  p.host_starts = starts.empty() ? nullptr : starts.data();
  p.lengths_out = detail::int_rows(length);
  run_write(p, keys, keys_new, k_scale, v_scale, "update_");
  return length;
}

void append_(at::Tensor& keys, at::Tensor& values, at::Tensor& lengths,
             const at::Tensor& keys_new, const at::Tensor& values_new,
             const std::optional<at::Tensor>& k_scale,
             const std::optional<at::Tensor>& v_scale) {
  const auto starts = detail::check_append(keys, values, lengths, keys_new,
                                           values_new, true, k_scale, v_scale);
  auto p = detail::update_params(keys, values, keys_new, values_new);
  p.starts = detail::int_rows(lengths);
  p.host_starts = starts.empty() ? nullptr : starts.data();
  p.lengths_out = p.starts;
  run_write(p, keys, keys_new, k_scale, v_scale, "append_");
}

at::Tensor append_returning_(at::Tensor& keys, at::Tensor& values,
                             const at::Tensor& lengths,
                             const at::Tensor& keys_new,
                             const at::Tensor& values_new,
                             const std::optional<at::Tensor>& k_scale,
                             const std::optional<at::Tensor>& v_scale) {
  // append_'s checks, naming lengths (also the in-place rules: the caller
  // copies the result into lengths, and that copy must not fail after the
  // buffers were written).
  const auto starts = detail::check_append(keys, values, lengths, keys_new,
                                           values_new, true, k_scale, v_scale);
  at::Tensor out = at::empty(lengths.sizes(), lengths.options());
  auto p = detail::update_params(keys, values, keys_new, values_new);
  p.starts = detail::int_rows(lengths);
  p.host_starts = starts.empty() ? nullptr : starts.data();
  p.lengths_out = detail::int_rows(out);
  run_write(p, keys, keys_new, k_scale, v_scale, "append_");
  return out;
}

// The deprecated aliases call the new writes through the dispatcher (not
// the entry points above): under tracing their CompositeImplicitAutograd
// kernels decompose into the new operator, whose fake kernel, autograd
// refusal and version bump then apply. They call the C++ API's writes
// (csrc/api.cpp), which do exactly that; update_quantized_ keeps a handle of
// its own because its start is a SymInt (the C++ API's is an int64_t, which
// would specialize a symbolic start while tracing).
at::Tensor update_quantized_(at::Tensor& keys, at::Tensor& values,
                             at::Tensor& k_scale, at::Tensor& v_scale,
                             const at::Tensor& keys_new,
                             const at::Tensor& values_new, c10::SymInt start) {
  static const auto op =
      detail::typed_op<at::Tensor(at::Tensor&, at::Tensor&, const at::Tensor&,
                       const at::Tensor&, c10::SymInt,
                       const std::optional<at::Tensor>&,
                       const std::optional<at::Tensor>&)>("kvcache::update_", "");
  return op.call(keys, values, keys_new, values_new, std::move(start), k_scale,
                 v_scale);
}

at::Tensor update_quantized_tensor_(at::Tensor& keys, at::Tensor& values,
                                    at::Tensor& k_scale, at::Tensor& v_scale,
                                    const at::Tensor& keys_new,
                                    const at::Tensor& values_new,
                                    const at::Tensor& start) {
  return kvcache::update_(keys, values, keys_new, values_new, start, k_scale,
                          v_scale);
}

void append_quantized_(at::Tensor& keys, at::Tensor& values,
                       at::Tensor& k_scale, at::Tensor& v_scale,
                       at::Tensor& lengths, const at::Tensor& keys_new,
                       const at::Tensor& values_new) {
  kvcache::append_(keys, values, lengths, keys_new, values_new, k_scale, v_scale);
}

}  // namespace ops
}  // namespace kvcache
