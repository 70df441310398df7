"""What the scripts that train under a real cap share (capped_run.py, giveup_capped.py,
hf_capped.py, lightning_capped.py). Each runs in its own process, started by its test,
since headroom's hard_limit caps the whole process; each prints what happened (one JSON
line, or its log) for the test to read."""

from __future__ import annotations

import argparse

import torch

import headroom


def arguments(room: str) -> argparse.ArgumentParser:
    """The options every capped script takes: `--log`, the run's log, and `--room`, the
    budget above what the process holds once it is warm; a script adds its own."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", required=True)
    ap.add_argument("--room", default=room, help="budget above what the process holds")
    return ap


def one_thread(seed: int | None = 0) -> None:
    """torch on one intra-op thread, seeded with `seed` (None: left unseeded)."""
    if seed is not None:
        torch.manual_seed(seed)
    torch.set_num_threads(1)


def budget(room: str) -> int:
    """The cap: what the process holds now (called once the model, the optimizer's state
    and the framework are loaded), plus `room`."""
    return headroom._native.rss() + headroom._native.parse_bytes(room)
