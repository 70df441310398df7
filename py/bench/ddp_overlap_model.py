"""What headroom's DDP design costs at 8 GPUs: the all-reduce overlap it gives up, modelled.

Run from the repository root (no GPU needed; a few seconds):

    ./dev bench-python py/bench/ddp_overlap_model.py

Plain DDP with gradient accumulation runs the micro-batches but the last under no_sync();
the last backward launches DDP's bucketed all-reduces as the buckets' gradients become
ready, so most of the communication hides behind that backward. headroom's adaptive mode
runs every micro-batch under no_sync(), syncs with the GPU (the step's loss), agrees with
the other ranks (a gloo all-gather), and only then all-reduces the gradients through one
preallocated 25 MiB bucket, bucket after bucket: all of it is paid after the last
backward. This script puts numbers on the difference.

(a) Measured here, on the CPU:
  - the benchmarks' GPT (py/bench/_gpt.py) under real DDP (gloo, world size 1): the
    gradient bytes, DDP's bucket layout after its rebuild (a comm hook sees every bucket),
    and when in the backward each bucket is handed to the communication (its share of
    the backward time), against what the FLOP model below predicts for the same model;
    then headroom's reduction of those gradients at world size 1. The same measurement
    is the GPU check, on one GPU (NCCL at world size 1, bf16 autocast, CUDA events):

        ./dev bench-python py/bench/ddp_overlap_model.py --device cuda \
            --measure gpt2-124m --micro 16 --iters 20

  - standard shapes built from a config on the `meta` device (no weights, no memory):
    GPT-2 124M / 350M / 1.3B (the example's own model, examples/python/nanogpt.py, at
    those shapes) and a 7B llama (transformers' LlamaForCausalLM, if transformers is
    installed): parameters, gradient bytes, DDP's and headroom's bucket layouts.

(b) Modelled for 8 GPUs (every number here is an input, not a measurement):
  - compute: 6 * matmul params + 12 * layers * width * seq FLOPs per token (the
    PaLM / nanoGPT MFU count), at MFU * 989 TFLOP/s (H100 SXM dense bf16); the backward
    is 2/3 of a micro-batch's FLOPs, and a parameter's gradient is ready when the FLOPs
    of every layer after it (and its own) are done (tied embeddings: at the end);
  - an all-reduce of S bytes over n ranks: latency + 2 (n-1)/n * S / busbw (nccl-tests'
    bus bandwidth definition), one bucket after another on NCCL's stream;
  - plain DDP: buckets launched at their ready time, in order; then the copy of each
    bucket back into .grad (DDP's default gradient_as_bucket_view=False) once its
    all-reduce is done. Exposed: what runs past the end of the backward. Its copy into
    the bucket during the backward is added to the backward;
  - headroom: sync + agreement, then for every bucket copy in, all-reduce, divide, copy
    out, serially (one buffer); a parameter larger than the bucket is reduced in place;
  - step = micro-batches * micro-batch compute + the exposed communication + AdamW
    (one pass over params, grads and both moments at HBM bandwidth).
  Printed: per model, interconnect and micro-batches per step (1, 4, 16), plain DDP's
  and headroom's exposed communication and the difference (the lost overlap) as a share
  of plain DDP's step; then, per model and interconnect, up to how many micro-batches
  per step the lost overlap stays above 1%.

Not modelled: NCCL kernels slowing the compute they overlap (a few % on NVLink), a
rank's wait for the slowest (both designs pay it), NCCL's protocol choice by size (the
latency term stands in), CUDA graphs / torch.compile.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "python"))
import nanogpt  # noqa: E402
from _gpt import make_model  # noqa: E402

MiB = 1 << 20
DDP_FIRST_BUCKET = 1 * MiB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET = 25 * MiB  # DDP's bucket_cap_mb=25
HEADROOM_BUCKET = 25 * MiB  # headroom._dist.BUCKET_BYTES

# ---- inputs (assumptions with their sources; none measured here) ---------------------

RANKS = 8
PEAK_FLOPS = 989e12  # H100 SXM, dense bf16 (NVIDIA H100 datasheet: 1979 TFLOP/s with sparsity)
MFU = 0.40  # a well-tuned DDP transformer run on H100s: 35-50% (nanoGPT/llm.c report ~40-50%)
HBM = 3.35e12 * 0.8  # H100 SXM HBM3 3.35 TB/s (datasheet), ~80% of it reached by a copy
LAUNCH_US = 20.0  # a few kernel launches after the GPU drained (host-side, assumption)


@dataclass
class Link:
    name: str
    busbw: float  # GB/s, nccl-tests all_reduce_perf busbw for large messages
    latency_us: float  # per all-reduce call at bucket sizes (the ramp below peak bandwidth)
    agree_us: float  # headroom's gloo all-gather of ~120 bytes among 8 processes
    source: str


LINKS = [
    Link(
        "NVLink (8xH100 SXM, 1 node)",
        400.0,
        50.0,
        100.0,
        "nccl-tests all_reduce busbw 8xH100 SXM NVSwitch: 370-480 GB/s at large sizes "
        "(NVIDIA NVLink4 450 GB/s per direction; docs.alayanew.com nccl-tests guide: "
        "460-480); lower at 25 MB buckets, hence the latency term (assumption)",
    ),
    Link(
        "PCIe 5.0 (8xH100 PCIe, 1 node)",
        40.0,
        50.0,
        100.0,
        "8xH100 PCIe without NVLink bridges: 35-45 GB/s busbw (docs.alayanew.com "
        "nccl-tests guide's reference table)",
    ),
    Link(
        "PCIe 4.0 (8 GPUs, 1 node)",
        20.0,
        50.0,
        100.0,
        "PCIe 4.0 x16 is 32 GB/s raw per direction; rings through the CPU's root "
        "complexes reach ~20 GB/s busbw (assumption, half of PCIe 5.0)",
    ),
    Link(
        "IB/RoCE 400 Gb/s (a NIC per GPU, across nodes)",
        45.0,
        100.0,
        300.0,
        "400 Gb/s = 50 GB/s line rate; nccl-tests reach ~90% of it inter-node "
        "(assumption; dstack's GCP A3 High, 2x8 H100 over GPUDirect-TCPX, measured "
        "~50 GB/s busbw at >=128 MB and 27 GB/s at 32 MB)",
    ),
    Link(
        "Ethernet 100 Gb/s (2 nodes x 4 GPUs)",
        11.0,
        100.0,
        300.0,
        "100 Gb/s = 12.5 GB/s line rate per node NIC, ~90% reached (assumption)",
    ),
]


@dataclass
class Shape:
    name: str
    build: object  # () -> nn.Module on the current device
    seq: int  # sequence length
    tokens_per_micro: int  # per GPU per micro-batch that fits an 80 GB H100 (assumption)
    grad_bytes: int  # bytes per gradient element
    opt_bytes: int  # bytes AdamW moves per parameter (read + write)
    note: str = ""


def gpt(seq: int, layers: int, heads: int, width: int):
    def build():
        nanogpt.VOCAB = 50257  # GPT-2's tokenizer (the example is byte-level: 256)
        try:
            return nanogpt.GPT(seq, layers, heads, width, dropout=0.0)
        finally:
            nanogpt.VOCAB = 256

    return build


def llama7b():
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(cfg)


SHAPES = [
    # fp32 parameters, bf16 autocast: fp32 gradients; AdamW moves 4 tensors of fp32
    # (param, grad, m, v: read 16 B, write 12 B).
    Shape("GPT-2 124M", gpt(1024, 12, 12, 768), 1024, 16 * 1024, 4, 28),
    Shape("GPT-2 350M", gpt(1024, 24, 16, 1024), 1024, 16 * 1024, 4, 28),
    Shape("GPT 1.3B", gpt(2048, 24, 16, 2048), 2048, 8 * 2048, 4, 28),
    # 16 B/param of fp32 state is 108 GB: a 7B model under DDP on 80 GB needs bf16
    # parameters and gradients and a lighter optimizer state (or an H200, or FSDP).
    Shape(
        "llama 7B",
        llama7b,
        4096,
        4096,
        2,
        14,
        "bf16 grads; DDP only fits 80 GB with bf16 params and a low-memory optimizer",
    ),
]

# ---- the model's pieces ---------------------------------------------------------------


@dataclass
class Param:
    name: str
    numel: int
    ready: float  # fraction of the backward at which its gradient is complete
    op: int  # the backward op that completes it (orders gradients ready at one time)


def backward_timeline(model: nn.Module, seq: int) -> tuple[list[Param], float, float]:
    """The parameters with the backward fraction at which each gradient is ready, from
    FLOPs: the modules in reverse registration order are the backward's order; a matmul's
    backward is 4 FLOPs per weight element per token, attention's 8 * seq * width per
    token (before the q/k/v projections), embeddings' lookups ~0. Returns (params in
    registration order, forward+backward FLOPs per token, layers' width)."""
    mods = [(n, m) for n, m in model.named_modules() if m._parameters]
    width = 0
    ops: list[tuple[float, list[int]]] = []
    for name, m in reversed(mods):
        ids = [id(p) for p in m._parameters.values() if p is not None]
        flops = 0.0
        if isinstance(m, nn.Linear):
            flops = 4.0 * m.weight.numel()
        if name.endswith("attn.qkv") or name.endswith("self_attn.v_proj"):
            width = m.in_features
            flops += 8.0 * seq * width
        ops.append((flops, ids))
    total = sum(f for f, _ in ops)
    ready: dict[int, tuple[float, int]] = {}
    t = 0.0
    for k, (f, ids) in enumerate(ops):
        t += f
        for i in ids:
            ready[i] = (t / total, k)
    params = [Param(n, p.numel(), *ready[id(p)]) for n, p in model.named_parameters()]
    return params, total * 1.5, width


