"""A `headroom.Run` as one rank of a torchrun job: who the rank is, what it tells the job,
and what the job's agreement (`_dist.Job`, the collectives) has it do: end with a rank
that failed, take the viewers' commands at the same step as every rank, stop together."""

from __future__ import annotations

import contextlib
import math

import torch

from . import _args, _dist, _fsdp, _torch
from ._errors import OutOfMemory, RankFailed
from ._signals import dropped

# run.backward's answer to run.step when a torchrun job gave the step up (a stop).
GIVEN_UP = ("given up",)


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


class JobRank:
    """`headroom.Run`'s side of a torchrun job (a part of the class, kept here)."""

    def _start_job(self, model, world: int, job_id: str | None) -> None:
        """Joins the job (`job_id`), or none (None). Collective: every rank's Run gets
        here (docs/PYTHON.md, torchrun)."""
        self._job = None
        self._job_commands: list[str] = []
        if job_id is not None:
            self._job = _dist.Job(self, model, self._params, job_id)
            job = self._job
            if job.fsdp is not None:
                job.grad_bytes = _fsdp.unsharded_grad_bytes(job.fsdp)
                job.hold_own = _fsdp.holds_unsharded(
                    self._sharded_accumulation, job.grad_bytes, self._native.limit_bytes
                )
                job.hold = job.agree_hold(job.hold_own)
            self._say_job(world)

    def _say_job(self, world: int) -> None:
        job = self._job
        if self._adaptive and job.fsdp is not None:
            text = (
                f"torchrun job {job.job_id}: rank {job.rank} of {world}, FSDP2 with "
                f"{job.units} units; effective_batch {self._effective} is per rank, so the "
                f"global batch is {self._effective * world} samples per step. The ranks agree "
                "on each step's number of micro-batches (the largest any rank needs), every "
                "all-gather and reduce-scatter waits behind a gate, and an out-of-memory error "
                "on any rank has every rank redo the step. Between micro-batches "
                + self._accumulation_text()
            )
        elif self._adaptive:
            text = (
                f"torchrun job {job.job_id}: rank {job.rank} of {world}; effective_batch "
                f"{self._effective} is per rank, so the global batch is {self._effective * world} "
                "samples per step. Each rank's controller sizes its own micro-batches (all under "
                "DDP's no_sync(), so an out-of-memory error stays local); before each rank's "
                "last backward the ranks agree, and the gradients' all-reduce runs during that "
                "backward, bucket by bucket as DDP's does"
                if job.overlap is not None
                else "DDP's no_sync(), so an out-of-memory error stays local); after every "
                "rank's micro-batches the ranks agree, then the gradients are all-reduced once"
                + (f" ({job.serial_why})" if job.serial_why else "")
            )
        else:
            text = (
                f"torchrun job {job.job_id}: rank {job.rank} of {world}, watched; each report "
                "joins the job's agreement (rank 0 serves every rank's row; commands reach "
                "every rank at the same step)"
            )
        self.notice(text)

    def _accumulation_text(self) -> str:
        job = self._job
        held = f"{job.grad_bytes / 2**20:.1f} MiB"
        limit = self._native.limit_bytes
        share = f", {job.grad_bytes / limit:.0%} of the limit" if limit > 0 else ""
        how = (
            "another rank's choice: every rank reduces alike"
            if job.hold_own and not job.hold
            else "sharded_accumulation=" + repr(self._sharded_accumulation)
            if self._sharded_accumulation != "auto"
            else "at most a tenth of the limit: held"
            if job.hold
            else "over a tenth of the limit: reduced"
        )
        if job.hold:
            return (
                f"each rank holds its units' unsharded gradients ({held}{share}; {how}) "
                "and reduce-scatters them once, after the last"
            )
        return (
            f"each rank reduce-scatters its gradients after every micro-batch, so they stay "
            f"sharded (unsharded they would take {held}{share}; {how})"
        )

    def _job_note(self, micro_batch: int, peak: int, dt: float, loss: float) -> None:
        """This rank's figures for its row at the next agreement."""
        limit, usage = self._native.last_memory
        self._job.last = {
            "micro_batch": float(micro_batch),
            "peak": float(peak),
            "limit": float(limit),
            "usage": usage,
            "step_time": dt,
            "loss": loss,
        }

    def _job_fail(self, step: int, error: BaseException) -> None:
        """This rank cannot finish the step: the others learn why at the agreement,
        instead of waiting there for it."""
        if isinstance(error, (RankFailed, _fsdp.CollectiveFailed)):
            # The others know already, or are inside a collective and cannot be told.
            return
        text = f"{type(error).__name__}: {error}".strip()
        # Best effort: the original error is what this rank raises either way.
        with contextlib.suppress(Exception):
            self._job.agree(step, _dist.FAILED, error=text)

    def _job_agreed(self, step: int, a: _dist.Agreement) -> None:
        """What the agreement says every rank does: end (another rank failed), take the
        commands at this step's end, stop after this step."""
        if a.failed:
            self._clear_grads()
            rank, text = next(iter(a.failed.items()))
            raise RankFailed(
                f"step {step}: rank {rank} of the job failed ({text}); rank {self._job.rank} "
                "ends too"
            )
        # Added to, not replaced: a step redone after an out-of-memory error agrees more
        # than once before its boundary takes them.
        self._job_commands.extend(a.commands)
        if a.stop_by and not self._native.stop_requested:
            who = ", ".join(map(str, a.stop_by))
            self._native.request_stop(
                f"a stop signal (rank {who}); every rank of the job stops after step {step}"
            )

    def _give_up_step(self, step: int, here: _dist.Abandon | None) -> float:
        """A job's stop during a step: every rank drops the step's gradients at the same
        agreement; the parameters are those of the last completed step, which the stop's
        checkpoint (at run.step's boundary) saves on every rank. Returns NaN: the step has
        no loss, and run.step applies nothing."""
        self._clear_grads()
        self.stop_gave_up_a_step = True
        where = f"after {here.done} of {here.samples} samples on this rank " if here else ""
        what = dropped(here.done, here.samples) if here else "its gradients are dropped"
        self._native.notice_text(
            f"step {step} given up by every rank of the job {where}(a stop signal): "
            f"{what}; {self._stop_saves('is')}, and a resume redoes step {step}",
            level="warn",
            source="signal",
        )
        self._accumulated = GIVEN_UP
        return math.nan

    def _job_boundary(self) -> None:
        """The step boundary of a job: the commands agreed on, then, while paused, rounds
        of the agreement every 100 ms, so every rank resumes (or stops) at the same one."""
        job = self._job
        while True:
            commands, self._job_commands = self._job_commands, []
            actions = self._native.apply_commands(commands)
            job.applied += len(commands)
            self._handle_pending_signals()
            for cid, kind in actions:
                self._native.confirm(cid, self._carry_out(kind))
            if not self._native.paused:
                return
            self._job_agreed(self._step, job.agree(self._step, wait_s=0.1))

    def _take_commands(self, wait_s: float) -> list[str]:
        """A viewer's commands, raw, for the job's agreement. A signal arriving while the
        extension waits is acted on after (it would need the run the wait borrows)."""
        self._in_poll = True
        try:
            return self._native.take_commands(wait_s)
        finally:
            self._in_poll = False
            self._handle_pending_signals()

    # ---- DDP: the gradients' all-reduce overlapped with the last backward (_overlap) ---

    def _overlapped(self) -> bool:
        """A DDP job's gradients are all-reduced during the last backward (a job under
        FSDP2 never has an overlap)."""
        return self._job is not None and self._job.overlap is not None

    def _before_last_backward(self, step: int, done: int, samples: int) -> None:
        """This rank's last micro-batch of the step has run its forward: the ranks agree
        here (a failure, a stop, the commands), so that once the buckets start going
        during the backward nothing but the verdict can end the step."""
        job = self._job
        a = job.agree(step, _dist.OK)
        self._job_agreed(step, a)
        if a.abandon:
            raise _dist.Abandon(done, samples, agreed=True)
        job.overlap.arm()

    def _after_last_backward(
        self, step: int, oom: bool = False, failed: bool = False
    ) -> tuple[bool, str | None]:
        """This rank's last backward has ended (`oom`, `failed`: how it failed; `failed`
        also for a loss that is not finite): the verdict. A rank that failed raises its
        own error after this (the agreement then says it to the others, who end here).
        Returns whether every rank redoes the step's samples, and this rank's own
        out-of-memory error if its zeros for a gradient it lacks did not fit: the caller
        handles it as one in its last backward."""
        job = self._job
        v = job.end_overlap(step, oom, failed)
        if failed:
            # This rank's own error is raised by its caller, and its agreement tells the
            # others (who are at theirs below), whatever else the verdict says.
            return False, None
        if v.failed:
            self._clear_grads()
            self._job_agreed(step, job.agree(step, _dist.OK))
            raise RankFailed(
                f"step {step}: another rank of the job failed; rank {job.rank} ends too"
            )
        if v.twice:
            job.set_overlap(False)
            self._native.notice_text(
                f"step {step}: a gradient was accumulated twice in one backward (a parameter "
                "used inside and outside a reentrant checkpoint?), so its bucket's all-reduce "
                "had left too early: every rank redoes the step, and the gradients are "
                "all-reduced after the last backward from now on",
                level="warn",
                source="job",
            )
        elif v.oom and not (oom or v.zeros_oom):
            self._native.notice_text(
                f"step {step}: another rank of the job ran out of memory in its last backward "
                "while the gradients were being all-reduced; every rank redoes the step's samples",
                level="warn",
                source="job",
            )
        return v.redo, v.zeros_oom

    def _job_reduce(self, step: int, grads_agree: bool) -> tuple[bool, str | None]:
        """The gradients' all-reduce after every rank's last backward (the overlap off).
        Returns whether every rank redoes the step's samples (the gradients dropped), and
        this rank's own out-of-memory error if its zeros for a gradient it lacks did not
        fit: the caller handles it as one in its micro-batches."""
        v = self._job.reduce(step, grads_agree)
        if v is None or not v.redo:
            return False, None
        self._clear_grads()
        if v.zeros_oom is None:
            self._native.notice_text(
                f"step {step}: another rank of the job ran out of memory making zeros for "
                "gradients its samples did not produce, before the gradients' all-reduce; "
                "every rank redoes the step's samples",
                level="warn",
                source="job",
            )
        return True, v.zeros_oom

    # ---- FSDP2: the same micro-batches on every rank, every collective gated ------------

    def _accumulate_sharded(
        self, batch, loss_fn, cut, n: int, seq: int, step: int, mb: int, reduction, backward, scaler
    ):
        """One step's micro-batches under FSDP2: as many on every rank (the ranks agree on
        the count), an out-of-memory error on any rank ending the attempt on every rank
        (the gates), FSDP reset, the gradients dropped and the step's samples run again
        from the first at the new count. Returns the weighted loss, the micro-batch and
        the memory predicted for it; a rank's failure is raised on it (and said to the
        others at the agreement)."""
        job = self._job
        gates = job.gates
        model = job.fsdp
        while True:
            count = self._gated(step, gates.count, -(-n // mb))
            if count == 0:
                # A rank gave up (one sample does not fit it): the agreement says which.
                self._job_agreed(step, job.agree(step, _dist.OK))
                raise RankFailed(
                    f"step {step}: another rank of the job gave up; rank {job.rank} ends too"
                )
            sizes = [n // count + (i < n % count) for i in range(count)]
            mb = max(sizes)
            predicted = self._native.predicted_bytes(mb, seq)
            self._meter.reset()
            total = torch.zeros((), device=self.device)
            status, failed = _fsdp.RUNNING, None
            start = 0
            gates.leaving = self._abandon_step_requested
            try:
                for i, size in enumerate(sizes):
                    if self._abandon_step_requested():
                        raise _fsdp.StopRequested("a stop signal on this rank")
                    _fsdp.set_sync(model, i == count - 1 or not job.hold)
                    end = start + size
                    with self._levers.autocast():
                        loss = loss_fn(cut(batch, start, end))
                    _args.micro_batch_loss(loss, step, start, end)
                    weight = size / n if reduction == "mean" else 1.0
                    _torch.backward_of(loss * weight, backward, scaler)
                    total += loss.detach() * weight
                    loss = None
                    start = end
            except _fsdp.PeerOutOfMemory:
                status = _fsdp.OOM
            except (_fsdp.StopRequested, _fsdp.PeerAbandoned):
                status = _fsdp.ABANDON
            except _fsdp.PeerFailed:
                status = _fsdp.FAILED
            except _fsdp.CollectiveFailed:
                raise
            except Exception as e:
                loss = None
                if _fsdp.is_comm_error(e):
                    # A peer is gone (died, or failed outside headroom): name it.
                    raise job._peer_lost(step, job.agreements, e) from e
                if not _torch.is_oom(e, capped=self._hard_limit):
                    # Out of the step before the others: they leave at their next gate.
                    self._gated(step, gates.leave, _fsdp.FAILED)
                    _fsdp.reset(model)
                    raise
                status = _fsdp.OOM
                failed = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            finally:
                gates.leaving = None
            worst = self._gated(step, gates.leave, status)
            if worst == _fsdp.RUNNING:
                return total, mb, predicted
            _fsdp.reset(model)
            self._clear_grads()
            _torch.free_memory(self.device)
            if worst == _fsdp.FAILED:
                # The failing rank says who and why at the agreement, where this rank ends.
                return total, mb, predicted
            if worst == _fsdp.ABANDON:
                # A stop signal on some rank, mid-step: every rank gives the step up at the
                # agreement (run.backward), its gradients already dropped here.
                raise _dist.Abandon(start, n)
            if failed is None:
                self._native.notice_text(
                    f"step {step}: another rank of the job ran out of memory; every rank redoes "
                    f"the step's samples",
                    level="warn",
                    source="job",
                )
                continue
            # No last resort here (the run was opened without it): one rank's switch of
            # checkpointing would change its collectives.
            retry, _, _ = self._native.oom(step, mb, seq, failed)
            self._snapshot_oom(step)
            if retry is None:
                self._gated(step, gates.count, 0, True)
                raise OutOfMemory(
                    f"step {step} ran out of memory at micro-batch {mb} ({seq} tokens per "
                    f"sample) repeatedly: {failed}; {self._save_on_give_up()}. Give the run "
                    "more memory or make a sample smaller"
                )
            self._native.notice_text(
                f"step {step}: out of memory on this rank at micro-batch {mb}; every rank of the "
                f"job redoes the step's samples, this one at micro-batch {retry}",
                level="warn",
                source="job",
            )
            mb = retry

    def _gated(self, step: int, fn, *args):
        """One of the gates' collectives; a peer gone under it (gloo sees its connection
        close) ends this rank naming it, as the agreement does."""
        try:
            return fn(*args)
        except Exception as e:
            if _fsdp.is_comm_error(e):
                raise self._job._peer_lost(step, self._job.agreements, e) from e
            raise
