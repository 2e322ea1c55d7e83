// The CUDA kernels of rollback, reset_rows and select_rows_, executed on the
// CPU: csrc/cuda/rows_kernels.cuh under cuda_emulator.h, with every device
// value (lengths, n, kv_start, index, mask) left on the "device", so bad
// ones reach the kernels' checks. The parameters are filled as the entries
// (csrc/ops/rows.cpp) fill them. Results against plain ATen indexing,
// under several schedules.
#include "emulated_runtime.h"  // first: the emulator, then the kernels
#include "cuda/rows_kernels.cuh"

#include <ATen/ATen.h>

#include <vector>

#include "catch.h"
#include "core/tensor_params.h"

namespace {

using kvcache::detail::int_rows;
using kvcache::testing::EmulatedRuntime;
using kvcache::testing::kSchedules;
using kvcache::testing::Schedule;
using kvcache::testing::use;

at::Tensor rollback(const at::Tensor& lengths, const at::Tensor& n,
                    const std::optional<at::Tensor>& kv_start) {
  at::Tensor out = at::empty_like(lengths);
  kvcache::detail::RollbackParams p;
  p.lengths = int_rows(lengths);
  p.n = int_rows(n);
  if (kv_start.has_value()) p.kv_start = int_rows(*kv_start);
  p.out = int_rows(out);
  p.rows = lengths.numel();
  EmulatedRuntime rt;
  kvcache::rows_kernels::run_rollback(p, rt);
  return out;
}

at::Tensor reset_rows(const at::Tensor& lengths, const at::Tensor& rows) {
  at::Tensor out = at::empty_like(lengths);
  kvcache::detail::ResetRowsParams p;
  p.lengths = int_rows(lengths);
  if (rows.scalar_type() == at::kBool) {
    p.mask = rows.const_data_ptr<bool>();
    p.mask_stride = rows.stride(0);
  } else {
    p.index = int_rows(rows);
  }
  p.out = int_rows(out);
  p.batch = lengths.size(0);
  EmulatedRuntime rt;
  kvcache::rows_kernels::run_reset_rows(p, rt);
  return out;
}

at::Tensor select_rows(at::Tensor& keys, at::Tensor& values, const at::Tensor& lengths,
                       const at::Tensor& index) {
  at::Tensor out = at::empty_like(lengths);
  kvcache::detail::SelectRowsParams p;
  p.buf[0] = kvcache::detail::dst_rows(keys);
  p.buf[1] = kvcache::detail::dst_rows(values);
  p.batch = keys.size(0);
  p.num_kv_heads = keys.size(1);
  p.max_len = keys.size(2);
  p.head_dim = keys.size(3);
  p.elem = static_cast<int64_t>(keys.element_size());
  p.lengths = int_rows(lengths);
  p.index = int_rows(index);
  p.out = int_rows(out);
  EmulatedRuntime rt;
  kvcache::rows_kernels::run_select_rows(p, rt);
  return out;
}

at::Tensor ints(std::vector<int64_t> v, at::ScalarType t = at::kInt) { return at::tensor(v).to(t); }

}  // namespace

TEST_CASE("emulated CUDA rollback: lengths - n, or -1 everywhere for a bad row", "[cuda-emulated]") {
  CHECK(at::equal(rollback(ints({10, 5, 7}), ints({3, 5, 0}), std::nullopt), ints({7, 0, 7})));
  CHECK(at::equal(rollback(ints({10, 5, 7}, at::kLong), ints({3, 5, 0}, at::kLong), ints({2, 0, 7}, at::kLong)),
                  ints({7, 0, 7}, at::kLong)));
  // A drop past the row's length, below its kv_start, or negative.
  CHECK(at::equal(rollback(ints({10, 5, 7}), ints({3, 6, 0}), std::nullopt), ints({-1, -1, -1})));
  CHECK(at::equal(rollback(ints({10, 5, 7}), ints({3, 1, 0}), ints({0, 5, 0})), ints({-1, -1, -1})));
  CHECK(at::equal(rollback(ints({10, 5, 7}), ints({-1, 0, 0}), std::nullopt), ints({-1, -1, -1})));
  // A 0-D length against a per-row kv_start.
  const at::Tensor nine = at::scalar_tensor(9, at::kInt), four = at::scalar_tensor(4, at::kInt);
  CHECK(at::equal(rollback(nine, four, ints({0, 5, 2})), at::scalar_tensor(5, at::kInt)));
  CHECK(at::equal(rollback(nine, four, ints({0, 6, 2})), at::scalar_tensor(-1, at::kInt)));
}

TEST_CASE("emulated CUDA reset_rows: selected rows 0 by mask or index, -1 for a bad index", "[cuda-emulated]") {
  const at::Tensor lengths = ints({4, 9, 2, 7});
  CHECK(at::equal(reset_rows(lengths, at::tensor(std::vector<int64_t>{0, 1, 0, 1}).to(at::kBool)),
                  ints({4, 0, 2, 0})));
  CHECK(at::equal(reset_rows(lengths, ints({3, 0, 3}, at::kLong)), ints({0, 9, 2, 0})));
  CHECK(at::equal(reset_rows(lengths, at::scalar_tensor(2, at::kInt)), ints({4, 9, 0, 7})));
  CHECK(at::equal(reset_rows(lengths, ints({1, 4})), ints({-1, -1, -1, -1})));
  CHECK(at::equal(reset_rows(lengths, ints({-1})), ints({-1, -1, -1, -1})));
}

TEST_CASE("emulated CUDA select_rows_: rows take their source's filled slots, sources overwritten too", "[cuda-emulated]") {
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    INFO("dtype " << dt);
    for (const Schedule& s : kSchedules) {
      use(s);
      at::manual_seed(5);
      at::Tensor keys = at::randn({4, 2, 10, 8}).to(dt), values = at::randn({4, 2, 10, 8}).to(dt);
      const at::Tensor k0 = keys.clone(), v0 = values.clone();
      const at::Tensor lengths = ints({3, 10, 0, 6});
      const at::Tensor index = ints({1, 3, 1, 0}, at::kLong);  // row 1 is a source and overwritten
      const at::Tensor out = select_rows(keys, values, lengths, index);
      CHECK(at::equal(out, ints({10, 6, 10, 3})));
      for (int64_t b = 0; b < 4; ++b) {
        const int64_t src = index[b].item<int64_t>();
        const int64_t len = lengths[src].item<int64_t>();
        // The source's filled slots; slots past them keep the row's old ones.
        CHECK(at::equal(keys[b].slice(1, 0, len), k0[src].slice(1, 0, len)));
        CHECK(at::equal(values[b].slice(1, 0, len), v0[src].slice(1, 0, len)));
        if (src != b) CHECK(at::equal(keys[b].slice(1, len), k0[b].slice(1, len)));
      }
    }
    use(kSchedules[0]);
  }
}

TEST_CASE("emulated CUDA select_rows_: a bad index or length moves nothing, lengths -1", "[cuda-emulated]") {
  for (int bad = 0; bad < 2; ++bad) {
    INFO("case " << bad);
    at::Tensor keys = at::randn({3, 1, 6, 4}), values = at::randn({3, 1, 6, 4});
    const at::Tensor k0 = keys.clone();
    const at::Tensor lengths = bad == 0 ? ints({2, 6, 1}) : ints({2, 7, 1});
    const at::Tensor index = bad == 0 ? ints({2, 3, 0}) : ints({2, 0, 0});
    CHECK(at::equal(select_rows(keys, values, lengths, index), ints({-1, -1, -1})));
    CHECK(at::equal(keys, k0));
  }
}
