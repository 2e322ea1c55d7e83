// The one place the kvcache operator schemas are defined.
//
// Device kernels register against these names in csrc/cpu/ and csrc/cuda/;
// the fake (meta) kernels used by torch.compile / torch.export live in
// python/kvcache/_fake.py. Only this file may contain TORCH_LIBRARY(kvcache):
// a process that sees two such blocks fails to load the second.
#include <torch/library.h>

TORCH_LIBRARY(kvcache, m) {
  // Allocates a zero-filled layer cache.
  //
  // Returns (keys, values, length): keys and values of shape
  // (batch_size, num_kv_heads, max_len, head_dim), two separate buffers of
  // `dtype` (default: the global default dtype) on `device` (default: CPU),
  // and length, an int32 0-D tensor holding 0 on the same device.
  m.def(
      "init_layer_cache(SymInt batch_size, SymInt num_kv_heads, "
      "SymInt head_dim, SymInt max_len, *, ScalarType? dtype=None, "
      "Device? device=None) -> (Tensor, Tensor, Tensor)");

  // Writes keys_new / values_new (batch, num_kv_heads, chunk, head_dim) into
  // keys / values (batch, num_kv_heads, max_len, head_dim) at positions
  // [start, start + chunk) of dim 2, in place, in one pass. Raises ValueError
  // / TypeError before writing anything if an argument is invalid.
  //
  // Returns the new length, start + chunk, as a new int32 0-D tensor on the
  // cache's device: computed by the same call (on CUDA, by the same kernel),
  // so a decode step costs one dispatch. It aliases no input.
  m.def(
      "update_(Tensor(a!) keys, Tensor(b!) values, Tensor keys_new, "
      "Tensor values_new, SymInt start) -> Tensor");

  // As update_, with the start read on the device from `positions`: an int32
  // or int64 tensor, 0-D (one start for all rows) or of shape (batch,) (one
  // start per row). Needs no host sync, so it can be captured in a CUDA graph
  // and traced without recompiling as the position advances. Returns
  // positions + chunk as a new int32 tensor of the positions' shape.
  m.def(
      "update_at_(Tensor(a!) keys, Tensor(b!) values, Tensor keys_new, "
      "Tensor values_new, Tensor positions) -> Tensor");
}
