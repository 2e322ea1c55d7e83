// CPU work of rollback, select_rows_ and reset_rows (see csrc/ops/rows.h).
#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "../ops/rows.h"
#include "copy_block.h"

namespace kvcache {
namespace {

using detail::ResetRowsParams;
using detail::RollbackParams;
using detail::SelectRowsParams;

void rollback_cpu(const RollbackParams& p) {
  for (int64_t b = 0; b < p.rows; ++b) {
    detail::write_row(p.out, b, p.host_new_lengths[b]);
  }
}

// The checks computed the new lengths (every index checked first).
void reset_rows_cpu(const ResetRowsParams& p) {
  for (int64_t b = 0; b < p.batch; ++b) {
    detail::write_row(p.out, b, p.host_new_lengths[b]);
  }
}

// Rows whose index is not their own take a copy of the filled slots of
// their source: O(filled slots moved), never O(capacity). A row can be the
// source of others and a destination itself, so it is written only once no
// pending row still reads it (index is a function on rows: its moved rows
// form trees that hang off cycles). Trees need no staging at all; each cycle
// (a swap, a rotation) stages one row in a scratch and reads that copy at
// its end. So a selection moves each moved row once plus one row per cycle,
// with scratch for one row (a permutation of pairs: 1.5x the moved bytes,
// where gather-all-then-scatter moved 2x and zeroed a scratch of them all).
void select_rows_cpu(const SelectRowsParams& p) {
  const int64_t row_bytes = p.head_dim * p.elem;
  const int64_t* index = p.host_index;
  const int64_t* len = p.host_lengths;
  std::vector<int64_t> readers(static_cast<size_t>(p.batch), 0);
  int64_t pending = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    if (index[b] != b) {
      ++readers[index[b]];
      ++pending;
    }
  }
  if (pending > 0 && row_bytes > 0) {
    // The stage holds one moved row's filled slots: (buffer, head, slot,
    // head_dim), dense. Allocated (not touched) before anything is written,
    // so running out of memory cannot leave a half-done selection.
    int64_t most = 0;
    for (int64_t b = 0; b < p.batch; ++b) {
      if (index[b] != b) most = std::max(most, len[b]);
    }
    std::unique_ptr<char[]> stage(
        new char[static_cast<size_t>(std::max<int64_t>(1, 2 * p.num_kv_heads * most * row_bytes))]);
    int64_t staged = -1;
    // Copies `slots` filled slots of one row, keys and values: from row src
    // (src < 0: from the stage) to row dst (dst < 0: into the stage).
    auto move = [&](int64_t dst, int64_t src, int64_t slots) {
      char* tmp = stage.get();
      for (int w = 0; w < 2; ++w) {
        const detail::DstRows& buf = p.buf[w];
        for (int64_t h = 0; h < p.num_kv_heads; ++h, tmp += slots * row_bytes) {
          char* row0 = buf.data + h * buf.stride[1];
          if (dst < 0) {
            cpu::copy_block(tmp, row_bytes, p.elem, row0 + src * buf.stride[0],
                            buf.stride[2], buf.stride[3], slots, p.head_dim, p.elem);
          } else if (src < 0) {
            cpu::copy_block(row0 + dst * buf.stride[0], buf.stride[2],
                            buf.stride[3], tmp, row_bytes, p.elem, slots,
                            p.head_dim, p.elem);
          } else {
            cpu::copy_block(row0 + dst * buf.stride[0], buf.stride[2],
                            buf.stride[3], row0 + src * buf.stride[0],
                            buf.stride[2], buf.stride[3], slots, p.head_dim,
                            p.elem);
          }
        }
      }
    };
    std::vector<char> done(static_cast<size_t>(p.batch), 0);
    std::vector<int64_t> ready;
    for (int64_t b = 0; b < p.batch; ++b) {
      if (index[b] != b && readers[b] == 0) ready.push_back(b);
    }
    int64_t next_cycle = 0;  // scan position for rows left on cycles
    while (pending > 0) {
      while (!ready.empty()) {
        const int64_t b = ready.back();
        ready.pop_back();
        const int64_t src = index[b];
        move(b, src == staged ? -1 : src, len[src]);
        done[b] = 1;
        --pending;
        if (src == staged) {
          staged = -1;  // a cycle's staged row has exactly one pending reader
        } else if (--readers[src] == 0 && index[src] != src && !done[src]) {
          ready.push_back(src);
        }
      }
      if (pending == 0) break;
      // Every pending row is now on a cycle: stage one and free it.
      while (index[next_cycle] == next_cycle || done[next_cycle]) ++next_cycle;
      const int64_t b = next_cycle;
      move(-1, b, len[b]);
      staged = b;
      readers[b] = 0;
      ready.push_back(b);
    }
  }
  // A 0-D lengths (every row the same) is unchanged by any selection (also
  // with batch 0, where there are no checked rows to read).
  const bool per_row = p.out.stride != 0 || p.out.numel > 1;
  for (int64_t b = 0; b < p.out.numel; ++b) {
    detail::write_row(p.out, b,
                      per_row ? p.host_lengths[p.host_index[b]]
                              : detail::read_row(p.lengths, 0));
  }
}

}  // namespace
}  // namespace kvcache

KVCACHE_REGISTER_KERNEL(rollback_stub, cpu, &kvcache::rollback_cpu);
KVCACHE_REGISTER_KERNEL(select_rows_stub, cpu, &kvcache::select_rows_cpu);
KVCACHE_REGISTER_KERNEL(reset_rows_stub, cpu, &kvcache::reset_rows_cpu);
