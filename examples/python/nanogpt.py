"""A nanoGPT-style byte-level transformer on Tiny Shakespeare, trained in headroom's
ADAPTIVE mode: the loop asks for an effective batch of N samples, and headroom's memory
controller picks the micro-batch each step is cut into (gradient accumulation), growing it
while memory allows and shrinking it, mid-step, when an out-of-memory error strikes. The
gradients always equal one full-batch backward's, so the training is the same whatever the
micro-batch.

Run it from the repository root, in the environment that has your torch, after
`pip install ./py` (which also gives the `headroom` command):

    python examples/python/nanogpt.py --steps 50

and in another terminal watch and steer it:

    headroom attach

A real capped run on the CPU: the whole process may hold at most 850 MiB, and past that an
allocation fails. Python, torch and the model hold about 0.6 GiB before training starts
(measured with torch 2.11's CUDA build; it depends on the build), and a micro-batch of 64
needs about 0.35 GiB more, so the first step runs out of memory. The controller recovers
mid-step: the samples not yet done are retried at a smaller micro-batch, which then grows
back as far as the budget allows. The log's `oom` and `decision` records show it all:

    python examples/python/nanogpt.py --memory-budget 850MiB --hard-limit \\
        --micro-batch 64 --steps 15 --log /tmp/nanogpt.jsonl

Plain PyTorch besides headroom: token and position embeddings, pre-LN blocks (causal
self-attention through scaled_dot_product_attention, and an MLP), a head tied to the token
embedding; AdamW with a linear warmup and a cosine decay. Samples are random contiguous
windows of the corpus's bytes, drawn from a seeded generator, so a run is reproducible.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import headroom

DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "assets" / "tinyshakespeare.txt"
VOCAB = 256  # bytes


# ---- the model -----------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"--n-embd {n_embd} is not a multiple of --n-head {n_head}")
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (b, t, c) -> (b, heads, t, c / heads)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, seq_len: int, n_layer: int, n_head: int, n_embd: int, dropout: float):
        super().__init__()
        self.seq_len = seq_len
        self.tok = nn.Embedding(VOCAB, n_embd)
        self.pos = nn.Embedding(seq_len, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                # GPT-2's scaled init of the layers that add into the residual stream.
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The mean next-byte cross-entropy of a (inputs, targets) batch."""
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


# ---- data ----------------------------------------------------------------------------------


