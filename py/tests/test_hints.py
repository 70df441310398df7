"""Live hints in a Python run, each raised by its real cause and cleared when the cause
goes: a leak in the model (a list that keeps a tensor every step), a cache that a shrink
cannot free, another process taking the host memory the run's limit counted on; and the
parts of a step's fixed memory, counted for the optimizer hint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import headroom

from conftest import TinyGPT, gpt_batches, in_fresh_process, kinds


def hints(log) -> list[dict]:
    return kinds(log, "hint")


def test_a_leak_in_the_model_is_said_in_mib_per_step_and_cleared_when_it_stops(tmp_path):
    in_fresh_process("test_hints", "leak", tmp_path)


def leak(tmp_path):
    log = tmp_path / "leak.jsonl"
    model = TinyGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept: list[torch.Tensor] = []
    leaking = {"on": False}

    def hook(h):
        # The leak: 4 MiB kept every forward, touched so the pages are resident.
        if leaking["on"]:
            kept.append(torch.ones(1 << 20))
        return h

    model.hook = hook
    run = headroom.Run(
        "leak", model=model, effective_batch=8, micro_batch=8, adaptive=False, log=log
    )
    for i, b in enumerate(gpt_batches(20, 8)):
        leaking["on"] = 4 <= i < 12
        run.backward(b, model.loss)
        run.step(opt)
    run.finish()
    got = [h for h in hints(log) if h["hint"] == "leak"]
    assert [h["raised"] for h in got] == [True, False], got
    raised, cleared = got
    # Raised once the window of six steps rose at every step (the fifth leaking step).
    assert 9 <= raised["step"] <= 12, raised
    # The rate said is the rate leaked: 4 MiB per step.
    assert 3.5 * 2**20 <= raised["figure_bytes"] <= 4.5 * 2**20, raised
    assert "MiB per step at a constant micro-batch 8 × 16 tokens" in raised["text"]
    assert cleared["step"] > 12, cleared
    assert len(kept) == 8


class CachedGPT(TinyGPT):
    """A model that keeps a scratch buffer sized for the largest batch it has seen (like
    a preallocated cache): a smaller batch reuses it, so shrinking frees none of it."""

    def __init__(self):
        super().__init__()
        self.cache: torch.Tensor | None = None

    def forward(self, x):
        need = x.shape[0] * (8 << 20) // 4  # 8 MiB per sample
        if self.cache is None or self.cache.numel() < need:
            self.cache = torch.ones(need)
        return super().forward(x) + self.cache[:1] * 0


def test_a_shrink_that_kept_the_peak_is_said_and_cleared_once_the_cache_goes(tmp_path):
    in_fresh_process("test_hints", "shrink_kept", tmp_path)


def shrink_kept(tmp_path):
    log = tmp_path / "shrink.jsonl"
    model = CachedGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    run = headroom.Run(
        "shrink", model=model, effective_batch=16, micro_batch=16, adaptive=False, log=log
    )
    for i, b in enumerate(gpt_batches(12, 16)):
        if i == 4:
            # The dashboard's pin, as a viewer sends it: a shrink 16 → 4.
            pin = {"command": "pin_micro_batch", "micro_batch": 4}
            run._native.apply_commands([json.dumps(pin)])
        if i == 8:
            model.cache = None  # the cause goes: the 128 MiB cache is dropped
        run.backward(b, model.loss)
        run.step(opt)
    run.finish()
    mem = kinds(log, "step_memory")
    assert [m["micro_batch"] for m in mem][3:6] == [16, 4, 4], mem
    got = [h for h in hints(log) if h["hint"] == "shrink_ineffective"]
    assert [h["raised"] for h in got] == [True, False], got
    raised, cleared = got
    assert raised["step"] == 5 and "16 → 4 did not lower" in raised["text"], raised
    assert cleared["step"] == 9, cleared
    # The figure is the peak after the shrink, as measured.
    assert raised["figure_bytes"] == mem[4]["peak_bytes"]


def _kib_field(path: str, key: str) -> int:
    """A `KEY: N kB` line of a /proc file, in bytes."""
    text = Path(path).read_text()
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


# Another process: takes N bytes of host memory (every page touched), says so, holds them.
HOLD = """
import sys, time
b = bytearray(int(sys.argv[1]))
b[::4096] = b"x" * len(b[::4096])
print("held", flush=True)
time.sleep(600)
"""


def _cgroup_room() -> int | None:
    """What this process's cgroups still let it and its children take (the least of
    limit - usage over the memory cgroup and its ancestors, v2 or v1), or None when no
    limit is set: in a container /proc/meminfo shows the host's memory, not this."""
    rooms = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, rel = line.split(":", 2)
        if hid == "0" and controllers == "":
            base, files = Path("/sys/fs/cgroup"), ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory")
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        d = base / rel.lstrip("/")
        while True:
            try:
                limit = (d / files[0]).read_text().strip()
                usage = int((d / files[1]).read_text())
                if limit != "max" and int(limit) < (1 << 60):
                    rooms.append(max(0, int(limit) - usage))
            except (OSError, ValueError):
                pass
            if d == base:
                break
            d = d.parent
    return min(rooms) if rooms else None


