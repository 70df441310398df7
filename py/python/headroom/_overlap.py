"""A DDP job's gradient all-reduce, overlapped with each rank's last backward of a step.

Plain DDP hides most of its gradient all-reduce inside the last micro-batch's backward:
a bucket's all-reduce starts as soon as its gradients are complete. headroom runs that
backward under ``no_sync()`` too (so an out-of-memory error in it can never strand a rank
in a half-entered collective), and without this module it all-reduces every gradient
after the backward, paying the communication on top of the step (docs/BENCHMARKS.md,
"The overlap at 8 GPUs, modelled": 2-15% of a step on 8 GPUs).

Here the buckets are launched by headroom, not by DDP, as their gradients become ready
(``Tensor.register_post_accumulate_grad_hook``), in a layout the same on every rank,
strictly in order (every rank issues the same collectives in the same sequence, as DDP
does). The first layout guesses the order gradients come in (reverse registration); the
first step that ends well lays the buckets out again in the order rank 0's came in (sent
with the verdict), within the buffers already allocated, as DDP rebuilds its buckets
after its first iteration. What keeps the guarantee that no rank's error leaves
another waiting: a rank whose last backward fails still launches every bucket it had not
launched (from preallocated buffers; the contents do not matter), then every rank reads
one small verdict on headroom's own gloo group (out of memory here, failed there, which
parameters have gradients anywhere). An out-of-memory error anywhere in a last backward
has every rank drop the step's gradients and redo its samples: one step of compute, only
for an error the controller makes rare (that micro-batch is no larger than the ones that
just fit in the same step).

Memory: buckets of several gradients go through a ring of ``RING`` buffers per dtype and
device, one allocation at the job's start, each buffer the size of the largest such
bucket (at most DDP's ``bucket_cap_mb``), or of a whole bucket where that dtype and device
has a gradient larger than one. Such a gradient is all-reduced in place, in chunks the
size of the whole ring (views of it, launched in order, the same chunks on every rank:
one collective up to ``RING`` buckets' size, a few more beyond). Nothing else is
allocated, except zeros for a gradient this rank does not have (a branch its data did not
take), as DDP's unused-parameter handling does: made as its bucket is launched, before the
verdict, so an out-of-memory error there is this rank's in its last backward (said in the
verdict: every rank redoes the step), and nothing allocates after the verdict. A rank
whose last backward failed, or whose zeros did not fit, launches its remaining buckets
from the ring alone, a large gradient's chunk by chunk: it allocates nothing, so however
short memory is, it reaches the verdict with the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import _torch

# Buffers per dtype and device: a bucket's buffer is reused two buckets later, after its
# all-reduce has finished (a host wait on gloo, a stream wait on NCCL).
RING = 2
EVERY = frozenset(range(RING))
NONE: frozenset[int] = frozenset()
# DDP's own first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES): small, so the
# communication starts early in the backward.
FIRST_BUCKET_BYTES = 1 << 20


# A dtype and device: gradients of one are bucketed and all-reduced together.
Key = tuple[torch.dtype, torch.device]


@dataclass
class Bucket:
    """Gradients all-reduced together: one dtype and device, contiguous in the buffer."""

    params: list[int]  # indices into the job's parameters
    key: tuple[torch.dtype, torch.device]
    numel: int
    solo: bool  # one gradient larger than a bucket: all-reduced in place, in chunks


@dataclass
class Verdict:
    """What every rank learned after the last backward's buckets: the same everywhere."""

    oom: int  # ranks whose last backward ran out of memory
    failed: int  # ranks whose step failed otherwise (an error, a non-finite loss)
    twice: int  # ranks where a gradient was accumulated twice in one backward
    has_grad: list[bool]  # per parameter: whether any rank has a gradient for it
    # This rank's own out-of-memory error (its first line) making zeros for a gradient it
    # lacks, counted in `oom`: the one field that differs between the ranks.
    zeros_oom: str | None = None
    # Until the layout is redone: the order rank 0's gradients were ready in, the one
    # every rank lays its buckets out in after a step that ends well.
    order: list[int] | None = None

    @property
    def redo(self) -> bool:
        return self.oom > 0 or self.twice > 0


