"""A rank of an FSDP2 job (the model sharded): the same number of micro-batches on every
rank, every all-gather and reduce-scatter behind a gate, and an out-of-memory error on any
rank ending the attempt on every rank, FSDP put back and the step's samples run again from
the first (the rules: `_fsdp`; docs/PYTHON.md, "Several processes", FSDP2)."""

from __future__ import annotations

from typing import Any

import torch

from . import _args, _dist, _fsdp, _torch
from ._errors import OutOfMemory, RankFailed
from ._job import JobRank
from ._rank import StepWork
from ._signals import Signals
from ._state import RunState


class ShardedRank(JobRank):
    def __init__(
        self,
        s: RunState,
        signals: Signals,
        plan: Any,
        model: Any,
        job_id: str,
        root: Any,
        sharded_accumulation: str,
    ):
        super().__init__(s, signals, plan, model, job_id)
        self.fsdp = root
        # Every unit's collectives behind a gate, on a gloo group of their own.
        self.gates = _fsdp.Gates(self.job.dist, self.job.dist.new_group(backend="gloo"))
        self.units = _fsdp.install(root, self.gates)
        self.sharded_accumulation = sharded_accumulation
        self.grad_bytes = _fsdp.unsharded_grad_bytes(root)
        # Whether the unsharded gradients are held until the last micro-batch: this
        # rank's vote (its own limit decides), and the job's one answer.
        self.hold_own = _fsdp.holds_unsharded(
            sharded_accumulation, self.grad_bytes, s.native.limit_bytes
        )
        self.hold = self.job.agree_hold(self.hold_own)

    def describe(self, world: int) -> str:
        job, eff = self.job, self.s.effective
        return (
            f"torchrun job {job.job_id}: rank {job.rank} of {world}, FSDP2 with "
            f"{self.units} units; effective_batch {eff} is per rank, so the "
            f"global batch is {eff * world} samples per step. The ranks agree "
            "on each step's number of micro-batches (the largest any rank needs), every "
            "all-gather and reduce-scatter waits behind a gate, and an out-of-memory error "
            "on any rank has every rank redo the step. Between micro-batches "
            + self.accumulation_text()
        )

    def accumulation_text(self) -> str:
        held = f"{self.grad_bytes / 2**20:.1f} MiB"
        limit = self.s.native.limit_bytes
        share = f", {self.grad_bytes / limit:.0%} of the limit" if limit > 0 else ""
        how = (
            "another rank's choice: every rank reduces alike"
            if self.hold_own and not self.hold
            else "sharded_accumulation=" + repr(self.sharded_accumulation)
            if self.sharded_accumulation != "auto"
            else "at most a tenth of the limit: held"
            if self.hold
            else "over a tenth of the limit: reduced"
        )
        if self.hold:
            return (
                f"each rank holds its units' unsharded gradients ({held}{share}; {how}) "
                "and reduce-scatters them once, after the last"
            )
        return (
            f"each rank reduce-scatters its gradients after every micro-batch, so they stay "
            f"sharded (unsharded they would take {held}{share}; {how})"
        )

    def close(self) -> None:
        # The gates open: a forward after the run (an evaluation, an export) collects as
        # FSDP does without headroom; their group goes with the run.
        self.gates.close()
        super().close()

    def accumulate(self, work: StepWork, mb: int):
        """One step's micro-batches under FSDP2: as many on every rank (the ranks agree on
        the count), an out-of-memory error on any rank ending the attempt on every rank
        (the gates), FSDP reset, the gradients dropped and the step's samples run again
        from the first at the new count. Returns the weighted loss, the micro-batch and
        the memory predicted for it; a rank's failure is raised on it (and said to the
        others at the agreement)."""
        s, job, gates, model = self.s, self.job, self.gates, self.fsdp
        step, n, seq = work.step, work.n, work.seq
        while True:
            count = self.gated(step, gates.count, -(-n // mb))
            if count == 0:
                # A rank gave up (one sample does not fit it): the agreement says which.
                self.agreed(step, job.agree(step, _dist.OK))
                raise RankFailed(
                    f"step {step}: another rank of the job gave up; rank {job.rank} ends too"
                )
            sizes = [n // count + (i < n % count) for i in range(count)]
            mb = max(sizes)
            predicted = s.native.predicted_bytes(mb, seq)
            s.meter.reset()
            total = torch.zeros((), device=s.device)
            status, failed = _fsdp.RUNNING, None
            start = 0
            gates.leaving = self.signals.abandon_requested
            try:
                for i, size in enumerate(sizes):
                    if self.signals.abandon_requested():
                        raise _fsdp.StopRequested("a stop signal on this rank")
                    _fsdp.set_sync(model, i == count - 1 or not self.hold)
                    end = start + size
                    with s.levers.autocast():
                        loss = work.loss_fn(work.cut(work.batch, start, end))
                    _args.micro_batch_loss(loss, step, start, end)
                    weight = work.weight(size)
                    _torch.backward_of(loss * weight, work.backward, work.scaler)
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
                    raise job.peer_lost(step, job.agreements, e) from e
                if not _torch.is_oom(e, capped=s.hard_limit):
                    # Out of the step before the others: they leave at their next gate.
                    self.gated(step, gates.leave, _fsdp.FAILED)
                    _fsdp.reset(model)
                    raise
                status = _fsdp.OOM
                failed = _torch.first_line(e)
            finally:
                gates.leaving = None
            worst = self.gated(step, gates.leave, status)
            if worst == _fsdp.RUNNING:
                return total, mb, predicted
            _fsdp.reset(model)
            s.clear_grads()
            _torch.free_memory(s.device)
            if worst == _fsdp.FAILED:
                # The failing rank says who and why at the agreement, where this rank ends.
                return total, mb, predicted
            if worst == _fsdp.ABANDON:
                # A stop signal on some rank, mid-step: every rank gives the step up at the
                # agreement (JobRank.backward), its gradients already dropped here.
                raise _dist.Abandon(start, n)
            if failed is None:
                s.notice(
                    f"step {step}: another rank of the job ran out of memory; every rank redoes "
                    f"the step's samples",
                    level="warn",
                    source="job",
                )
                continue
            # No last resort here (the run was opened without it): one rank's switch of
            # checkpointing would change its collectives.
            retry, _, _ = s.native.oom(step, mb, seq, failed)
            s.snapshot_oom(step)
            if retry is None:
                self.gated(step, gates.count, 0, True)
                raise OutOfMemory(
                    f"step {step} ran out of memory at micro-batch {mb} ({seq} tokens per "
                    f"sample) repeatedly: {failed}; {self.save_on_give_up()}. Give the run "
                    "more memory or make a sample smaller"
                )
            s.notice(
                f"step {step}: out of memory on this rank at micro-batch {mb}; every rank of the "
                f"job redoes the step's samples, this one at micro-batch {retry}",
                level="warn",
                source="job",
            )
            mb = retry
