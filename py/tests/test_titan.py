"""A training loop written the way torchtitan writes one (titan_loop.py: a small Llama,
``fully_shard`` per block and on the root kept gathered, a MixedPrecisionPolicy, AdamW
with a cosine schedule, ``clip_grad_norm_`` over DTensor gradients between run.backward
and run.step) under torchrun, 2 ranks on gloo, one of them out of memory for real or by
injection at every point of a step: no rank waits in a collective (each job has a
timeout), and the job's parameters equal the same loop's without headroom.

"The same loop without headroom" is the plain FSDP2 loop cutting each step into as many
micro-batches as headroom's did (``--plain-split``: read from the capped rank's log), so
the float sums are the same and any trace of an attempt an OOM ended would show: the
parameters must agree to 1e-6 (they agree bit for bit). Against the plain loop's single
backward per step the sums differ in their last bits, which AdamW's normalisation lifts
to about 1e-5 over a few steps: FSDP's noise, not headroom's (PYTHON.md, "FSDP2")."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from conftest import assert_params_close, finish, kinds, torchrun

pytest.importorskip("torch.distributed.fsdp")

# A model whose 16-sample micro-batch needs a few hundred MiB (its logits and their
# gradient): a cap of 120-200 MiB above what the rank holds bites at the first step.
MODEL = ("--dim", "128", "--seq", "256", "--vocab", "4096", "--layers", "2")
TOL = 1e-6
JOB_TIMEOUT = 120


def job(tmp_path, name: str, *flags: str, timeout: float = JOB_TIMEOUT) -> dict:
    out = tmp_path / name
    out.mkdir()
    finish(torchrun(2, "titan_loop.py", *flags, "--out", str(out)), timeout)
    return {r: json.loads((out / f"done-rank{r}.json").read_text()) for r in range(2)}


def params(tmp_path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(tmp_path / name / "params.pt")


def plain_replay(tmp_path, name: str, *flags: str) -> dict[str, torch.Tensor]:
    """The plain loop with the split headroom's capped rank logged."""
    job(
        tmp_path,
        name + "-plain",
        *flags,
        "--plain",
        "--plain-split",
        str(tmp_path / name / "rank1.jsonl"),
    )
    return params(tmp_path, name + "-plain")


@pytest.mark.parametrize("cap_mib", [120, 200])
def test_a_real_cap_on_one_rank_is_recovered_and_the_job_learns_what_the_plain_loop_learns(
    tmp_path, cap_mib
):
    """Rank 1 under a real hard cap its first micro-batch does not fit (the deadlock of
    issue 44 was this job at 150 MiB: rank 1's all-gather failed after its gate)."""
    done = job(tmp_path, "hr", *MODEL, "--cap-rank", "1", "--cap-extra-mib", str(cap_mib))
    capped, free = tmp_path / "hr" / "rank1.jsonl", tmp_path / "hr" / "rank0.jsonl"
    assert kinds(capped, "oom"), "the cap never bit"
    assert not kinds(free, "oom")
    assert done[0]["steps"] == done[1]["steps"] == 4, done
    counts = [[s["accum_steps"] for s in kinds(log, "step")] for log in (free, capped)]
    assert counts[0] == counts[1] and counts[0][0] > 1, counts
    # clip_grad_norm_'s collective between run.backward and run.step saw one norm.
    assert done[0]["norms"] == done[1]["norms"], done
    assert_params_close(params(tmp_path, "hr"), plain_replay(tmp_path, "hr", *MODEL), TOL)


