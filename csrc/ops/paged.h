// Paged caches: keys and values in pages of block_size slots, found through
// a block table, for many sequences that join and leave (continuous
// batching). The memory is vLLM's flash layout and transformers'
// PagedAttentionCache tensor viewed as pages, so either is read and written
// in place:
//
//   key_pages, value_pages  (num_blocks, block_size, num_kv_heads, head_dim)
//   key_scales, value_scales (num_blocks, block_size, num_kv_heads) float32,
//                           for int8 / float8_e4m3fn pages (core/quant.h)
//   slot s = block * block_size + offset: page s / block_size, slot
//            s % block_size of it
//
// paged_write_: token t of key / value (num_tokens, num_kv_heads, head_dim)
// goes to slot slot_mapping[t] of the pages; -1 skips the token (vLLM's
// reshape_and_cache_flash). Quantized pages are quantized on write, with
// their scales. Every slot is checked first: a slot outside [-1,
// num_blocks * block_size) or a slot given twice raises ValueError and
// nothing is written (on CUDA a bad slot_mapping writes nothing; the values
// are not known on the host there).
//
// paged_attend: q (total_q, num_heads, head_dim) holds the queries of
// num_seqs sequences back to back, sequence s's at tokens [cu_seqlens_q[s],
// cu_seqlens_q[s + 1]). Its context_lens[s] tokens (this step's included)
// are at positions [0, context_lens[s]), position j in slot j % block_size
// of page block_table[s, j / block_size]. Its queries are its last tokens
// (flash's causal alignment): query i sits at position context_lens[s] -
// q_len + i and sees positions (pos - window, pos] (window 0: [0, pos]).
// Prefill, decode and mixed batches are one call. Returns (total_q,
// num_heads, head_dim) in q's dtype. q may end with padding: rows
// [cu_seqlens_q[num_seqs], total_q) belong to no sequence and are returned as
// 0 (a batch padded to a fixed size for a compiled or CUDA-graph step, as
// transformers' continuous batching pads its steps then). Only the pages
// of visible positions are read: their table entries must be in [0,
// num_blocks); entries of other blocks (past the context, or freed out of a
// sliding window) may be -1.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "../core/device_stub.h"
#include "../core/quant.h"
#include "kvcache/export.h"
#include "attend.h"

