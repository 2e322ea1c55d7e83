#!/usr/bin/env bash
# Sanitizer gate: AddressSanitizer + UndefinedBehaviorSanitizer.
#
#  1. Builds libkvcache.so and the Catch2 tests with
#     -fsanitize=address,undefined (flags given to CMake on the command line,
#     in their own build folder, $KVCACHE_SAN_BUILD, default build/asan) and
#     runs them under ctest. Any report fails the job: ASan halts on the
#     first error, UBSan is built with -fno-sanitize-recover=all (every
#     report aborts), and LeakSanitizer is on for the C++ tests.
#  2. Runs the Python property tests (tests/python/test_properties.py, the
#     ci hypothesis profile) and the reliability tests once against that
#     sanitized library: the ASan runtime is LD_PRELOADed into python (it
#     must be the first library loaded), and LD_LIBRARY_PATH puts the
#     sanitized libkvcache.so before the package's own copy. That works
#     because kvcache._C finds libkvcache.so through DT_RUNPATH ($ORIGIN),
#     which the loader searches after LD_LIBRARY_PATH. With
#     KVCACHE_EXPECT_LIB set, a test in test_properties.py reads
#     /proc/self/maps of the test process: it fails unless the only mapped
#     libkvcache.so is the sanitized one and the ASan runtime is loaded.
#     Leak detection is off for python (CPython and torch keep allocations
#     alive on purpose at exit).
#
# Cost on an idle 2-core AMD EPYC Zen 4, MAX_JOBS=2: the first sanitizer
# build 190 s (398 s when the library was built at -O3); ctest 58 s, its
# cases run 2 at a time (each is a process, mostly LibTorch start-up under
# ASan; 111 s one at a time): the 47 CPU cases twice, on the AVX2 and the
# AVX-512 paths, and the 31 emulated CUDA cases once; the Python tests 13 s
# (test_properties ci profile, 300 examples per property, plus the
# bounds/aliasing/autograd/tensor-kind tests).
# The script prints each figure.
#
# Proof that it catches a real bug: an off-by-one bound check (start <=
# max_len - chunk + 1) on a throwaway branch made ctest fail with
# "AddressSanitizer: heap-buffer-overflow ... WRITE of size 96 ... in
# copy_block (csrc/cpu/copy_block.h:45) ... copy_slab (csrc/cpu/update.cpp)"
# in "errors are raised before anything is written", and the Python half
# abort in test_write_ops_match_slicing with the same report.
set -euo pipefail
cd "$(dirname "$0")/.."

# The venv and the package (kvcache._C, built by scripts/setup.sh; CI's
# test.sh has run it already). Only a missing one is set up here.
if [ ! -x "${KVCACHE_VENV:-.venv}/bin/python" ] || ! ls python/kvcache/_C*.so >/dev/null 2>&1; then
  bash scripts/setup.sh >/dev/null
fi
# shellcheck disable=SC1091
. "${KVCACHE_VENV:-.venv}/bin/activate"
python -c "import hypothesis" 2>/dev/null || pip install -q --disable-pip-version-check "hypothesis==6.168.3"

BUILD=${KVCACHE_SAN_BUILD:-build/asan}
JOBS=${MAX_JOBS:-$(nproc)}
SAN="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
CXX=${CXX:-g++}
ASAN_RT=$("$CXX" -print-file-name=libasan.so)
[ -e "$ASAN_RT" ] || { echo "sanitize.sh: no ASan runtime for $CXX ($ASAN_RT)" >&2; exit 1; }
ASAN_RT=$(readlink -f "$ASAN_RT")
# libstdc++ is preloaded right after the ASan runtime: python does not link
# it, and unless it is loaded when ASan starts, ASan's __cxa_throw
# interceptor has no real function to call and the first C++ exception
# aborts ("CHECK failed: asan_interceptors.cpp ... real___cxa_throw").
STDCXX=$(readlink -f "$("$CXX" -print-file-name=libstdc++.so.6)")