def ddp_buckets(params: list[Param], elem: int) -> list[tuple[int, float]]:
    """DDP's layout after its rebuild (torch's compute_bucket_assignment_by_size on the
    gradients in ready order, limits [1 MiB, 25 MiB]): (bytes, ready) per bucket."""
    order = sorted(params, key=lambda p: (p.ready, p.op))
    out = []
    limit, used, ready = DDP_FIRST_BUCKET, 0, 0.0
    for p in order:
        used += p.numel * elem
        ready = max(ready, p.ready)
        if used >= limit:
            out.append((used, ready))
            limit, used, ready = DDP_BUCKET, 0, 0.0
    if used:
        out.append((used, ready))
    return out


def headroom_buckets(params: list[Param], elem: int) -> list[tuple[int, bool]]:
    """headroom's GradReducer: registration order into one 25 MiB buffer, flushed when
    the next gradient does not fit; a gradient larger than the buffer is reduced in
    place. (bytes, in_place) per all-reduce."""
    cap = HEADROOM_BUCKET
    out, used = [], 0
    for p in params:
        b = p.numel * elem
        if b > cap:
            if used:
                out.append((used, False))
            out.append((b, True))
            used = 0
            continue
        if used + b > cap:
            out.append((used, False))
            used = 0
        used += b
    if used:
        out.append((used, False))
    return out


