"""A run's rank: the way it trains, as Lightning's Strategy is a loop's. `headroom.Run`
holds one and never asks which: the rank cuts a step into micro-batches and redoes what an
out-of-memory error ended, says what it did, ends a step (the commands, a pause, a stop)
and fails. `SoloRank` (here) is one process; `_job.JobRank` a rank of a torchrun job that
only watches, `_replicated.ReplicatedRank` one under DDP, `_sharded.ShardedRank` one under
FSDP2."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import _args, _dist, _fsdp, _torch
from ._errors import LossError
from ._signals import Signals
from ._state import RunState

# run.backward's answer to run.step when a torchrun job gave the step up (a stop).
GIVEN_UP = ("given up",)


@dataclass
class StepWork:
    """One step's batch as run.backward was handed it: what every attempt at it needs."""

    step: int
    batch: Any
    loss_fn: Callable[[Any], torch.Tensor]
    cut: Callable[[Any, int, int], Any]
    n: int  # samples
    seq: int  # tokens per sample (the controller's memory model)
    reduction: str  # "mean": each micro-batch's loss weighted by its share; "sum": as is
    backward: Callable[[torch.Tensor], Any] | None
    scaler: Any

    def weight(self, size: int) -> float:
        return size / self.n if self.reduction == "mean" else 1.0


def finite(step: int, total: torch.Tensor) -> float:
    """The step's loss, or LossError when it is not finite."""
    value = float(total)
    if not math.isfinite(value):
        raise LossError(
            f"step {step}: the batch's loss is {value} (training diverged, or the data holds "
            "a NaN/inf); the gradients were cleared. Lower the learning rate or check the "
            "batch"
        )
    return value