def test_a_cap_full_when_the_first_backward_must_start_its_threads_is_an_oom_recovered(
    tmp_path,
):
    """The autograd engine starts its threads at the first backward (8 here, 8 MiB of
    stack each, which RLIMIT_DATA counts): under a full cap that start failed with EAGAIN,
    a bare "RuntimeError: Resource temporarily unavailable" that ended the job. Now the
    run starts them before it sets the cap, and the backward's allocations under the full
    cap are an out-of-memory error like any other: recovered, exact."""
    flags = (*MODEL, "--cap-rank", "1", "--cap-extra-mib", "3000")
    done = job(tmp_path, "hr", *flags, "--inject", "1:cap-full@1")
    assert done[1]["fired"] == [1], done
    assert [o["step"] for o in kinds(tmp_path / "hr" / "rank1.jsonl", "oom")] == [1]
    assert_params_close(params(tmp_path, "hr"), plain_replay(tmp_path, "hr", *MODEL), TOL)


def test_without_an_oom_the_job_is_the_plain_loop_bit_for_bit(tmp_path):
    job(tmp_path, "hr", *MODEL)
    job(tmp_path, "plain", *MODEL, "--plain")
    assert_params_close(params(tmp_path, "hr"), params(tmp_path, "plain"), 0.0)


# ---- the matrix: FSDP2 configurations x the points an OOM can strike -------------------

# Each point on its own step of one job, on rank 1 ("optimizer" on step 1, where AdamW's
# first step makes its state). "all-gather"/"reduce-scatter": the cap full between the
# gate and FSDP's collective (the mechanism of issue 44's deadlock).
POINTS = (
    "optimizer",
    "fwd-0",
    "fwd-1",
    "fwd-head",
    "bwd-1",
    "bwd-in-0",
    "bwd-embed",
    "all-gather",
    "reduce-scatter",
)

# (block reshard_after_forward, root reshard_after_forward, extra flags).
CONFIGS = [
    *((str(b), str(r), ()) for b, r in itertools.product([True, False], [False, True])),
    ("2", "False", ()),
    ("True", "False", ("--tied",)),
    ("True", "False", ("--bf16",)),
    ("True", "False", ("--accumulation", "1:reduce", "--eval-every", "3")),
]


def _config_id(c) -> str:
    block, root, extra = c
    return "-".join(
        [f"blocks{block}", f"root{root}", *(e.strip("-") for e in extra if e.startswith("--"))]
    )


@pytest.mark.parametrize("config", CONFIGS, ids=[_config_id(c) for c in CONFIGS])
def test_an_oom_at_every_point_of_a_step_under_every_fsdp2_configuration(tmp_path, config):
    block, root, extra = config
    flags = (
        "--block-reshard",
        block,
        "--root-reshard",
        root,
        "--micro",
        "4",
        "--steps",
        str(len(POINTS) + 1),
        *extra,
    )
    inject = "1:" + ",".join(f"{p}@{i}" for i, p in enumerate(POINTS, 1))
    # A generous cap on rank 1: headroom's own, which it lifts for a collective.
    done = job(
        tmp_path,
        "hr",
        *flags,
        *("--cap-rank", "1", "--cap-extra-mib", "3000", "--inject", inject, "--then-plain"),
    )
    assert done[1]["fired"] == list(range(1, len(POINTS) + 1)), done[1]
    assert done[0]["steps"] == done[1]["steps"] == len(POINTS) + 1
    oom_steps = [o["step"] for o in kinds(tmp_path / "hr" / "rank1.jsonl", "oom")]
    # An OOM in a unit's compute is one the controller learns from; the optimizer's is
    # undone in place; the cap full at a collective is lifted, so no error at all.
    compute = [i for i, p in enumerate(POINTS, 1) if p.startswith(("fwd", "bwd"))]
    assert oom_steps == compute, (oom_steps, compute)
    assert not kinds(tmp_path / "hr" / "rank0.jsonl", "oom")
    assert done[0]["norms"] == done[1]["norms"]
    # clip_grad_norm_ saw the plain loop's norms: every step's gradients were the same.
    assert done[1]["norms"] == done[1]["plain_norms"], done[1]
    plain = torch.load(tmp_path / "hr" / "params-plain.pt")
    assert_params_close(params(tmp_path, "hr"), plain, TOL)
