// kvcache._C: a small pybind11 module over the op library.
//
// The operators themselves are reached through torch.ops.kvcache (the
// dispatcher), which torch.compile, torch.export and TorchScript understand;
// a pybind11-bound op would be opaque to them. This module only reports how
// the linked op library was built, and importing it loads that library.
#include <pybind11/pybind11.h>

#include "kvcache/build_info.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "Build information of the kvcache operator library.";
  m.def(
      "build_info",
      []() {
        const auto info = kvcache::build_info();
        pybind11::dict d;
        d["with_cuda"] = info.with_cuda;
        d["torch_version"] = info.torch_version;
        d["cuda_version"] = info.cuda_version;
        d["cuda_archs"] = info.cuda_archs;
        return d;
      },
      R"doc(Returns how the kvcache op library was built.

Returns:
  dict with ``with_cuda`` (bool: CUDA kernels compiled in), ``torch_version``
  (the torch the library was compiled against), ``cuda_version`` and
  ``cuda_archs`` (empty strings for a CPU-only build).
)doc");
}
