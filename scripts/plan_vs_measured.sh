#!/usr/bin/env bash
# `headroom plan` for a config against the step peaks real runs measure, for each
# precision × checkpointing choice at two fixed micro-batches (docs/BENCHMARKS.md,
# "The planner"). Usage: scripts/plan_vs_measured.sh [BIN] [CONFIG] [MB1 MB2]
set -euo pipefail
bin=${1:-target/release/headroom}
config=${2:-configs/default.toml}
sizes=(${3:-8} ${4:-64})
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
"$bin" plan --config "$config" --device cpu --threads 1 --batch-size "${sizes[0]}" | tee "$work/plan.txt"
printf '\n%-16s %5s %14s %14s %8s %16s %8s\n' "lever" "mb" "plan (CLI)" "measured" "error" "run's own plan" "error"
for lever in "fp32 none" "bf16 none" "fp32 blocks" "bf16 blocks"; do
  set -- $lever
  for mb in "${sizes[@]}"; do
    rm -rf "$work/ck" "$work/run.jsonl"
    "$bin" train --headless --config "$config" --device cpu --threads 1 --steps 3 \
      --batch-size "$mb" --effective-batch "$mb" --memory-budget "" --precision "$1" \
      --activation-checkpoint "$2" --checkpoint-every 0 --checkpoint-dir "$work/ck" \
      --log "$work/run.jsonl" > /dev/null 2>&1
    python3 - "$work/run.jsonl" "$work/plan.txt" "$1" "$2" "$mb" <<'PY'
import json, re, sys
log, plan_txt, prec, ck, mb = sys.argv[1:]
mb = int(mb)
recs = [json.loads(l) for l in open(log)]
mem = [r for r in recs if r["kind"] == "step_memory"][-1]
check = [r for r in recs if r["kind"] == "plan_check"]
check = check[-1]["planned_bytes"] if check else None
# The CLI's row for this lever: fixed + per sequence × mb (MiB as printed).
unit = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
def parse(s):
    v, u = s.split()
    return float(v) * unit[u]
row = next(l for l in open(plan_txt) if re.match(rf"[* ] {prec} · {ck}\b", l))
cells = re.findall(r"([\d.]+ (?:B|KiB|MiB|GiB))", row)
fixed, per_seq = parse(cells[0]), parse(cells[1])
floor = re.search(r"never below ([\d.]+ (?:B|KiB|MiB|GiB))", open(plan_txt).read())
cli = max(fixed + per_seq * mb, parse(floor.group(1)) if floor else 0)
peak = mem["peak_bytes"]
M = 1 << 20
err = lambda p: f"{100 * (p - peak) / peak:+.1f}%"
own = f"{check / M:10.1f} MiB {err(check):>8}" if check else "n/a"
print(f"{prec + ' · ' + ck:<16} {mb:>5} {cli / M:10.1f} MiB {peak / M:10.1f} MiB {err(cli):>8} {own}")
PY
  done
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
