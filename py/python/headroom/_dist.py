"""Many ranks, one job: adaptive micro-batching under torchrun that cannot deadlock.

Why it cannot: every micro-batch of every rank runs under DDP's ``no_sync()``, so an
out-of-memory error in any forward or backward is local and recovered locally, with no
collective half-entered. Once a rank's last micro-batch of the step has run its forward it
enters one small collective, the *agreement* (an all-gather of a fixed record per rank on
headroom's own gloo group); the gradients' all-reduce then runs inside that last
backward, bucket by bucket as DDP's does (``_overlap``), and a small verdict after it
tells every rank whether all of them got through (a rank whose last backward failed still
launches every bucket, so nobody waits; an out-of-memory error there has every rank redo
the step). A rank that fails says so in the agreement (the others raise with its reason
instead of waiting); a rank that dies cannot say anything, and torchrun's agent ends the
job: the others, waiting in the agreement, handle its SIGTERM there and end as failed,
naming the ranks that never arrived.

The agreement also carries what the screen needs (each rank's row for rank 0's
``job_ranks`` record) and what every rank must do at the same step: commands sent to
any rank, a stop asked by a signal on any rank, a pause. Each rank sizes its own
micro-batches with its own controller: the all-reduce sums gradients, not micro-batches,
so ranks with less memory (or a tighter budget) simply split finer.

FSDP2 runs collectives inside forward and backward, where no_sync() cannot help: there
the micro-batch count is agreed and every collective is gated (``_fsdp``).

Only torch.distributed's own machinery moves data between ranks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _fsdp, _internals, _overlap, _torch

# headroom._dist.RankFailed stays importable (it was defined here before _errors).
from ._errors import RankFailed, RunError

# One record per rank, float64, in this order.
FIELDS = (
    "status",  # OK, FAILED or ABANDON
    "step",  # steps this rank completed before this agreement
    "micro_batch",
    "peak",
    "limit",
    "usage",
    "ooms",
    "step_time",
    "loss",  # NaN before the first step
    "want_stop",  # a signal on this rank asks the job to stop
    "cmd_bytes",  # commands from viewers waiting on this rank
    "none_sum",  # which parameters have no gradient (`missing_key`) ...
    "none_count",  # ... and how many: must agree, or the reduction zero-fills
    "paused",
    "applied",  # commands this rank has carried out
)
_I = {name: i for i, name in enumerate(FIELDS)}
OK, FAILED, ABANDON = 0.0, 1.0, 2.0


def missing_key(none: list[int]) -> float:
    """Which parameters (by index) have no gradient, as one float64 the agreement carries:
    a 48-bit hash of the set, exact in a float64. Ranks whose keys differ reduce with
    zeros for what they lack; equal keys for different sets would have them all-reduce
    different tensors, so a sum of per-index terms (equal for {0, 3} and {1, 2}) will not
    do."""
    digest = hashlib.blake2b(",".join(map(str, none)).encode(), digest_size=6).digest()
    return float(int.from_bytes(digest, "little"))


# The gradient all-reduce goes through a preallocated bucket of at most this many bytes
# per dtype (DDP's default bucket size): allocated before the first step, so the
# reduction itself never allocates, and never runs out of memory.
BUCKET_BYTES = 25 << 20

# Waiting in the agreement: after this long, say which ranks have not arrived; after a
# stop signal (torchrun ending the job), give the missing ranks this long, then fail.
SAY_WAITING_S = 10.0
# After this long at an agreement a rank marks its arrival in the job's store (the slow
# path only: a fast agreement never touches the store).
MARK_ARRIVAL_S = 0.2
GRACE_AFTER_SIGNAL_S = 3.0
# torchrun kills a worker 30 s after its SIGTERM; a rank still missing by then is
# given up on a little before, so this one's end is recorded.
STOP_DEADLINE_S = 25.0


class Abandon(Exception):
    """A stop signal reached this rank mid-step: it leaves its micro-batches for the
    agreement, where every rank gives the step up together."""

    def __init__(self, done: int, samples: int, agreed: bool = False):
        super().__init__(f"step given up after {done} of {samples} samples")
        self.done, self.samples = done, samples
        # The agreement already said so (another rank's stop, seen before this rank's
        # last backward): nothing is left to agree.
        self.agreed = agreed


def _ranks_text(ranks: list[int], bare: bool = False) -> str:
    if not ranks:
        return " another rank" if bare else ""
    names = ", ".join(map(str, ranks))
    text = f"rank {names}" if len(ranks) == 1 else f"ranks {names}"
    return f" {text}" if bare else f" ({text} missing)"


def world_size() -> int:
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size()


def _is_ddp(model: Any) -> bool:
    return isinstance(_torch.uncompiled(model), torch.nn.parallel.DistributedDataParallel)


def refuse_unsupported(model: Any, world: int) -> None:
    """Adaptive mode under a process group is built for DDP and FSDP2: say what else
    gets."""
    # torch.compile of the wrapped model: what it wraps decides.
    model = _torch.uncompiled(model)
    if _fsdp.is_fsdp2(model):
        why = _fsdp.check(model)
        if why is not None:
            raise RunError(
                f"adaptive mode under a process group of {world} ranks with FSDP2: {why}; "
                "watch the run with run.report(loss) (create the Run without effective_batch=)"
            )
        return
    if "DeepSpeed" in type(model).__name__:
        raise RunError(deepspeed_refusal(f"under a process group of {world} ranks"))
    for m in model.modules() if isinstance(model, torch.nn.Module) else ():
        kind = type(m).__name__
        if kind == "FullyShardedDataParallel" or kind.startswith("FSDP"):
            raise RunError(
                f"adaptive mode under a process group of {world} ranks with FSDP1 ({kind}) or "
                "an FSDP2 unit below the model given: headroom gates FSDP2's collectives "
                "(torch.distributed.fsdp.fully_shard), each unit's and the root's; apply "
                "fully_shard to the blocks and then to the whole model, and give the Run "
                "that root. Or watch the run with run.report(loss)"
            )
    if not _is_ddp(model):
        raise RunError(
            f"adaptive mode under a process group of {world} ranks needs the model wrapped "
            "in torch.nn.parallel.DistributedDataParallel (headroom runs its micro-batches "
            "under no_sync() and all-reduces the gradients once per step through DDP's "
            "process group) or sharded with FSDP2's fully_shard (headroom gates its "
            f"collectives); got {type(model).__name__}"
        )
    hooks = _internals.ddp_comm_hooks(model)
    if hooks:
        raise RunError(
            f"adaptive mode under a process group of {world} ranks with a DDP communication "
            f"hook ({', '.join(hooks)}): headroom runs every micro-batch under no_sync() and "
            "all-reduces the step's averaged gradients itself, so the hook would never run "
            "and the gradients would not be the ones it makes (compressed, PowerSGD's). "
            "Register no hook to train adaptively, or watch the run with run.report(loss)"
        )


def deepspeed_refusal(where: str) -> str:
    """Why adaptive mode refuses DeepSpeed, and what to do instead: one text for a loop,
    the HF Trainer and Lightning."""
    return (
        f"adaptive mode {where} with DeepSpeed: its engine partitions the gradients and "
        "the optimizer state (ZeRO) and reduces them in its own backward hooks at its own "
        "accumulation boundary, so headroom can neither cut a step into micro-batches "
        "the ranks agree on nor have every rank redo a step after one rank's out-of-memory "
        "error. Shard with FSDP2 instead (torch.distributed.fsdp.fully_shard; the HF "
        'Trainer\'s fsdp="full_shard" with fsdp_config={"fsdp_version": 2}; '
        "Lightning's ModelParallelStrategy), which headroom gates; or watch the DeepSpeed "
        "run (run.report(loss), headroom.hf.Watch, headroom.lightning.Watch)"
    )


def refuse_process_group() -> None:
    """run.backward() in a run that joined no job, under a process group of many ranks."""
    world = world_size()
    if world > 1:
        raise RunError(
            f"run.backward() under an initialised process group of {world} ranks: each rank "
            "would pick its own micro-batches, and DDP's gradient all-reduce would then wait "
            "for backward passes other ranks never make (a deadlock). Synchronised adaptive "
            "batching across ranks is not built yet; watch each rank with run.report(loss) "
            "instead"
        )


def poll_pause(waited_s: float) -> float:
    """The sleep before a wait's next look at its collective, after `waited_s`: a
    sixteenth of the wait so far (20 µs at least, 10 ms at most), so a collective is seen
    done at most ~6% after it is (py/bench/agree_wait.py: 0.04-1.0 ms late where the
    rank waited for arrives 0.5-20 ms after this one; 0.06-1.7 ms with the fixed 0.2 ms
    steps before)."""
    return min(0.01, max(2e-5, waited_s / 16))


OVERLAP_ENV = "HEADROOM_DDP_OVERLAP"


def overlap_asked() -> str:
    """HEADROOM_DDP_OVERLAP: on, off or auto (unset). Checked as a Run starts, before
    anything is set up."""
    asked = os.environ.get(OVERLAP_ENV, "auto").strip().lower() or "auto"
    if asked not in ("on", "off", "auto"):
        raise RunError(
            f"{OVERLAP_ENV}={os.environ[OVERLAP_ENV]!r}: say on (the gradients' all-reduce "
            "overlaps the last backward), off (after it) or auto (the default), or unset it"
        )
    return asked


def overlap_facts(group, params: list[torch.nn.Parameter]) -> tuple[str, bool, int, int]:
    """What this rank knows for `overlap_pays`: HEADROOM_DDP_OVERLAP, whether its
    gradients go through gloo on the CPU, its compute threads, its cores."""
    asked = overlap_asked()
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    cpu_gloo = backend == "gloo" and all(p.device.type == "cpu" for p in params)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return asked, cpu_gloo, torch.get_num_threads(), cores


def overlap_pays(gathered: list[tuple[str, str, bool, int, int]]) -> bool:
    """Whether the job's gradients are all-reduced during the last backward (else after
    it), from every rank's (host, asked, cpu_gloo, threads, cores): the same answer on
    every rank. HEADROOM_DDP_OVERLAP=off on any rank, or on, decides. By default the
    overlap is on, except for gloo on the CPU where a host's ranks' compute threads and
    one communication thread each fill its cores: there the all-reduce competes with the
    backward for the same cores and hides nothing, and the overlap's hooks, copies and
    verdict are extra (py/bench/ddp.py on 2 cores, docs/BENCHMARKS.md: headroom 1.039 and
    1.048 × plain DDP overlapped, 1.000 and 1.007 × after the backward, 2 and 4 ranks)."""
    asked = {g[1] for g in gathered}
    if "off" in asked:
        return False
    if "on" in asked:
        return True
    if not all(g[2] for g in gathered):
        return True
    load: dict[str, int] = {}
    cores: dict[str, int] = {}
    for host, _, _, threads, n in gathered:
        load[host] = load.get(host, 0) + threads + 1
        cores[host] = min(cores.get(host, n), n)
    return all(load[h] <= cores[h] for h in load)


@dataclass
class Agreement:
    """What every rank learned at one agreement: the same on every rank."""

    rows: list[dict[str, float]]
    failed: dict[int, str] = field(default_factory=dict)
    abandon: bool = False
    stop_by: list[int] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    grads_agree: bool = True
    waited_us: float = 0.0


class Job:
    """One rank's side of the job: the agreement, the gradient reduction, the rows."""

    def __init__(self, s, model: Any, job_id: str, take_commands, ddp_reduction: bool):
        """`s`: the run's state (_state.RunState); `take_commands(wait_s)`: a viewer's
        commands for the next agreement; `ddp_reduction`: whether headroom all-reduces a
        DDP model's gradients (an adaptive DDP rank)."""
        import torch.distributed as dist

        self.dist = dist
        self.s = s
        self.take_commands = take_commands
        params = s.params
        # torch.compile of the wrapped model: what it wraps is the job's.
        inner = _torch.uncompiled(model)
        self.ddp = inner if _is_ddp(inner) else None
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.job_id = job_id
        # The gradients move through the job's own group (NCCL on GPUs, gloo on CPUs);
        # the records through headroom's own gloo group, on the CPU: no device sync, and
        # nothing interleaves with the user's collectives.
        self.grad_group = self.ddp.process_group if self.ddp is not None else None
        self.meta = dist.new_group(backend="gloo")
        self.params = params
        # The gradients' all-reduce overlapped with the last backward (_overlap), or, once
        # that is off (see set_overlap), after it through the reducer.
        self.overlap: _overlap.Overlap | None = None
        self.reducer: GradReducer | None = None
        # Each rank's host, and what it knows for the choice of overlap (the same choice on
        # every rank: they issue the same collectives).
        mine = (socket.gethostname(), *overlap_facts(self.grad_group, params))
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, mine, group=self.meta)
        self.hosts = [str(g[0]) for g in gathered]
        # Why the gradients go after the last backward, when they do from the start.
        self.serial_why = ""
        if self.ddp is not None and ddp_reduction:
            on = overlap_pays(gathered)
            self.set_overlap(on)
            if not on:
                self.serial_why = (
                    f"{OVERLAP_ENV}=off"
                    if any(g[1] == "off" for g in gathered)
                    else "gloo on a CPU whose cores the ranks' threads fill: the all-reduce "
                    f"could hide behind nothing; {OVERLAP_ENV}=on overlaps it"
                )
        self.want_stop: str | None = None
        self.applied = 0
        self.agreed_applied = 0
        self.last: dict[str, float] = {}
        self.agreements = 0
        self.agree_us_total = 0.0

    def agree_hold(self, mine: bool) -> bool:
        """FSDP2: whether every rank holds its unsharded gradients until the last
        micro-batch. One answer for the job: a rank that reduce-scatters after every
        micro-batch while another holds would enter reduce-scatters the other never
        does (each rank's own limit decides its vote: a capped rank reduces)."""
        t = torch.tensor([1.0 if mine else 0.0], dtype=torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN, group=self.meta)
        return bool(t[0] > 0)

    # ---- the agreement ---------------------------------------------------------------

    def record(self, status: float, commands: list[str]) -> torch.Tensor:
        """This rank's row of the agreement: its last step's figures and what it asks."""
        last = self.last
        none = [i for i, p in enumerate(self.params) if p.grad is None]
        values = {
            "status": status,
            "step": float(self.s.step),
            "micro_batch": float(self.s.native.micro_batch or last.get("micro_batch", 0)),
            "peak": last.get("peak", 0.0),
            "limit": last.get("limit", 0.0),
            "usage": last.get("usage", 0.0),
            "ooms": float(self.s.native.ooms),
            "step_time": last.get("step_time", 0.0),
            "loss": last.get("loss", math.nan),
            "want_stop": 1.0 if self.want_stop else 0.0,
            "cmd_bytes": float(sum(len(c) for c in commands)),
            "none_sum": missing_key(none),
            "none_count": float(len(none)),
            "paused": 1.0 if self.s.native.paused else 0.0,
            "applied": float(self.applied),
        }
        return torch.tensor([values[f] for f in FIELDS], dtype=torch.float64)

    def agree(
        self, step: int, status: float = OK, error: str = "", wait_s: float = 0.0
    ) -> Agreement:
        """The one collective per step every rank enters: what each did, what all do.
        `wait_s`: how long to wait for a viewer's command first (a paused job's rounds)."""
        commands = self.take_commands(wait_s)
        mine = self.record(status, commands)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        t0 = time.perf_counter()
        try:
            with _torch.cap_lifted():
                work = self.dist.all_gather(out, mine, group=self.meta, async_op=True)
            self._wait(work, step, self.agreements)
        except RankFailed:
            raise
        except RuntimeError as e:
            raise self.peer_lost(step, self.agreements, e) from e
        waited = (time.perf_counter() - t0) * 1e6
        self.agreements += 1
        self.agree_us_total += waited
        rows = [{f: float(t[_I[f]]) for f in FIELDS} for t in out]
        a = Agreement(rows=rows, waited_us=waited)
        if any(r["status"] == FAILED for r in rows):
            texts: list[Any] = [None] * self.world
            self.dist.all_gather_object(texts, error, group=self.meta)
            a.failed = {i: str(texts[i]) for i, r in enumerate(rows) if r["status"] == FAILED}
        a.abandon = any(r["status"] == ABANDON for r in rows)
        a.stop_by = [i for i, r in enumerate(rows) if r["want_stop"]]
        if any(r["cmd_bytes"] for r in rows):
            lists: list[Any] = [None] * self.world
            self.dist.all_gather_object(lists, commands, group=self.meta)
            a.commands = [c for per_rank in lists for c in per_rank]
        sums = {(r["none_sum"], r["none_count"]) for r in rows}
        a.grads_agree = len(sums) == 1
        if self.rank == 0:
            self._publish(step, a)
        return a

    def _wait(self, work, step: int, round_: int) -> None:
        """Waits for the collective in Python, so a signal's handler runs meanwhile (a
        blocking wait would sit in C++ through torchrun's SIGTERM until its SIGKILL).

        Once this rank has been signalled (torchrun ending the job, or a stop), the ranks
        still missing are judged through the job's store: one that said it is alive (its
        handler marks it) is finishing its micro-batch and is waited for; one that never
        said so within GRACE_AFTER_SIGNAL_S died, and this rank ends as failed, naming it.
        """
        start = time.monotonic()
        pause = 0.0
        said = False
        marked = False
        signalled_at = None
        while not work.is_completed():
            time.sleep(pause)
            now = time.monotonic()
            pause = poll_pause(now - start)
            if not marked and now - start > MARK_ARRIVAL_S:
                # A slow agreement: say this rank is here, so a rank that loses a peer
                # meanwhile names the ranks that are gone, not the ones still waiting.
                marked = True
                self._mark_arrived(round_)
            if self.want_stop and signalled_at is None:
                signalled_at = now
            if not said and now - start > SAY_WAITING_S:
                said = True
                missing, _ = self._missing(round_)
                self.s.native.notice_text(
                    f"step {step}: waiting {now - start:.0f} s for the other ranks at the "
                    f"agreement{_ranks_text(missing)}",
                    level="warn",
                    source="job",
                )
            if signalled_at is None or now - signalled_at < GRACE_AFTER_SIGNAL_S:
                continue
            missing, silent = self._missing(round_)
            if silent or now - signalled_at > STOP_DEADLINE_S:
                gone = silent or missing
                raise RankFailed(
                    f"the job is ending ({self.want_stop}) and rank {self.rank} waited at "
                    f"step {step}'s agreement for{_ranks_text(gone, bare=True)}, which never "
                    "arrived: it died or failed outside headroom (its own log and torchrun's "
                    "output say why)"
                )
            pause = 0.2
        work.wait()

    def peer_lost(self, step: int, round_: int, error: BaseException) -> RankFailed:
        """A collective failed under this rank (gloo sees a dead peer's connection close at
        once): name the ranks that never arrived, once the live ones have had a moment to
        say they did."""
        self._missing(round_)
        time.sleep(1.0)
        missing, _ = self._missing(round_)
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return RankFailed(
            f"step {step}: the job lost{_ranks_text(missing, bare=True)} (it died or failed "
            f"outside headroom; its own log and torchrun's output say why): {first}"
        )

    def close(self) -> None:
        """The run has ended on this rank: headroom's own groups go now, while the
        interpreter is whole. A gloo group left to the interpreter's teardown can abort
        the process as it exits (torch's gloo workers release their last work then),
        after a run that did everything right."""
        if self.overlap is not None:
            self.overlap.close()
        meta, self.meta = self.meta, None
        if meta is not None:
            self.dist.destroy_process_group(meta)

    def on_signal(self, name: str) -> None:
        """A stop signal reached this rank: the job stops at the next agreement. Marked
        in the job's store too, so ranks already waiting there know this one is alive."""
        self.want_stop = self.want_stop or name
        try:
            store = _internals.default_store()
            store.set(f"headroom/{self.job_id}/alive/{self.rank}", "1")
        except Exception:
            pass

    def _missing(self, round_: int) -> tuple[list[int], list[int]]:
        """The ranks that have not reached this agreement, and those of them that never
        said they are alive since a signal (through the job's store; only on the slow
        path). Unknown (no store): nobody."""
        try:
            store = _internals.default_store()
            arrived = f"headroom/{self.job_id}/arrived/{round_}/"
            self._mark_arrived(round_)
            missing = [r for r in range(self.world) if not store.check([arrived + str(r)])]
            alive = f"headroom/{self.job_id}/alive/"
            silent = [r for r in missing if not store.check([alive + str(r)])]
        except Exception:
            return [], []
        return missing, silent

    def _mark_arrived(self, round_: int) -> None:
        with contextlib.suppress(Exception):
            store = _internals.default_store()
            store.set(f"headroom/{self.job_id}/arrived/{round_}/{self.rank}", "1")

    def _publish(self, step: int, a: Agreement) -> None:
        ranks = []
        for i, r in enumerate(a.rows):
            status = "failed" if r["status"] == FAILED else "paused" if r["paused"] else "running"
            if self.s.native.stop_requested or a.stop_by:
                status = "stopping" if status == "running" else status
            ranks.append(
                {
                    "rank": i,
                    "host": self.hosts[i],
                    "step": int(r["step"]),
                    "micro_batch": int(r["micro_batch"]),
                    "peak_bytes": int(r["peak"]),
                    "limit_bytes": int(r["limit"]),
                    "usage": r["usage"],
                    "ooms": int(r["ooms"]),
                    "step_time_s": r["step_time"],
                    "loss": None if math.isnan(r["loss"]) else r["loss"],
                    "status": status,
                    "commands_applied": int(r["applied"]),
                }
            )
        self.s.native.job_ranks(
            json.dumps(
                {
                    "job": self.job_id,
                    "step": step,
                    "world_size": self.world,
                    "uniform_micro_batch": False,
                    "agree_us": a.waited_us,
                    "ranks": ranks,
                }
            )
        )
        applied = [int(r["applied"]) for r in a.rows]
        if min(applied) > self.agreed_applied and min(applied) == max(applied):
            n = min(applied) - self.agreed_applied
            self.agreed_applied = min(applied)
            self.s.native.notice_text(
                f"{n} command(s) carried out by every rank ({self.world} of {self.world}) "
                f"by step {int(a.rows[0]['step'])}",
                source="job",
            )

    # ---- the step's collectives ------------------------------------------------------

    def no_sync(self):
        """Every micro-batch's backward stays local: no collective can be left half done
        by an out-of-memory error. DDP's own buffer broadcast in forward is taken over by
        :meth:`sync_buffers` (once per step, before any micro-batch), so retried forwards
        never make a rank enter a broadcast the others do not. (FSDP2's collectives are
        gated instead: the sharded accumulation sets its own sync.)"""
        if self.ddp is None:
            return contextlib.nullcontext()
        _internals.ddp_forward_sync_off(self.ddp)
        return self.ddp.no_sync()

    def sync_buffers(self, step: int) -> None:
        """Rank 0's buffers to every rank at the step's start, as DDP does for a step
        of accumulated micro-batches (its first forward broadcasts them)."""
        ddp = self.ddp
        if ddp is None or not ddp.broadcast_buffers:
            return
        buffers = _internals.ddp_buffers(ddp)
        try:
            with torch.no_grad(), _torch.cap_lifted():
                for b in buffers:
                    self.dist.broadcast(b, src=0, group=self.grad_group)
        except RuntimeError as e:
            raise self.peer_lost(step, self.agreements, e) from e

    def set_overlap(self, on: bool) -> None:
        """The gradients' all-reduce during the last backward (on) or after it (off: the
        fallback when a gradient is accumulated twice in one backward, and the benchmark's
        side-by-side). Every rank switches at the same step boundary."""
        if on and self.overlap is None:
            cap = getattr(self.ddp, "bucket_bytes_cap", BUCKET_BYTES)
            self.overlap = _overlap.Overlap(
                self.dist, self.params, self.grad_group, self.world, cap, self.rank
            )
            self.reducer = None
        elif not on:
            if self.overlap is not None:
                self.overlap.close()
                self.overlap = None
            if self.reducer is None:
                self.reducer = GradReducer(self.params, self.grad_group, self.world)

    def end_overlap(self, step: int, oom: bool, failed: bool) -> _overlap.Verdict:
        """After this rank's last backward of a step (done, or failed with `oom` or
        `failed`): the buckets it had not launched, then the verdict every rank reads (on
        headroom's gloo group, so it waits like the agreement: signals and lost peers
        seen), then the all-reduces' results in the gradients. The verdict's `zeros_oom`:
        this rank's zeros for a gradient it lacks did not fit, its own out-of-memory error
        in the last backward for every purpose (the caller's controller is told)."""
        ov = self.overlap
        zeros_oom = None
        try:
            try:
                ov.launch_rest(abort=oom or failed)
            except RuntimeError as e:
                if not _torch.is_oom(e):
                    raise
                zeros_oom = _torch.first_line(e)
                ov.launch_rest(abort=True)
            mine = ov.verdict_record(oom or zeros_oom is not None, failed)
            with _torch.cap_lifted():
                work = self.dist.all_reduce(mine, group=self.meta, async_op=True)
            self._wait(work, step, self.agreements)
            self.agreements += 1
            v = ov.read(mine, len(self.params))
            v.zeros_oom = zeros_oom
            if v.redo or v.failed:
                ov.abort = True
            # Allocates nothing: every gradient a bucket copies back into exists.
            ov.drain()
        except RankFailed:
            raise
        except RuntimeError as e:
            if _torch.is_oom(e):
                # Not headroom's: abort mode allocates nothing, nor does anything after
                # the verdict (a collective's own, then).
                raise
            raise self.peer_lost(step, self.agreements, e) from e
        if not (v.redo or v.failed):
            ov.drop_unused(v)
            if v.order is not None:
                ov.relayout(v.order)
        return v

    def reduce(self, step: int, grads_agree: bool) -> _overlap.Verdict | None:
        """The gradients' all-reduce after every rank's last backward (the overlap off).
        When the ranks disagree on which parameters have gradients, each first makes zeros
        for those it lacks, then every rank reads a verdict, as after an overlapped
        backward, before anything is reduced: zeros that did not fit on any rank have
        every rank redo the step (nothing reduced; `zeros_oom` on the rank they did not
        fit), and a parameter no rank has a gradient for keeps none. Returns that verdict
        (None when no zeros were needed)."""
        if self.reducer is None:
            return None
        v = None
        try:
            if not grads_agree:
                had = [p.grad is not None for p in self.params]
                zeros_oom = None
                try:
                    self.reducer.zero_fill()
                except RuntimeError as e:
                    if not _torch.is_oom(e):
                        raise
                    zeros_oom = _torch.first_line(e)
                head = [1.0 if zeros_oom else 0.0, 0.0, 0.0]
                mine = torch.tensor(head + [1.0 if h else 0.0 for h in had], dtype=torch.float64)
                with _torch.cap_lifted():
                    work = self.dist.all_reduce(mine, group=self.meta, async_op=True)
                self._wait(work, step, self.agreements)
                self.agreements += 1
                v = _overlap.Overlap.read(mine)
                v.zeros_oom = zeros_oom
                if v.redo:
                    return v
                for p, has in zip(self.params, v.has_grad):
                    if not has:
                        p.grad = None
            with _torch.cap_lifted():
                self.reducer.reduce()
        except RankFailed:
            raise
        except RuntimeError as e:
            raise self.peer_lost(step, self.agreements, e) from e
        return v


