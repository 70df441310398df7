#!/usr/bin/env bash
# Evaluation under a real cap (docs/BENCHMARKS.md, "Evaluation under a cap"): for each of a
# hand-written loop, the HF Trainer and a Lightning fit, py/tests/eval_capped.py under the
# same hard cap three ways, one after another on one thread each: headroom (the eval batch
# as asked, split where it does not fit), the framework alone (its own evaluation: fails),
# and the framework with the eval batch set by hand (HAND, default 16 samples). Prints one
# row per run: mode, how, exit, evaluations done, seconds, the first result.
#   scripts/eval-bench.sh [MODE...]      (MODE: loop hf lightning; default all three)
set -u
cd "$(dirname "$0")/.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
./dev python -c pass > /dev/null 2>&1 || { echo "staging the Python package failed"; exit 1; }
modes=("$@")
((${#modes[@]})) || modes=(loop hf lightning)
printf '%-10s %-9s %4s %6s %8s  %s\n' mode how exit evals seconds first
for mode in "${modes[@]}"; do
  for how in headroom alone hand; do
    ./dev python py/tests/eval_capped.py --mode "$mode" --how "$how" --hand-batch "${HAND:-16}" \
      --log "$out/$mode-$how.jsonl" --out "$out/$mode-$how" > "$out/stdout" 2> "$out/err"
    rc=$?
    line=$(tail -1 "$out/stdout")
    python3 - "$mode" "$how" "$rc" "$line" << 'PY'
import json, sys
mode, how, rc, line = sys.argv[1:]
try:
    r = json.loads(line)
except ValueError:
    print(f"{mode:<10} {how:<9} {rc:>4}   (no result: {line[:80]})"); sys.exit()
res = r["results"]
first = res[0][0] if res and isinstance(res[0], list) else (res[0] if res else r["error"][:70])
print(f"{mode:<10} {how:<9} {rc:>4} {len(res):>6} {r['seconds']:>8.1f}  {first}")
PY
  done
done
