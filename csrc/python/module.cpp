// kvcache._C: the Python side of the op library.
//
// The operators are reached through torch.ops.kvcache (the dispatcher),
// which torch.compile, torch.export and TorchScript understand. This module
// has two jobs:
//
//  * importing it loads libkvcache.so (it is linked against it), which
//    registers the operators;
//  * it exposes the operators' argument checks (csrc/ops/*.h) to the fake
//    kernels in python/kvcache/_fake.py. They run on fake tensors with
//    symbolic sizes, so a traced program raises exactly the error, type and
//    message, that eager code raises: one source of truth for every check.
#include <torch/extension.h>

#include <optional>

#include "kvcache/build_info.h"
#include "../ops/attend.h"
#include "../ops/init_layer_cache.h"
#include "../ops/ring.h"
#include "../ops/rows.h"
#include "../ops/update.h"

namespace {

namespace py = pybind11;
namespace d = kvcache::detail;

// c10::ValueError -> ValueError, c10::TypeError -> TypeError, with the same
// message the dispatcher's Python binding shows.
template <typename Fn>
void translated(Fn fn) {
  try {
    fn();
  } catch (const c10::ValueError& e) {
    throw py::value_error(e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    throw py::type_error(e.what_without_backtrace());
  }
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "kvcache's operator checks (for the fake kernels) and build info.";

  m.def("check_init",
        [](c10::SymInt b, c10::SymInt h, c10::SymInt dim,
                      c10::SymInt len, std::optional<at::ScalarType> dtype) {
          translated([&] {
            d::check_init(b, h, dim, len, dtype);
          });
        },
        "Checks init_layer_cache's arguments.");
  m.def("check_update",
        [](const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& kn, const at::Tensor& vn,
                      c10::SymInt start) {
          translated([&] {
            d::check_update(k, v, kn, vn, start);
          });
        },
        "Checks update_'s arguments.");
  m.def("check_update_tensor",
        [](const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& kn, const at::Tensor& vn,
                      const at::Tensor& start) {
          translated([&] {
            d::check_update_tensor(k, v, kn, vn, start, false);
          });
        },
        "Checks update_.Tensor's arguments (not the start's values).");
  m.def("check_append",
        [](const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& lengths, const at::Tensor& kn,
                      const at::Tensor& vn) {
          translated([&] {
            d::check_append(k, v, lengths, kn, vn, false);
          });
        },
        "Checks append_'s arguments (not the lengths' values).");
  m.def("check_attend",
        [](const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& v, const at::Tensor& lengths,
                      const std::optional<at::Tensor>& kv_start,
                      std::optional<double> scale, int64_t window,
                      double softcap, const std::optional<at::Tensor>& positions,
                      int64_t sinks) {
          translated([&] {
            d::check_attend(q, k, v, lengths, kv_start, scale, window, softcap,
                          false, positions, sinks);
          });
        },
        py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("lengths"),
        py::arg("kv_start"), py::arg("scale"), py::arg("window"),
        py::arg("softcap"), py::arg("positions") = py::none(),
        py::arg("sinks") = 0,
        "Checks attend's arguments (not the lengths' values).");
  m.def("check_ring_update",
        [](const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
           const at::Tensor& kn, const at::Tensor& vn, const at::Tensor& start,
           int64_t sinks) {
          translated([&] {
            d::check_ring_update(k, v, positions, kn, vn, start, sinks, false);
          });
        },
        "Checks ring_update_'s arguments (not the start's values).");
  m.def("check_rollback",
        [](const at::Tensor& lengths, const at::Tensor& n,
                      const std::optional<at::Tensor>& kv_start) {
          translated([&] {
            d::check_rollback(lengths, n, kv_start, false);
          });
        },
        "Checks rollback's arguments (not their values).");
  m.def("check_select_rows",
        [](const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& lengths, const at::Tensor& index) {
          translated([&] {
            d::check_select_rows(k, v, lengths, index, false);
          });
        },
        "Checks select_rows_'s arguments (not their values).");

  m.def(
      "build_info",
      []() {
        const auto info = kvcache::build_info();
        py::dict out;
        out["with_cuda"] = info.with_cuda;
        out["torch_version"] = info.torch_version;
        out["cuda_version"] = info.cuda_version;
        out["cuda_archs"] = info.cuda_archs;
        return out;
      },
      R"doc(Returns how the loaded kvcache op library was built.

Returns:
  dict with ``with_cuda`` (bool: CUDA kernels compiled in), ``torch_version``
  (the torch the library was compiled against), ``cuda_version`` and
  ``cuda_archs`` (empty strings for a CPU-only build).
)doc");
}
