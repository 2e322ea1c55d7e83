#!/usr/bin/env bash
# Sets up (scripts/setup.sh), then runs the main job: greedy generation with
# and without kvcache (python -m kvcache.demo). Extra arguments go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${KVCACHE_VENV:-.venv}/bin/activate"
python -m kvcache.demo "$@"