# The most another process is asked to hold: a quarter of a bigger room than this is more
# than a test should touch (seconds of page faults, and memory other work on the host needs).
MAX_TAKE = 16 << 30


def test_another_process_taking_host_memory_is_said_and_cleared_when_it_ends(tmp_path):
    # The hint is raised when another process takes 15% of the limit, and the limit here is
    # all the host can give (what this run holds plus MemAvailable): the other process must
    # take a quarter of that. Not where that is too much to touch, or more than half of what
    # can really be taken (a container's cgroup limit, which MemAvailable does not show).
    room = _kib_field("/proc/self/status", "VmRSS") + _kib_field("/proc/meminfo", "MemAvailable")
    take = room // 4
    safe = _kib_field("/proc/meminfo", "MemAvailable")
    cgroup = _cgroup_room()
    if cgroup is not None:
        safe = min(safe, cgroup)
    if take > MAX_TAKE:
        pytest.skip(
            f"a quarter of this host's room ({take >> 20} MiB) is more than "
            f"{MAX_TAKE >> 30} GiB to hold"
        )
    if safe < 2 * take:
        pytest.skip(
            f"another process would hold {take >> 20} MiB (a quarter of the host's room as the "
            f"limit counts it), more than half of the {safe >> 20} MiB that can be taken here"
            + (" (cgroup limit)" if cgroup is not None and cgroup == safe else "")
        )
    in_fresh_process("test_hints", "other_process", tmp_path)


def other_process(tmp_path):
    log = tmp_path / "other.jsonl"
    model = TinyGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # A budget of what the host can give this run now: another process's memory then
    # lowers the CPU limit under it (the limit is never more than this process holds
    # plus what the host could still give).
    room = _kib_field("/proc/self/status", "VmRSS") + _kib_field("/proc/meminfo", "MemAvailable")
    budget = room - (256 << 20)
    take = room // 4
    run = headroom.Run(
        "other",
        model=model,
        effective_batch=8,
        micro_batch=8,
        adaptive=False,
        memory_budget=f"{budget >> 20}MiB",
        log=log,
    )
    holder = None
    try:
        for i, b in enumerate(gpt_batches(14, 8)):
            if i == 4:
                holder = subprocess.Popen(
                    [sys.executable, "-c", HOLD, str(take)], stdout=subprocess.PIPE, text=True
                )
                assert holder.stdout.readline().strip() == "held"
            if i == 9:
                holder.kill()
                holder.wait()
            run.backward(b, model.loss)
            run.step(opt)
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
    run.finish()
    got = [h for h in hints(log) if h["hint"] == "outside_allocator"]
    assert [h["raised"] for h in got] == [True, False], got
    raised, cleared = got
    assert raised["step"] == 5, raised
    # What was taken is what the other process holds less the 256 MiB left out of the
    # budget, within a fifth of the hold for what the host's own use moved meanwhile.
    expected = take - (room - budget)
    assert abs(raised["figure_bytes"] - expected) <= 0.2 * take, (raised, take, expected)
    assert "other processes hold host memory" in raised["text"], raised
    assert cleared["step"] == 10, cleared


def test_the_fixed_parts_are_counted_after_the_first_step(tmp_path):
    log = tmp_path / "parts.jsonl"
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = headroom.Run("parts", model=model, effective_batch=4, micro_batch=4, log=log)
    for b in gpt_batches(2, 4):
        run.backward(b, model.loss)
        run.step(opt)
    run.finish()
    (parts,) = kinds(log, "memory_parts")
    p = sum(q.numel() * 4 for q in model.parameters())
    assert parts["parameters"] == p and parts["gradients"] == p
    # AdamW: two moments per parameter, and a step counter per parameter tensor.
    n = len(list(model.parameters()))
    assert parts["optimizer"] == 2 * p + 4 * n, (parts, p, n)