def overlapped_buckets(params: list[Param], elem: int) -> list[tuple[int, float, bool]]:
    """headroom's overlapped layout (headroom._overlap.layout): reverse registration
    order, packed up to 25 MiB (the first up to 1 MiB), a gradient larger than a bucket
    alone, in place, in chunks of at most its ring (two buckets). (bytes, ready, in_place)
    per all-reduce, in launch order."""
    out, used, ready, first = [], 0, 0.0, True
    for p in reversed(params):
        b = p.numel * elem
        if b > DDP_BUCKET:
            chunk = 2 * DDP_BUCKET
            out.extend((min(chunk, b - o), p.ready, True) for o in range(0, b, chunk))
            continue
        limit = DDP_FIRST_BUCKET if first else DDP_BUCKET
        if used and used + b > limit:
            out.append((used, ready, False))
            used, ready, first = 0, 0.0, False
        used += b
        ready = max(ready, p.ready)
    if used:
        out.append((used, ready, False))
    return out


def overlapped_exposed(buckets, t_bwd: float, link: Link) -> float:
    """Seconds headroom's overlapped reduction adds past the end of the last backward:
    its agreement before that backward and its verdict after it (two small gloo
    collectives), then the bucket chain as DDP's (launched in order from each bucket's
    ready time; NCCL averages, so no divide pass), the ring's copies back. A ring
    buffer's reuse makes the compute stream wait for the all-reduce two buckets back: on
    a link slower than the backward that delays the backward, not the chain's end."""
    done = 0.0
    finish = []
    for nbytes, ready, _ in buckets:
        done = max(done, ready * t_bwd) + allreduce_s(nbytes, link)
        finish.append(done)
    copied = t_bwd
    for (nbytes, _, in_place), f in zip(buckets, finish):
        copied = max(copied, f) + (0 if in_place else 2 * nbytes / HBM)
    return copied - t_bwd + (LAUNCH_US + 2 * link.agree_us) * 1e-6


