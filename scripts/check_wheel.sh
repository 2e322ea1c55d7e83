#!/usr/bin/env bash
# The route a new user takes, tested end to end:
#   1. `python -m build --no-isolation`: an sdist of this tree, then a wheel
#      built in the unpacked sdist (so the sdist must be complete), through
#      ccache: the editable build's objects serve it (scripts/ccache_env.sh);
#   2. the wheel installed into a FRESH virtual environment with torch pinned
#      (torch==2.13.0 by default; never an unpinned torch);
#   3. the README's Python example there (init, update, append, attend),
#      compared with plain PyTorch;
#   4. the C++ route from the installed wheel, outside the source tree:
#      find_package(kvcache) in a temporary CMake project, one program on the
#      C++ API (kvcache::kvcache) and one that reaches the ops only through the
#      dispatcher (kvcache_link_ops), both run.
# Uses the development environment (.venv, scripts/setup.sh) to build; the
# sdist, wheel and logs go to build/wheel-check, the fresh venv and the C++
# project to a temporary folder outside the tree (removed at the end).
# Environment: KVCACHE_VENV (build venv, default .venv), KVCACHE_TORCH
# (default torch==2.13.0), KVCACHE_KEEP=1 keeps the temporary folder.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/pip_quiet.sh
. scripts/pip_quiet.sh
# shellcheck source=scripts/ccache_env.sh
. scripts/ccache_env.sh
ROOT=$PWD
VENV=${KVCACHE_VENV:-.venv}
TORCH_SPEC=${KVCACHE_TORCH:-torch==2.13.0}
OUT=$ROOT/build/wheel-check
TMP=$(mktemp -d -t kvcache-wheel.XXXXXX)
[ "${KVCACHE_KEEP:-0}" = 1 ] || trap 'rm -rf "$TMP"' EXIT
case "$TORCH_SPEC" in *==*) ;; *) echo "check_wheel: KVCACHE_TORCH must pin a version (torch==X.Y.Z)" >&2; exit 2 ;; esac

elapsed() { echo "$(( $(date +%s) - $1 ))s"; }
rm -rf "$OUT"
mkdir -p "$OUT"

# shellcheck disable=SC1091
. "$VENV/bin/activate"
# (cd /: the tree's build/ folder would pass for the package)
(cd / && python -c "import build.__main__") 2>/dev/null || pip_quiet build

echo "== sdist, then a wheel built from the unpacked sdist"
start=$(date +%s)
if ! python -m build --no-isolation --sdist --outdir "$OUT/dist" . >"$OUT/build.log" 2>&1; then
  grep -E "error|Error|FAILED" "$OUT/build.log" | head -40 >&2
  echo "check_wheel: python -m build --sdist failed (full log: $OUT/build.log)" >&2
  exit 1
fi
sdist=$(ls "$OUT"/dist/kvcache-*.tar.gz)
mkdir -p "$OUT/src"
tar -xzf "$sdist" -C "$OUT/src"
src=$(ls -d "$OUT"/src/kvcache-*/)
src=${src%/}
# The wheel is built in the unpacked sdist (so the sdist must be complete),
# by the build venv's python reached through a link at the same place
# relative to the tree as in the checkout: the compiles then read the same
# relative paths as the editable build's, and ccache serves them
# (scripts/ccache_env.sh). A venv outside the checkout is used as it is: its
# paths stay absolute, the same from both trees.
venv_abs=$(cd "$VENV" && pwd -P)
build_python=$venv_abs/bin/python
case "$venv_abs/" in
  "$(pwd -P)/"*) ln -sfn "$venv_abs" "$src/.venv"; build_python=./.venv/bin/python ;;
esac
use_ccache "$ROOT"
command -v ccache >/dev/null && ccache -z >/dev/null 2>&1 || true
if ! (cd "$src" && "$build_python" -m build --no-isolation --wheel --outdir "$OUT/dist" .) \
     >>"$OUT/build.log" 2>&1; then
  grep -E "error|Error|FAILED" "$OUT/build.log" | head -40 >&2
  echo "check_wheel: the wheel build from the sdist failed (full log: $OUT/build.log)" >&2
  exit 1
fi
if [ "${KVCACHE_CCACHE:-1}" != 0 ] && command -v ccache >/dev/null; then
  echo "   ccache over the wheel's compiles: $(ccache --print-stats 2>/dev/null \
    | awk -F'\t' '$1 == "direct_cache_hit" || $1 == "preprocessed_cache_hit" { h += $2 }
                   $1 == "cache_miss" { m += $2 } END { printf "%d hits, %d misses", h, m }')"
