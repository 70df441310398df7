"""A Python run's controller reads its memory meter as `headroom train`'s does: one
function (headroom_host::procmem::with_meter) says it for both."""

from __future__ import annotations

import torch

import headroom


def _adaptive_run(tmp_path):
    model = torch.nn.Linear(4, 2)
    return headroom.Run(
        "meter", model=model, effective_batch=4, log=str(tmp_path / "m.jsonl"), device="cpu"
    )


def test_a_cpu_runs_controller_counts_the_heaps_fragments_as_the_built_in_does(
    tmp_path, monkeypatch, runtime_dir
):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    with _adaptive_run(tmp_path) as run:
        noise, fragments = run._native.controller_meter
    # The resident set's scatter, and glibc's heap keeping freed tensors' pages.
    assert noise == 0.02 and fragments, (noise, fragments)


def test_with_the_users_mmap_threshold_the_heap_leaves_no_fragments(
    tmp_path, monkeypatch, runtime_dir
):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    with _adaptive_run(tmp_path) as run:
        _, fragments = run._native.controller_meter
    assert not fragments
