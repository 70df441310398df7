"""`Run(..., oom_snapshot=True)`: on CUDA, a real out-of-memory error writes the
allocator's snapshot (memory_viz's pickle) beside the log and names it in the event log;
on the CPU the setting is off, and the run says so."""

from __future__ import annotations

import pickle

import pytest
import torch

import headroom

from conftest import TinyGPT, gpt_batches, kinds


def test_on_the_cpu_the_snapshot_is_off_and_said(tmp_path):
    log = tmp_path / "cpu.jsonl"
    model = TinyGPT()
    run = headroom.Run("cpu", model=model, effective_batch=4, log=log, oom_snapshot=True)
    run.finish()
    texts = [n["text"] for n in kinds(log, "notice")]
    assert any(t.startswith("oom_snapshot: off on the CPU") for t in texts), texts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_cuda_oom_writes_a_snapshot_memory_viz_reads(tmp_path):
    log = tmp_path / "cuda.jsonl"
    model = TinyGPT(d=256, t=256, layers=4).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    # A cap the first micro-batch (1024 sequences) cannot fit in: a real allocator OOM.
    run = headroom.Run(
        "cuda",
        model=model,
        effective_batch=1024,
        memory_budget="1GiB",
        log=log,
        oom_snapshot=True,
    )
    for x, y in gpt_batches(2, 1024, t=256):
        run.backward((x.cuda(), y.cuda()), model.loss)
        run.step(opt)
    run.finish()
    assert kinds(log, "oom"), "the cap never bit"
    said = [n["text"] for n in kinds(log, "notice") if ".oom-step" in n["text"]]
    assert said, "no snapshot path in the event log"
    path = said[0].split(" is in ")[1].split(" (")[0]
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert snap["segments"] and "device_traces" in snap