fi
# The sdist step leaves its metadata in python/; an editable install's sys.path
# entry would see it as a second kvcache distribution.
rm -rf python/kvcache.egg-info
wheel=$(ls "$OUT"/dist/kvcache-*.whl)
echo "   $(basename "$sdist") ($(du -k "$sdist" | cut -f1) KiB), $(basename "$wheel") ($(du -k "$wheel" | cut -f1) KiB), in $(elapsed "$start")"
python - "$sdist" "$wheel" <<'PY'
import sys, tarfile, zipfile
sdist, wheel = sys.argv[1:]
names = tarfile.open(sdist).getnames()
root = names[0].split("/")[0]
for want in ["CMakeLists.txt", "cmake/build_settings.json", "cmake/kvcacheConfig.cmake", "LICENSE",
             "csrc/include/kvcache/kvcache.h", "csrc/core/checks.h", "csrc/python/module.cpp",
             "tests/python/kv_testing.py", "tests/cpp/main.cpp", "scripts/test.sh", "benchmarks/common.py"]:
    assert f"{root}/{want}" in names, f"sdist lacks {want}"
bad = [n for n in names if n.endswith((".so", ".o")) or "_build_info.py" in n]
assert not bad, f"sdist holds build outputs: {bad}"
files = zipfile.ZipFile(wheel).namelist()
for want in ["kvcache/libkvcache.so", "kvcache/_build_info.py", "kvcache/include/kvcache/kvcache.h",
             "kvcache/share/cmake/kvcache/kvcacheConfig.cmake",
             "kvcache/share/cmake/kvcache/kvcacheConfigVersion.cmake"]:
    assert want in files, f"wheel lacks {want}"
meta = zipfile.ZipFile(wheel).read(next(f for f in files if f.endswith(".dist-info/METADATA"))).decode()
reqs = [l for l in meta.splitlines() if l.startswith("Requires-Dist: torch")]
print("   wheel requires:", reqs)
assert len(reqs) == 1 and "<" in reqs[0], "the wheel must pin torch's major.minor"
PY

echo "== a fresh venv with $TORCH_SPEC and the wheel"
start=$(date +%s)
deactivate
python3 -m venv "$TMP/venv"
# shellcheck disable=SC1091
. "$TMP/venv/bin/activate"
# numpy beside torch: torch's wheel does not require numpy, but without it
# every `import torch` (so every `import kvcache`) warns "Failed to initialize
# NumPy: No module named 'numpy'" (torch/_subclasses/functional_tensor.py
# converts a tensor at import). kvcache itself does not use numpy.
pip_quiet "$TORCH_SPEC" numpy "$wheel"
echo "   installed in $(elapsed "$start"): $(pip list 2>/dev/null | grep -E '^(torch|kvcache) ' | tr -s ' ' | paste -sd, -)"

echo "== the README's Python example, from the installed wheel"
cd "$TMP"  # nothing of the source tree on sys.path
python - <<'PY'
import os
import torch
import kvcache

assert "site-packages" in kvcache.__file__, kvcache.__file__
torch.manual_seed(0)
batch, heads, kv_heads, head_dim, max_len = 2, 4, 2, 16, 64
cache = kvcache.init_kv_layer_cache(batch, kv_heads, head_dim, max_len, torch.float32)
k = torch.randn(batch, kv_heads, 5, head_dim)
v = torch.randn(batch, kv_heads, 5, head_dim)
cache = kvcache.update_kv_layer_cache(cache, k, v, 0)            # prefill: length 5
k1 = torch.randn(batch, kv_heads, 1, head_dim)
v1 = torch.randn(batch, kv_heads, 1, head_dim)
cache = kvcache.append_kv_layer_cache(cache, k1, v1)             # decode step: length 6
q = torch.randn(batch, heads, 1, head_dim)
out = kvcache.attend(q, cache)

# Plain PyTorch: the same keys/values by concatenation, attention in float64.
keys, values = torch.cat([k, k1], 2), torch.cat([v, v1], 2)
assert int(cache.length) == 6
assert torch.equal(cache.keys[:, :, :6], keys) and torch.equal(cache.values[:, :, :6], values)
assert not cache.keys[:, :, 6:].any() and not cache.values[:, :, 6:].any()
group = heads // kv_heads
ref = torch.nn.functional.scaled_dot_product_attention(
    q.double(), keys.double().repeat_interleave(group, 1), values.double().repeat_interleave(group, 1))
torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
print(f"   kvcache {kvcache.__version__} on torch {torch.__version__}: "
      f"update, append, attend match plain PyTorch (max diff {(out.double() - ref).abs().max():.1e})")
PY

