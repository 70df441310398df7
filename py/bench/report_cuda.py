"""A watch-only run on CUDA (issue 34): `run.report(loss)` with a CUDA tensor loss never
waits for the device on the training thread; the reporter thread reads the loss and the
allocator's peak. Prints what it saw as JSON lines; exits 1 when a check fails.

    ./dev python py/bench/report_cuda.py [--steps 200]    (on a machine with a GPU)
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
    ).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    log = os.path.join(tempfile.mkdtemp(), "run.jsonl")
    losses, calls = [], []
    with headroom.Run("report-cuda", log=log, listen=None) as run:
        for _ in range(args.steps):
            x = torch.randn(256, 1024, device=dev)
            # A long queue of kernels behind the loss: a sync here would wait for them.
            for _ in range(4):
                x = model(x)
            loss = x.square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t = time.perf_counter()
            run.report(loss)
            calls.append((time.perf_counter() - t) * 1e6)
            losses.append(loss.detach())
        # A NaN loss on the device is raised at the next report, naming its step.
        raised = None
        run.report(torch.tensor(float("nan"), device=dev))
        torch.cuda.synchronize()
        time.sleep(0.1)
        try:
            run.report(torch.tensor(1.0, device=dev))
        except headroom.LossError as e:
            raised = str(e)
    with open(log) as f:
        recs = [json.loads(line) for line in f]
    steps = [r for r in recs if r["kind"] == "step"]
    mem = [r for r in recs if r["kind"] == "step_memory"]
    want = [float(v) for v in losses]
    got = [s["loss"] for s in steps[: args.steps]]
    checks = {
        "every step recorded": [s["step"] for s in steps] == list(range(1, args.steps + 3)),
        "losses read off-thread equal .item()": got == want,
        "peaks from the allocator": all(m["peak_bytes"] > 0 for m in mem[: args.steps]),
        "device NaN raised at the next report": raised is not None
        and f"step {args.steps + 1}" in raised,
    }
    out = {
        "device": torch.cuda.get_device_name(),
        "report_us_median": statistics.median(calls[10:]),
        "report_us_p99": statistics.quantiles(calls[10:], n=100)[98],
        "peak_mib_first_last": [
            mem[0]["peak_bytes"] >> 20,
            mem[args.steps - 1]["peak_bytes"] >> 20,
        ],
        "raised": raised,
        "checks": checks,
    }
    print(json.dumps(out))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
