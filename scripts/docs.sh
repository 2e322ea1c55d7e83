#!/usr/bin/env bash
# Builds the documentation (Sphinx; docs/conf.py) into build/docs/html.
#   bash scripts/docs.sh            # warnings are errors, broken cross-references too
# Needs the built package (scripts/setup.sh: the API pages import kvcache, the
# Operators page reads torch.ops.kvcache) and the doc tools setup.sh installs.
# The performance pages are regenerated from their saved JSON first
# (scripts/perf_page.py --all), so a page never drifts from its data.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -x "${KVCACHE_VENV:-.venv}/bin/python" ]; then
  # shellcheck disable=SC1091
  . "${KVCACHE_VENV:-.venv}/bin/activate"
fi
python -c "import sphinx, myst_parser, furo" 2>/dev/null || {
  echo "the doc tools are missing: run bash scripts/setup.sh (it installs them)" >&2
  exit 1
}
start=$(date +%s)
python scripts/perf_page.py --all --check
# -W: warnings are errors; --keep-going: report them all; -n: nitpicky (every
# cross-reference must resolve); -E: read every page again (no stale pickles).
python -m sphinx -b html -W --keep-going -n -E -q docs build/docs/html
echo "== docs built in $(( $(date +%s) - start ))s: build/docs/html/index.html"
