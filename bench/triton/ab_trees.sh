#!/bin/bash
# GPU side of a commit A/B: each tree's own bench_full.py, decode only, the trees alternating for
# ROUNDS rounds on one warm GPU, so that the ratio between commits is not machine-to-machine
# noise. Trees: "." (the working tree) and ab/<sha> (ab_prepare.sh); carry "ab" and ".whl".
# Reads TREES (default: . and every tree in AB_DIR, ab/), CTX (4096), ROUNDS (2), LAYERS (all),
# ARGS (more bench_full.py arguments, split on spaces: e.g. --set with JSON that has none). Writes $OUT/ab.csv (round, tree, context, GPU ms a step,
# greedy tokens/s) and the runs' logs (runs.tgz); prints the CSV last.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-ab_out}
if compgen -G ".whl/*.whl" > /dev/null; then  # (the GPU machine has no network: wheels carried along)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
TREES=${TREES:-". $(ls -d "${AB_DIR:-ab}"/*/ 2>/dev/null | sed 's|/$||' | tr '\n' ' ')"}
mkdir -p "$OUT/runs"
RES=$(mktemp -d)  # each run's results.json
trap 'rm -rf "$RES"' EXIT
(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo unknown) | head -1 > "$OUT/device.txt"
echo "device,round,tree,ctx,gpu_ms,greedy_tokens_per_s" > "$OUT/ab.csv"
layers=$( [ -n "${LAYERS:-}" ] && echo "--layers $LAYERS" )
for round in $(seq 1 "${ROUNDS:-2}"); do
  for tree in $TREES; do
    name=$( [ "$tree" = . ] && echo work || basename "$tree" )
    res="$RES/$round-$name"
    (cd "$tree" && PYTHONPATH=/tmp/site:. timeout "${RUN_TIMEOUT:-300}" python3 bench/triton/bench_full.py --out "$res" \
       --ctx "${CTX:-4096}" --prefill , --prefill-table , $layers ${ARGS:-}) > "$OUT/runs/$round-$name.log" 2>&1 \
      || echo "$tree: bench_full.py failed (round $round), see runs/$round-$name.log" >&2
    python3 - "$res/results.json" "$(cat "$OUT/device.txt")" "$round" "$tree" >> "$OUT/ab.csv" <<'PY'
import json, sys
path, device, rnd, tree = sys.argv[1:]
try:
    decode = json.load(open(path))["decode"]
except (OSError, KeyError, ValueError):
    decode = []
for d in decode:
    print(f"{device},{rnd},{tree},{d['ctx']},{d['gpu_ms_per_step']:.3f},{d['greedy_tokens_per_s']:.1f}")
PY
  done
done
# the logs as one archive (the run tool brings back at most 8 files)
tar czf "$OUT/runs.tgz" -C "$OUT" runs && rm -rf "$OUT/runs"
cat "$OUT/ab.csv"
