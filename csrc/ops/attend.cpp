#include "attend.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <string>

#include "../core/checks.h"
#include "../core/tensor_params.h"
#include "ring.h"

namespace kvcache {
namespace detail {

DeviceStub<AttendFn> attend_stub;

void check_attend_options(std::optional<double> scale, int64_t window,
                          double softcap, int64_t head_dim) {
  // The kernels compute in float32: the value they use is the float32 one.
  // A double that is finite but overflows float32 (1e39) or underflows to 0
  // (1e-46: a softcap that silently became "no softcap") is refused too.
  if (scale.has_value()) {
    const float f = static_cast<float>(*scale);
    TORCH_CHECK_VALUE(std::isfinite(*scale) && std::isfinite(f) && f > 0.0f,
                      "scale must be a finite number > 0 in float32 range (",
                      std::numeric_limits<float>::denorm_min(), " to ",
                      std::numeric_limits<float>::max(), "), got ", *scale);
  }
  TORCH_CHECK_VALUE(window >= 0, "window must be >= 0 (0: no window), got ",
                    window);
  const float cap32 = static_cast<float>(softcap);
  TORCH_CHECK_VALUE(softcap == 0.0 || (std::isfinite(softcap) &&
                                       std::isfinite(cap32) && cap32 > 0.0f),
                    "softcap must be 0 (no cap) or a finite number > 0 in "
                    "float32 range (",
                    std::numeric_limits<float>::denorm_min(), " to ",
                    std::numeric_limits<float>::max(), "), got ", softcap);
  // Scores must stay finite in float32, where the kernels compute them (a
  // score of +-inf makes the softmax's inf - inf a NaN). They cannot be
  // bounded for every input, so the bound is stated for the inputs it is
  // meant for: query and key elements of magnitude at most 1, whose dot
  // product is at most head_dim. The kernels work in base 2 (the CPU folds
  // log2(e) into the queries), so the bound is
  //   scale * log2(e) * head_dim <= FLT_MAX         (the scaled score)
  // and with a softcap also
  //   (scale / softcap) * head_dim <= FLT_MAX       (what tanh takes)
  //   softcap * log2(e) <= FLT_MAX                  (the capped score).
  // Checked in double (every operand is a finite float32 here, so no
  // product overflows a double); head_dim 0 counts as 1.
  {
    const int64_t d = head_dim;
    const double dims = d > 1 ? double(d) : 1.0;
    const double s = scale.value_or(d > 0 ? 1.0 / std::sqrt(double(d)) : 1.0);
    constexpr double kLog2e = 1.4426950408889634;
    constexpr double kFltMax = std::numeric_limits<float>::max();
    TORCH_CHECK_VALUE(s * kLog2e * dims <= kFltMax, "scale=", s,
                      " makes scores overflow float32: scale * log2(e) * "
                      "head_dim must be at most ", kFltMax,
                      " (the kernels compute scores in float32, in base 2; "
                      "query and key elements of magnitude up to 1 give "
                      "|q.k| <= head_dim=", d, "), so scale <= ",
                      kFltMax / (kLog2e * dims));
    if (softcap > 0.0) {
      TORCH_CHECK_VALUE(softcap * kLog2e <= kFltMax, "softcap=", softcap,
                        " makes capped scores overflow float32: softcap * "
                        "log2(e) must be at most ", kFltMax,
                        " (the kernels compute scores in float32, in base "
                        "2), so softcap <= ", kFltMax / kLog2e);
      TORCH_CHECK_VALUE(s / softcap * dims <= kFltMax, "softcap=", softcap,
                        " is too small for scale=", s,
                        ": scale / softcap * head_dim must be at most ",
                        kFltMax,
                        " (the kernels compute scores in float32; query "
                        "and key elements of magnitude up to 1 give "
                        "|q.k| <= head_dim=", d, ")");
    }
  }
}

void check_sink_logits(const at::Tensor& sl, const c10::SymInt& heads,
                       const at::Device& dev) {
  check_dense(sl, "sink_logits");
  TORCH_CHECK_TYPE(sl.scalar_type() == at::kFloat,
                   "sink_logits must be a torch.float32 tensor, got ",
                   py_dtype(sl.scalar_type()));
  TORCH_CHECK_VALUE(sl.dim() == 1 && holds(sl.sym_size(0).sym_eq(heads)),
                    "sink_logits must have shape (num_heads=", shown(heads),
                    ",), got ", shape_str(sl));
  check_device(sl, dev, "sink_logits", "the device of q");
}

AttendRows check_attend(const at::Tensor& q, const at::Tensor& keys,
                        const at::Tensor& values, const at::Tensor& lengths,
                        const std::optional<at::Tensor>& kv_start,
                        std::optional<double> scale, int64_t window,
                        double softcap, bool values_known,
                        const std::optional<at::Tensor>& positions,
                        int64_t sinks,
                        const std::optional<at::Tensor>& k_scale,
                        const std::optional<at::Tensor>& v_scale,
                        const std::optional<at::Tensor>& sink_logits) {
  check_dense(q, "q");
  check_dense(keys, "keys");
  check_dense(values, "values");
  check_rank(q, 4, "q", "(batch, num_heads, seq, head_dim)");
  check_rank(keys, 4, "keys", "(batch, num_kv_heads, max_len, head_dim)");
  check_rank(values, 4, "values", "(batch, num_kv_heads, max_len, head_dim)");
  TORCH_CHECK_VALUE(same_sizes(values, keys),
                    "values must have the same shape as keys ",
                    shape_str(keys), ", got ", shape_str(values));
  const c10::SymInt batch = keys.sym_size(0);
  const c10::SymInt kv_heads = keys.sym_size(1);
  const c10::SymInt max_len = keys.sym_size(2);
  const c10::SymInt head_dim = keys.sym_size(3);
  const c10::SymInt heads = q.sym_size(1);
  const c10::SymInt seq = q.sym_size(2);
  TORCH_CHECK_VALUE(
      holds(q.sym_size(0).sym_eq(batch)) &&
          holds(q.sym_size(3).sym_eq(head_dim)),
      "q must have shape (batch=", shown(batch), ", num_heads, seq, head_dim=",
      shown(head_dim), ") to match the cache, got ", shape_str(q));
  // Grouped-query attention: query head h reads KV head h / (heads / kv).
  TORCH_CHECK_VALUE(
      holds(kv_heads.sym_gt(0)) ? holds((heads % kv_heads).sym_eq(0))
                                : holds(heads.sym_eq(0)),
      "q has num_heads=", shown(heads),
      ", which must be a multiple of the cache's num_kv_heads=",
      shown(kv_heads));

  TORCH_CHECK_TYPE(is_float_dtype(q.scalar_type()),
                   "q must be a torch.float32, torch.bfloat16 or "
                   "torch.float16 tensor, got ",
                   py_dtype(q.scalar_type()));
  const auto dev = q.device();
  const KvFormat format = format_of(keys.scalar_type());
  if (format == KvFormat::kPlain) {
    // A dtype attend reads at all first: otherwise the cast named below
    // (q.to(the cache's dtype)) would itself be refused.
    TORCH_CHECK_TYPE(is_float_dtype(keys.scalar_type()), "the cache's keys are ",
                     py_dtype(keys.scalar_type()),
                     ": attend reads caches of torch.float32, torch.bfloat16 or "
                     "torch.float16 (q's dtype), or torch.int8 / "
                     "torch.float8_e4m3fn with k_scale and v_scale");
    // The cache's dtype is the user's choice and q's the model's: name both,
    // and the cast that fixes it, rather than blame the cache.
    TORCH_CHECK_TYPE(keys.scalar_type() == q.scalar_type(), "q is ",
                     py_dtype(q.scalar_type()), " but the cache's keys are ",
                     py_dtype(keys.scalar_type()),
                     ": q and the cache must have one dtype (no implicit "
                     "casts): pass q.to(",
                     py_dtype(keys.scalar_type()),
                     ") or make the cache in q's dtype");
    check_dtype(values, keys.scalar_type(), "values", "the dtype of keys");
    TORCH_CHECK_VALUE(!k_scale.has_value() && !v_scale.has_value(),
                      "k_scale and v_scale are the scales of a quantized "
                      "cache (torch.int8 or torch.float8_e4m3fn keys and "
                      "values), got keys of dtype ",
                      py_dtype(keys.scalar_type()));
  } else {
    // A quantized cache: both buffers in one format, and both scales.
    check_dtype(values, keys.scalar_type(), "values",
                "the dtype of keys (one quantized format)");
    TORCH_CHECK_VALUE(k_scale.has_value() && v_scale.has_value(),
                      "keys and values are a quantized cache (",
                      py_dtype(keys.scalar_type()),
                      "): pass both k_scale and v_scale");
  }
  check_device(keys, dev, "keys", "the device of q");
  check_device(values, dev, "values", "the device of q");
  if (format != KvFormat::kPlain) {
    check_scale_tensor(*k_scale, "k_scale", keys);
    check_scale_tensor(*v_scale, "v_scale", keys);
  }
  TORCH_CHECK_VALUE(holds(max_len.sym_le(kMaxLen)), "keys has max_len=",
                    shown(max_len),
                    " positions; lengths are int32, so a cache holds at most ",
                    kMaxLen, " positions");
  check_row_ints(lengths, "lengths", batch, dev);
  if (kv_start.has_value()) {
    check_row_ints(*kv_start, "kv_start", batch, dev);
  }
  check_attend_options(scale, window, softcap, shown(head_dim));

  const bool ring = positions.has_value();
  if (ring) {
    check_positions(*positions, batch, max_len, dev);
  }
  TORCH_CHECK_VALUE(sinks >= 0, "sinks must be >= 0, got ", sinks);
  if (sink_logits.has_value()) check_sink_logits(*sink_logits, heads, dev);
  TORCH_CHECK_VALUE(sinks == 0 || ring,
                    "sinks=", sinks, " needs positions (a ring cache); a "
                    "linear cache has no sinks");

  AttendRows rows;
  if (!values_known || !dev.is_cpu()) {
    return rows;
  }
  const int64_t n = batch.expect_int();
  const int64_t s = seq.expect_int();
  const int64_t cap = max_len.expect_int();
  rows.lengths.resize(static_cast<size_t>(n));
  for (int64_t b = 0; b < n; ++b) {
    const int64_t len = row_value(lengths, b);
    TORCH_CHECK_VALUE(len >= s, "lengths must be >= seq=", s,
                      " (the queries are the last seq filled slots), got ", len,
                      at_index(lengths, b));
    // A ring's lengths are logical positions, bounded only by int32.
    TORCH_CHECK_VALUE(len <= (ring ? kMaxLen : cap),
                      ring ? "lengths must be <= " : "lengths must be <= max_len=",
                      ring ? kMaxLen : cap, ", got ", len, at_index(lengths, b));
    rows.lengths[b] = len;
  }
  if (kv_start.has_value()) {
    rows.kv_start.resize(static_cast<size_t>(n));
    for (int64_t b = 0; b < n; ++b) {
      const int64_t first = row_value(*kv_start, b);
      TORCH_CHECK_VALUE(first >= 0 && first <= rows.lengths[b],
                        "kv_start must be in [0, lengths] = [0, ",
                        rows.lengths[b], "], got ", first,
                        at_index(*kv_start, b));
      rows.kv_start[b] = first;
    }
  }
  return rows;
}


namespace {

void strides_of(const at::Tensor& t, int64_t* out) {
  for (int k = 0; k < 4; ++k) out[k] = t.stride(k);
}

}  // namespace

AttendParams attend_params(const at::Tensor& q, const at::Tensor& out, const at::Tensor& keys,
                           const at::Tensor& values, const at::Tensor& lengths,
                           const std::optional<at::Tensor>& kv_start,
                           std::optional<double> scale, int64_t window, double softcap,
                           const std::optional<at::Tensor>& positions, int64_t sinks,
                           const std::optional<at::Tensor>& k_scale,
                           const std::optional<at::Tensor>& v_scale,
                           const std::optional<at::Tensor>& sink_logits,
                           const AttendRows& rows) {
  AttendParams p;
  p.dtype = q.scalar_type() == at::kFloat      ? AttnDtype::kFloat32
            : q.scalar_type() == at::kBFloat16 ? AttnDtype::kBFloat16
                                               : AttnDtype::kFloat16;
  p.q = q.const_data_ptr();
  p.k = keys.const_data_ptr();
  p.v = values.const_data_ptr();
  p.out = out.mutable_data_ptr();
  strides_of(q, p.q_stride);
  strides_of(keys, p.k_stride);
  strides_of(values, p.v_stride);
  strides_of(out, p.out_stride);
  p.batch = keys.size(0);
  p.num_kv_heads = keys.size(1);
  p.max_len = keys.size(2);
  p.head_dim = keys.size(3);
  p.num_heads = q.size(1);
  p.seq = q.size(2);
  p.scale = static_cast<float>(
      scale.value_or(p.head_dim > 0 ? 1.0 / std::sqrt(double(p.head_dim)) : 1.0));
  p.softcap = static_cast<float>(softcap);
  p.window = window;
  if (positions.has_value()) {
    p.positions = positions->const_data_ptr<int32_t>();
    p.pos_stride[0] = positions->stride(0);
    p.pos_stride[1] = positions->stride(1);
  }
  p.sinks = sinks;
  if (sink_logits.has_value()) {
    p.sink_logits = sink_logits->const_data_ptr<float>();
    p.sink_stride = sink_logits->stride(0);
  }
  p.lengths = int_rows(lengths);
  if (kv_start.has_value()) p.kv_start = int_rows(*kv_start);
  p.host_lengths = rows.lengths.empty() ? nullptr : rows.lengths.data();
  p.host_kv_start = rows.kv_start.empty() ? nullptr : rows.kv_start.data();
  p.device_index = q.device().index();
  p.kv_format = format_of(keys.scalar_type());
  if (p.kv_format != KvFormat::kPlain) {
    p.k_scale = k_scale->const_data_ptr<float>();
    p.v_scale = v_scale->const_data_ptr<float>();
    for (int k = 0; k < 3; ++k) {
      p.ks_stride[k] = k_scale->stride(k);
      p.vs_stride[k] = v_scale->stride(k);
    }
  }
  return p;
}

}  // namespace detail

namespace ops {

at::Tensor attend(const at::Tensor& q, const at::Tensor& keys,
                  const at::Tensor& values, const at::Tensor& lengths,
                  const std::optional<at::Tensor>& kv_start,
                  std::optional<double> scale, int64_t window, double softcap,
                  const std::optional<at::Tensor>& positions, int64_t sinks,
                  const std::optional<at::Tensor>& k_scale,
                  const std::optional<at::Tensor>& v_scale,
                  const std::optional<at::Tensor>& sink_logits) {
  const auto rows = detail::check_attend(q, keys, values, lengths, kv_start,
                                         scale, window, softcap, true,
                                         positions, sinks, k_scale, v_scale,
                                         sink_logits);
  // (batch, seq, heads, head_dim) memory: the caller's transpose(1, 2) and
  // reshape to (batch, seq, heads * head_dim) is then a free view.
  at::Tensor out =
      at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options())
          .transpose(1, 2);
  const detail::AttendParams p =
      detail::attend_params(q, out, keys, values, lengths, kv_start, scale, window, softcap,
                            positions, sinks, k_scale, v_scale, sink_logits, rows);
  if (out.numel() > 0) {
    detail::attend_stub.get(q.device().type(), "attend")(p);
  }
  return out;
}

}  // namespace ops
}  // namespace kvcache
