#!/usr/bin/env bash
# Sets up (scripts/setup.sh), then runs the main job: greedy generation with
# and without kvcache (python -m kvcache.demo). Extra arguments go to the demo.
# --help / -h prints the usage below at once, with no setup.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  # The demo's flags, copied from python/kvcache/demo.py's parse_args so that --help needs no
  # setup and no Python (tests/python/test_demo.py checks that both name the same flags).
  cat <<'USAGE'
usage: bash scripts/demo.sh [DEMO FLAGS]

Sets up first (scripts/setup.sh: system packages when missing, a virtual environment in
$KVCACHE_VENV, default .venv, with torch, and the C++ build; the first run downloads torch and
compiles kvcache, a few minutes; later runs take seconds), then runs python -m kvcache.demo with
the flags given: greedy generation on a small seeded decoder three ways (kvcache.attend, masked
SDPA over the whole cache, no cache), timed in interleaved rounds, each method's tokens/s as a
median with its spread (min - max), then whether the logits agree.

Demo flags (python -m kvcache.demo --help says the same):
  -h, --help            this help
  --layers N            decoder layers (default: 4)
  --d-model N           model width (default: 256)
  --heads N             query heads (default: 8)
  --kv-heads N          key/value heads; fewer than --heads is grouped-query attention (default: 2)
  --batch N             sequences decoded together (default: 2)
  --prompt-len N        prompt tokens per sequence (default: 64)
  --new-tokens N        tokens generated per sequence (default: 128)
  --capacity N          cache capacity (max_len); the masked-SDPA path reads all of it every step
                        (default: 4096)
  --threads N           torch intra-op threads (default: 0, torch's default: one per core);
                        1 gives steadier figures on a busy machine
  --rounds N            interleaved timing rounds: every method runs once per round, and each is
                        reported as its median with the min-max over the rounds (default: 5)
  --speculative         speculative decoding vs plain greedy, instead of the three-way comparison
  --k N                 with --speculative: draft tokens per round (default: 4)
  --draft-layers N      with --speculative: target layers the early-exit draft runs (default: half)
  --dtype {bfloat16,float16,float32}
                        weights and cache dtype (default: float32)
  --device DEVICE       cpu or cuda (default: cpu)
  --seed N              seed of the random weights and prompt (default: 0)
  --no-progress         no progress bar

Examples:
  bash scripts/demo.sh --threads 1              steadier figures on a shared machine
  bash scripts/demo.sh --speculative --k 4      speculative decoding on the package's caches
USAGE
}

for arg in "$@"; do
  case "$arg" in
    -h|--help) usage; exit 0 ;;
  esac
done

VENV=${KVCACHE_VENV:-.venv}
echo "== demo.sh: setting up first (scripts/setup.sh): system packages if missing, $VENV with torch,"
echo "   then the C++ build. The first run downloads torch and compiles kvcache: a few minutes,"
echo "   with little output meanwhile; later runs check, rebuild only what changed, and take seconds."
start=$(date +%s)
# While setup runs, say every 30 s that it still does (a first build is quiet for minutes).
# One-second sleeps: the ticker ends within a second of setup, holding no pipe open after it.
( while :; do
    for _ in $(seq 30); do sleep 1; done
    echo "   ... still setting up ($(( $(date +%s) - start ))s; a first build takes a few minutes)"
  done ) &
ticker=$!
trap 'kill "$ticker" 2>/dev/null || true' EXIT
bash scripts/setup.sh
kill "$ticker" 2>/dev/null || true
wait "$ticker" 2>/dev/null || true
echo "== setup done in $(( $(date +%s) - start ))s; running: python -m kvcache.demo $*"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m kvcache.demo "$@"
