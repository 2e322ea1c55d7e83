// The slot-mapped write of the CPU kernels: one core for every write that
// puts token t of the new data at a slot chosen per token (vLLM's
// slot_mapping, -1: the token is not written):
//
//   ring_update_ (csrc/cpu/ring.cpp)   position p of row b at slot
//       ring_slot(p) of that row; positions the ring does not keep skipped;
//   paged_write_ (csrc/cpu/paged.cpp)  token t at slot slot_mapping[t] of
//       the pages (page s / block_size, offset s % block_size), -1 skipped.
//
// A layout turns its slot mapping into runs: consecutive tokens written to
// consecutive slots whose memory is one stride apart (a ring row's slots up
// to the end of the row, a page's up to the end of the page). The ring's
// runs come in closed form (at most three per row); a page's from reading
// slot_mapping and joining neighbours. The core then writes every run of
// both buffers (keys, values) in one of two formats:
//
//   plain      a copy (copy_run: one memcpy when tokens and heads are one
//              dense block on both sides, else one per dense row);
//   quantized  each (token, head) slot quantized by quantize_slab (the
//              quantizer of every CPU quantized write, formats in
//              core/quant.h), its float32 scale beside it.
//
// Invariants the callers guarantee (their operators' checks ran before
// anything is written): every slot is in range and written at most once,
// and no destination byte overlaps a source byte, so runs are independent
// and big writes are split over threads by run.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "../core/quant.h"
#include "copy_block.h"
#include "helpers.h"
#include "quantize_slab.h"

