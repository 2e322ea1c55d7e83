#include "checks.h"

#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include "overlap.h"

namespace kvcache {
namespace detail {

std::string py_dtype(at::ScalarType t) {
  return "torch." + std::string(std::get<0>(c10::getDtypeNames(t)));
}

bool holds(const c10::SymBool& cond) {
  if (auto b = cond.maybe_as_bool()) {
    return *b;
  }
  return cond.guard_or_true(__FILE__, __LINE__);
}

int64_t shown(const c10::SymInt& v) {
  if (auto i = v.maybe_as_int()) {
    return *i;
  }
  return v.guard_int(__FILE__, __LINE__);
}

std::string shape_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (d > 0) s += ", ";
    s += std::to_string(shown(t.sym_size(d)));
  }
  return s + "]";
}

bool same_sizes(const at::Tensor& a, const at::Tensor& b) {
  if (a.dim() != b.dim()) {
    return false;
  }
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (!holds(a.sym_size(d).sym_eq(b.sym_size(d)))) {
      return false;
    }
  }
  return true;
}

void check_dense(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined(), name, " must be a defined tensor");
  TORCH_CHECK_VALUE(!t.is_nested(), name,
                    " must be a strided (dense) tensor, got a nested tensor");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, name,
                    " must be a strided (dense) tensor, got layout ",
                    t.layout());
  TORCH_CHECK_TYPE(!t.is_quantized(), name,
                   " must not be a quantized tensor, got dtype ",
                   py_dtype(t.scalar_type()));
}

void check_writable(const at::Tensor& t, const char* name) {
  check_dense(t, name);
  TORCH_CHECK_VALUE(!t.is_conj(), name,
                    " must not have the conjugate bit set (it is written in "
                    "place): pass ", name, ".resolve_conj()");
  TORCH_CHECK_VALUE(!t.is_neg(), name,
                    " must not have the negative bit set (it is written in "
                    "place): pass ", name, ".resolve_neg()");
  // PyTorch's own message and type for the same mistake with a built-in
  // in-place op; raised here because inference tensors skip the autograd
  // kernels where the other in-place rules live.
  TORCH_CHECK(!t.is_inference() || c10::InferenceMode::is_enabled(),
              "Inplace update to inference tensor outside InferenceMode is "
              "not allowed. You can make a clone to get a normal tensor "
              "before doing inplace update. (kvcache: ", name,
              " is an inference tensor)");
}

void check_written_rows(const at::Tensor& t, const char* name) {
  check_writable(t, name);
  bool overlapping = false;
  for (int64_t k = 0; k < t.dim() && !overlapping; ++k) {
    const auto stride = t.sym_stride(k).maybe_as_int();
    if (stride && *stride == 0) {
      const c10::SymInt& size = t.sym_size(k);
      overlapping = size.maybe_as_int() ? *size.maybe_as_int() > 1
                                        : size.has_hint() && holds(size.sym_gt(1));
    }
  }
  TORCH_CHECK_VALUE(!overlapping && !self_overlaps(t), name,
                    " must not have internally overlapping memory (it is "
                    "written in place, one entry per row)");
}

void check_rank(const at::Tensor& t, int64_t rank, const char* name,
                const char* dims) {
  TORCH_CHECK_VALUE(t.dim() == rank, name, " must be a ", rank,
                    "-D tensor of shape ", dims, ", got ", t.dim(),
                    "-D shape ", shape_str(t));
}

void check_dtype(const at::Tensor& t, at::ScalarType expected,
                 const char* name, const char* what) {
  TORCH_CHECK_TYPE(t.scalar_type() == expected, name, " must have ", what,
                   " ", py_dtype(expected), " (no implicit casts), got ",
                   py_dtype(t.scalar_type()));
}

void check_device(const at::Tensor& t, const at::Device& device,
                  const char* name, const char* what) {
  TORCH_CHECK_VALUE(t.device() == device, name, " must be on ", what, " (",
                    device, "), got ", t.device());
}

void check_int_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(
      t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name,
      " must be an int32 or int64 tensor, got dtype ",
      py_dtype(t.scalar_type()));
}

std::string at_index(const at::Tensor& t, int64_t b) {
  return t.dim() == 0 ? std::string() : " at index " + std::to_string(b);
}