def allreduce_s(nbytes: float, link: Link, n: int = RANKS) -> float:
    return link.latency_us * 1e-6 + 2 * (n - 1) / n * nbytes / (link.busbw * 1e9)


def plain_exposed(buckets, t_bwd: float, link: Link) -> float:
    """Seconds plain DDP's reduction runs past the end of the last backward: buckets
    all-reduced in order from their ready time, then copied back into .grad in order on
    the compute stream after the backward."""
    done = 0.0
    finish = []
    for nbytes, ready in buckets:
        done = max(done, ready * t_bwd) + allreduce_s(nbytes, link)
        finish.append(done)
    copied = t_bwd
    for (nbytes, _), f in zip(buckets, finish):
        copied = max(copied, f) + 2 * nbytes / HBM
    return copied - t_bwd


def headroom_exposed(buckets, link: Link) -> float:
    t = (LAUNCH_US + link.agree_us) * 1e-6
    for nbytes, in_place in buckets:
        passes = 2 if in_place else 6  # divide in place, or copy in + divide + copy out
        t += allreduce_s(nbytes, link) + passes * nbytes / HBM
    return t


@dataclass
class Row:
    shape: Shape
    link: Link
    micro: int
    step_ms: float
    comm_ms: float
    plain_ms: float
    headroom_ms: float
    overlapped_ms: float

    @property
    def lost(self) -> float:
        return (self.headroom_ms - self.plain_ms) / self.step_ms

    @property
    def lost_now(self) -> float:
        """What the overlapped design still loses against plain DDP."""
        return (self.overlapped_ms - self.plain_ms) / self.step_ms


def model_rows(shape: Shape, params, flops_tok: float, link: Link, micro: int) -> Row:
    elem = shape.grad_bytes
    n = sum(p.numel for p in params)
    grad = n * elem
    t_mb = flops_tok * shape.tokens_per_micro / (MFU * PEAK_FLOPS)
    copy_in = 2 * grad / HBM  # DDP copies each gradient into its bucket in the backward
    t_bwd = t_mb * 2 / 3 + copy_in
    dbk = ddp_buckets(params, elem)
    plain = plain_exposed(dbk, t_bwd, link) + copy_in
    hroom = headroom_exposed(headroom_buckets(params, elem), link)
    # The ring's copies in run inside the backward, as DDP's do (counted in t_bwd).
    over = overlapped_exposed(overlapped_buckets(params, elem), t_bwd, link) + copy_in
    opt = n * shape.opt_bytes / HBM
    step = micro * t_mb + plain + opt
    comm = sum(allreduce_s(b, link) for b, _ in dbk)
    return Row(shape, link, micro, step * 1e3, comm * 1e3, plain * 1e3, hroom * 1e3, over * 1e3)


# ---- the CPU measurement of the benchmarks' GPT ---------------------------------------


MEASURABLE = {
    "bench": (lambda: make_model(0), 64, 8),  # the benchmarks' GPT: (build, seq, micro)
    "gpt2-124m": (gpt(1024, 12, 12, 768), 1024, 16),
    "gpt2-350m": (gpt(1024, 24, 16, 1024), 1024, 16),
}