def layout(
    params: list[torch.nn.Parameter],
    cap_bytes: int,
    order: list[int] | None = None,
    slot_bytes: dict[tuple[torch.dtype, torch.device], int] | None = None,
) -> list[Bucket]:
    """The buckets in launch order: the parameters in `order` (by default reverse
    registration order, the order a backward usually completes their gradients, DDP's
    first guess too), packed per dtype and device up to `cap_bytes` (the first bucket up
    to 1 MiB) and, where given, up to that dtype and device's `slot_bytes` (the ring
    already allocated: a layout redone from the order the gradients came in fits it)."""
    if order is None:
        order = list(reversed(range(len(params))))
    buckets: list[Bucket] = []
    # Open buckets, and when each was opened: they close in that order.
    open_: dict[tuple[torch.dtype, torch.device], tuple[int, Bucket]] = {}
    opened = 0
    for i in order:
        p = params[i]
        key = (p.dtype, p.device)
        size = p.element_size()
        limit = cap_bytes if buckets else min(FIRST_BUCKET_BYTES, cap_bytes)
        if slot_bytes is not None and key in slot_bytes:
            limit = min(limit, slot_bytes[key])
        if p.numel() * size > cap_bytes:
            buckets.append(Bucket([i], key, p.numel(), solo=True))
            continue
        b = open_[key][1] if key in open_ else None
        if b is not None and (b.numel + p.numel()) * size > limit:
            buckets.append(open_.pop(key)[1])
            b = None
        if b is None:
            b = Bucket([], key, 0, solo=False)
            open_[key] = (opened, b)
            opened += 1
        b.params.append(i)
        b.numel += p.numel()
    buckets.extend(b for _, b in sorted(open_.values(), key=lambda e: e[0]))
    return buckets