void check_row_ints(const at::Tensor& t, const char* name,
                    const c10::SymInt& batch, const at::Device& device) {
  check_dense(t, name);
  check_int_dtype(t, name);
  TORCH_CHECK_VALUE(
      t.dim() == 0 || (t.dim() == 1 && holds(t.sym_size(0).sym_eq(batch))),
      name, " must be a 0-D tensor (one value for every row) or have shape "
      "(batch=", shown(batch), ",), got shape ", shape_str(t));
  check_device(t, device, name, "the cache's device");
}

int64_t row_value(const at::Tensor& t, int64_t b) {
  const int64_t i = t.dim() == 0 ? 0 : b * t.stride(0);
  return t.scalar_type() == at::kInt
             ? static_cast<int64_t>(t.const_data_ptr<int32_t>()[i])
             : t.const_data_ptr<int64_t>()[i];
}

void check_cache(const at::Tensor& keys, const at::Tensor& values) {
  check_writable(keys, "keys");
  check_writable(values, "values");
  check_rank(keys, 4, "keys", "(batch, num_kv_heads, max_len, head_dim)");
  check_rank(values, 4, "values", "(batch, num_kv_heads, max_len, head_dim)");
  TORCH_CHECK_VALUE(same_sizes(values, keys),
                    "values must have the same shape as keys ",
                    shape_str(keys), ", got ", shape_str(values));
  TORCH_CHECK_TYPE(values.scalar_type() == keys.scalar_type(),
                   "values must have the same dtype as keys (",
                   py_dtype(keys.scalar_type()), "), got ",
                   py_dtype(values.scalar_type()));
  check_device(values, keys.device(), "values", "the same device as keys");
  // Lengths are int32 (what attention kernels and the seed's API use).
  const c10::SymInt max_len = keys.sym_size(2);
  TORCH_CHECK_VALUE(holds(max_len.sym_le(kMaxLen)), "keys has max_len=",
                    shown(max_len),
                    " positions; lengths are int32, so a cache holds at most ",
                    kMaxLen, " positions");
  // A cache whose elements share bytes, or whose keys and values share
  // bytes, is corrupted by any write. Interleaved views of one buffer (a
  // fused (..., 2, head_dim) K/V layout) share none and are fine.
  TORCH_CHECK_VALUE(!self_overlaps(keys),
                    "keys must not have internally overlapping memory (for "
                    "example an expand()ed tensor)");
  TORCH_CHECK_VALUE(!self_overlaps(values),
                    "values must not have internally overlapping memory (for "
                    "example an expand()ed tensor)");
  TORCH_CHECK_VALUE(!overlaps(box_of(keys), box_of(values)),
                    "keys and values must not share memory: give each its "
                    "own buffer (or disjoint slices of one)");
}

KvFormat format_of(at::ScalarType t) {
  return t == at::kChar            ? KvFormat::kInt8
         : t == at::kFloat8_e4m3fn ? KvFormat::kFp8
                                   : KvFormat::kPlain;
}

bool is_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

FloatDtype float_dtype_of(at::ScalarType t) {
  return t == at::kFloat      ? FloatDtype::kFloat32
         : t == at::kBFloat16 ? FloatDtype::kBFloat16
                              : FloatDtype::kFloat16;
}

void check_scale_tensor(const at::Tensor& t, const char* name,
                        const at::Tensor& keys) {
  check_dense(t, name);
  check_rank(t, 3, name, "(batch, num_kv_heads, max_len)");
  TORCH_CHECK_VALUE(holds(t.sym_size(0).sym_eq(keys.sym_size(0))) &&
                        holds(t.sym_size(1).sym_eq(keys.sym_size(1))) &&
                        holds(t.sym_size(2).sym_eq(keys.sym_size(2))),
                    name, " must have shape (batch=", shown(keys.sym_size(0)),
                    ", num_kv_heads=", shown(keys.sym_size(1)), ", max_len=",
                    shown(keys.sym_size(2)), ") to match the cache, got ",
                    shape_str(t));
  check_dtype(t, at::kFloat, name, "the scale dtype");
  check_device(t, keys.device(), name, "the cache's device");
}

}  // namespace detail
}  // namespace kvcache
