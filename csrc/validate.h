// Argument checks shared by every backend's kernels.
//
// Each check raises before anything is written, as ValueError
// (TORCH_CHECK_VALUE) or TypeError (TORCH_CHECK_TYPE), and names the argument
// and what was expected. The Python fake kernels (python/kvcache/_fake.py)
// mirror these checks for torch.compile / torch.export tracing.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace kvcache {
namespace detail {

// Shape of one update, after validation.
struct UpdateGeometry {
  int64_t batch;
  int64_t heads;
  int64_t chunk;
  int64_t head_dim;
  int64_t max_len;
};

// Checks the four tensors of an update: ranks, shapes, dtypes, devices,
// layouts and aliasing. Positions are checked separately.
UpdateGeometry check_update_tensors(
    const at::Tensor& keys,
    const at::Tensor& values,
    const at::Tensor& keys_new,
    const at::Tensor& values_new);

// Checks a host start position: 0 <= start and start + chunk <= max_len.
void check_start(int64_t start, const UpdateGeometry& g);

// Checks the metadata of a device position tensor: integer dtype, rank 0 or
// shape (batch,), same device as the cache. Does not read its values.
void check_positions_meta(const at::Tensor& positions, const at::Tensor& keys,
                          const UpdateGeometry& g);

// Reads a CPU positions tensor (0-D or (batch,)), checks every value is in
// range (raising on the first bad one), and returns the values as int64.
std::vector<int64_t> read_positions_cpu(const at::Tensor& positions,
                                        const UpdateGeometry& g);

}  // namespace detail
}  // namespace kvcache
