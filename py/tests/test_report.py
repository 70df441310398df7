"""A watch-only run's report (issue 34): the caller hands the step over and goes on; the
extension's reporter thread reads the peak and records the step, in order, each with its
own peak."""

from __future__ import annotations

import socket
import threading
import time

import torch

import headroom

from conftest import kinds, records


def test_reports_never_wait_for_the_peak_or_the_records_and_all_arrive_in_order(tmp_path):
    """The peak source stalls (a device's peak read stands in for any slow part of the
    record) while a viewer that never reads is connected and the log is written: fifty
    reports return anyway, and once the source answers every step is recorded, in order,
    with its loss and the peak read for it."""
    log = tmp_path / "run.jsonl"
    run = headroom.Run("report-async", log=log)
    viewer = socket.socket(socket.AF_UNIX)
    viewer.connect(run.socket)  # connected, never read from
    gate = threading.Event()
    reads: list[int] = []

    def peak() -> int:
        # Called on the reporter thread, one read per step (CUDA's allocator peak is read
        # through this route); the first one waits until the test lets it go.
        reads.append(len(reads) + 1)
        gate.wait(60)
        return 100_000_000 + len(reads)

    run._meter.cuda = True
    run._meter.take_peak = peak
    try:
        run.report(0.0, samples=2, lr=0.1)
        deadline = time.monotonic() + 30
        while not reads and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reads == [1], "the reporter never read step 1's peak"
        for i in range(1, 50):
            run.report(float(i), samples=2, lr=0.1)
        # Every report returned while the reporter sat in the first step's peak read.
        assert reads == [1], reads
    finally:
        gate.set()
    run._native.flush()
    assert len(reads) == 50
    run._meter.cuda = False
    run.finish()
    viewer.close()
    steps = kinds(log, "step")
    assert [s["step"] for s in steps] == list(range(1, 51))
    assert [s["loss"] for s in steps] == [float(i) for i in range(50)]
    assert {s["micro_batch"] for s in steps} == {2}
    memory = kinds(log, "step_memory")
    assert [m["peak_bytes"] for m in memory] == [100_000_000 + i for i in range(1, 51)]


def test_each_watch_only_step_gets_its_own_peak(tmp_path):
    """Step 3 holds 256 MiB for a moment; its record says so, and no other step's does:
    the reporter reads the kernel's high-water mark for step 3 after step 3 and restarts
    the window before step 4."""
    log = tmp_path / "run.jsonl"
    big = 256 << 20
    with headroom.Run("report-peaks", log=log, listen=None) as run:
        for step in range(1, 7):
            if step == 3:
                x = torch.ones(big // 4)  # written: resident
                del x
            run.report(1.0)
            # The reporter reads each step's peak before the next step allocates (it
            # does within its 1-20 ms tick; a flush makes that hold on a loaded machine).
            run._native.flush()
    peaks = {m["step"]: m["peak_bytes"] for m in kinds(log, "step_memory")}
    assert sorted(peaks) == [1, 2, 3, 4, 5, 6]
    others = [peaks[s] for s in (1, 2, 4, 5, 6)]
    assert peaks[3] >= min(others) + big * 0.9, peaks
    assert max(others) < min(others) + big / 2, peaks


def test_a_diverged_loss_raises_after_its_step_is_recorded(tmp_path):
    log = tmp_path / "run.jsonl"
    run = headroom.Run("report-nan", log=log, listen=None)
    run.report(2.0)
    try:
        run.report(float("nan"))
    except headroom.LossError as e:
        assert "step 2" in str(e)
    else:
        raise AssertionError("a NaN loss did not raise")
    run.finish()
    steps = kinds(log, "step")
    assert [s["step"] for s in steps] == [1, 2]
    errors = [n for n in kinds(log, "notice") if "step 2: the loss" in n["text"]]
    assert errors, "the divergence was not said"
    # The step's record comes before the notice that names it.
    order = [
        (r["kind"], r["step"] if r["kind"] == "step" else None)
        for r in records(log)
        if r["kind"] in ("step", "notice")
        and (r["kind"] == "step" or "step 2: the loss" in r.get("text", ""))
    ]
    assert order == [("step", 1), ("step", 2), ("notice", None)], order
