#!/usr/bin/env bash
# Sets up (scripts/setup.sh), then runs every test: pytest and the Catch2
# tests under CTest. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${KVCACHE_VENV:-.venv}/bin/activate"

echo "== pytest"
start=$(date +%s)
python -m pytest -q tests/python
echo "== pytest took $(( $(date +%s) - start ))s"

echo "== C++ build (CMake, LibTorch, Catch2) and ctest"
start=$(date +%s)
cmake -S . -B build/cmake -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$(python -c 'import torch; print(torch.utils.cmake_prefix_path)')" >/dev/null
cmake --build build/cmake -j "$(nproc)"
ctest --test-dir build/cmake --output-on-failure
echo "== C++ build and tests took $(( $(date +%s) - start ))s"
