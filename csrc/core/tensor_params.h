// Turns checked tensors into the plain kernel parameters of params.h.
#pragma once

#include <ATen/core/Tensor.h>

#include "params.h"

namespace kvcache {
namespace detail {

inline DstRows dst_rows(at::Tensor& t) {
  const int64_t es = static_cast<int64_t>(t.element_size());
  DstRows r;
  r.data = static_cast<char*>(t.mutable_data_ptr());
  for (int k = 0; k < 4; ++k) r.stride[k] = t.stride(k) * es;
  return r;
}

inline SrcRows src_rows(const at::Tensor& t) {
  const int64_t es = static_cast<int64_t>(t.element_size());
  SrcRows r;
  r.data = static_cast<const char*>(t.const_data_ptr());
  for (int k = 0; k < 4; ++k) r.stride[k] = t.stride(k) * es;
  return r;
}

// An undefined tensor gives an absent IntRows.
inline IntRows int_rows(const at::Tensor& t) {
  IntRows r;
  if (!t.defined()) return r;
  r.data = const_cast<void*>(t.const_data_ptr());
  r.is_int64 = t.scalar_type() == at::kLong;
  r.stride = t.dim() == 0 ? 0 : t.stride(0);
  r.numel = t.numel();
  return r;
}

}  // namespace detail
}  // namespace kvcache
