"""How late a job's agreement sees its collective done: headroom waits for the ranks in
Python (so a signal's handler runs meanwhile; a blocking wait sits in C++ through
torchrun's SIGTERM), looking at the collective between short sleeps. Each look that
comes after the collective is done is time added to the step.

Run under torchrun (gloo on CPU), from the repository root:

    ./dev bench-python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        py/bench/agree_wait.py

Rank 1 joins an all-reduce of the agreement's size D ms after rank 0 (D = 0.5, 2, 5,
20); rank 0 waits for it (a) blocking in C++ (`work.wait()`, the floor), (b) with the
fixed 0.2 ms steps headroom used before, (c) with headroom's `_dist.poll_pause` now.
Printed: rank 0's median time from the launch to seeing it done, and each schedule's
lateness against the blocking wait.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from headroom import _dist


def blocking(work) -> None:
    work.wait()


def steps(work) -> None:
    pause = 0.0
    while not work.is_completed():
        time.sleep(pause)
        pause = min(0.01, pause + 0.0002)


def headroom_now(work) -> None:
    start = time.monotonic()
    pause = 0.0
    while not work.is_completed():
        time.sleep(pause)
        pause = _dist.poll_pause(time.monotonic() - start)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    record = torch.zeros(16, dtype=torch.float64)
    ways = {"blocking": blocking, "0.2 ms steps": steps, "poll_pause": headroom_now}
    for late_ms in (0.5, 2.0, 5.0, 20.0):
        seen: dict[str, list[float]] = {w: [] for w in ways}
        # Interleaved, so a slow spell of the machine hits every way alike.
        for _ in range(args.reps):
            for name, wait in ways.items():
                dist.barrier()
                if rank == 0:
                    t = time.perf_counter()
                    wait(dist.all_reduce(record, async_op=True))
                    seen[name].append((time.perf_counter() - t) * 1e3)
                else:
                    time.sleep(late_ms / 1e3)
                    dist.all_reduce(record)
        if rank == 0:
            med = {w: statistics.median(v) for w, v in seen.items()}
            print(
                f"rank 1 {late_ms:4.1f} ms late: blocking {med['blocking']:.3f} ms; "
                + ", ".join(
                    f"{w} {med[w] - med['blocking']:+.3f} ms" for w in ways if w != "blocking"
                )
            )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
