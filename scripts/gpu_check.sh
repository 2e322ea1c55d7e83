#!/usr/bin/env bash
# The one prepared script to run first on a lent GPU machine (an H200 here):
#
#   run(command="bash scripts/gpu_check.sh", timeout_s=600)
#
# 1. builds the CUDA package in place against the machine's own torch (that
#    image has no network: torch 2.14.1 cannot be installed there, so the
#    build uses the torch it has, 2.11 when last seen, with C++20 forced for
#    the host compiler as the project needs), for this GPU's architecture
#    only (a faster build; CI checks the release targets);
# 2. runs tests/python/test_cuda.py (one log, a junit XML);
# 3. runs the CUDA benchmarks (bench_update --device cuda, bench_attend_cuda,
#    bench_paged --device cuda),
# writing everything under $OUT (or ./gpu-results when OUT is unset).
# Fail-soft: the benchmarks run even if tests fail; every step has a time
# limit, so the logs come back within one 10-minute call.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 ))s; }

note "== gpu_check $(date -u +%FT%TZ) on $(hostname)"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee -a "$SUMMARY"
"$PY" - <<'PY' 2>&1 | tee -a "$SUMMARY"
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None,
      "capability", torch.cuda.get_device_capability() if torch.cuda.is_available() else None)
PY

# ---------------------------------------------------------------- build
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST=$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null || echo "9.0")
fi
export TORCH_CUDA_ARCH_LIST KVCACHE_CUDA=1 MAX_JOBS=${MAX_JOBS:-$(nproc)}
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
# torch < 2.13 makes cpp_extension compile C++ as C++17; the project's host
# code is C++20 (as CMakeLists.txt says): a compiler wrapper raises the
# standard. The CUDA sources are C++17-clean and keep nvcc's flags.
torch_minor=$("$PY" -c 'import torch; v = torch.__version__.split("+")[0].split("."); print(int(v[0]) * 100 + int(v[1]))')
if [ "$torch_minor" -lt 213 ]; then
  wrap=$OUT/.cxx20
  mkdir -p "$wrap"
  cat >"$wrap/c++" <<'SH'
#!/usr/bin/env bash
args=()
for a in "$@"; do [ "$a" = "-std=c++17" ] && a="-std=c++20"; args+=("$a"); done
exec g++ "${args[@]}"
SH
  chmod +x "$wrap/c++"
  export CXX="$wrap/c++"
  note "== torch $torch_minor < 2.13: host C++ compiled as C++20 through $CXX"
fi
note "== building (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS)"
build() {  # $1: extra nvcc flags
  NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:-} -Xptxas=-v $1" timeout 200 "$PY" setup.py -q build_ext --inplace
}
if ! build "" >"$OUT/build.log" 2>&1 \
   && ! { note "== build failed ($(elapsed)); again with nvcc -std=c++20"; build "-std=c++20" >>"$OUT/build.log" 2>&1; }; then
  note "== BUILD FAILED after $(elapsed) (build.log):"
  grep -E "error|Error|FAILED" "$OUT/build.log" | head -30 | tee -a "$SUMMARY"
  rm -rf "$OUT/.cxx20"
  exit 1
fi
rm -rf "$OUT/.cxx20"
grep -E "registers|spill" "$OUT/build.log" | sort | uniq -c | sort -rn | head -5 >>"$SUMMARY"
export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
note "== built in $(elapsed): $("$PY" -c 'import kvcache; print(kvcache.build_info())' 2>&1 | tail -1)"

# ---------------------------------------------------------------- tests
note "== tests/python/test_cuda.py, test_row_op_mistakes.py (its CUDA case)"
# Several workers when pytest-xdist is there: the compile and opcheck tests are
# CPU-bound. SIGINT at the limit: pytest still prints its summary and XML.
par=()
"$PY" -c "import xdist" 2>/dev/null && par=(-n 6)
per_test=()
"$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=150)
PYTHONUNBUFFERED=1 timeout -s INT -k 15 250 "$PY" -m pytest -q -p no:cacheprovider -rfE --durations=10 \
  "${par[@]}" "${per_test[@]}" --junitxml="$OUT/test_cuda.xml" tests/python/test_cuda.py \
  tests/python/test_row_op_mistakes.py >"$OUT/test_cuda.log" 2>&1
rc=$?
note "== tests: exit $rc after $(elapsed): $(grep -E '^(FAILED|ERROR)|[0-9]+ (passed|failed)' "$OUT/test_cuda.log" | tail -1)"
grep -E "^(FAILED|ERROR)" "$OUT/test_cuda.log" | head -40 >>"$SUMMARY"

# ---------------------------------------------------------------- benchmarks
note "== benchmarks"
{
  PYTHONUNBUFFERED=1 timeout 50 "$PY" benchmarks/bench_update.py --device cuda --threads 0 --min-time 0.1 \
    --json "$OUT/bench_update.json"
  echo "bench_update exit $?"
  PYTHONUNBUFFERED=1 timeout 50 "$PY" benchmarks/bench_attend_cuda.py --min-time 0.1 \
    --json "$OUT/bench_attend_cuda.json"
  echo "bench_attend_cuda exit $?"
  PYTHONUNBUFFERED=1 timeout 60 "$PY" benchmarks/bench_paged.py --device cuda --threads 0 --min-time 0.1 \
    --rounds 3 --json "$OUT/bench_paged.json"
  echo "bench_paged exit $?"
} >"$OUT/bench.log" 2>&1
grep -E "exit" "$OUT/bench.log" | tee -a "$SUMMARY"
note "== done in $(elapsed); files in $OUT"
exit $rc