def measure(shape: str, device: str, micro: int | None, iters: int) -> None:
    """One rank of real DDP (world size 1: gloo on the CPU, NCCL on a GPU) on `shape`:
    DDP's buckets after its rebuild as a comm hook sees them, when in the backward each
    is handed over (a CUDA event recorded in the hook on a GPU), the forward and backward
    times and the MFU they make; then headroom's reduction of the same gradients at world
    size 1 (its copies and a local all-reduce: the compute side of its post-backward
    cost). On a GPU, the measured shares and MFU replace the model's inputs."""
    import torch.distributed as dist

    from headroom import _dist as hdist

    cuda = device.startswith("cuda")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    build, seq, default_micro = MEASURABLE[shape]
    micro = micro or default_micro
    torch.manual_seed(0)
    model = build().to(device)
    ddp = nn.parallel.DistributedDataParallel(model)
    vocab = model.tok.num_embeddings

    def mark():
        if cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def between(a, b) -> float:
        return a.elapsed_time(b) / 1e3 if cuda else b - a

    seen: list[tuple[object, int, int]] = []

    def hook(_state, bucket):
        buf = bucket.buffer()
        seen.append((mark(), bucket.index(), buf.numel() * buf.element_size()))
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    ddp.register_comm_hook(None, hook)
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, vocab, (micro, seq + 1), generator=g).to(device)
    x, y = w[:, :-1], w[:, 1:]
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    fracs: dict[int, list[float]] = {}
    fwd_bwd = []
    layout: list[tuple[int, int]] = []
    for it in range(iters + 2):
        seen.clear()
        t0 = mark()
        with amp:
            loss = nn.functional.cross_entropy(ddp(x).flatten(0, 1).float(), y.flatten())
        t1 = mark()
        loss.backward()
        t2 = mark()
        if cuda:
            torch.cuda.synchronize()
        if it < 2:  # DDP rebuilds its buckets in ready order after the first iteration
            model.zero_grad(set_to_none=True)
            continue
        layout = [(i, b) for _, i, b in seen]
        for t, i, _ in seen:
            fracs.setdefault(i, []).append(between(t1, t) / between(t1, t2))
        fwd_bwd.append((between(t0, t1), between(t1, t2)))
        if it < iters + 1:
            model.zero_grad(set_to_none=True)
    # headroom's reduction of the gradients the last backward left (world size 1).
    reducer = hdist.GradReducer([p for p in model.parameters() if p.requires_grad], None, world=1)
    reduce_s = []
    for _ in range(iters):
        a = mark()
        reducer.reduce(zero_fill=False)
        b = mark()
        if cuda:
            torch.cuda.synchronize()
        reduce_s.append(between(a, b))
    dist.destroy_process_group()
    with torch.device("meta"):
        params, flops_tok, _ = backward_timeline(build(), seq)
    predicted = ddp_buckets(params, 4)
    n = sum(p.numel for p in params)
    grad = n * 4
    fwd = statistics.median(f for f, _ in fwd_bwd)
    bwd = statistics.median(b for _, b in fwd_bwd)
    mfu = ""
    if cuda:
        mfu = f", {flops_tok * micro * seq / (fwd + bwd) / PEAK_FLOPS:.0%} MFU of 989 TFLOP/s"
    print(
        f"{shape} under DDP on {device} (world size 1, micro-batch {micro} x {seq} tokens, "
        f"{iters} iterations): {grad / MiB:.2f} MiB of fp32 gradients ({n:,} parameters); "
        f"forward {fwd * 1e3:.2f} ms, backward {bwd * 1e3:.2f} ms (backward "
        f"{bwd / (fwd + bwd):.0%} of the micro-batch; the FLOP model says 67%){mfu}"
    )
    print("  DDP's buckets after its rebuild, in launch order (a comm hook's view):")
    print("    bucket  MiB      handed over (share of the backward)   FLOP model: MiB, ready")
    for k, (i, b) in enumerate(layout):
        pb, pr = predicted[k] if k < len(predicted) else (0, float("nan"))
        print(
            f"    {i:>6}  {b / MiB:7.2f}  {statistics.median(fracs[i]):>6.0%} "
            f"(range {min(fracs[i]):.0%}-{max(fracs[i]):.0%}){'':14}"
            f"{pb / MiB:7.2f}, {pr:.0%}"
        )
    last = layout[-1][1]
    print(
        f"  The last bucket ({last / MiB:.2f} MiB, {last / grad:.0%} of the gradients) is "
        "handed over at the backward's end: plain DDP cannot hide it either. The rest "
        "can hide behind the remainder of the backward."
    )
    print(
        f"  headroom's reduction of these gradients at world size 1 (its copies and a "
        f"local all-reduce, no network): median {statistics.median(reduce_s) * 1e3:.2f} ms"
    )


# ---- the table ------------------------------------------------------------------------


MS = (1, 4, 16)  # the micro-batches per step the tables show