echo "== C++: find_package(kvcache) from the installed wheel, outside the source tree"
start=$(date +%s)
proj="$TMP/consumer"
mkdir -p "$proj"
cat >"$proj/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.19)
project(kvcache_consumer LANGUAGES CXX)
find_package(kvcache 0.1 REQUIRED)     # finds Torch too
add_executable(use_api use_api.cpp)    # calls kvcache:: functions
target_link_libraries(use_api PRIVATE kvcache::kvcache)
add_executable(use_dispatcher use_dispatcher.cpp)  # calls the ops only by name
target_link_libraries(use_dispatcher PRIVATE ${TORCH_LIBRARIES})
kvcache_link_ops(use_dispatcher)
add_executable(readme readme.cpp)      # the README's C++ snippet, as written
target_link_libraries(readme PRIVATE kvcache::kvcache)
CMAKE
# The README's ```cpp block, verbatim: it must build and run on CPU as written.
python - "$ROOT/README.md" "$proj/readme.cpp" <<'PY'
import re, sys
blocks = re.findall(r"^```cpp\n(.*?)^```", open(sys.argv[1], encoding="utf-8").read(), re.S | re.M)
assert len(blocks) == 1, f"expected one C++ block in README.md, found {len(blocks)}"
open(sys.argv[2], "w").write(blocks[0])
PY
cat >"$proj/use_api.cpp" <<'CPP'
#include <kvcache/kvcache.h>

#include <ATen/ATen.h>
#include <iostream>

int main() {
  auto cache = kvcache::init_kv_layer_cache(2, 2, 8, 16, at::kFloat);
  auto k = at::randn({2, 2, 3, 8});
  auto v = at::randn({2, 2, 3, 8});
  cache = kvcache::update_kv_layer_cache(cache, k, v, 4);
  bool ok = at::equal(cache.keys.narrow(2, 4, 3), k) && at::equal(cache.values.narrow(2, 4, 3), v) &&
            cache.length.item<int32_t>() == 7 && cache.keys.narrow(2, 0, 4).count_nonzero().item<int64_t>() == 0;
  try {
    kvcache::update_kv_layer_cache(cache, k, v, 14);  // 14 + 3 > max_len 16
    ok = false;
  } catch (const c10::ValueError&) {
  }
  std::cout << "   use_api: " << (ok ? "OK" : "FAILED") << std::endl;
  return ok ? 0 : 1;
}
CPP
cat >"$proj/use_dispatcher.cpp" <<'CPP'
// References no kvcache symbol: only kvcache_link_ops keeps libkvcache.so
// linked, so that its operators register.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <iostream>

int main() {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow("kvcache::update_", "");
  auto keys = at::zeros({1, 2, 8, 4});
  auto values = at::zeros({1, 2, 8, 4});
  auto kn = at::randn({1, 2, 2, 4});
  auto vn = at::randn({1, 2, 2, 4});
  // A boxed call carries every argument of the schema: the kernel pops as
  // many as the schema has, defaults are not filled in for the caller. So
  // the positional ones, then each remaining (keyword-only) argument's
  // default, read from the schema (here k_scale=None, v_scale=None), so
  // that a later optional argument does not break this caller.
  torch::jit::Stack stack{keys, values, kn, vn, c10::IValue(int64_t{3})};
  const auto& args = op.schema().arguments();
  for (size_t i = stack.size(); i < args.size(); ++i) {
    if (!args[i].default_value()) {
      std::cout << "   use_dispatcher: argument " << args[i].name() << " has no default" << std::endl;
      return 1;
    }
    stack.push_back(*args[i].default_value());
  }
  op.callBoxed(&stack);
  bool ok = stack.size() == 1 && stack[0].toTensor().item<int32_t>() == 5 &&
            at::equal(keys.narrow(2, 3, 2), kn) && at::equal(values.narrow(2, 3, 2), vn);
  std::cout << "   use_dispatcher: " << (ok ? "OK" : "FAILED") << std::endl;
  return ok ? 0 : 1;
}
CPP
# The package folder is the CMake prefix: kvcache/share/cmake/kvcache/kvcacheConfig.cmake.
prefix=$(python -c 'import os, kvcache; print(os.path.dirname(kvcache.__file__))')
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if ! { cmake -S "$proj" -B "$proj/build" "${generator[@]}" -DCMAKE_PREFIX_PATH="$prefix" \
       && cmake --build "$proj/build" -j "$(nproc)"; } >"$OUT/consumer.log" 2>&1; then
  tail -40 "$OUT/consumer.log" >&2
  echo "check_wheel: the CMake consumer failed to build (full log: $OUT/consumer.log)" >&2
  exit 1
fi
"$proj/build/use_api"
"$proj/build/use_dispatcher"
echo "   README C++ snippet: $("$proj/build/readme")"
echo "   C++ consumer built and ran in $(elapsed "$start")"
echo "== check_wheel: OK ($(basename "$wheel"))"
