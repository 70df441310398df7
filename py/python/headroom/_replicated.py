"""A rank of a DDP job (the model replicated on every rank): each rank sizes its own
micro-batches, all under DDP's ``no_sync()`` so an out-of-memory error stays local; the
ranks agree before each rank's last backward, which carries the gradients' all-reduce
bucket by bucket (`_overlap`), or after it, once (`_dist.GradReducer`), with a verdict on
whether every rank got through (docs/PYTHON.md, "Several processes")."""

from __future__ import annotations

from . import _dist
from ._errors import RankFailed
from ._job import JobRank
from ._rank import StepWork


class ReplicatedRank(JobRank):
    replicates = True

    def describe(self, world: int) -> str:
        job, eff = self.job, self.s.effective
        said = (
            f"torchrun job {job.job_id}: rank {job.rank} of {world}; effective_batch "
            f"{eff} is per rank, so the global batch is {eff * world} samples per step. Each "
            "rank's controller sizes its own micro-batches (all under DDP's no_sync(), so an "
            "out-of-memory error stays local); "
        )
        if job.overlap is not None:
            return said + (
                "before each rank's last backward the ranks agree, and the gradients' "
                "all-reduce runs during that backward, bucket by bucket as DDP's does"
            )
        return (
            said + "after every rank's micro-batches the ranks agree, then the gradients are "
            "all-reduced once" + (f" ({job.serial_why})" if job.serial_why else "")
        )

    def sync_buffers(self, step: int) -> None:
        self.job.sync_buffers(step)

    def accumulate(self, work: StepWork, mb: int):
        with self.job.no_sync():
            return super().accumulate(work, mb)

    # ---- the gradients' all-reduce overlapped with the last backward (_overlap) -------

    def overlaps(self) -> bool:
        return self.job.overlap is not None

    def before_last_backward(self, step: int, done: int, samples: int) -> None:
        """This rank's last micro-batch of the step has run its forward: the ranks agree
        here (a failure, a stop, the commands), so that once the buckets start going
        during the backward nothing but the verdict can end the step."""
        job = self.job
        a = job.agree(step, _dist.OK)
        self.agreed(step, a)
        if a.abandon:
            raise _dist.Abandon(done, samples, agreed=True)
        job.overlap.arm()

    def after_last_backward(
        self, step: int, oom: bool = False, failed: bool = False
    ) -> tuple[bool, str | None]:
        """This rank's last backward has ended (`oom`, `failed`: how it failed; `failed`
        also for a loss that is not finite): the verdict. A rank that failed raises its
        own error after this (the agreement then says it to the others, who end here).
        Returns whether every rank redoes the step's samples, and this rank's own
        out-of-memory error if its zeros for a gradient it lacks did not fit: the caller
        handles it as one in its last backward."""
        s, job = self.s, self.job
        v = job.end_overlap(step, oom, failed)
        if failed:
            # This rank's own error is raised by its caller, and its agreement tells the
            # others (who are at theirs below), whatever else the verdict says.
            return False, None
        if v.failed:
            s.clear_grads()
            self.agreed(step, job.agree(step, _dist.OK))
            raise RankFailed(
                f"step {step}: another rank of the job failed; rank {job.rank} ends too"
            )
        if v.twice:
            job.set_overlap(False)
            s.notice(
                f"step {step}: a gradient was accumulated twice in one backward (a parameter "
                "used inside and outside a reentrant checkpoint?), so its bucket's all-reduce "
                "had left too early: every rank redoes the step, and the gradients are "
                "all-reduced after the last backward from now on",
                level="warn",
                source="job",
            )
        elif v.oom and not (oom or v.zeros_oom):
            s.notice(
                f"step {step}: another rank of the job ran out of memory in its last backward "
                "while the gradients were being all-reduced; every rank redoes the step's samples",
                level="warn",
                source="job",
            )
        return v.redo, v.zeros_oom

    def reduce(self, step: int, grads_agree: bool) -> tuple[bool, str | None]:
        """The gradients' all-reduce after every rank's last backward (the overlap off).
        Returns whether every rank redoes the step's samples (the gradients dropped), and
        this rank's own out-of-memory error if its zeros for a gradient it lacks did not
        fit: the caller handles it as one in its micro-batches."""
        v = self.job.reduce(step, grads_agree)
        if v is None or not v.redo:
            return False, None
        self.s.clear_grads()
        if v.zeros_oom is None:
            self.s.notice(
                f"step {step}: another rank of the job ran out of memory making zeros for "
                "gradients its samples did not produce, before the gradients' all-reduce; "
                "every rank redoes the step's samples",
                level="warn",
                source="job",
            )
        return True, v.zeros_oom
