// attend: attention of new queries over the filled part of a KV cache.
//
//   out[b, h, i] = softmax_j(score(q[b, h, i], keys[b, h / group, j])) .
//                  values[b, h / group, j]
//
// over the slots j a query may see: query i of row b sits at slot
// p = lengths[b] - seq + i and sees kv_start[b] <= j <= p, and, with a
// window w > 0, p - w < j. Slots outside [kv_start[b], lengths[b]) are never
// read, so a step costs O(filled slots), not O(capacity). score is
// scale * q.k, then softcap * tanh(score / softcap) when softcap > 0.
// A query that sees no slot (a left-padding position) gets zeros.
//
// scale and softcap are bounded so that scores stay finite in float32
// (where the kernels compute them, in base 2) for query and key elements of
// magnitude at most 1 (|q.k| <= head_dim): scale * log2(e) * head_dim <=
// FLT_MAX (scale <= about 2.36e38 / head_dim), and with a softcap also
// softcap * log2(e) <= FLT_MAX (softcap <= about 2.36e38) and
// scale / softcap * head_dim <= FLT_MAX. Larger values raise ValueError
// naming the argument (they gave NaN: inf - inf in the softmax).
//
// Rings (positions given): the slots are read by the logical position each
// one records, with the rule of csrc/core/visibility.h (sinks always
// visible, empty (-1) and stale slots never read); lengths are logical (may
// exceed max_len); a step costs O(max_len) = O(window + sinks + R).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "../core/device_stub.h"
#include "kvcache/export.h"
#include "../core/params.h"
#include "../core/quant.h"

namespace kvcache {
namespace detail {

enum class AttnDtype { kFloat32, kBFloat16, kFloat16 };

struct AttendParams {
  AttnDtype dtype = AttnDtype::kFloat32;
  // Element strides (not bytes): the kernels index typed pointers.
  const void* q = nullptr;  // (batch, num_heads, seq, head_dim)
  int64_t q_stride[4] = {};
  const void* k = nullptr;  // (batch, num_kv_heads, max_len, head_dim)
  int64_t k_stride[4] = {};
  const void* v = nullptr;  // same shape as k
  int64_t v_stride[4] = {};
  void* out = nullptr;  // (batch, num_heads, seq, head_dim)
  int64_t out_stride[4] = {};
  int64_t batch = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t seq = 0;
  int64_t head_dim = 0;
  int64_t max_len = 0;
  float scale = 1.0f;
  float softcap = 0.0f;  // 0: none
  int64_t window = 0;    // 0: none
  // A ring's slot positions ((batch, max_len) int32, element strides), or
  // nullptr (a linear cache: slot j holds position j).
  const int32_t* positions = nullptr;
  int64_t pos_stride[2] = {};
  int64_t sinks = 0;
  // On the device (CUDA reads them there; out-of-range rows get NaN).
  IntRows lengths;
  IntRows kv_start;  // absent: 0
  // CPU: the checked values, one per row.
  const int64_t* host_lengths = nullptr;
  const int64_t* host_kv_start = nullptr;  // nullptr: 0
  // The tensors' device index (CUDA: the device the kernels run on).
  int device_index = -1;
  // A quantized cache (kv_format != kPlain): k and v hold int8 or e4m3fn
  // elements, dequantized in registers with one float32 scale per
  // (row, KV head, slot); element strides of the (batch, kv_heads, max_len)
  // scale tensors.
  KvFormat kv_format = KvFormat::kPlain;
  const float* k_scale = nullptr;
  int64_t ks_stride[3] = {};
  const float* v_scale = nullptr;
  int64_t vs_stride[3] = {};
  // Learned per-head sink logits ((num_heads,) float32, element stride), in
  // the units of the scaled scores; nullptr: none.
  const float* sink_logits = nullptr;
  int64_t sink_stride = 0;

  // Paged layout (block_table != nullptr; csrc/ops/paged.h): k and v are
  // pages (num_blocks, block_size, num_kv_heads, head_dim) and k_stride /
  // v_stride hold {page, head, slot in page, element}; slot j of row b is
  // slot j % block_size of page block_table[b, j / block_size]. Scales are
  // (num_blocks, block_size, num_kv_heads), ks_stride / vs_stride {page,
  // head, slot in page}. Every entry a visible slot needs was checked to be
  // in [0, num_blocks) (CPU; CUDA checks on the device).
  const int32_t* block_table = nullptr;
  int64_t bt_stride[2] = {};
  int64_t block_size = 0;
  int64_t num_blocks = 0;
  // Varlen queries (host_q_start != nullptr): row b's queries are tokens
  // [host_q_start[b], host_q_start[b + 1]) of q (total_q, num_heads,
  // head_dim), q_stride and out_stride {0, head, token, element}; `seq` is
  // the largest of them. On CUDA cu_seqlens_q holds the same offsets.
  const int64_t* host_q_start = nullptr;
  const int32_t* cu_seqlens_q = nullptr;
  int64_t cu_stride = 1;  // cu_seqlens_q's element stride

