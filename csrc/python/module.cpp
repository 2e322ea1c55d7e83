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
#include <vector>

#include "kvcache/attend_cpu.h"
#include "kvcache/build_info.h"
#include "../core/memory.h"
#include "../ops/attend.h"
#include "../ops/init_layer_cache.h"
#include "../ops/operators.h"
#include "../ops/ring.h"
#include "../ops/paged.h"
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

template <typename... Args>
void bind_check(py::module_& m, const char* name, void (*fn)(Args...),
                const char* doc) {
  m.def(
      name,
      [fn](Args... args) {
        translated([&] { fn(std::forward<Args>(args)...); });
      },
      doc);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "kvcache's operator checks (for the fake kernels) and build info.";

  // check_<id> for every operator: its trace-time checks, with the
  // schema's arguments in the schema's order.
#define KVCACHE_BIND_CHECK(id, name, kind, stub, schema)                 \
  bind_check(m, "check_" #id, &d::trace_check_##id,                     \
             "Checks " name "'s arguments as its fake kernel does (not "  \
             "the values of tensors read by the kernel).");
  KVCACHE_OPERATORS(KVCACHE_BIND_CHECK)
#undef KVCACHE_BIND_CHECK

  // The operator list itself, for the fake kernels, scripts and tests.
  py::list operators;
#define KVCACHE_LIST_OP(id, name, kind, stub, schema)                    \
  operators.append(py::dict(py::arg("id") = #id, py::arg("name") = name, \
                            py::arg("kind") = #kind,                     \
                            py::arg("schema") = schema));
  KVCACHE_OPERATORS(KVCACHE_LIST_OP)
#undef KVCACHE_LIST_OP
  m.attr("operators") = operators;

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

  m.def(
      "cache_zeros",
      [](std::vector<int64_t> shape, at::ScalarType dtype, std::optional<at::Device> device) {
        std::vector<c10::SymInt> sym(shape.begin(), shape.end());
        return kvcache::detail::cache_zeros(
            sym, at::TensorOptions().dtype(dtype).device(device.value_or(at::kCPU)));
      },
      py::arg("shape"), py::arg("dtype"), py::arg("device") = std::nullopt,
      R"doc(Returns a zero-filled contiguous buffer for a cache, as ``torch.zeros``.

On the CPU (Linux) the buffer's huge-page-aligned part (2 MB pages on
x86-64) is advised into transparent huge pages before it is filled
(``madvise(MADV_HUGEPAGE)``):
fewer TLB misses when attend reads the cache (csrc/core/memory.h);
``KVCACHE_HUGE_PAGES=0`` turns this off. ``init_layer_cache`` allocates
keys and values this way.

Args:
  shape: sizes (ints >= 0).
  dtype: a ``torch.dtype``.
  device: ``None`` (CPU) or a ``torch.device``.

Returns:
  torch.Tensor of ``shape`` and ``dtype`` on ``device``, zero-filled.
)doc");

  m.def(
      "attend_cpu_isa", []() { return kvcache::attend_cpu_isa(); },
      R"doc(Returns the instruction-set path the CPU attend kernel takes here.

Returns:
  str: ``"avx512bf16"`` (the avx512vnni path, with AVX512-BF16 dot
  products for bf16 caches), ``"avx512vnni"`` (the avx512 path, with
  AVX512-VNNI integer dot products for int8 caches), ``"avx512"`` (AVX-512
  F/BW/VL), ``"avx2"`` (AVX2/FMA/F16C) or ``"generic"`` (the portable
  code). The environment variable
  ``KVCACHE_ATTEND_ISA=generic|avx2|avx512|avx512vnni|avx512bf16`` (read
  once) caps the choice.
)doc");

  m.def(
      "attend_cpu_tuning",
      []() {
        const auto t = kvcache::attend_cpu_tuning();
        py::dict out;
        out["parallel_work"] = t.parallel_work;
        out["min_split"] = t.min_split;
        out["gemm_rows"] = t.gemm_rows;
        return out;
      },
      R"doc(Returns the CPU attend kernel's threading and chunk settings.

Returns:
  dict with ``parallel_work`` (float: estimated work above which a call uses
  helper threads; 0: always), ``min_split`` (int: fewest slots in a split
  of a row when rows are split between threads) and ``gemm_rows`` (int:
  fewest query rows of a task, query heads per KV head x positions, that
  see a block for it to run the chunk (GEMM) loops).
)doc");

  m.def(
      "set_attend_cpu_tuning",
      [](std::optional<double> parallel_work, std::optional<int64_t> min_split,
         std::optional<int64_t> gemm_rows) {
        auto t = kvcache::attend_cpu_tuning();
        if (parallel_work) t.parallel_work = *parallel_work;
        if (min_split) t.min_split = *min_split;
        if (gemm_rows) t.gemm_rows = *gemm_rows;
        if (!(t.parallel_work >= 0.0)) {
          throw py::value_error("parallel_work must be a number >= 0, got " +
                                std::to_string(t.parallel_work));
        }
        if (t.min_split < 1) {
          throw py::value_error("min_split must be >= 1, got " + std::to_string(t.min_split));
        }
        if (t.gemm_rows < 1) {
          throw py::value_error("gemm_rows must be >= 1, got " + std::to_string(t.gemm_rows));
        }
        kvcache::set_attend_cpu_tuning(t);
      },
      py::arg("parallel_work") = py::none(), py::arg("min_split") = py::none(),
      py::arg("gemm_rows") = py::none(),
      R"doc(Replaces the CPU attend kernel's threading and chunk settings (benchmarks, tests).

Args:
  parallel_work: float >= 0 or None (keep): estimated work above which a
    call uses helper threads; 0 makes every call with more than one task
    parallel.
  min_split: int >= 1 or None (keep): fewest slots in a split of a row.
  gemm_rows: int >= 1 or None (keep): fewest query rows of a task that see
    a block for it to run the chunk (GEMM) loops; 1: every block.

Raises:
  ValueError: parallel_work < 0 (or NaN), min_split < 1 or gemm_rows < 1.
)doc");
}
