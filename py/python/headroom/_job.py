"""A run as one rank of a torchrun job: who the rank is, what it tells the job, and what
the job's agreement (`_dist.Job`, the collectives) has it do: end with a rank that failed,
take the viewers' commands at the same step as every rank, stop together. `JobRank` is a
watched rank, and the base of the adaptive ones (`_replicated`, `_sharded`): the step's
loop of attempts and agreements is theirs alike."""

from __future__ import annotations

import contextlib
from typing import Any

from . import _dist, _fsdp, _torch
from ._errors import RankFailed
from ._rank import GIVEN_UP, Rank, StepWork, finite
from ._signals import SAME_SIGNAL_WINDOW_S, Signals, dropped
from ._state import RunState


def identity(name: str) -> tuple[str, tuple[str, int, int, int] | None]:
    """The run's name and, under torchrun, its job (id, rank, local rank, world size):
    each rank's run is named after the job and the rank."""
    ranks = _torch.rank_info()
    if ranks is None:
        return name, None
    job_id = ranks["TORCHELASTIC_RUN_ID"] or "job"
    job = (
        job_id,
        int(ranks["RANK"]),
        int(ranks["LOCAL_RANK"] or ranks["RANK"]),
        int(ranks["WORLD_SIZE"]),
    )
    return f"{name}.{job_id}.rank{ranks['RANK']}", job