  // Row b's number of queries and the token of its first query.
  int64_t seq_of(int64_t b) const {
    return host_q_start != nullptr ? host_q_start[b + 1] - host_q_start[b] : seq;
  }
  int64_t first_token(int64_t b) const {
    return host_q_start != nullptr ? host_q_start[b] : 0;
  }
};

using AttendFn = void (*)(const AttendParams&);
extern DeviceStub<AttendFn> attend_stub;

// Checked lengths and kv_start, one entry per row (empty when the values
// are not known on the host: device tensors, or tracing).
struct AttendRows {
  std::vector<int64_t> lengths;
  std::vector<int64_t> kv_start;
};

// The options every attend takes: scale finite and > 0 in float32, window
// >= 0, softcap 0 or finite > 0, and scores that stay finite in float32 for
// query and key elements of magnitude up to 1 (see the file comment).
// Raises ValueError naming the argument.
KVCACHE_API void check_attend_options(std::optional<double> scale, int64_t window,
                                      double softcap, int64_t head_dim);

// sink_logits: dense float32 (num_heads,) on `dev`.
KVCACHE_API void check_sink_logits(const at::Tensor& sink_logits,
                                   const c10::SymInt& heads, const at::Device& dev);

KVCACHE_API AttendRows check_attend(const at::Tensor& q, const at::Tensor& keys,
                        const at::Tensor& values, const at::Tensor& lengths,
                        const std::optional<at::Tensor>& kv_start,
                        std::optional<double> scale, int64_t window,
                        double softcap, bool values_known,
                        const std::optional<at::Tensor>& positions = std::nullopt,
                        int64_t sinks = 0,
                        const std::optional<at::Tensor>& k_scale = std::nullopt,
                        const std::optional<at::Tensor>& v_scale = std::nullopt,
                        const std::optional<at::Tensor>& sink_logits = std::nullopt);

// The parameters of attend's stubs, after check_attend, for q and the output
// `out` the entry allocated. `rows` is check_attend's answer and must outlive
// the parameters (the CPU kernel reads the host lengths from it; empty, the
// kernels read lengths and kv_start on the device). Exported for the emulated
// CUDA tests (tests/cpp/test_attend_cuda_emulated.cpp).
KVCACHE_API AttendParams attend_params(
    const at::Tensor& q, const at::Tensor& out, const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& lengths, const std::optional<at::Tensor>& kv_start,
    std::optional<double> scale, int64_t window, double softcap,
    const std::optional<at::Tensor>& positions, int64_t sinks,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
    const std::optional<at::Tensor>& sink_logits, const AttendRows& rows);

// The checks with the schema's arguments, as a fake kernel runs them.
inline void trace_check_attend(const at::Tensor& q, const at::Tensor& keys,
                               const at::Tensor& values,
                               const at::Tensor& lengths,
                               const std::optional<at::Tensor>& kv_start,
                               std::optional<double> scale, int64_t window,
                               double softcap,
                               const std::optional<at::Tensor>& positions,
                               int64_t sinks,
                               const std::optional<at::Tensor>& k_scale,
                               const std::optional<at::Tensor>& v_scale,
                               const std::optional<at::Tensor>& sink_logits) {
  check_attend(q, keys, values, lengths, kv_start, scale, window, softcap,
               false, positions, sinks, k_scale, v_scale, sink_logits);
}

}  // namespace detail

// Operator entry points (registered in csrc/schema.cpp).
namespace ops {

at::Tensor attend(const at::Tensor& q, const at::Tensor& keys,
                  const at::Tensor& values, const at::Tensor& lengths,
                  const std::optional<at::Tensor>& kv_start,
                  std::optional<double> scale, int64_t window, double softcap,
                  const std::optional<at::Tensor>& positions, int64_t sinks,
                  const std::optional<at::Tensor>& k_scale,
                  const std::optional<at::Tensor>& v_scale,
                  const std::optional<at::Tensor>& sink_logits);

}  // namespace ops
}  // namespace kvcache
