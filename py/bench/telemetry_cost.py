"""What the telemetry stream costs at each rate (issue 34: 20 Hz for ≤ 1% of a core): a
watch-only run with a log sits idle for --seconds while its sampler reads host memory
(and NVML and the allocator on a GPU) and the log writer writes the samples; the
process's CPU time over that window, less an idle window without a run, per second and
per sample read (the log keeps at most 4 a second of them, host/src/log_thinning.rs).
docs/BENCHMARKS.md, "Telemetry".

    ./dev python py/bench/telemetry_cost.py [--seconds 5] [--rates 4,10,20,50]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

import headroom


def threads_cpu() -> dict[str, float]:
    """CPU seconds of each of this process's threads by name (the scheduler's own count,
    /proc/self/task/*/schedstat), same-named threads summed."""
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + ns / 1e9
    return out


def cpu_over(seconds: float) -> tuple[float, dict[str, float]]:
    """The process's CPU seconds over `seconds` of the main thread sleeping, and each
    thread's share of them."""
    t, before = time.process_time(), threads_cpu()
    time.sleep(seconds)
    after = threads_cpu()
    per = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return time.process_time() - t, per


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rates", default="4,10,20,50")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rates = [float(r) for r in args.rates.split(",")]
    rows: dict[float, list[tuple[float, int]]] = {r: [] for r in rates}
    by_thread: dict[float, list[dict[str, float]]] = {r: [] for r in rates}
    slowed: dict[float, str] = {}
    idle = []
    for _ in range(args.rounds):
        idle.append(cpu_over(args.seconds)[0])
        for hz in rates:
            log = os.path.join(tempfile.mkdtemp(), "run.jsonl")
            run = headroom.Run(
                f"telemetry-{hz:g}", log=log, listen=None, sample_hz=hz, device=device
            )
            time.sleep(0.5)  # the sampler's first reads (NVML's open) are not the rate's
            with open(log) as f:
                before = sum(1 for line in f if '"kind":"sample"' in line)
            cpu, per = cpu_over(args.seconds)
            by_thread[hz].append(per)
            run.finish()
            with open(log) as f:
                records = [json.loads(line) for line in f]
            samples = [r for r in records if r["kind"] == "sample"]
            rows[hz].append((cpu, len(samples) - before))
            # The sampler slows itself where its reads cost more than its budget: then
            # the rate asked is not the rate read, and its notice says the one it took.
            for r in records:
                if r["kind"] == "notice" and r.get("source") == "sampler":
                    slowed[hz] = r["text"]
    base = statistics.median(idle)
    print(
        f"{device}: CPU over {args.seconds:g} s idle windows ({args.rounds} rounds; an idle "
        f"window without a run, {base * 1e3 / args.seconds:.2f} ms/s, subtracted):"
    )
    for hz in rates:
        cpu = statistics.median(c for c, _ in rows[hz]) - base
        got = statistics.median(n for _, n in rows[hz]) / args.seconds
        per_s = cpu / args.seconds
        print(
            f"  {hz:5g} Hz: {got:5.1f} samples/s written, {per_s * 1e3:6.2f} ms CPU a second "
            f"({per_s * 100:.2f}% of a core), {per_s / hz * 1e6:6.0f} µs a sample read"
        )
        names = sorted({n for d in by_thread[hz] for n in d})
        shares = {
            n: statistics.median(d.get(n, 0.0) for d in by_thread[hz]) / args.seconds for n in names
        }
        busy = [f"{n} {v * 1e3:.2f}" for n, v in sorted(shares.items(), key=lambda kv: -kv[1])]
        print(f"         by thread, ms a second: {', '.join(busy[:5])}")
        if hz in slowed:
            print(f"         {slowed[hz]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
