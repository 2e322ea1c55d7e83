#!/usr/bin/env bash
# Proves on a machine without a GPU that the CUDA kernels compile and link:
# setup.py builds libkvcache.so with CUDA against torch 2.14.1 (a CUDA 13
# build) and nvcc, once. The library must
#  - hold sm_80 and sm_90 machine code and compute_90 PTX (newer GPUs JIT it),
#  - contain every CUDA kernel (symbol check),
#  - load into that torch (through the package's own _C module) and report
#    build_info()["with_cuda"] == True, which is only true when the CUDA
#    objects are linked in and every operator's CUDA work is registered.
# CMakeLists.txt's CUDA route is configured and compiles one CUDA object
# (csrc/cuda/build_facts.cu), which must name the same architectures as the
# setup.py library: the same sources compiled twice by the same nvcc prove
# nothing more, and cost CI minutes.
# It also prints ptxas's register / spill counts of every kernel. Nothing
# here runs on a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/pip_quiet.sh
. scripts/pip_quiet.sh

VENV=${KVCACHE_CUDA_VENV:-.venv-cuda}
OUT=build/cuda
# Unset: both builds take the default from cmake/build_settings.json (Ampere
# and Hopper machine code, plus Hopper PTX for newer GPUs).
archs=${TORCH_CUDA_ARCH_LIST:-$(python3 -c 'import json; print(json.load(open("cmake/build_settings.json"))["cuda_arch_list"])')}
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
nvcc_version=$(nvcc --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')

start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV: torch==2.14.1 with CUDA 13 and its nvidia-* wheels, about 5.5 GB on disk" \
       "(kept for the next run; KVCACHE_CUDA_VENV=DIR puts it elsewhere, rm -rf $VENV frees it)"
  # 5.5 GB of wheels plus pip's unpacking and the two builds (about 1 GB).
  need_disk "$(dirname "$VENV")" 8 "check_cuda_build: the CUDA venv $VENV"
  python3 -m venv "$VENV"
else
  echo "== using $VENV (torch==2.14.1 with CUDA 13, about 5.5 GB; rm -rf $VENV frees it)"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
# cmake from PyPI: Debian's 3.25 does not know nvcc 13's C++20 flags.
pip_quiet torch==2.14.1 numpy "setuptools>=77" ninja "cmake>=3.30"
echo "== CUDA torch ready in $(( $(date +%s) - start ))s: $(python -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"
echo "== CUDA architectures $archs, nvcc $nvcc_version"

mkdir -p "$OUT"
# The copy planner and copy loop of the CUDA kernels, run on the host (no GPU)
# with UBSan's alignment check.
torch_inc=$(python -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))')
g++ -std=c++20 -O1 -g -fsanitize=alignment,undefined -fno-sanitize-recover=all -I csrc/cuda -I csrc \
  -I "$torch_inc" csrc/cuda/copy_host_test.cpp -o "$OUT/copy_host_test" \
  -L "$torch_inc/../lib" -lc10 -Wl,-rpath,"$torch_inc/../lib"
"$OUT/copy_host_test"

start=$(date +%s)
# -Xptxas=-v: register and spill counts in the log (nvcc reads this variable).
if ! NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:-} -Xptxas=-v" KVCACHE_CUDA=1 \
    python setup.py -q build_ext --build-lib "$OUT/lib" --build-temp "$OUT/temp" \
    >"$OUT/build.log" 2>&1; then
  grep -E "error|FAILED" "$OUT/build.log" | head -40 >&2
  echo "check_cuda_build: the CUDA build failed (full log: $OUT/build.log)" >&2
  exit 1
fi
lib="$OUT/lib/kvcache/libkvcache.so"
echo "== CUDA build took $(( $(date +%s) - start ))s: $lib"

# Registers, spills and stack per kernel and target, from ptxas.
python - "$OUT/build.log" <<'PY'
import re, sys
rows, entry, arch = [], None, None
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"Compiling entry function '(\S+)' for '(sm_\d+)'", line)
    if m:
        entry, arch = m.group(1), m.group(2)
        continue
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and entry:
        stack, spill_st, spill_ld = map(int, m.groups())
        rows.append([entry, arch, None, stack, spill_st, spill_ld])
        continue
    m = re.search(r"Used (\d+) registers", line)
    if m and rows and rows[-1][2] is None:
        rows[-1][2] = int(m.group(1))
