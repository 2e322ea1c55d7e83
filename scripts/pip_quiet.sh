# Sourced by the setup and check scripts (not run on its own).
#
# pip_quiet ARGS...: `pip install -q ARGS`, without pip's "WARNING: Location"
# noise, returning pip's own exit status. (Piping pip into `grep -v` needs
# `|| true` for the case where grep prints nothing, and that also hid pip's
# failures: a full disk went unnoticed until a later step found no torch.)
pip_quiet() {
  local log rc=0
  log=$(mktemp -t kvcache-pip.XXXXXX)
  pip install -q --disable-pip-version-check "$@" >"$log" 2>&1 || rc=$?
  grep -v "^WARNING: Location" "$log" || true
  rm -f "$log"
  if [ "$rc" -ne 0 ]; then
    echo "pip install $* failed (exit $rc); free disk where pip writes:" >&2
    df -h "${VIRTUAL_ENV:-.}" "${TMPDIR:-/tmp}" >&2 || true
  fi
  return "$rc"
}

# need_disk DIR GB WHAT: fail, saying so, unless DIR's file system has GB
# gigabytes free (checked before a large install rather than failing halfway).
need_disk() {
  local dir=$1 gb=$2 what=$3 free_kb
  mkdir -p "$dir"
  free_kb=$(df -Pk "$dir" | awk 'NR == 2 { print $4 }')
  if [ "$free_kb" -lt $(( gb * 1024 * 1024 )) ]; then
    echo "$what needs about ${gb} GB free in $dir; there are $(( free_kb / 1024 / 1024 )) GB" >&2
    return 1
  fi
}
