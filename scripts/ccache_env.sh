# Sourced by scripts/setup.sh and scripts/check_wheel.sh (not run on its own).
#
# use_ccache ROOT: puts ccache's compiler links (/usr/lib/ccache: c++, g++, gcc)
# first on PATH, so that the release builds of one configuration share one
# cache: the editable build (setup.sh) and the wheel built from the unpacked
# sdist (check_wheel.sh) compile the same sources with the same flags, and
# the second one is served from the cache. No-op when ccache is missing or
# KVCACHE_CCACHE=0.
#
# Why the cache hits across two source trees: ccache rewrites every absolute
# path under CCACHE_BASEDIR (ROOT, the checkout; the sdist is unpacked inside
# it) in the compiler's arguments into one relative to the working
# directory, so a tree's own paths (csrc/..., and the build venv, which
# check_wheel.sh reaches through a .venv link inside the unpacked sdist) read
# the same from either tree, while paths outside ROOT (Python's headers, the
# system's) stay absolute and equal; CCACHE_NOHASHDIR keeps the working
# directory itself out of the hash (release builds carry no debug info,
# whose paths it would affect).
use_ccache() {
  [ "${KVCACHE_CCACHE:-1}" != 0 ] || return 0
  local links=/usr/lib/ccache
  command -v ccache >/dev/null && [ -x "$links/c++" ] || return 0
  case ":$PATH:" in *":$links:"*) ;; *) export PATH="$links:$PATH" ;; esac
  CCACHE_BASEDIR=$(cd "$1" && pwd -P)
  export CCACHE_BASEDIR CCACHE_NOHASHDIR=1
  # Headers under a venv change only with a reinstall; the sloppiness lets
  # the direct mode trust their mtimes and ctimes (pip writes them fresh).
  export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-include_file_mtime,include_file_ctime,time_macros}
}