def windows(
    data: torch.Tensor, n: int, seq_len: int, gen: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` random contiguous windows of `seq_len + 1` bytes: (inputs, targets shifted by 1)."""
    starts = torch.randint(0, len(data) - seq_len - 1, (n,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)
    w = data[idx].to(device=device, dtype=torch.long)
    return w[:, :-1], w[:, 1:]


@torch.no_grad()
def evaluate(model: GPT, val: tuple[torch.Tensor, torch.Tensor], chunk: int) -> float:
    """The mean loss over the fixed validation windows, `chunk` windows at a time."""
    model.eval()
    x, y = val
    total = 0.0
    for i in range(0, len(x), chunk):
        total += float(model.loss((x[i : i + chunk], y[i : i + chunk]))) * len(x[i : i + chunk])
    model.train()
    return total / len(x)


def lr_at(step: int, args: argparse.Namespace, warmup: int) -> float:
    """Linear warmup to --lr, then a cosine decay to a tenth of it at --steps."""
    if step <= warmup:
        return args.lr * step / warmup
    progress = min(1.0, (step - warmup) / max(1, args.steps - warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


# ---- checkpoints ---------------------------------------------------------------------------


def checkpointer(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer):
    """The on_checkpoint callback: the dashboard's checkpoint key (and the end of the run)
    saves the model and optimizer to DIR/step-N.pt, atomically, and returns the path."""
    directory.mkdir(parents=True, exist_ok=True)

    def save(step: int) -> Path:
        path = directory / f"step-{step}.pt"
        # Written beside the final name, then renamed over it: a crash mid-write never
        # leaves a truncated step-N.pt.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                state = {
                    "step": step,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                }
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path

    return save


# ---- the loop ------------------------------------------------------------------------------


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written; each option's default, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if all(action.default is not v for v in (None, False, argparse.SUPPRESS)):
            text += " (default: %(default)s)"
        return text


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="a text file to train on")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps")
    ap.add_argument("--effective-batch", type=int, default=64, help="samples per optimizer step")
    ap.add_argument(
        "--micro-batch", type=int, default=8, help="the micro-batch the controller starts from"
    )
    ap.add_argument("--seq-len", type=int, default=128, help="bytes per sample")
    ap.add_argument("--n-layer", type=int, default=4, help="transformer blocks")
    ap.add_argument("--n-head", type=int, default=4, help="attention heads per block")
    ap.add_argument("--n-embd", type=int, default=128, help="width of the residual stream")
    ap.add_argument("--dropout", type=float, default=0.0, help="dropout probability")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    ap.add_argument(
        "--warmup", type=int, default=None, help="warmup steps (none given: steps/10, at most 100)"
    )
    ap.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's, on matrices only")
    ap.add_argument("--seed", type=int, default=1337, help="seeds the model and the data")
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu, cuda, cuda:1, ...",
    )
    ap.add_argument(
        "--memory-budget",
        default=None,
        help='what the run may use, e.g. "1GiB" (CPU: the whole process\'s resident memory, '
        "Python and torch included; CUDA: a cap on the caching allocator), or auto on the CPU",
    )
    ap.add_argument(
        "--hard-limit",
        action="store_true",
        help="CPU only: allocations past --memory-budget really fail (the controller recovers)",
    )
    ap.add_argument("--log", default=None, help="write the run's JSONL log to this file")
    ap.add_argument(
        "--listen", default=None, help="also serve dashboards on TCP (PORT or HOST:PORT)"
    )
    ap.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="where the dashboard's checkpoint key, and the end of the run, save step-N.pt",
    )
    ap.add_argument(
        "--eval-every", type=int, default=50, help="validation loss every N steps (0: never)"
    )
    ap.add_argument(
        "--eval-samples", type=int, default=64, help="validation windows (held-out last 10%%)"
    )
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    data = torch.frombuffer(bytearray(args.corpus.read_bytes()), dtype=torch.uint8)
    if len(data) < 20 * (args.seq_len + 1):
        sys.exit(
            f"{args.corpus}: {len(data)} bytes is too little text for --seq-len {args.seq_len}"
        )
    cut = int(len(data) * 0.9)
    train_data, val_data = data[:cut], data[cut:]
    # Fixed validation windows from the held-out last 10%; training draws from its own stream.
    val = windows(
        val_data, args.eval_samples, args.seq_len, torch.Generator().manual_seed(0), device
    )
    gen = torch.Generator().manual_seed(args.seed)

    model = GPT(args.seq_len, args.n_layer, args.n_head, args.n_embd, args.dropout).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        # One kernel, no parameter-sized temporaries once the update begins: an
        # out-of-memory error can only strike before anything changed, which headroom
        # undoes, so every step is all-or-nothing (docs/PYTHON.md).
        fused=True,
    )
    warmup = args.warmup if args.warmup is not None else max(1, min(100, args.steps // 10))
    save = checkpointer(args.checkpoint_dir, model, optimizer) if args.checkpoint_dir else None
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"nanogpt: {n_params / 1e6:.2f}M parameters on {device}, {len(train_data):,} training "
        f"bytes; {args.steps} steps of {args.effective_batch} x {args.seq_len} bytes",
        flush=True,
    )

    with headroom.Run(
        "nanogpt",
        model=model,
        total_steps=args.steps,
        effective_batch=args.effective_batch,
        micro_batch=args.micro_batch,
        max_seq_len=args.seq_len,
        memory_budget=args.memory_budget,
        hard_limit=args.hard_limit,
        log=args.log,
        listen=args.listen,
        on_checkpoint=save,
    ) as run:
        print(f"headroom: attach with `headroom attach` (socket {run.socket})", flush=True)
        t_start = last_t = time.perf_counter()
        last_step = 0
        for step in range(1, args.steps + 1):
            if run.should_stop:
                print(f"stop asked from the dashboard: ending after step {step - 1}", flush=True)
                break
            lr = lr_at(step, args, warmup)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = windows(train_data, args.effective_batch, args.seq_len, gen, device)
            # Forward and backward in the controller's micro-batches, then the update.
            loss = run.backward(batch, model.loss)
            run.step(optimizer)

            if step % 10 == 0 or step == 1 or step == args.steps:
                now = time.perf_counter()
                per_step = (now - last_t) / (step - last_step)
                last_t, last_step = now, step
                print(
                    f"step {step:5d}  loss {loss:.4f}  lr {lr:.2e}  micro-batch "
                    f"{run.micro_batch:3d}  {per_step:.2f} s/step",
                    flush=True,
                )
            if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
                val_loss = evaluate(model, val, chunk=run.micro_batch or args.micro_batch)
                run.eval(val_loss, train_loss=loss)
                print(f"step {step:5d}  val loss {val_loss:.4f}", flush=True)
        done = run.step_count
        elapsed = time.perf_counter() - t_start
        if save is not None and done:
            run.checkpoint_saved(save(done))
        print(
            f"done: {done} steps in {elapsed:.1f} s ({done / max(elapsed, 1e-9):.2f} steps/s), "
            f"micro-batch {run.micro_batch}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
