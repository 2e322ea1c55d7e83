#!/usr/bin/env bash
# Proves on a machine without a GPU that the CUDA kernels compile and link:
# builds libkvcache.so with CUDA against torch 2.14.1 (a CUDA 13 build) and
# nvcc, checks the binary holds sm_80 and sm_90 code, and loads it into that
# torch to check the CUDA kernels register. Nothing here runs on a GPU.
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
pip install -q --disable-pip-version-check torch==2.14.1 numpy "setuptools>=69" wheel \
  "pybind11>=2.12" ninja 2>&1 | grep -v "^WARNING: Location" || true
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
archs=$(strings "$lib" | grep -o -E '\bsm_[0-9]+a?\b' | sort -u | tr '\n' ' ')
echo "== device code for: $archs"
for want in sm_80 sm_90; do
  case " $archs " in *" $want "*) ;; *) echo "missing $want device code" >&2; exit 1 ;; esac
done

python - "$lib" <<'PY'
import sys
import torch
torch.ops.load_library(sys.argv[1])
for op in ("update_", "update_at_"):
    for key in ("CPU", "CUDA"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kvcache::{op}", key), (op, key)
print("== libkvcache.so loads into torch", torch.__version__, "with CPU and CUDA kernels registered")
PY
