#!/usr/bin/env bash
# Sets up (scripts/setup.sh), then runs every test: the C++ build with the
# Catch2 tests under CTest, then pytest, then the Hugging Face tests again on
# the oldest transformers kvcache.hf supports (KVCACHE_HF_OLDEST, default
# 5.18.0; empty: skipped). Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${KVCACHE_VENV:-.venv}/bin/activate"

echo "== C++ build (CMake, LibTorch, Catch2) and ctest"
start=$(date +%s)
# The Catch2 tests and the runner link the library setup.sh built
# (python/kvcache/libkvcache.so, through its package config, as a wheel's C++
# users do) rather than compiling the same sources again; the CMake build of
# the library itself runs in scripts/sanitize.sh and scripts/check_wheel.sh.
cmake -S . -B build/cmake -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DKVCACHE_PREBUILT_PACKAGE="$PWD/python/kvcache" \
  -DCMAKE_PREFIX_PATH="$(python -c 'import torch; print(torch.utils.cmake_prefix_path)')" >/dev/null
cmake --build build/cmake -j "$(nproc)"
# -j: each Catch2 case is its own process, most of its time LibTorch start-up.
ctest --test-dir build/cmake -j "$(nproc)" --output-on-failure
echo "== C++ build and tests took $(( $(date +%s) - start ))s"

# pytest in worker processes (pytest-xdist), one a core up to 4
# (KVCACHE_TEST_WORKERS overrides; 1: in this process). Most tests are
# single-threaded Python (import, tracing, subprocesses), so a serial run
# keeps a 2-core machine 112% busy. OMP_WAIT_POLICY=PASSIVE: a worker's idle
# OpenMP threads sleep instead of spinning on the core the other worker
# needs. Idle 2-core Zen 4: 312 s serial, 287 s with 2 workers, 198 s with
# 2 workers and passive waits.
workers=${KVCACHE_TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}
python -c "import xdist" 2>/dev/null || workers=1
pytest_par=() pytest_env=()
if [ "$workers" -gt 1 ]; then
  pytest_par=(-n "$workers")
  pytest_env=(OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}")
fi

# After the C++ build: the TorchScript test runs build/cmake/kvcache_run.
echo "== pytest (${workers} workers)"
start=$(date +%s)
env "${pytest_env[@]}" KVCACHE_RUNNER="$PWD/build/cmake/kvcache_run" \
  python -m pytest -q -p no:cacheprovider "${pytest_par[@]}" tests/python
echo "== pytest took $(( $(date +%s) - start ))s"

# kvcache.hf supports transformers 5.18 to 5.25 (kvcache/hf/_compat.py): the HF tests again on the
# oldest, installed beside the venv's (--target, no dependencies: 5.25's serve it) and put first on
# PYTHONPATH. In this process: the tensor-parallel test's two ranks want both cores (44 s serial,
# 54 s with 2 workers).
oldest=${KVCACHE_HF_OLDEST-5.18.0}
if [ -n "$oldest" ]; then
  echo "== pytest (Hugging Face tests, transformers $oldest)"
  start=$(date +%s)
  . scripts/pip_quiet.sh
  target="$PWD/build/transformers-$oldest"
  [ -d "$target/transformers" ] || pip_quiet --no-deps --target "$target" "transformers==$oldest"
  PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" python -m pytest -q -p no:cacheprovider \
    tests/python/test_hf.py tests/python/test_hf_paged.py tests/python/test_hf_ring.py \
    tests/python/test_tensor_parallel.py
  echo "== pytest (transformers $oldest) took $(( $(date +%s) - start ))s"
fi