class JobRank(Rank):
    """A rank of a torchrun job. Creating it is collective: every rank's Run gets here
    (docs/PYTHON.md, torchrun)."""

    reads_loss_off_thread = False

    def __init__(self, s: RunState, signals: Signals, plan: Any, model: Any, job_id: str):
        super().__init__(s, signals, plan)
        self.job = _dist.Job(s, model, job_id, self.take_commands, ddp_reduction=self.replicates)
        # The commands the agreements carried, taken at the step's end.
        self.agreed_commands: list[str] = []

    # A rank whose gradients the job all-reduces through headroom's reduction (DDP).
    replicates = False

    def start(self, world: int) -> None:
        self.s.notice(self.describe(world))

    def describe(self, world: int) -> str:
        job = self.job
        return (
            f"torchrun job {job.job_id}: rank {job.rank} of {world}, watched; each report "
            "joins the job's agreement (rank 0 serves every rank's row; commands reach "
            "every rank at the same step)"
        )

    def close(self) -> None:
        self.job.close()

    def take_commands(self, wait_s: float) -> list[str]:
        return self.s.take_commands(wait_s, self.signals.handle_pending)

    # ---- a watched rank's step -------------------------------------------------------

    def report(self, step, value, n, seq_len, dt, lr, grad_norm, diverged) -> None:
        s = self.s
        peak = s.meter.peak()
        s.native.observe(step, n, seq_len, peak)
        if self.plan is not None:
            s.native.plan_check(step, n, self.plan.predict(n), peak)
        s.native.step(step, value, n, n, seq_len, dt, n * seq_len, lr, grad_norm)
        s.step = step
        if diverged:
            self.diverged(step, value)
        self.stepped(n, peak, dt, value)
        self.agreed(step, self.job.agree(step))
        self.boundary()

    # ---- what the job agrees ---------------------------------------------------------

    def stepped(self, micro_batch: int, peak: int, dt: float, loss: float) -> None:
        """This rank's figures for its row at the next agreement."""
        limit, usage = self.s.native.last_memory
        self.job.last = {
            "micro_batch": float(micro_batch),
            "peak": float(peak),
            "limit": float(limit),
            "usage": usage,
            "step_time": dt,
            "loss": loss,
        }

    def fail(self, step: int, error: BaseException) -> None:
        """This rank cannot finish the step: the others learn why at the agreement,
        instead of waiting there for it."""
        if isinstance(error, (RankFailed, _fsdp.CollectiveFailed)):
            # The others know already, or are inside a collective and cannot be told.
            return
        text = f"{type(error).__name__}: {error}".strip()
        # Best effort: the original error is what this rank raises either way.
        with contextlib.suppress(Exception):
            self.job.agree(step, _dist.FAILED, error=text)

    def agreed(self, step: int, a: _dist.Agreement) -> None:
        """What the agreement says every rank does: end (another rank failed), take the
        commands at this step's end, stop after this step."""
        s = self.s
        if a.failed:
            s.clear_grads()
            rank, text = next(iter(a.failed.items()))
            raise RankFailed(
                f"step {step}: rank {rank} of the job failed ({text}); rank {self.job.rank} "
                "ends too"
            )
        # Added to, not replaced: a step redone after an out-of-memory error agrees more
        # than once before its boundary takes them.
        self.agreed_commands.extend(a.commands)
        if a.stop_by and not s.native.stop_requested:
            who = ", ".join(map(str, a.stop_by))
            s.native.request_stop(
                f"a stop signal (rank {who}); every rank of the job stops after step {step}"
            )

    def stop_signal(self, name: str) -> bool:
        # Every rank stops at the same step: the job agrees on it at the next step.
        self.job.on_signal(name)
        self.s.notice(
            f"{name}: the job stops at the next step's agreement, every rank at the same "
            f"step ({name} again within {SAME_SIGNAL_WINDOW_S:g} s is the same request; a "
            "second signal later ends this process at once)",
            level="warn",
            source="signal",
        )
        return True

    def commands(self) -> None:
        """The step boundary of a job: the commands agreed on, then, while paused, rounds
        of the agreement every 100 ms, so every rank resumes (or stops) at the same one."""
        s, job = self.s, self.job
        while True:
            commands, self.agreed_commands = self.agreed_commands, []
            actions = s.native.apply_commands(commands)
            job.applied += len(commands)
            self.signals.handle_pending()
            for cid, kind in actions:
                s.native.confirm(cid, s.carry_out(kind))
            if not s.native.paused:
                return
            self.agreed(s.step, job.agree(s.step, wait_s=0.1))

    # ---- an adaptive rank's step: attempts and agreements -----------------------------

    def check_backward(self) -> None:
        pass

    def backward(self, work: StepWork, mb: int):
        """The step's attempts: the micro-batches (this rank's way), then the agreement
        and the gradients' reduction; an out-of-memory error on any rank has every rank
        redo the step, a stop on any rank gives it up on every rank, a failure ends
        every rank."""
        step = work.step
        given_up = None
        # The reduction after the last backward found that this rank's zeros for a
        # gradient it lacks did not fit: its own out-of-memory error, the step redone.
        zeros_oom = None
        while True:
            try:
                if zeros_oom is not None:
                    mb = self.retry_after_oom(step, mb, work.seq, zeros_oom)
                    self.s.notice(
                        f"step {step}: out of memory on this rank making zeros for gradients "
                        "its samples did not produce, before the gradients' all-reduce; every "
                        "rank of the job drops the step's gradients and its samples start "
                        f"over, this rank's at micro-batch {mb}",
                        level="warn",
                    )
                    zeros_oom = None
                total, mb, predicted = self.accumulate(work, mb)
                value = finite(step, total)
            except _dist.Abandon as e:
                # A stop signal on this rank: the step is given up at the agreement, by
                # every rank together (below).
                given_up = e
            except BaseException as e:
                # Whatever ends the step early (a bad loss, an error in loss_fn, Ctrl-C)
                # leaves no gradient of it behind: a retried step starts clean.
                self.s.clear_grads()
                self.fail(step, e)
                raise
            if given_up is not None and given_up.agreed:
                return self.give_up_step(step, given_up)
            if given_up is None and self.overlaps():
                # The agreement came before the last backward, the gradients' all-reduce
                # during it.
                break
            agreed = self.job.agree(step, _dist.ABANDON if given_up else _dist.OK)
            self.agreed(step, agreed)
            if agreed.abandon:
                return self.give_up_step(step, given_up)
            redo, zeros_oom = self.reduce(step, agreed.grads_agree)
            if not redo:
                break
        return value, mb, predicted

    def reduce(self, step: int, grads_agree: bool) -> tuple[bool, str | None]:
        """After the agreement: the gradients' reduction, where headroom makes it (DDP);
        whether every rank redoes the step, and this rank's own out-of-memory error."""
        return False, None

    def between_micro_batches(self, done: int, samples: int) -> None:
        if self.signals.abandon_requested():
            raise _dist.Abandon(done, samples)

    def give_up_step(self, step: int, here: _dist.Abandon | None):
        """A job's stop during a step: every rank drops the step's gradients at the same
        agreement; the parameters are those of the last completed step, which the stop's
        checkpoint (at run.step's boundary) saves on every rank. run.step applies
        nothing."""
        s = self.s
        s.clear_grads()
        self.signals.gave_up_a_step = True
        where = f"after {here.done} of {here.samples} samples on this rank " if here else ""
        what = dropped(here.done, here.samples) if here else "its gradients are dropped"
        s.notice(
            f"step {step} given up by every rank of the job {where}(a stop signal): "
            f"{what}; {s.stop_saves('is')}, and a resume redoes step {step}",
            level="warn",
            source="signal",
        )
        return GIVEN_UP

    def save_on_give_up(self) -> str:
        if self.s.on_checkpoint is None:
            return super().save_on_give_up()
        return "no checkpoint was taken (under torchrun a save is every rank's together)"

    def gated(self, step: int, fn, *args):
        """A collective of headroom's; a peer gone under it (gloo sees its connection
        close) ends this rank naming it, as the agreement does."""
        try:
            return fn(*args)
        except Exception as e:
            if _fsdp.is_comm_error(e):
                raise self.job.peer_lost(step, self.job.agreements, e) from e
            raise
