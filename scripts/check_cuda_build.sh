#!/usr/bin/env bash
# Proves on a machine without a GPU that the CUDA kernels compile and link,
# through both builds: setup.py and CMakeLists.txt build libkvcache.so with
# CUDA against torch 2.14.1 (a CUDA 13 build) and nvcc; each binary must hold
# sm_80 and sm_90 code and load into that torch with its CUDA kernels
# registered. Nothing here runs on a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${KVCACHE_CUDA_VENV:-.venv-cuda}
OUT=build/cuda
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-"8.0;9.0"}
if ! command -v nvcc >/dev/null; then
  for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
    [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break
  done
fi
command -v nvcc >/dev/null || { echo "check_cuda_build: nvcc not found" >&2; exit 1; }
if [ -z "${CUDA_HOME:-}" ]; then
  # /usr/local/bin/nvcc may be a wrapper script: prefer the toolkit folder.
  if [ -x /usr/local/cuda/bin/nvcc ]; then CUDA_HOME=/usr/local/cuda
  else CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"); fi
fi
export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"

start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
# cmake from PyPI: Debian's 3.25 does not know nvcc 13's C++20 flags.
pip install -q --disable-pip-version-check torch==2.14.1 numpy "setuptools>=69" wheel \
  "pybind11>=2.12" ninja "cmake>=3.30" 2>&1 | grep -v "^WARNING: Location" || true
echo "== CUDA torch ready in $(( $(date +%s) - start ))s: $(python -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"

start=$(date +%s)
mkdir -p "$OUT"
if ! KVCACHE_CUDA=1 python setup.py -q build_ext --build-lib "$OUT/lib" --build-temp "$OUT/temp" \
    >"$OUT/build.log" 2>&1; then
  grep -E "error|FAILED" "$OUT/build.log" | head -40 >&2
  echo "check_cuda_build: the CUDA build failed (full log: $OUT/build.log)" >&2
  exit 1
fi
lib="$OUT/lib/kvcache/libkvcache.so"
echo "== CUDA build took $(( $(date +%s) - start ))s: $lib"

# cuobjdump is not part of this toolkit; the fatbinary names its targets.
check_lib() {
  local lib=$1
  # cuobjdump is not part of this toolkit; the fatbinary names its targets.
  local archs
  archs=$(strings "$lib" | grep -o -E '\bsm_[0-9]+a?\b' | sort -u | tr '\n' ' ')
  echo "== $lib: device code for: $archs"
  for want in sm_80 sm_90; do
    case " $archs " in *" $want "*) ;; *) echo "missing $want device code in $lib" >&2; exit 1 ;; esac
  done
  python - "$lib" <<'PY'
import sys
import torch
torch.ops.load_library(sys.argv[1])
for op in ("update_", "update_at_"):
    for key in ("CPU", "CUDA"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kvcache::{op}", key), (op, key)
print("   loads into torch", torch.__version__, "with CPU and CUDA kernels registered")
PY
}
check_lib "$lib"

start=$(date +%s)
# torch's CMake config links nvrtc, which ships in the nvidia-* wheels, not in this toolkit.
nvrtc=$(python -c 'import glob, nvidia; print((glob.glob(list(nvidia.__path__)[0] + "/**/libnvrtc.so*", recursive=True) or [""])[0])')
if ! { cmake -S . -B "$OUT/cmake" -G Ninja -DKVCACHE_CUDA=ON -DKVCACHE_BUILD_TESTS=OFF \
         -DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc" ${nvrtc:+-DCUDA_nvrtc_LIBRARY="$nvrtc"} \
         -DCMAKE_PREFIX_PATH="$(python -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
       && cmake --build "$OUT/cmake" -j "$(nproc)"; } >"$OUT/cmake.log" 2>&1; then
  grep -E "error|Error|FAILED" "$OUT/cmake.log" | head -40 >&2
  echo "check_cuda_build: the CMake CUDA build failed (full log: $OUT/cmake.log)" >&2
  exit 1
fi
echo "== CMake CUDA build took $(( $(date +%s) - start ))s"
check_lib "$OUT/cmake/libkvcache.so"