t0=$(date +%s)
# -O1 -g1, in CMake's Debug configuration: the library's release flags
# (-O3, cmake/build_settings.json) apply to Release and RelWithDebInfo only,
# and under ASan+UBSan -O3 made csrc/cpu/attend.cpp alone a 373 s compile
# (125 s at -O1; the whole build's critical path). -O1 is what ASan's own
# documentation recommends for readable reports. -g1: line tables only,
# which is all a sanitizer report's file:line stack needs; full debug info
# (-g) of the template-heavy kernels made the build slower for nothing a
# report prints.
echo "== sanitizer build ($BUILD): $SAN"
cmake -S . -B "$BUILD" -G Ninja \
  -DCMAKE_CXX_COMPILER="$CXX" \
  -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" \
  -DCMAKE_CXX_FLAGS="$SAN" \
  -DCMAKE_SHARED_LINKER_FLAGS="$SAN" \
  -DCMAKE_EXE_LINKER_FLAGS="$SAN" \
  -DKVCACHE_CUDA=OFF \
  -DKVCACHE_BUILD_RUNNER=OFF \
  -DCMAKE_PREFIX_PATH="$(python -c 'import torch; print(torch.utils.cmake_prefix_path)')" >/dev/null
cmake --build "$BUILD" -j "$JOBS"
t1=$(date +%s)
echo "== sanitizer build took $((t1 - t0))s"

# Fail on the first report of any kind; keep the report readable.
export ASAN_OPTIONS="halt_on_error=1:abort_on_error=1:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1"
export UBSAN_OPTIONS="halt_on_error=1:abort_on_error=1:print_stacktrace=1"
# GCC's use-after-return fake stack frames do not keep the 64-byte alignment
# that AVX-512 locals need (the attend kernel's avx512 instances spill zmm
# values with aligned moves: a general-protection fault, reported as a SEGV
# at a small address; a normal build realigns the stack). So on a CPU with
# AVX-512 the C++ tests run twice: with use-after-return detection on the
# AVX2 path (KVCACHE_ATTEND_ISA caps the kernel), and without it on the best
# path, so that the AVX-512 code runs under ASan/UBSan too; the Python tests
# below run without it.
NO_UAR="${ASAN_OPTIONS/detect_stack_use_after_return=1/detect_stack_use_after_return=0}"
# The emulated CUDA kernels (tests/cpp/test_*_cuda_emulated.cpp) run
# each GPU thread as a fiber: with use-after-return detection every fiber
# switch takes ASan's fake-stack path (100 s against 19 s without it), and
# what they test does not depend on the CPU's ISA, so they run once, with it
# off. ASan still checks every access their kernels make.
EMULATED="^emulated CUDA"
if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
  echo "== ctest under ASan/UBSan/LSan, AVX2 path, use-after-return detection on"
  KVCACHE_ATTEND_ISA=avx2 ctest --test-dir "$BUILD" -j "$JOBS" --output-on-failure -E "$EMULATED"
  echo "== ctest under ASan/UBSan/LSan, AVX-512 paths and the emulated CUDA kernels, use-after-return detection off"
  ASAN_OPTIONS="$NO_UAR" ctest --test-dir "$BUILD" -j "$JOBS" --output-on-failure
  PY_ASAN_OPTIONS="$NO_UAR"
else
  echo "== ctest under ASan/UBSan/LSan"
  ctest --test-dir "$BUILD" -j "$JOBS" --output-on-failure -E "$EMULATED"
  echo "== the emulated CUDA kernels under ASan/UBSan/LSan, use-after-return detection off"
  ASAN_OPTIONS="$NO_UAR" ctest --test-dir "$BUILD" -j "$JOBS" --output-on-failure -R "$EMULATED"
  PY_ASAN_OPTIONS="$ASAN_OPTIONS"
fi
t2=$(date +%s)
echo "== ctest took $((t2 - t1))s"

echo "== Python property + reliability tests against the sanitized library"
SAN_LIB=$(readlink -f "$BUILD/libkvcache.so")
export KVCACHE_EXPECT_LIB="$SAN_LIB"
export KVCACHE_HYPOTHESIS_PROFILE=${KVCACHE_HYPOTHESIS_PROFILE:-ci}
# Python: no leak detection (see above); everything else as for ctest.
# pytest -s: a sanitizer report goes straight to stderr (with pytest's
# capture it would be lost when the process aborts).
LD_PRELOAD="$ASAN_RT $STDCXX" \
  LD_LIBRARY_PATH="$(dirname "$SAN_LIB")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  ASAN_OPTIONS="${PY_ASAN_OPTIONS/detect_leaks=1/detect_leaks=0}" \
  python -m pytest -q -s -p no:cacheprovider \
    tests/python/test_properties.py tests/python/test_bounds.py tests/python/test_aliasing.py tests/python/test_autograd.py tests/python/test_tensor_kinds.py
t3=$(date +%s)
echo "== Python tests under ASan took $((t3 - t2))s; sanitizer job total $((t3 - t0))s"
