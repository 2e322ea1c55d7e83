#!/usr/bin/env bash
# Sets up a fresh machine for kvcache: system packages (Debian; ccache
# among them), a virtual environment in .venv with torch==2.13.0 (CPU), and
# an editable build through ccache (scripts/ccache_env.sh).
# Idempotent: a second run reinstalls nothing and rebuilds only if C++ changed.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/pip_quiet.sh
. scripts/pip_quiet.sh
# shellcheck source=scripts/apt_install.sh
. scripts/apt_install.sh
# shellcheck source=scripts/ccache_env.sh
. scripts/ccache_env.sh

PYTHON=${PYTHON:-python3}
VENV=${KVCACHE_VENV:-.venv}
TORCH_SPEC=${KVCACHE_TORCH:-torch==2.13.0}

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v g++ >/dev/null || need_apt+=(g++)
[ -e /usr/include/catch2/catch.hpp ] || [ -e /usr/include/catch2/catch_test_macros.hpp ] \
  || [ -e /usr/local/include/catch2/catch_test_macros.hpp ] || need_apt+=(catch2)
# ccache: scripts/check_wheel.sh's wheel then compiles from the cache (KVCACHE_CCACHE=0: none).
[ "${KVCACHE_CCACHE:-1}" = 0 ] || command -v ccache >/dev/null || need_apt+=(ccache)
[ ${#need_apt[@]} -eq 0 ] || apt_install "${need_apt[@]}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
echo "== installing $TORCH_SPEC and the build/test requirements"
# torch is pinned so pip never resolves (and downloads) another release.
# Build: setuptools >= 77, ninja (optional: parallel compiles) and build
# (python -m build, for scripts/check_wheel.sh); the rest is for the tests
# (pytest-xdist: scripts/test.sh runs pytest in worker processes),
# demo and benchmarks, and the `hf` extra's packages (transformers, and gguf
# + accelerate, which transformers needs to load the GGUF model of
# examples/hf_generate.py and examples/hf_speculative.py): installed here, so
# the examples run after this script with no second install and no rebuild.
pip_quiet "$TORCH_SPEC" "setuptools>=77" ninja \
  build numpy pytest "pytest-xdist==3.8.0" expecttest "hypothesis==6.168.3" tqdm matplotlib \
  "transformers==5.25.0" "gguf==0.19.0" "accelerate==1.15.0"
python -c "import torch" >/dev/null  # fail here, clearly, if torch did not install
# The documentation tools (scripts/docs.sh, a CI step), pinned: Sphinx with autodoc/napoleon,
# MyST for the Markdown pages, the furo theme. Pure Python, a few MB.
pip_quiet "sphinx==9.0.4" "myst-parser==5.2.0" "furo==2025.12.19"

# A rebuild recompiles only the sources that changed (setup.py keeps the
# objects in build/temp-*, ninja tracks them), but pip's own steps still take
# a while: skip it when the installed editable build is newer than every C++
# source and the build scripts.
if python - <<'PY' 2>/dev/null; then
import glob, os, sys
import kvcache  # fails (rebuild) if built for another torch
lib = os.path.getmtime(kvcache.library_path())
inputs = [f for f in glob.glob("csrc/**/*", recursive=True) if os.path.isfile(f)]
inputs += glob.glob("cmake/*") + ["setup.py", "pyproject.toml"]
sys.exit(0 if all(os.path.getmtime(f) <= lib for f in inputs) else 1)
PY
  echo "== kvcache is built and up to date"
else
  echo "== building kvcache (pip install --no-build-isolation -e .)"
  start=$(date +%s)
  use_ccache "$PWD"
  pip_quiet --no-build-isolation --no-deps -e .
  echo "== build took $(( $(date +%s) - start ))s"
fi
python -c "import kvcache; print('kvcache', kvcache.__version__, kvcache.build_info())"