namespace kvcache {
namespace cpu {

// One run: n tokens of the new data written to n consecutive slots.
struct SlotRun {
  const char* src[2] = {nullptr, nullptr};  // keys / values: first token, head 0
  char* dst[2] = {nullptr, nullptr};        // keys / values: first slot, head 0
  float* scale[2] = {nullptr, nullptr};     // its scales (quantized writes)
  int64_t n = 0;
};

// The geometry and format shared by every run of one call.
struct SlotWrite {
  // Byte strides of keys (0) and values (1) between consecutive tokens of a
  // run, heads of a token and elements of a head.
  int64_t src_token[2] = {}, src_head[2] = {}, src_elem[2] = {};
  int64_t dst_token[2] = {}, dst_head[2] = {}, dst_elem[2] = {};
  // Element strides of the scales between consecutive slots and heads.
  int64_t scale_token[2] = {}, scale_head[2] = {};
  int64_t heads = 0;
  int64_t head_dim = 0;
  int64_t elem = 0;  // bytes per source element (a plain write: per cache element too)
  detail::KvFormat format = detail::KvFormat::kPlain;
  detail::FloatDtype source = detail::FloatDtype::kFloat32;  // quantized writes: the new data's dtype
};

// Copies n tokens x heads x head_dim between byte-strided blocks, in the
// loop order that makes the fewest, longest memcpys.
inline void copy_run(const SlotWrite& w, int b, const SlotRun& r) {
  const int64_t dt = w.dst_token[b], dh = w.dst_head[b], de = w.dst_elem[b];
  const int64_t st = w.src_token[b], sh = w.src_head[b], se = w.src_elem[b];
  if (dt == w.heads * dh && st == w.heads * sh) {
    // Tokens and heads step as one row dimension on both sides (pages with
    // (token, head, dim) new data): one block of n * heads rows.
    copy_block(r.dst[b], dh, de, r.src[b], sh, se, r.n * w.heads, w.head_dim, w.elem);
    return;
  }
  const int64_t row = w.head_dim * w.elem;
  if ((dt == row && st == row) || !(dh == row && sh == row)) {
    // Tokens dense (a ring row's slots), or neither: head by head.
    for (int64_t h = 0; h < w.heads; ++h) {
      copy_block(r.dst[b] + h * dh, dt, de, r.src[b] + h * sh, st, se, r.n, w.head_dim, w.elem);
    }
  } else {
    // Heads dense: token by token.
    for (int64_t t = 0; t < r.n; ++t) {
      copy_block(r.dst[b] + t * dt, dh, de, r.src[b] + t * st, sh, se, w.heads, w.head_dim,
                 w.elem);
    }
  }
}

template <typename T, detail::KvFormat F>
void quantize_run(const SlotWrite& w, int b, const SlotRun& r, float* row) {
  for (int64_t h = 0; h < w.heads; ++h) {
    quantize_slab<T, F>(r.src[b] + h * w.src_head[b], w.src_token[b], w.src_elem[b],
                        r.dst[b] + h * w.dst_head[b], w.dst_token[b], w.dst_elem[b],
                        r.scale[b] + h * w.scale_head[b], w.scale_token[b], r.n, w.head_dim, row);
  }
}

template <typename T>
void quantize_run_as(const SlotWrite& w, int b, const SlotRun& r, float* row) {
  if (w.format == detail::KvFormat::kInt8) {
    quantize_run<T, detail::KvFormat::kInt8>(w, b, r, row);
  } else {
    quantize_run<T, detail::KvFormat::kFp8>(w, b, r, row);
  }
}

// Writes buffer b (0: keys, 1: values) of one run. `row`: head_dim floats.
inline void write_run(const SlotWrite& w, int b, const SlotRun& r, float* row) {
  if (r.n <= 0 || w.heads <= 0 || w.head_dim <= 0) return;
  if (w.format == detail::KvFormat::kPlain) {
    copy_run(w, b, r);
    return;
  }
  switch (w.source) {
    case detail::FloatDtype::kBFloat16: quantize_run_as<c10::BFloat16>(w, b, r, row); break;
    case detail::FloatDtype::kFloat16: quantize_run_as<c10::Half>(w, b, r, row); break;
    case detail::FloatDtype::kFloat32: quantize_run_as<float>(w, b, r, row); break;
  }
}

// Bytes read before a write is split over threads, and per task (a
// parallel region costs more than a small write: decode steps stay serial).
constexpr int64_t kSlotParallelBytes = int64_t{1} << 20;
constexpr int64_t kSlotGrainBytes = int64_t{256} << 10;

// Writes every run of both buffers. Big writes: runs cut into pieces of
// about kSlotGrainBytes (a piece of a run is a run), then (piece, buffer)
// tasks over threads.
inline void write_slot_runs(const SlotWrite& w, std::vector<SlotRun> runs) {
  const int64_t token_bytes = w.heads * w.head_dim * w.elem;  // per buffer
  int64_t tokens = 0;
  for (const SlotRun& r : runs) tokens += r.n;
  if (2 * tokens * token_bytes < kSlotParallelBytes) {
    std::vector<float> row(static_cast<size_t>(std::max<int64_t>(w.head_dim, 0)));
    for (const SlotRun& r : runs) {
      for (int b = 0; b < 2; ++b) write_run(w, b, r, row.data());
    }
    return;
  }
  const int64_t piece = std::max<int64_t>(1, kSlotGrainBytes / std::max<int64_t>(1, token_bytes));
  std::vector<SlotRun> pieces;
  for (const SlotRun& r : runs) {
    for (int64_t i = 0; i < r.n; i += piece) {
      SlotRun p;
      for (int b = 0; b < 2; ++b) {
        p.src[b] = r.src[b] + i * w.src_token[b];
        p.dst[b] = r.dst[b] + i * w.dst_token[b];
        p.scale[b] = r.scale[b] == nullptr ? nullptr : r.scale[b] + i * w.scale_token[b];
      }
      p.n = std::min(piece, r.n - i);
      pieces.push_back(p);
    }
  }
  const int64_t tasks = 2 * static_cast<int64_t>(pieces.size());
  for_each_task(tasks, [&](int64_t i) {
    std::vector<float> row(static_cast<size_t>(w.head_dim));
    write_run(w, static_cast<int>(i % 2), pieces[static_cast<size_t>(i / 2)], row.data());
  });
}

}  // namespace cpu
}  // namespace kvcache