def ring_sizes(
    params: list[torch.nn.Parameter], buckets: list[Bucket], cap_bytes: int
) -> tuple[dict[Key, int], dict[Key, int]]:
    """Per dtype and device: a ring buffer's elements (the largest bucket's of several
    gradients, or a bucket's where there are chunks), and, with a gradient larger than a
    bucket, its chunks' elements: the whole ring's (RING buckets). A rank in abort mode
    sends each chunk from the ring (every rank cuts the same chunks, so the collectives'
    sizes match), and a gradient up to 50 MiB (at DDP's default) still takes one
    collective, as in DDP."""
    slot: dict[Key, int] = {}
    chunk: dict[Key, int] = {}
    for b in buckets:
        size = params[b.params[0]].element_size()
        n = b.numel
        if b.solo:
            n = max(1, cap_bytes // size)
            chunk[b.key] = RING * n
        # Every buffer 512-byte aligned, as its own allocation would be (NCCL's
        # vectorized path).
        align = max(1, 512 // size)
        slot[b.key] = max(slot.get(b.key, 0), -(-n // align) * align)
    return slot, chunk


def full_order(seen: list[int], n_params: int) -> list[int]:
    """The order gradients came in (`seen`); those that never came (a branch not taken)
    after them, in reverse registration order."""
    came = set(seen)
    return seen + [i for i in reversed(range(n_params)) if i not in came]


def relaid(
    params: list[torch.nn.Parameter], cap_bytes: int, order: list[int], slot: dict[Key, int]
) -> list[Bucket]:
    """The layout in `order`, each bucket within the ring `slot` sized for the first."""
    slot_bytes = {key: n * key[0].itemsize for key, n in slot.items()}
    return layout(params, cap_bytes, order, slot_bytes)


class Overlap:
    """One rank's buckets, hooks and buffers; armed for the last backward of a step."""

    def __init__(
        self, dist, params: list[torch.nn.Parameter], group, world: int, cap: int, rank: int = 0
    ):
        self.dist = dist
        self.group = group
        self.world = world
        self.rank = rank
        self.params = params
        self.cap = cap
        self._set_buckets(layout(params, cap))
        # NCCL averages in the collective; gloo sums and the copy back divides.
        backend = str(dist.get_backend(group)).lower()
        self.op = dist.ReduceOp.AVG if backend == "nccl" else dist.ReduceOp.SUM
        self.divide = self.op == dist.ReduceOp.SUM and world > 1
        self.slot, self.chunk = ring_sizes(params, self.buckets, cap)
        self.ring = {
            key: torch.empty(RING * n, dtype=key[0], device=key[1]) for key, n in self.slot.items()
        }
        self.uses: dict[tuple[torch.dtype, torch.device], int] = {}
        # The first guess (reverse registration) launches nothing until the backward ends
        # when the gradients come in another order (a head registered before the body,
        # an encoder after its decoder): the order they came in on rank 0 is carried by
        # the first verdict, and every rank lays its buckets out again in it once, as
        # DDP rebuilds its buckets after its first iteration.
        self.relaid = False
        self.seen: list[int] = []
        self.armed = False
        self.abort = False
        self.next = 0
        # Elements of bucket `next` already launched (a solo bucket's chunks): a launch
        # interrupted after some went resumes after them, or the ranks' collectives would
        # no longer match.
        self.sent = 0
        self.ready = [0] * len(self.buckets)
        self.fired = [False] * len(params)
        self.twice = False
        # Per parameter: whether this rank had a gradient before any zeros were made.
        self.had: list[bool] | None = None
        # (bucket, work, ring slots, the tensor all-reduced), in launch order: a bucket of
        # several gradients holds one slot of its dtype and device's ring, a chunk sent in
        # abort mode every slot, a chunk of a gradient reduced in place none; an entry
        # leaves when its slots are taken again, or when drained.
        self.pending: list[tuple[int, Any, frozenset[int], torch.Tensor]] = []
        self.hooks = [
            p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)
        ]
        # Buckets launched while a backward still ran (this attempt's, and the run's).
        self.launched_in_backward = 0
        self.early_total = 0

    def _set_buckets(self, buckets: list[Bucket]) -> None:
        self.buckets = buckets
        self.bucket_of = [0] * len(self.params)
        for k, b in enumerate(buckets):
            for i in b.params:
                self.bucket_of[i] = k

    def ready_order(self) -> list[int]:
        """The order this attempt's gradients were ready in (`full_order`)."""
        return full_order(self.seen, len(self.params))

    def relayout(self, order: list[int]) -> bool:
        """The buckets laid out again in `order` (the same on every rank, between steps),
        each within the ring already allocated. Returns whether the layout changed."""
        self.relaid = True
        buckets = relaid(self.params, self.cap, order, self.slot)
        if [b.params for b in buckets] == [b.params for b in self.buckets]:
            return False
        self._set_buckets(buckets)
        return True

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []

    # ---- one attempt at a step's last backward ----------------------------------------

    def arm(self) -> None:
        """The ranks agreed the step's last backward runs: launch its buckets as they fill."""
        self.armed, self.abort, self.twice = True, False, False
        self.had = None
        self.next = 0
        self.sent = 0
        self.ready = [0] * len(self.buckets)
        self.fired = [False] * len(self.params)
        self.seen = []
        self.uses = {}
        self.pending = []
        self.launched_in_backward = 0

    def _hook(self, i: int):
        def ready(_param: torch.Tensor) -> None:
            if not self.armed:
                return
            if self.fired[i]:
                # A second accumulation in one backward (a parameter used inside and
                # outside a reentrant checkpoint): its bucket may already have gone.
                self.twice = True
                return
            self.fired[i] = True
            if not self.relaid:
                self.seen.append(i)
            k = self.bucket_of[i]
            self.ready[k] += 1
            while self.next < len(self.buckets) and self.ready[self.next] == len(
                self.buckets[self.next].params
            ):
                self._launch(self.next)
                self.next += 1
                self.launched_in_backward += 1
                self.early_total += 1

        return ready

    def launch_rest(self, abort: bool) -> None:
        """After the backward: every bucket not yet launched, in order (gradients that did
        not arrive count as they are, or as zeros). `abort`: this rank's backward failed;
        the collectives only keep the ranks in step, and nothing is copied back."""
        self.armed = False
        if self.had is None:
            self.had = [p.grad is not None for p in self.params]
        self.abort = self.abort or abort
        while self.next < len(self.buckets):
            self._launch(self.next)
            self.next += 1

    def _launch(self, k: int) -> None:
        b = self.buckets[k]
        if not self.abort:
            # Zeros, as DDP reduces an unused parameter's; dropped again after the verdict
            # if no rank has a gradient for it. Made before anything of the bucket is
            # touched: after an out-of-memory error here the bucket is launched again, in
            # abort mode, which allocates nothing.
            # A gradient larger than a bucket is contiguous: its chunks, views of it, follow
            # the elements' order, the same on every rank whatever each gradient's layout
            # (a channels_last parameter's).
            for i in b.params:
                p = self.params[i]
                if p.grad is None:
                    p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
                elif b.solo and not p.grad.is_contiguous():
                    p.grad = p.grad.contiguous()
        if b.solo:
            self._launch_chunks(k, b)
        else:
            use = self.uses.get(b.key, 0)
            self.uses[b.key] = use + 1
            slot = use % RING
            self._claim(b.key, frozenset((slot,)))
            size = self.slot[b.key]
            flat = self.ring[b.key][slot * size : slot * size + b.numel]
            if not self.abort:
                # Abort mode sends the buffer as it is: the results are dropped.
                off = 0
                with torch.no_grad():
                    for i in b.params:
                        p = self.params[i]
                        n = p.numel()
                        if p.grad is None:
                            flat[off : off + n].zero_()
                        else:
                            flat[off : off + n].view_as(p).copy_(p.grad)
                        off += n
            # Past the agreement every rank launches every bucket: the launch itself must
            # not fail under the cap (_torch.cap_lifted).
            with _torch.cap_lifted():
                work = self.dist.all_reduce(flat, op=self.op, group=self.group, async_op=True)
            self.pending.append((k, work, frozenset((slot,)), flat))
        self.sent = 0

    def _launch_chunks(self, k: int, b: Bucket) -> None:
        """A gradient larger than a bucket, in place, chunk after chunk; in abort mode each
        chunk is sent from the ring instead (this rank may have no gradient to send, and
        no memory to make one)."""
        step = self.chunk[b.key]
        grad = None if self.abort else self.params[b.params[0]].grad.view(-1)
        while self.sent < b.numel:
            n = min(step, b.numel - self.sent)
            if grad is None:
                self._claim(b.key, EVERY)
                part, slots = self.ring[b.key][:n], EVERY
            else:
                part, slots = grad[self.sent : self.sent + n], NONE
            with _torch.cap_lifted():
                work = self.dist.all_reduce(part, op=self.op, group=self.group, async_op=True)
            self.pending.append((k, work, slots, part))
            self.sent += n

    def _claim(self, key: tuple[torch.dtype, torch.device], slots: frozenset[int]) -> None:
        """Those slots of `key`'s ring, free: the all-reduces still pending on them waited
        for, their results copied back."""

        def on(entry) -> bool:
            return bool(entry[2] & slots) and self.buckets[entry[0]].key == key

        done = [e for e in self.pending if on(e)]
        if done:
            self.pending = [e for e in self.pending if not on(e)]
            for e in done:
                self._complete(*e)

    def drain(self) -> None:
        """Every launched bucket's all-reduce waited for and copied back (on NCCL the wait
        is the stream's, not the host's)."""
        pending, self.pending = self.pending, []
        for e in pending:
            self._complete(*e)

    def _complete(self, k: int, work, _slots: frozenset[int], flat: torch.Tensor) -> None:
        work.wait()
        if self.abort:
            return
        b = self.buckets[k]
        with torch.no_grad():
            if self.divide:
                flat.div_(self.world)
            if b.solo:
                # A chunk of the gradient itself.
                return
            off = 0
            for i in b.params:
                p = self.params[i]
                n = p.numel()
                # Every gradient exists: zero-filled at the launch, unless aborted.
                p.grad.copy_(flat[off : off + n].view_as(p))
                off += n

    def verdict_record(self, oom: bool, failed: bool) -> torch.Tensor:
        """This rank's part of the verdict (summed over the ranks): the gradients it had,
        not the zeros it made; until the layout is redone, rank 0's ready order (zeros
        from the others, so the sum is rank 0's)."""
        has = [1.0 if h else 0.0 for h in self.had]
        head = [float(oom), float(failed), float(self.twice)]
        order: list[float] = []
        if not self.relaid:
            order = [float(i) for i in self.ready_order()] if self.rank == 0 else [0.0] * len(has)
        return torch.tensor(head + has + order, dtype=torch.float64)

    @staticmethod
    def read(summed: torch.Tensor, n_params: int | None = None) -> Verdict:
        v = summed.tolist()
        n = len(v) - 3 if n_params is None else n_params
        order = [int(x) for x in v[3 + n :]] or None
        return Verdict(
            oom=int(v[0]),
            failed=int(v[1]),
            twice=int(v[2]),
            has_grad=[x > 0 for x in v[3 : 3 + n]],
            order=order,
        )

    def drop_unused(self, v: Verdict) -> None:
        """A parameter no rank has a gradient for keeps none (as in a one-process run)."""
        for p, has in zip(self.params, v.has_grad):
            if not has:
                p.grad = None
