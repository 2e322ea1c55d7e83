#!/usr/bin/env bash
# Cross-compiles the CPU kernels for aarch64 (ARM NEON), so that code which
# only x86 machines run (this project's CI and dev machines) cannot break the
# ARM build unseen. On aarch64 the attend kernel runs its portable flavour
# (VecGeneric, GCC vector extensions), which GCC lowers to NEON; the check
# fails if the object has no NEON fused multiply-adds (fmla .4s), i.e. if
# the vectors fell back to scalar code. Compile only: nothing here runs ARM
# code, and the portable flavour's results are tested on x86 by the pytest
# suite (KVCACHE_ATTEND_ISA=generic).
# Needs .venv (scripts/setup.sh) for torch's headers; installs
# g++-aarch64-linux-gnu (apt-get) when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
CXX=aarch64-linux-gnu-g++
OBJDUMP=aarch64-linux-gnu-objdump
# shellcheck source=scripts/apt_install.sh
. scripts/apt_install.sh
command -v "$CXX" >/dev/null || apt_install g++-aarch64-linux-gnu
PY=${KVCACHE_VENV:-.venv}/bin/python
TI=$("$PY" -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")
# The release build's language standard, flags and OpenMP, from the one place
# they are set.
mapfile -t flags < <("$PY" - <<'PY'
import json
s = json.load(open("cmake/build_settings.json"))
print(f"-std=c++{s['cxx_standard']}")
for f in s["release_flags"]:
    print(f)
if s["openmp"]:
    print("-fopenmp")
PY
)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for src in csrc/cpu/*.cpp; do
  obj="$out/$(basename "$src" .cpp).o"
  echo "== $CXX -march=armv8-a $src"
  "$CXX" "${flags[@]}" -march=armv8-a -fPIC -Wall -Werror -Wno-psabi \
    -Icsrc -Icsrc/include -I"$TI" -I"$TI/torch/csrc/api/include" -c "$src" -o "$obj"
done
fmla=$("$OBJDUMP" -d "$out/attend.o" | grep -c 'fmla.*\.4s' || true)
echo "== attend.o (aarch64): $fmla NEON fmla .4s instructions"
if [ "$fmla" -lt 100 ]; then
  echo "the aarch64 attend kernel has (almost) no NEON FMAs: its vectors were scalarized" >&2
  exit 1
fi
echo "== aarch64 cross-compile: OK"
