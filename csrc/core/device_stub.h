// One function pointer per device for the data movement of an operator.
//
// The pattern of ATen's structured kernels and DispatchStub: an operator's
// entry point (csrc/ops/) checks its arguments, computes the geometry and
// allocates its outputs once, for every device; then it calls the stub,
// which runs the device's work on plain parameters (raw pointers, byte
// strides, sizes). csrc/cpu/*.cpp and csrc/cuda/*.cu fill the stubs with
// KVCACHE_REGISTER_KERNEL at static-initialization time.
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/util/Exception.h>

namespace kvcache {
namespace detail {

template <typename Fn>
struct DeviceStub {
  Fn cpu = nullptr;
  Fn cuda = nullptr;

  Fn get(c10::DeviceType type, const char* op) const {
    Fn fn = type == c10::DeviceType::CPU    ? cpu
            : type == c10::DeviceType::CUDA ? cuda
                                            : nullptr;
    TORCH_CHECK_VALUE(
        fn != nullptr, "kvcache::", op, " has no kernel for device type ",
        type,
        type == c10::DeviceType::CUDA
            ? ": this build of kvcache has no CUDA kernels (build it with "
              "nvcc and a CUDA-enabled torch, or set KVCACHE_CUDA=1)"
            : "");
    return fn;
  }
};

}  // namespace detail
}  // namespace kvcache

#define KVCACHE_REGISTER_KERNEL(stub, device, fn)                      \
  static const bool kvcache_registered_##stub##_##device = [] {        \
    ::kvcache::detail::stub.device = (fn);                             \
    return true;                                                       \
  }()