class Rank:
    """What every rank does alike, and one process's answers where a job's differ."""

    # Whether a watch-only step's device loss may be read on the extension's reporter
    # thread (a job's agreement needs it now).
    reads_loss_off_thread = True
    # The job's agreement (_dist.Job), for a rank of a job.
    job: _dist.Job | None = None

    def __init__(self, s: RunState, signals: Signals, plan: Any = None):
        self.s = s
        self.signals = signals
        self.plan = plan
        signals.rank = self

    # ---- the start and the end -------------------------------------------------------

    def start(self, world: int) -> None:
        """What the rank says as the run starts (a job's rank: how it trains)."""

    def close(self) -> None:
        """The run has ended."""

    # ---- a watched loop's step -------------------------------------------------------

    def report(self, step, value, n, seq_len, dt, lr, grad_norm, diverged) -> None:
        """A watch-only step outside a job: the extension's reporter thread reads the peak
        (on the CPU; CUDA's allocator peak is read here, where torch is) and records the
        step; the boundary runs only when it has work (commands, pause, stop, signals)."""
        s, signals = self.s, self.signals
        peak = s.meter.take_peak if s.meter.cuda else None
        planned = None if self.plan is None else self.plan.predict(n)
        busy = s.native.report(step, value, n, seq_len, dt, lr, grad_norm, peak, planned)
        s.step = step
        if diverged:
            self.diverged(step, value)
        if busy or signals.pending or signals.checkpoint_asked or signals.signalled:
            # The reporter has read this step's peak before the boundary's own work (a
            # checkpoint) and its reset, as the step's peak always excluded them.
            s.native.flush()
            late = s.native.take_diverged()
            if late is not None:
                # A device tensor's loss, read off this thread: said at the next report.
                self.diverged(*late)
            self.boundary()
            return
        s.boundary_t = time.perf_counter()

    def diverged(self, step: int, value: float) -> None:
        error = (
            f"step {step}: the loss given to run.report() is {value} (training diverged, "
            "or the data holds a NaN/inf); the step is recorded without a loss. Lower the "
            "learning rate or check the batch"
        )
        self.s.notice(error, level="error")
        failure = LossError(error)
        self.fail(step, failure)
        raise failure

    # ---- an adaptive step ------------------------------------------------------------

    def check_backward(self) -> None:
        """Before a step: one process under a process group of many ranks would pick its
        own micro-batches, and DDP's all-reduce would wait for backwards others never make."""
        _dist.refuse_process_group()

    def sync_buffers(self, step: int) -> None:
        """At a step's start, before any micro-batch (DDP's buffers)."""

    def backward(self, work: StepWork, mb: int) -> tuple[float, int, int] | tuple[str]:
        """Forward and backward over the step's batch in micro-batches, out-of-memory
        errors recovered: the batch's loss, the micro-batch the step ended at and the
        memory predicted for it (or GIVEN_UP, a job's stop)."""
        try:
            total, mb, predicted = self.accumulate(work, mb)
            return finite(work.step, total), mb, predicted
        except BaseException:
            # Whatever ends the step early (a bad loss, an error in loss_fn, Ctrl-C)
            # leaves no gradient of it behind: a retried step starts clean.
            self.s.clear_grads()
            raise

    def accumulate(self, work: StepWork, mb: int):
        """The micro-batches of one step, forward and backward, with out-of-memory errors
        caught and the remaining samples retried smaller; returns the weighted loss, the
        micro-batch it ended at and the memory predicted for it."""
        s = self.s
        step, n, seq = work.step, work.n, work.seq
        total = torch.zeros((), device=s.device)
        start = 0
        s.meter.reset()
        predicted = s.native.predicted_bytes(mb, seq)
        while start < n:
            self.between_micro_batches(start, n)
            end = min(n, start + mb)
            failed = None
            in_backward = False
            # A job's last backward of the step carries the gradients' all-reduce.
            overlapped = False
            versions = s.grad_versions()
            try:
                with s.levers.autocast():
                    loss = work.loss_fn(work.cut(work.batch, start, end))
                _args.micro_batch_loss(loss, step, start, end)
                weight = work.weight(end - start)
                if end == n and self.overlaps():
                    self.before_last_backward(step, start, n)
                    overlapped = True
                in_backward = True
                _torch.backward_of(loss * weight, work.backward, work.scaler)
                total += loss.detach() * weight
            except Exception as e:
                oom = _torch.is_oom(e, capped=s.hard_limit)
                if overlapped:
                    self.after_last_backward(step, oom=oom, failed=not oom)
                if not oom:
                    raise
                failed = _torch.first_line(e)
            except BaseException:
                if overlapped:
                    self.after_last_backward(step, failed=True)
                raise
            loss = None
            zeros = False
            if failed is None and overlapped:
                redo, failed = self.after_last_backward(
                    step, failed=not math.isfinite(float(total))
                )
                zeros = failed is not None
                if redo and not zeros:
                    # Another rank's last backward ran out of memory: the step's gradients
                    # are dropped on every rank, and its samples start again.
                    s.clear_grads()
                    total = torch.zeros((), device=s.device)
                    start = 0
                    s.meter.reset()
                    continue
            if failed is None:
                start = end
                continue
            # Out of memory: the attempt's tensors went with its frames. In a job's last
            # backward the all-reduce had begun: every rank starts the step over. FSDP2
            # without a job: its units put back to between steps, and the step over too
            # (what its half-run unit had gathered or accumulated cannot be told apart).
            restart = overlapped or (in_backward and s.grads_changed(versions))
            if self.reset_after_oom():
                restart = True
            retry = self.retry_after_oom(step, mb, seq, failed)
            if restart:
                # The backward had already added part of this micro-batch's gradients:
                # they cannot be told apart from the completed ones', so the step's
                # samples start over (exact, at the cost of recomputing them).
                where = (
                    "on this rank making zeros for gradients its samples did not produce, "
                    "after its last backward"
                    if zeros
                    else "in this rank's last backward"
                )
                s.notice(
                    f"step {step}: out of memory {where}, with the gradients' all-reduce "
                    "under way; every rank of the job drops the step's gradients and its "
                    f"samples start over, this rank's at micro-batch {retry}"
                    if overlapped
                    else f"step {step}: the out-of-memory error struck after gradients were "
                    "partly accumulated; the step's samples start over at micro-batch "
                    f"{retry}",
                    level="warn",
                )
                s.clear_grads()
                total = torch.zeros((), device=s.device)
                start = 0
            mb = retry
            s.meter.reset()
            predicted = s.native.predicted_bytes(mb, seq)
        return total, mb, predicted

    def between_micro_batches(self, done: int, samples: int) -> None:
        """Before each micro-batch: a stop signal gives the step up here (one process:
        the run ends; a job's rank leaves for the agreement)."""
        if self.signals.abandon_requested():
            self.signals.give_up_step(done, samples)

    def overlaps(self) -> bool:
        """Whether the step's last backward carries the gradients' all-reduce (DDP)."""
        return False

    def before_last_backward(self, step: int, done: int, samples: int) -> None:
        pass

    def after_last_backward(self, step: int, oom: bool = False, failed: bool = False):
        return False, None

    def reset_after_oom(self) -> bool:
        """After an out-of-memory error in a micro-batch: whatever the model's wrapper left
        half run put back; whether the step must start over for it."""
        return False

    def reset_evaluation(self) -> None:
        """An evaluation chunk ran out of memory: what the model's wrapper left half run put
        back."""

    def retry_after_oom(self, step: int, mb: int, seq: int, failed: str) -> int:
        return self.s.retry_after_oom(step, mb, seq, failed, self.save_on_give_up)

    def save_on_give_up(self) -> str:
        """As `headroom train` does when it gives up: the last completed step saved through
        on_checkpoint (its parameters and optimizer state are untouched by the step given
        up), with the hard cap lifted meanwhile, since the cap is for training's
        allocations and the callback's own objects may need what it holds back. Returns
        what became of the save, for the error."""
        s = self.s
        if s.on_checkpoint is None:
            return "no checkpoint was taken (pass on_checkpoint=fn to have one)"
        try:
            with _torch.cap_lifted():
                path = s.on_checkpoint(s.step)
        except Exception as e:
            return f"the checkpoint failed too: {type(e).__name__}: {e}"
        where = "" if path is None else f" at {os.fspath(path)}"
        if path is not None:
            s.native.checkpoint_saved(s.step, os.fspath(path))
        said = f"the state after step {s.step} is saved by on_checkpoint{where}"
        s.notice(said, level="warn", source="checkpoint")
        return said

    # ---- the step's end --------------------------------------------------------------

    def fail(self, step: int, error: BaseException) -> None:
        """This rank cannot finish the step (one process: nobody to tell)."""

    def stepped(self, next_mb: int, peak: int, dt: float, loss: float) -> None:
        """An adaptive step ended (its figures, for a job's rows)."""

    def stop_signal(self, name: str) -> bool:
        """A stop signal: whether this rank took it (a job's agreement stops every rank at
        one step); one process's run stops by itself."""
        return False

    def commands(self) -> None:
        """At a step's end: the viewers' commands, and while paused, waiting here."""
        s, signals = self.s, self.signals
        while True:
            s.in_poll = True
            try:
                actions = s.native.poll()
            finally:
                s.in_poll = False
            signals.handle_pending()
            for cid, kind in actions:
                s.native.confirm(cid, s.carry_out(kind))
            # Also while paused: the saving is what the signal's sender waits for.
            signals.checkpoint_if_asked()
            if not s.native.paused:
                return

    def boundary(self) -> None:
        """A step's end: commands, a checkpoint a signal or a stop asks for, a stop."""
        s, signals = self.s, self.signals
        s.boundary_t = time.perf_counter()
        self.commands()
        signals.checkpoint_if_asked()
        signals.checkpoint_for_stop()
        signals.after_boundary()
        s.boundary_t = time.perf_counter()
        s.meter.reset()


class SoloRank(Rank):
    """One process (or a world of one: nothing to agree with). Under FSDP2 alone an
    out-of-memory error inside a unit leaves it half run (a unit's parameters gathered and
    never resharded, its state mid-forward), and training on from there learns the wrong
    thing: the units are put back and the step starts over."""

    def __init__(self, s: RunState, signals: Signals, plan: Any = None):
        super().__init__(s, signals, plan)
        self.fsdp = _fsdp.outermost(s.model) if s.adaptive and s.model is not None else None

    def reset_after_oom(self) -> bool:
        if self.fsdp is None:
            return False
        _fsdp.reset(self.fsdp)
        return True

    def reset_evaluation(self) -> None:
        if self.fsdp is not None:
            _fsdp.reset(self.fsdp)