def short(name):
    m = re.search(r"(?<=\d)(paged_attend_kernel|paged_combine_kernel|paged_write_copy_kernel|paged_write_quant_kernel|"
                  r"paged_slots_check_kernel|update_copy_kernel|validate_starts_kernel|attend_combine_kernel|attend_kernel|"
                  r"rollback_kernel|select_plan_kernel|select_move_kernel|ring_validate_kernel|ring_copy_kernel|ring_quant_kernel|"
                  r"reset_rows_kernel|nan_unless_start_zero_kernel)"
                  r"(?=[IE])"
                  r"(I(f|N3c108BFloat16E|N3c104HalfE)(f|a|S\d*_|N(?:S\d*_|3c10)13Float8_e4m3fnE|LN\S+?KvFormatE(\d)E)?(Li(\d+)E)?)?",
                  name)
    if not m:
        return name[:60]
    if not m.group(2):
        return m.group(1)
    dtype = {"f": "f32", "N3c108BFloat16E": "bf16", "N3c104HalfE": "f16"}[m.group(3)]
    kv = m.group(4)
    if kv is None:
        kv = ""
    elif m.group(5):
        kv = {"1": ",int8", "2": ",fp8"}.get(m.group(5), "")
    elif kv == "a":
        kv = ",int8"
    elif "Float8" in kv:
        kv = ",fp8"
    else:
        kv = ""  # the cache has q's dtype
    return f"{m.group(1)}<{dtype}{kv}" + (f",R={m.group(7)}" if m.group(7) else "") + ">"
print(f"== ptxas: {len(rows)} kernel builds (kernel, target, registers, stack, spill st/ld bytes)")
for name, arch, regs, stack, st, ld in sorted(rows, key=lambda r: (short(r[0]), r[1])):
    flag = "  <- spills" if st or ld else ""
    print(f"   {short(name):44s} {arch}  {regs:4d} regs  stack {stack:3d}  spill {st}/{ld}{flag}")
if not rows:
    print("   (no ptxas report: nothing was recompiled; remove build/cuda for a full report)")
PY

# Machine code and PTX per target: cuobjdump (from triton's wheel; this
# toolkit has none), else the fatbinary's strings (machine code only).
cuobjdump=$(python -c 'import glob, os, triton; print((glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")) or [""])[0])' 2>/dev/null || true)

