"""The built-in trainer (`headroom train`) against its PyTorch eager twin on the CPU, and
its two memory levers.

    python py/bench/builtin_vs_torch.py speed [--threads 1] [--layers 4] [--embd 128]
        [--batch 64] [--seq 64] [--steps 40] [--rounds 2] [--precision fp32|bf16|both]
        [--before-bin PATH]
    python py/bench/builtin_vs_torch.py levers [--steps 30] ...

`speed`: the same model (the twin below of trainer/src/model.rs: byte vocabulary, pre-norm
blocks, exact GELU, causal SDPA, head tied to the embedding, no dropout), the
same fixed micro-batch with no accumulation, the same intra-op threads, AdamW with the
built-in trainer's settings (betas 0.9/0.99, eps 1e-8, weight decay 0.1 on matrices only,
`torch.optim.AdamW` with its defaults otherwise) and clipping at 1.0, the data drawn from
the same corpus. The built-in side is `headroom train --headless` with the controller
held (`memory.adaptive = false`, no budget), evaluation and periodic checkpoints off; it
is timed from its own log (`t` of the step records), step 1's end to the last step's
end; the PyTorch side is timed over the same span in this process. The two sides
alternate (A B A B ...) so a busy spell of a shared machine hits both; each round gives
tokens/s of each and their ratio, and the ratio of the medians is printed last. bf16:
`--precision bf16` against `torch.autocast("cpu", torch.bfloat16)`. `--before-bin` adds a
third side, another `headroom` binary (an older build), in the same rotation: before and
after are then measured in the same rounds against the same PyTorch runs. `--cpu-time`
counts tokens per CPU second (user + system, every thread) instead of per wall second:
on a machine shared with other work, wall time mostly measures the others.

`levers`: the built-in trainer alone for each precision × checkpointing choice: tokens/s
and peak memory per token at a fixed micro-batch (the step peak's growth from micro-batch
B/2 to B, divided by the tokens added: what each more token costs), then the micro-batch
the controller settles at under one fixed budget (`--budget`) when it starts at 1 and may
grow up to the effective batch (`--effective`).

Needs HEADROOM_BIN (default target/release/headroom) and torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "assets" / "tinyshakespeare.txt"


class Block(nn.Module):
    """trainer/src/model.rs's block: pre-norm attention and a 4x exact-GELU MLP."""

    def __init__(self, c: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.c_attn, self.attn_proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.c_fc, self.mlp_proj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
            for z in self.c_attn(self.ln_1(x)).split(c, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class Gpt(nn.Module):
    """The PyTorch twin of the built-in byte-level GPT (head tied to the embedding)."""

    def __init__(self, seq: int, n_layer: int, n_head: int, c: int):
        super().__init__()
        self.wte = nn.Parameter(torch.randn(256, c) * 0.02)
        self.wpe = nn.Parameter(torch.randn(seq, c) * 0.02)
        self.h = nn.ModuleList(Block(c, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(c)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = F.embedding(idx, self.wte) + self.wpe[: idx.shape[1]]
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte)


def headroom_bin() -> str:
    return os.environ.get("HEADROOM_BIN", str(ROOT / "target" / "release" / "headroom"))


def config_toml(a: argparse.Namespace, **over) -> str:
    o = {
        "precision": "fp32",
        "checkpoint": "none",
        "adaptive": False,
        "budget": "",
        "micro": a.batch,
        "effective": a.batch,
        "min_micro": 1,
        **over,
    }
    return f"""
[run]
name = "bench"
steps = {a.steps}
device = "cpu"
checkpoint_every = 0
eval_every = 0
eval_batches = 1
threads = {a.threads}
[data]
seq_len = {a.seq}
[model]
n_layer = {a.layers}
n_head = {a.heads}
n_embd = {a.embd}
precision = "{o["precision"]}"
checkpoint = "{o["checkpoint"]}"
[batch]
micro_batch = {o["micro"]}
effective_batch = {o["effective"]}
[memory]
memory_budget = "{o["budget"]}"
adaptive = {str(o["adaptive"]).lower()}
min_micro_batch = {o["min_micro"]}
"""


def run_headroom(a: argparse.Namespace, workdir: Path, binary: str = "", **over) -> list[dict]:
    """Runs `headroom train --headless` and returns its log's records."""
    cfg = workdir / "bench.toml"
    cfg.write_text(config_toml(a, **over))
    log = workdir / "run.jsonl"
    out = subprocess.run(
        [binary or headroom_bin(), "train", "--headless", "--config", str(cfg), "--log", str(log)]
        + ["--overwrite", "--checkpoint-dir", str(workdir / "ck")],
        cwd=workdir,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"headroom train failed:\n{out.stderr[-2000:]}")
    return [json.loads(line) for line in log.read_text().splitlines()]


def children_cpu_s() -> float:
    """CPU seconds (user + system, every thread) of the children waited for so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def headroom_cpu_tokens_per_s(a: argparse.Namespace, workdir: Path, binary: str, **over) -> float:
    """Tokens per CPU second of `headroom train`: the CPU time of a run of `--steps` less
    that of a run of 3 steps (start-up, the final evaluation and checkpoint cancel out),
    over the tokens of the steps between."""
    cpu = []
    for steps in [a.steps, 3]:
        before = children_cpu_s()
        run_headroom(argparse.Namespace(**{**vars(a), "steps": steps}), workdir, binary, **over)
        cpu.append(children_cpu_s() - before)
    return (a.steps - 3) * a.batch * a.seq / (cpu[0] - cpu[1])


def headroom_tokens_per_s(records: list[dict], a: argparse.Namespace) -> float:
    t = [r["t"] for r in records if r["kind"] == "step"]
    return (len(t) - 1) * a.batch * a.seq / (t[-1] - t[0])


def torch_tokens_per_s(a: argparse.Namespace, precision: str) -> tuple[float, float]:
    """The PyTorch twin: same shape, batch, threads, optimizer and clipping. Tokens per
    second of wall time and per second of this process's CPU time."""
    torch.set_num_threads(a.threads)
    torch.manual_seed(1337)
    model = Gpt(a.seq, a.layers, a.heads, a.embd)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=3e-3,
        betas=(0.9, 0.99),
        eps=1e-8,
    )
    data = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(1)
    ar = torch.arange(a.seq + 1)
    start = cpu_start = None
    for step in range(1, a.steps + 1):
        starts = torch.randint(0, len(data) - a.seq - 1, (a.batch,), generator=gen)
        w = data[starts[:, None] + ar].long()
        x, y = w[:, :-1], w[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(x)
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1))
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        loss.item()
        if step == 1:
            start, cpu_start = time.perf_counter(), time.process_time()
    tokens = (a.steps - 1) * a.batch * a.seq
    return tokens / (time.perf_counter() - start), tokens / (time.process_time() - cpu_start)


def speed(a: argparse.Namespace) -> None:
    precisions = ["fp32", "bf16"] if a.precision == "both" else [a.precision]
    sides = ["headroom", "torch"] + (["before"] if a.before_bin else [])
    print(
        f"{a.layers} layers x {a.embd}, micro-batch {a.batch} x {a.seq} tokens, "
        f"{a.threads} thread(s), {a.steps} steps per side, {a.rounds} rounds, "
        f"load average {os.getloadavg()[0]:.2f}"
        + (", per CPU second" if a.cpu_time else ", per wall second")
    )
    with tempfile.TemporaryDirectory() as d:
        for precision in precisions:
            rates: dict[str, list[float]] = {s: [] for s in sides}
            for r in range(a.rounds):
                # The sides rotate: none always goes first.
                order = sides[r % len(sides) :] + sides[: r % len(sides)]
                got = {}
                for side in order:
                    binary = a.before_bin if side == "before" else ""
                    if side == "torch":
                        wall, cpu = torch_tokens_per_s(a, precision)
                        got[side] = cpu if a.cpu_time else wall
                    elif a.cpu_time:
                        got[side] = headroom_cpu_tokens_per_s(
                            a, Path(d), binary, precision=precision
                        )
                    else:
                        recs = run_headroom(a, Path(d), binary, precision=precision)
                        got[side] = headroom_tokens_per_s(recs, a)
                for side in sides:
                    rates[side].append(got[side])
                line = ", ".join(
                    f"{side} {got[side]:7.0f} tok/s"
                    + ("" if side == "torch" else f" ({got[side] / got['torch']:.3f})")
                    for side in sides
                )
                print(
                    f"  {precision} round {r} (load {os.getloadavg()[0]:.2f}): {line}",
                    flush=True,
                )
            for side in [s for s in sides if s != "torch"]:
                ratios = [h / t for h, t in zip(rates[side], rates["torch"])]
                print(
                    f"{precision} {side}/torch per round {min(ratios):.3f}..{max(ratios):.3f}, "
                    f"median of rounds {statistics.median(ratios):.3f}, ratio of medians "
                    f"{statistics.median(rates[side]) / statistics.median(rates['torch']):.3f}"
                )


def levers(a: argparse.Namespace) -> None:
    mib = 1 << 20
    print(
        f"{a.layers} layers x {a.embd}, seq {a.seq}, {a.threads} thread(s); per-token cost "
        f"from micro-batch {a.batch // 2} to {a.batch}; controller under {a.budget}"
    )
    print("| precision | checkpoint | tokens/s | peak at B | MiB per 1k tokens | settles at |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for precision in ["fp32", "bf16"]:
            for ck in ["none", "every:2", "blocks"]:
                peaks, rate = {}, 0.0
                for b in [a.batch // 2, a.batch]:
                    recs = run_headroom(
                        a, Path(d), precision=precision, checkpoint=ck, micro=b, effective=b
                    )
                    mem = [r["peak_bytes"] for r in recs if r["kind"] == "step_memory"]
                    # The median of the steps after the first (which grows the heap).
                    peaks[b] = statistics.median(mem[1:])
                    if b == a.batch:
                        a2 = argparse.Namespace(**{**vars(a), "batch": b})
                        rate = headroom_tokens_per_s(recs, a2)
                per_token = (peaks[a.batch] - peaks[a.batch // 2]) / (a.batch // 2 * a.seq)
                if precision not in a.settle.split(","):
                    print(
                        f"| {precision} | {ck} | {rate:.0f} | {peaks[a.batch] / mib:.0f} MiB | "
                        f"{per_token * 1000 / mib:.2f} | not run |"
                    )
                    continue
                # Three times the steps: the controller grows from 1 before it settles.
                recs = run_headroom(
                    argparse.Namespace(**{**vars(a), "steps": 3 * a.steps}),
                    Path(d),
                    precision=precision,
                    checkpoint=ck,
                    adaptive=True,
                    budget=a.budget,
                    micro=1,
                    effective=a.effective,
                )
                sizes = [r["micro_batch"] for r in recs if r["kind"] == "step_memory"]
                settled = statistics.median(sizes[-10:])
                print(
                    f"| {precision} | {ck} | {rate:.0f} | {peaks[a.batch] / mib:.0f} MiB | "
                    f"{per_token * 1000 / mib:.2f} | {settled:g} |"
                )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["speed", "levers"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--precision", choices=["fp32", "bf16", "both"], default="both")
    p.add_argument(
        "--cpu-time",
        action="store_true",
        help="speed: tokens per CPU second instead of per wall second (a shared machine's "
        "load changes wall time far more than CPU time; the built-in side is then a run of "
        "--steps less a run of 3)",
    )
    p.add_argument(
        "--before-bin",
        default="",
        help="speed: a second headroom binary (an older build) timed in the same rounds",
    )
    p.add_argument("--budget", default="768MiB", help="levers: the controller's budget")
    p.add_argument("--effective", type=int, default=256, help="levers: the effective batch")
    p.add_argument(
        "--settle",
        default="fp32,bf16",
        help="levers: the precisions whose controller run is made (bf16 is slow on CPUs "
        "without bf16 instructions)",
    )
    a = p.parse_args()
    if a.layers <= 0 or a.batch < 2 or not math.isfinite(a.steps) or a.steps < 3:
        raise SystemExit("--layers, --batch >= 2 and --steps >= 3 are needed")
    speed(a) if a.what == "speed" else levers(a)


if __name__ == "__main__":
    main()