def print_table(built, head_cells: str, cell, lost, comm: bool) -> None:
    """One table: a row per model and interconnect, a cell per m in MS, and the largest m
    (up to 256) at which `lost(row)` still passes 1%."""
    head = f"{'model':11} {'interconnect':47} {head_cells} | lost>1% up to m"
    print(head)
    print("-" * len(head))
    for s, params, flops_tok in built:
        for link in LINKS:
            rows = [model_rows(s, params, flops_tok, link, m) for m in MS]
            cells = " | ".join(cell(r) for r in rows)
            upto = 0
            for m in range(1, 257):
                if lost(model_rows(s, params, flops_tok, link, m)) > 0.01:
                    upto = m
            first = f"{rows[0].comm_ms:5.2f}ms | " if comm else "| "
            print(f"{s.name:11} {link.name:47} {first}{cells} | {upto if upto < 256 else '>256'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=10, help="timed iterations measured")
    ap.add_argument("--no-measure", action="store_true", help="skip the measurement")
    ap.add_argument("--measure", choices=sorted(MEASURABLE), default="bench")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU check")
    ap.add_argument("--micro", type=int, help="samples per micro-batch measured")
    ap.add_argument("--mfu", type=float, default=MFU, help="the model's MFU input")
    args = ap.parse_args()
    globals()["MFU"] = args.mfu
    torch.set_num_threads(1)
    if not args.no_measure:
        measure(args.measure, args.device, args.micro, args.iters)
        print()
    built = []
    for s in SHAPES:
        try:
            with torch.device("meta"):
                m = s.build()
        except ImportError as e:
            print(f"{s.name}: skipped ({e})")
            continue
        params, flops_tok, _ = backward_timeline(m, s.seq)
        built.append((s, params, flops_tok))
        n = sum(p.numel for p in params)
        dbk = ddp_buckets(params, s.grad_bytes)
        hbk = headroom_buckets(params, s.grad_bytes)
        big = max(b for b, _ in dbk)
        print(
            f"{s.name}: {n / 1e6:,.1f}M parameters, {n * s.grad_bytes / 2**30:.2f} GiB of "
            f"gradients ({s.grad_bytes} B each); DDP {len(dbk)} buckets (largest "
            f"{big / MiB:.0f} MiB, last {dbk[-1][0] / MiB:.0f} MiB ready at "
            f"{dbk[-1][1]:.0%}), headroom {len(hbk)} all-reduces; "
            f"{flops_tok / 1e9:.2f} GFLOP/token, {s.tokens_per_micro} tokens per "
            f"micro-batch per GPU{'; ' + s.note if s.note else ''}"
        )
    print()
    print(
        f"8 GPUs, {MFU:.0%} MFU of {PEAK_FLOPS / 1e12:.0f} TFLOP/s, HBM copies at "
        f"{HBM / 1e12:.2f} TB/s; shares are of plain DDP's step"
    )
    print_table(
        built,
        f"{'comm':>7} | " + " | ".join(f"m={m:<2} step   plain  headroom  lost" for m in MS),
        lambda r: (
            f"{r.step_ms:8.1f}ms {r.plain_ms / r.step_ms:6.1%} {r.headroom_ms / r.step_ms:7.1%}"
            f" {r.lost:6.1%}"
        ),
        lambda r: r.lost,
        comm=True,
    )
    print()
    print(
        "Overlapped (headroom._overlap, built since): plain DDP's exposed share / the "
        "overlapped design's / what it still loses"
    )
    print_table(
        built,
        "| " + " | ".join(f"m={m:<2}  plain  overlapped  lost" for m in MS),
        lambda r: (
            f"{r.plain_ms / r.step_ms:10.1%} {r.overlapped_ms / r.step_ms:10.1%} {r.lost_now:6.2%}"
        ),
        lambda r: r.lost_now,
        comm=False,
    )
    print()
    print("headroom's time after the last backward, by part (the same at every m):")
    for s, params, _ in built:
        hbk = headroom_buckets(params, s.grad_bytes)
        copies = sum((2 if ip else 6) * b / HBM for b, ip in hbk) * 1e3
        for link in (LINKS[0], LINKS[3]):
            comm = sum(allreduce_s(b, link) for b, _ in hbk) * 1e3
            agree = (LAUNCH_US + link.agree_us) / 1e3
            print(
                f"  {s.name:11} {link.name:47} sync + agreement {agree:.2f} ms, "
                f"all-reduces {comm:7.2f} ms ({len(hbk)} x {link.latency_us:.0f} us of "
                f"latency), copies and divides {copies:6.2f} ms"
            )
    print()
    print("Inputs (assumptions, with their sources):")
    for link in LINKS:
        print(
            f"  {link.name}: busbw {link.busbw:.0f} GB/s, {link.latency_us:.0f} us per "
            f"all-reduce, headroom's agreement {link.agree_us:.0f} us: {link.source}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
