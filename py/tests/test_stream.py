"""A Python run on headroom's stream: `headroom ls` lists it, a viewer gets its records,
and the dashboard's commands reach the loop and are confirmed."""

from __future__ import annotations

import subprocess
import threading
import time

import torch

import headroom

from conftest import TinyCNN, Viewer, cnn_batches, headroom_bin, kinds


def test_a_watch_only_run_is_listed_and_streams_its_steps(tmp_path):
    log = tmp_path / "watch.jsonl"
    run = headroom.Run("watcher", log=log, total_steps=5)
    v = Viewer(run.socket)
    assert v.hello["run_name"] == "watcher"
    assert v.hello["producer"].startswith("headroom.py")
    v.until(lambda r: r["kind"] == "caught_up")
    keep = []
    for i in range(5):
        # 40 MiB more each step: above glibc's largest mmap threshold (32 MiB), so each is
        # fresh pages. 4 MiB could reuse heap pages that earlier tests in this process
        # freed but kept resident (their large frees raise the threshold, as test_plan's
        # do), and the peak would then not move.
        keep.append(torch.ones(10 << 20))
        run.report(1.0 / (i + 1), samples=32)
    step = v.until(lambda r: r["kind"] == "step" and r["step"] == 5)
    assert step["loss"] == 0.2 and step["samples_per_s"] > 0
    ls = subprocess.run([headroom_bin(), "ls"], capture_output=True, text=True, timeout=30)
    assert ls.returncode == 0, ls.stderr
    row = next(line for line in ls.stdout.splitlines() if line.startswith("watcher"))
    assert str(__import__("os").getpid()) in row and "running" in row, ls.stdout
    run.finish()
    v.until(lambda r: r["kind"] == "finished")
    mem = kinds(log, "step_memory")
    assert [m["step"] for m in mem] == [1, 2, 3, 4, 5]
    # Peaks are this process's own: each step held 40 MiB more than the last.
    assert mem[-1]["peak_bytes"] >= mem[0]["peak_bytes"] + (120 << 20)
    assert all(0 < m["usage"] < 1 for m in mem)


def test_commands_from_a_viewer_reach_the_loop_and_are_confirmed(tmp_path):
    saved = []

    def on_checkpoint(step):
        path = tmp_path / f"step-{step}.pt"
        torch.save({"step": step}, path)
        saved.append(step)
        return path

    model = TinyCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = headroom.Run(
        "steered", model=model, effective_batch=8, micro_batch=8, on_checkpoint=on_checkpoint
    )
    v = Viewer(run.socket)
    v.until(lambda r: r["kind"] == "caught_up")
    answers = {}
    gap = {}

    def steer():
        v.until(lambda r: r["kind"] == "step" and r["step"] == 3)
        v.command("checkpoint")
        answers["checkpoint"] = v.until(
            lambda r: r["kind"] == "command_applied" and r["command"]["command"] == "checkpoint"
        )
        v.command(
            "set_thresholds",
            thresholds={"target": 0.8, "warning": 0.85, "critical": 0.9, "emergency": 0.95},
        )
        answers["thresholds"] = v.until(lambda r: r["kind"] == "thresholds_changed")
        v.command("pin_micro_batch", micro_batch=2)
        answers["pin"] = v.until(
            lambda r: (
                r["kind"] == "command_applied" and r["command"]["command"] == "pin_micro_batch"
            )
        )
        v.command("pause")
        v.until(lambda r: r["kind"] == "status" and r["status"] == "paused")
        t0 = time.monotonic()
        time.sleep(1.0)
        v.command("resume")
        v.until(lambda r: r["kind"] == "status" and r["status"] == "running")
        gap["paused_s"] = time.monotonic() - t0
        # A CPU run's samples carry the heap: `f` trims it, and the count says so.
        heap = v.until(lambda r: r["kind"] == "sample" and r.get("heap"))["heap"]
        answers["heap_before"] = heap
        v.command("free_cache")
        answers["free"] = v.until(
            lambda r: r["kind"] == "command_applied" and r["command"]["command"] == "free_cache"
        )
        answers["heap_after"] = v.until(
            lambda r: r["kind"] == "sample" and r["heap"]["trims"] > heap["trims"]
        )["heap"]
        v.command("stop")
        answers["stop"] = v.until(lambda r: r["kind"] == "status" and r["status"] == "stopping")

    t = threading.Thread(target=steer)
    t.start()
    step_times = []
    micro = []
    for b in cnn_batches(400, 8):
        if run.should_stop:
            break
        run.backward(b, model.loss)
        run.step(opt)
        step_times.append(time.monotonic())
        micro.append(run.micro_batch)
        time.sleep(0.01)
    t.join(timeout=30)
    assert not t.is_alive()
    assert run.should_stop and run.step_count < 400
    run.finish()
    finished = v.until(lambda r: r["kind"] == "finished")
    assert finished["stopped_by_user"]
    # The asked checkpoint, then the stop's own, at the last step (as `headroom train`).
    assert len(saved) == 2 and saved[-1] == run.step_count, saved
    assert f"step-{saved[0]}.pt" in answers["checkpoint"]["applied"]
    assert answers["thresholds"]["thresholds"]["target"] == 0.8
    assert run.thresholds == (0.8, 0.85, 0.9, 0.95)
    assert "pinned at 2" in answers["pin"]["applied"] and micro[-1] == 2
    assert "cached memory freed" in answers["free"]["applied"]
    before, after = answers["heap_before"], answers["heap_after"]
    assert before["in_use"] > 0 and before["rss_anon"] > 0, before
    assert after["last_trim_freed"] is not None, after
    # The loop held still while paused: one gap between steps as long as the pause.
    longest = max(b - a for a, b in zip(step_times, step_times[1:]))
    assert longest >= 0.9 * gap["paused_s"], (longest, gap)


def test_a_checkpoint_asked_of_a_run_without_a_callback_is_refused_not_ignored():
    run = headroom.Run("no-callback")
    v = Viewer(run.socket)
    v.until(lambda r: r["kind"] == "caught_up")
    v.command("checkpoint")
    v.command("pin_micro_batch", micro_batch=4)
    deadline = time.monotonic() + 10
    while (
        time.monotonic() < deadline
        and len([r for r in v.seen if r["kind"] == "command_applied"]) < 2
    ):
        run.report(1.0)
        try:
            v.sock.settimeout(0.05)
            v.seen.append(v.read())
        except TimeoutError:
            pass
    v.sock.settimeout(10)
    applied = {
        r["command"]["command"]: r["applied"] for r in v.seen if r["kind"] == "command_applied"
    }
    assert "on_checkpoint" in applied["checkpoint"]
    assert "watch-only run has no micro-batch" in applied["pin_micro_batch"]
    run.finish()