namespace kvcache {
namespace detail {

struct PagedWriteParams {
  // Byte strides. src: (num_tokens, num_kv_heads, head_dim); pages:
  // (num_blocks, block_size, num_kv_heads, head_dim).
  const char* k_src = nullptr;
  const char* v_src = nullptr;
  int64_t k_src_stride[3] = {};
  int64_t v_src_stride[3] = {};
  char* k_pages = nullptr;
  char* v_pages = nullptr;
  int64_t k_page_stride[4] = {};
  int64_t v_page_stride[4] = {};
  // Quantized pages: scales (num_blocks, block_size, num_kv_heads), element
  // strides.
  KvFormat format = KvFormat::kPlain;
  float* k_scale = nullptr;
  float* v_scale = nullptr;
  int64_t ks_stride[3] = {};
  int64_t vs_stride[3] = {};
  FloatDtype src_dtype = FloatDtype::kFloat32;  // quantized pages: the source's
  int64_t elem_size = 0;  // of the pages (plain: of the source too)
  IntRows slots;          // (num_tokens,) int32/int64, on the device
  int64_t num_tokens = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t block_size = 0;
  int64_t num_blocks = 0;
  int device_index = -1;
};

using PagedWriteFn = void (*)(const PagedWriteParams&);
extern DeviceStub<PagedWriteFn> paged_write_stub;
// The CPU kernel is attend's (AttendParams::block_table, host_q_start).
extern DeviceStub<AttendFn> paged_attend_stub;

// Checks of paged_write_ (see the file comment). values_known: read the
// slots (CPU eager) and refuse bad ones.
KVCACHE_API void check_paged_write(const at::Tensor& key_pages, const at::Tensor& value_pages,
                                   const at::Tensor& key, const at::Tensor& value,
                                   const at::Tensor& slot_mapping,
                                   const std::optional<at::Tensor>& key_scales,
                                   const std::optional<at::Tensor>& value_scales,
                                   bool values_known);

// The host values paged_attend's CPU kernel reads (empty when unknown).
struct PagedRows {
  std::vector<int64_t> context_lens;
  std::vector<int64_t> q_start;  // num_seqs + 1
  int64_t max_q = 0;
};

KVCACHE_API PagedRows check_paged_attend(
    const at::Tensor& q, const at::Tensor& key_pages, const at::Tensor& value_pages,
    const at::Tensor& block_table, const at::Tensor& context_lens,
    const at::Tensor& cu_seqlens_q, std::optional<double> scale, int64_t window,
    double softcap, const std::optional<at::Tensor>& key_scales,
    const std::optional<at::Tensor>& value_scales,
    const std::optional<at::Tensor>& sink_logits, bool values_known);

// The parameters of paged_write_'s stubs (pointers into the tensors, byte
// strides), after check_paged_write. Exported for the emulated CUDA tests
// (tests/cpp/test_paged_cuda_emulated.cpp), which run the CUDA stub's code on
// them.
KVCACHE_API PagedWriteParams paged_write_params(const at::Tensor& key_pages,
                                                const at::Tensor& value_pages,
                                                const at::Tensor& key, const at::Tensor& value,
                                                const at::Tensor& slot_mapping,
                                                const std::optional<at::Tensor>& key_scales,
                                                const std::optional<at::Tensor>& value_scales);

// The parameters of paged_attend's stubs, after check_paged_attend, for q
// and the output `out` the entry allocated. `rows` is check_paged_attend's
// answer and must outlive the parameters: with host values (CPU) the CPU
// kernel's per-sequence rows point into it and seq is the longest query
// run; empty (values on the device, CUDA) seq is q.size(0) and the kernel
// reads cu_seqlens_q and context_lens itself.
KVCACHE_API AttendParams paged_attend_params(
    const at::Tensor& q, const at::Tensor& out, const at::Tensor& key_pages,
    const at::Tensor& value_pages, const at::Tensor& block_table,
    const at::Tensor& context_lens, const at::Tensor& cu_seqlens_q, std::optional<double> scale,
    int64_t window, double softcap, const std::optional<at::Tensor>& key_scales,
    const std::optional<at::Tensor>& value_scales, const std::optional<at::Tensor>& sink_logits,
    const PagedRows& rows);

inline void trace_check_paged_write_(const at::Tensor& key_pages, const at::Tensor& value_pages,
                                     const at::Tensor& key, const at::Tensor& value,
                                     const at::Tensor& slot_mapping,
                                     const std::optional<at::Tensor>& key_scales,
                                     const std::optional<at::Tensor>& value_scales) {
  check_paged_write(key_pages, value_pages, key, value, slot_mapping, key_scales, value_scales,
                    false);
}

inline void trace_check_paged_attend(
    const at::Tensor& q, const at::Tensor& key_pages, const at::Tensor& value_pages,
    const at::Tensor& block_table, const at::Tensor& context_lens,
    const at::Tensor& cu_seqlens_q, std::optional<double> scale, int64_t window,
    double softcap, const std::optional<at::Tensor>& key_scales,
    const std::optional<at::Tensor>& value_scales,
    const std::optional<at::Tensor>& sink_logits) {
  check_paged_attend(q, key_pages, value_pages, block_table, context_lens, cu_seqlens_q, scale,
                     window, softcap, key_scales, value_scales, sink_logits, false);
}

}  // namespace detail

namespace ops {

void paged_write_(const at::Tensor& key_pages, const at::Tensor& value_pages,
                  const at::Tensor& key, const at::Tensor& value, const at::Tensor& slot_mapping,
                  const std::optional<at::Tensor>& key_scales,
                  const std::optional<at::Tensor>& value_scales);

at::Tensor paged_attend(const at::Tensor& q, const at::Tensor& key_pages,
                        const at::Tensor& value_pages, const at::Tensor& block_table,
                        const at::Tensor& context_lens, const at::Tensor& cu_seqlens_q,
                        std::optional<double> scale, int64_t window, double softcap,
                        const std::optional<at::Tensor>& key_scales,
                        const std::optional<at::Tensor>& value_scales,
                        const std::optional<at::Tensor>& sink_logits);

}  // namespace ops
}  // namespace kvcache
