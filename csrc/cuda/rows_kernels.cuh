// The CUDA kernels of rollback, select_rows_ and reset_rows (see
// csrc/ops/rows.h) and the host code that launches them over a runtime `Rt`
// (see paged_kernels.cuh): rows.cu passes the CUDA one,
// tests/cpp/test_rows_cuda_emulated.cpp the CPU emulator's.
// The operator entries have checked everything the host can see; the values
// of the device tensors (lengths, n, kv_start, index, rows) are checked here, all
// before anything is written: one bad row makes the op write nothing but
// -1 into every entry of the new lengths it returns (the one check that is
// always right: (lengths >= 0).all()). No host sync; every launch can be
// captured in a CUDA graph.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>

#include "../core/rules.h"
#include "../ops/rows.h"
#include "copy.cuh"
#include "launch.cuh"

namespace kvcache {
namespace rows_kernels {

using cuda::CopyPlan;
using detail::IntRows;
using detail::ResetRowsParams;
using detail::RollbackParams;
using detail::SelectRowsParams;

// ----------------------------------------------------------------- rollback

// One block: every row is checked before any entry of `out` is written.
static __global__ void rollback_kernel(const IntRows lengths, const IntRows n,
                                const IntRows kv_start, const IntRows out,
                                int64_t rows) {
  // A 0-D lengths with a (k,) kv_start: the shared length (stride 0) is
  // checked against each of the k first slots; `out` keeps lengths' shape.
  // Every row read exists: check_rollback refuses a kv_start of another
  // shape than lengths', or an empty one with a 0-D lengths (k >= 1).
  const int64_t checks =
      kv_start.data != nullptr && kv_start.numel > rows ? kv_start.numel : rows;
  int bad = 0;
  for (int64_t b = threadIdx.x; b < checks; b += blockDim.x) {
    const int64_t len = detail::read_row(lengths, b);
    const int64_t drop = detail::read_row(n, b);
    const int64_t first =
        kv_start.data != nullptr ? detail::read_row(kv_start, b) : 0;
    // drop > len - first, never len - drop < first: len - first cannot
    // overflow once 0 <= first <= len, a drop near 2^63 could.
    bad |= !detail::rollback_fits(len, first, drop);
  }
  bad = __syncthreads_or(bad);
  for (int64_t b = threadIdx.x; b < rows; b += blockDim.x) {
    detail::write_row(out, b,
                      bad ? detail::kPoisonLength
                          : detail::read_row(lengths, b) -
                                detail::read_row(n, b));
  }
}

template <typename Rt>
void run_rollback(const RollbackParams& p, Rt& rt) {
  if (p.rows <= 0) return;
  const int64_t checks = p.kv_start.data != nullptr && p.kv_start.numel > p.rows
                             ? p.kv_start.numel
                             : p.rows;
  rt.launch(rollback_kernel, dim3(1), dim3(cuda::check_threads(checks)), 0, p.lengths, p.n,
            p.kv_start, p.out, p.rows);
}

// --------------------------------------------------------------- reset_rows

// One block: every index is checked (in [0, batch)) before any entry of
// `out` is written; a bad one makes every entry -1. Then out = lengths, and
// after a barrier the selected rows become 0 (repeated indices are fine).
static __global__ void reset_rows_kernel(const IntRows lengths, const bool* mask,
                                  int64_t mask_stride, const IntRows index,
                                  const IntRows out, int64_t batch) {
  int bad = 0;
  if (mask == nullptr) {
    for (int64_t i = threadIdx.x; i < index.numel; i += blockDim.x) {
      const int64_t r = detail::read_row(index, i);
      bad |= !detail::row_index_fits(r, batch);
    }
  }
  bad = __syncthreads_or(bad);
  for (int64_t b = threadIdx.x; b < batch; b += blockDim.x) {
    const bool hit = mask != nullptr && mask[b * mask_stride];
    detail::write_row(out, b,
                      bad ? detail::kPoisonLength
                      : hit ? 0
                            : detail::read_row(lengths, b));
  }
  if (bad || mask != nullptr) return;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < index.numel; i += blockDim.x) {
    detail::write_row(out, detail::read_row(index, i), 0);
  }
}

template <typename Rt>
void run_reset_rows(const ResetRowsParams& p, Rt& rt) {
  if (p.batch <= 0) return;
  const int64_t n = p.index.numel > p.batch ? p.index.numel : p.batch;
  rt.launch(reset_rows_kernel, dim3(1), dim3(cuda::check_threads(n)), 0, p.lengths, p.mask,
            p.mask_stride, p.index, p.out, p.batch);
}

// ------------------------------------------------------------- select_rows_
//
// Row b takes row index[b]'s filled slots and length. A row can be the
// source of other rows and be overwritten itself, so the moved rows' slots
// are first gathered into a scratch buffer, then scattered: three kinds of
// launch, in stream order.
//  1. plan (one block): checks every index (in [0, batch)) and every row's
//     length (in [0, max_len]; rows 0..batch-1, as the CPU checks: a 0-D
//     lengths is every row's); writes plan[b] = the length row b will have
//     (lengths[index[b]]), or -1 for every row if anything is bad, and the
//     op's new lengths (per-row: plan; 0-D: unchanged) or -1. With batch 0
//     nothing is checked and a 0-D lengths comes back as it is (the CPU's
//     answer too).
//  2. gather: for each row b with index[b] != b, slots [t0, t0 + chunk) of
//     its source row (those below plan[b]) -> scratch.
//  3. scatter: scratch -> row b.
// The scratch holds `chunk` slots of every (buffer, row, head), sized from
// the buffers' shapes (never from device values); when the buffers are
// larger than kScratchBytes, the slots go through it in several rounds
// (slot t of a row only ever moves to slot t, so rounds are independent),
// never more than kMaxRounds.

constexpr int64_t kScratchBytes = int64_t{512} << 20;
constexpr int64_t kMaxRounds = 16;

static __global__ void select_plan_kernel(const IntRows lengths, const IntRows index,
                                   const IntRows out, int64_t batch,
                                   int64_t max_len, int64_t* plan) {
  int bad = 0;
  for (int64_t b = threadIdx.x; b < batch; b += blockDim.x) {
    const int64_t len = detail::read_row(lengths, b);  // 0-D: stride 0
    bad |= !detail::length_fits(len, max_len);
    const int64_t src = detail::read_row(index, b);
    bad |= !detail::row_index_fits(src, batch);
  }
  bad = __syncthreads_or(bad);
  for (int64_t b = threadIdx.x; b < batch; b += blockDim.x) {
    plan[b] = bad ? detail::kPoisonLength
                  : detail::read_row(lengths, detail::read_row(index, b));
  }
  // out has lengths' shape: per row, the plan; 0-D, the shared length.
  const bool per_row = out.stride != 0 || out.numel > 1;
  for (int64_t b = threadIdx.x; b < out.numel; b += blockDim.x) {
    detail::write_row(out, b,
                      bad ? detail::kPoisonLength
                      : per_row ? detail::read_row(lengths, detail::read_row(index, b))
                                : detail::read_row(lengths, 0));
  }
}

struct MoveArgs {
  CopyPlan pair[2];  // keys, values: gather (buffer -> scratch) or scatter
  unsigned slabs;    // batch * heads
  unsigned heads;
  IntRows index;
  const int64_t* plan;
  int64_t t0;      // first slot of this round
  int64_t chunk;   // slots per round
  bool gather;     // true: read row index[b] of the buffer; false: write row b
};

static __global__ void select_move_kernel(const MoveArgs a) {
  const unsigned slab = blockIdx.x;
  const unsigned which = slab >= a.slabs ? 1u : 0u;
  const unsigned bh = slab - which * a.slabs;
  const unsigned b = bh / a.heads;
  const unsigned h = bh - b * a.heads;
  const int64_t len = a.plan[b];  // -1 if anything was bad
  if (len <= a.t0) return;
  const int64_t src = detail::read_row(a.index, b);  // checked by the plan
  if (src == static_cast<int64_t>(b)) return;  // stays in place
  int64_t rows = len - a.t0;
  if (rows > a.chunk) rows = a.chunk;
  const CopyPlan p = which ? a.pair[1] : a.pair[0];
  // Gather: buffer (row src, slots t0..) -> scratch (row b, slots 0..);
  // scatter: scratch (row b) -> buffer (row b, slots t0..).
  const int64_t buf_row = a.gather ? src : static_cast<int64_t>(b);
  char* dst;
  const char* from;
  if (a.gather) {
    dst = p.dst.data + b * p.dst.stride[0] + h * p.dst.stride[1];
    from = p.src.data + buf_row * p.src.stride[0] + h * p.src.stride[1] +
           a.t0 * p.src.stride[2];
  } else {
    dst = p.dst.data + buf_row * p.dst.stride[0] + h * p.dst.stride[1] +
          a.t0 * p.dst.stride[2];
    from = p.src.data + b * p.src.stride[0] + h * p.src.stride[1];
  }
  cuda::copy_rows_planned(p, dst, from, rows);
}

template <typename Rt>
void run_select_rows(const SelectRowsParams& p, Rt& rt) {
  if (p.batch <= 0 && p.out.numel <= 0) return;  // nothing to write
  if (p.batch <= 0) {
    // No row, but a 0-D lengths to return (out was allocated, not
    // written): the plan kernel copies it (it reads no row and writes no
    // plan entry, so it needs no scratch).
    rt.launch(select_plan_kernel, dim3(1), dim3(cuda::check_threads(p.out.numel)), 0, p.lengths,
              p.index, p.out, int64_t{0}, p.max_len, static_cast<int64_t*>(nullptr));
    return;
  }

  const int64_t slabs = p.batch * p.num_kv_heads;
  const int64_t row_bytes = p.head_dim * p.elem;
  const bool move = slabs > 0 && row_bytes > 0 && p.max_len > 0;
  // Rounds of `chunk` slots through a scratch of about kScratchBytes.
  int64_t chunk = 0;
  int64_t rounds = 0;
  if (move) {
    cuda::check_copy_slabs(slabs);  // before any launch: nothing written
    const int64_t per_slot = 2 * slabs * row_bytes;  // no overflow: < buffers' bytes
    chunk = kScratchBytes / per_slot;
    // At most kMaxRounds rounds (launch count), even if the scratch must
    // then exceed kScratchBytes (a 1/kMaxRounds share of the buffers).
    const int64_t fewest = (p.max_len + kMaxRounds - 1) / kMaxRounds;
    if (chunk < fewest) chunk = fewest;
    if (chunk < 1) chunk = 1;
    if (chunk > p.max_len) chunk = p.max_len;
    rounds = (p.max_len + chunk - 1) / chunk;
  }
  // One allocation: plan (int64 per row), then the slots (16-byte aligned).
  const int64_t plan_bytes = ((p.batch * 8 + 255) / 256) * 256;
  const int64_t data_bytes = move ? 2 * slabs * chunk * row_bytes : 0;
  // Stream-ordered device memory (graph-safe), freed when the runtime goes.
  void* scratch = rt.scratch(static_cast<size_t>(plan_bytes + data_bytes));
  auto* plan = static_cast<int64_t*>(scratch);
  char* slots = static_cast<char*>(scratch) + plan_bytes;

  const int64_t n = p.batch > p.out.numel ? p.batch : p.out.numel;
  rt.launch(select_plan_kernel, dim3(1), dim3(cuda::check_threads(n)), 0, p.lengths, p.index,
            p.out, p.batch, p.max_len, plan);
  if (!move) return;

  // Scratch: dense (buffer, row, head, slot, element).
  const int64_t scr_stride[4] = {p.num_kv_heads * chunk * row_bytes, chunk * row_bytes,
                                 row_bytes, p.elem};
  const int64_t scr_size[4] = {p.batch, p.num_kv_heads, chunk, p.head_dim};
  const int64_t buf_size[4] = {p.batch, p.num_kv_heads, p.max_len, p.head_dim};
  MoveArgs gather, scatter;
  for (int w = 0; w < 2; ++w) {
    char* scr = slots + w * p.batch * scr_stride[0];
    gather.pair[w] = cuda::plan_copy(scr, scr_stride, scr_size, p.buf[w].data,
                                     p.buf[w].stride, buf_size, p.head_dim,
                                     p.elem);
    scatter.pair[w] = cuda::plan_copy(p.buf[w].data, p.buf[w].stride, buf_size,
                                      scr, scr_stride, scr_size, p.head_dim,
                                      p.elem);
  }
  for (MoveArgs* m : {&gather, &scatter}) {
    m->slabs = static_cast<unsigned>(slabs);
    m->heads = static_cast<unsigned>(p.num_kv_heads);
    m->index = p.index;
    m->plan = plan;
    m->chunk = chunk;
  }
  gather.gather = true;
  scatter.gather = false;
  const int64_t units = gather.pair[0].units > gather.pair[1].units
                            ? gather.pair[0].units
                            : gather.pair[1].units;
  const cuda::CopyBlock block = cuda::copy_block_shape(units, chunk);
  const dim3 grid(static_cast<unsigned>(2 * slabs), cuda::copy_grid_y(chunk, block));
  for (int64_t r = 0; r < rounds; ++r) {
    gather.t0 = scatter.t0 = r * chunk;
    rt.launch(select_move_kernel, grid, dim3(block.x, block.y), 0, gather);
    rt.launch(select_move_kernel, grid, dim3(block.x, block.y), 0, scatter);
  }
}

}  // namespace rows_kernels
}  // namespace kvcache