class GradReducer:
    """Averages the gradients over the ranks once per step: bucket by bucket through a
    buffer allocated at start (so the reduction never allocates), in place."""

    def __init__(self, params: list[torch.nn.Parameter], group, world: int):
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        self.world = world
        self.params = params
        self.buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        for p in params:
            key = (p.dtype, p.device)
            sizes[key] = sizes.get(key, 0) + p.numel()
        for (dtype, device), n in sizes.items():
            per = BUCKET_BYTES // torch.empty((), dtype=dtype).element_size()
            self.buffers[(dtype, device)] = torch.empty(min(n, per), dtype=dtype, device=device)

    def zero_fill(self) -> None:
        """Zeros for the gradients this rank lacks, when the ranks disagree on which
        parameters have them (a branch one rank's data took), so every rank reduces the
        same tensors, as DDP does for unused parameters."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def reduce(self) -> None:
        """Every gradient this rank has: the same parameters' on every rank."""
        pending: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p in self.params:
            if p.grad is not None:
                pending.setdefault((p.dtype, p.device), []).append(p.grad)
        for key, grads in pending.items():
            self._reduce_group(self.buffers[key], grads)

    def _reduce_group(self, buf: torch.Tensor, grads: list[torch.Tensor]) -> None:
        batch: list[torch.Tensor] = []
        used = 0
        for g in grads:
            n = g.numel()
            if n > buf.numel():
                self._flush(buf, batch, used)
                batch, used = [], 0
                self.dist.all_reduce(g, group=self.group)
                g.div_(self.world)
                continue
            if used + n > buf.numel():
                self._flush(buf, batch, used)
                batch, used = [], 0
            batch.append(g)
            used += n
        self._flush(buf, batch, used)

    def _flush(self, buf: torch.Tensor, batch: list[torch.Tensor], used: int) -> None:
        if not batch:
            return
        off = 0
        with torch.no_grad():
            for g in batch:
                buf[off : off + g.numel()].view_as(g).copy_(g)
                off += g.numel()
            flat = buf[:used]
            self.dist.all_reduce(flat, group=self.group)
            flat.div_(self.world)
            off = 0
            for g in batch:
                g.copy_(flat[off : off + g.numel()].view_as(g))
                off += g.numel()