stage_package() {  # $1: libkvcache.so to load, $2: folder to stage the package in
  rm -rf "$2" && mkdir -p "$2"
  cp -r python/kvcache "$2/kvcache"
  rm -f "$2"/kvcache/*.so
  cp "$1" "$2/kvcache/libkvcache.so"
  cp "$OUT"/lib/kvcache/_C*.so "$2/kvcache/"  # links libkvcache.so from its own folder
  # The build's record of its torch (import refuses another torch's build);
  # the source tree's copy is the CPU build's.
  cp "$OUT"/lib/kvcache/_build_info.py "$2/kvcache/"
}

check_lib() {
  local lib=$1 stage=$2
  if [ -n "$cuobjdump" ]; then
    local elf ptx
    elf=$("$cuobjdump" --list-elf "$lib" | grep -o -E 'sm_[0-9]+a?' | sort -u | tr '\n' ' ')
    ptx=$("$cuobjdump" --list-ptx "$lib" | grep -o -E 'sm_[0-9]+a?' | sort -u | sed 's/sm_/compute_/' | tr '\n' ' ')
    echo "== $lib: machine code for: $elf; PTX for: $ptx"
    for want in sm_80 sm_90; do
      case " $elf " in *" $want "*) ;; *) echo "missing $want machine code in $lib" >&2; exit 1 ;; esac
    done
    case " $ptx " in *" compute_90 "*) ;; *) echo "missing compute_90 PTX in $lib (TORCH_CUDA_ARCH_LIST needs 9.0+PTX)" >&2; exit 1 ;; esac
  else
    local archs
    archs=$(strings "$lib" | grep -o -E '\bsm_[0-9]+a?\b' | sort -u | tr '\n' ' ')
    echo "== $lib: device code for: $archs (no cuobjdump: PTX not checked)"
    for want in sm_80 sm_90; do
      case " $archs " in *" $want "*) ;; *) echo "missing $want device code in $lib" >&2; exit 1 ;; esac
    done
  fi
  local missing=""
  local syms
  syms=$(nm -C "$lib")
  for k in validate_starts_kernel update_copy_kernel attend_kernel attend_combine_kernel \
           rollback_kernel select_plan_kernel select_move_kernel ring_validate_kernel ring_copy_kernel \
           ring_quant_kernel paged_write_copy_kernel paged_write_quant_kernel paged_slots_check_kernel \
           paged_attend_kernel paged_combine_kernel; do
    grep -q "$k" <<<"$syms" || missing="$missing $k"
  done
  [ -z "$missing" ] || { echo "missing CUDA kernels in $lib:$missing" >&2; exit 1; }
  echo "   every CUDA kernel is in the library"
  stage_package "$lib" "$stage"
  PYTHONPATH="$stage" python - "$nvcc_version" <<'PY'
import json, sys
import torch
import kvcache
info = kvcache.build_info()
print("   loads into torch", torch.__version__, "; build_info:", json.dumps(info))
assert info["with_cuda"] is True, "CUDA kernels are not linked in / registered"
assert info["cuda_version"] == sys.argv[1], (info["cuda_version"], sys.argv[1])
assert info["cuda_archs"] == "8.0;9.0", info["cuda_archs"]
from kvcache import _C
# Every operator of csrc/ops/operators.h that has device work.
for op in (o["name"] for o in _C.operators if o["kind"] not in ("Factory", "Alias")):
    name, _, overload = op.partition(".")
    packet = getattr(torch.ops.kvcache, name)
    assert (overload or "default") in packet.overloads(), op
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kvcache::{op}", "CUDA"), op
import os
with open(os.path.join(os.path.dirname(os.path.dirname(kvcache.__file__)), "build_info.json"), "w") as f:
    print(json.dumps(info), file=f)
PY
}
check_lib "$lib" "$OUT/stage-setup"

start=$(date +%s)
# CMake: one CUDA compile check is enough (the same nvcc and sources as the
# build above), so CMakeLists.txt's CUDA route is configured in full and one
# CUDA object of it compiled: csrc/cuda/build_facts.cu, whose constant
# records the architectures nvcc compiled for. It must name the same ones as
# the setup.py library reports, proving that both builds hand nvcc the same
# targets.
# torch's CMake config links nvrtc, which ships in the nvidia-* wheels, not in this toolkit.
nvrtc=$(python -c 'import glob, nvidia; print((glob.glob(list(nvidia.__path__)[0] + "/**/libnvrtc.so*", recursive=True) or [""])[0])')
if ! cmake -S . -B "$OUT/cmake" -G Ninja -DKVCACHE_CUDA=ON -DKVCACHE_BUILD_TESTS=OFF \
       -DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc" ${nvrtc:+-DCUDA_nvrtc_LIBRARY="$nvrtc"} \
       -DCMAKE_PREFIX_PATH="$(python -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
       >"$OUT/cmake.log" 2>&1; then
  grep -E "error|Error" "$OUT/cmake.log" | head -40 >&2
  echo "check_cuda_build: the CMake CUDA configure failed (full log: $OUT/cmake.log)" >&2
  exit 1
fi
facts_obj=$(ninja -C "$OUT/cmake" -t targets all | sed -n 's/^\(.*build_facts\.cu\.o\): .*/\1/p' | head -1)
[ -n "$facts_obj" ] || { echo "check_cuda_build: CMake has no build_facts.cu object" >&2; exit 1; }
if ! ninja -C "$OUT/cmake" "$facts_obj" >>"$OUT/cmake.log" 2>&1; then
  grep -E "error|FAILED" "$OUT/cmake.log" | head -40 >&2
  echo "check_cuda_build: CMake's nvcc compile failed (full log: $OUT/cmake.log)" >&2
  exit 1
fi
# "8.0;9.0" (build_info) -> "800,900" (__CUDA_ARCH_LIST__, as the object holds it).
want=$(python -c 'import json; print(",".join(str(round(float(a) * 100)) for a in json.load(open("'"$OUT"'/stage-setup/build_info.json"))["cuda_archs"].split(";")))')
if ! strings -a "$OUT/cmake/$facts_obj" | grep -qx "$want"; then
  echo "check_cuda_build: CMake's nvcc compiled for other architectures than setup.py's ($want):" >&2
  strings -a "$OUT/cmake/$facts_obj" | grep -E '^[0-9]{3}(,[0-9]{3})*$' >&2 || true
  exit 1
fi
echo "== CMake CUDA configure + build_facts.cu compile took $(( $(date +%s) - start ))s: architectures $want, as setup.py's build"
