// CPU work of rollback and select_rows_ (see csrc/ops/rows.h).
#include <cstdint>
#include <vector>

#include "../ops/rows.h"
#include "copy_block.h"

namespace kvcache {
namespace {

using detail::RollbackParams;
using detail::SelectRowsParams;

void rollback_cpu(const RollbackParams& p) {
  for (int64_t b = 0; b < p.rows; ++b) {
    detail::write_row(p.out, b, p.host_new_lengths[b]);
  }
}

// Rows whose index is not their own take a copy of the filled slots of
// their source, gathered first (a row may be the source of another row and
// be overwritten itself): O(filled slots moved), never O(capacity).
void select_rows_cpu(const SelectRowsParams& p) {
  const int64_t row_bytes = p.head_dim * p.elem;
  std::vector<int64_t> moved;
  int64_t total = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    if (p.host_index[b] != b) {
      moved.push_back(b);
      total += p.host_lengths[p.host_index[b]];
    }
  }
  if (!moved.empty() && row_bytes > 0) {
    // Dense scratch: (buffer, moved row, head, slot, head_dim).
    std::vector<char> scratch(static_cast<size_t>(2 * total * p.heads * row_bytes));
    for (int pass = 0; pass < 2; ++pass) {  // 0: gather, 1: scatter
      char* tmp = scratch.data();
      for (int w = 0; w < 2; ++w) {
        const detail::DstRows& buf = p.buf[w];
        for (int64_t b : moved) {
          const int64_t src = p.host_index[b];
          const int64_t len = p.host_lengths[src];
          for (int64_t h = 0; h < p.heads; ++h) {
            char* row0 = buf.data + h * buf.stride[1];
            if (pass == 0) {
              cpu::copy_block(tmp, row_bytes, p.elem, row0 + src * buf.stride[0],
                              buf.stride[2], buf.stride[3], len, p.head_dim, p.elem);
            } else {
              cpu::copy_block(row0 + b * buf.stride[0], buf.stride[2],
                              buf.stride[3], tmp, row_bytes, p.elem, len,
                              p.head_dim, p.elem);
            }
            tmp += len * row_bytes;
          }
        }
      }
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
