"""A run under a real cap (headroom's hard_limit) where one long sample fits only with its
blocks' activations recomputed: run by test_levers.py in its own process, since the cap is
process-wide. Short samples, then the long one, then short ones again, at micro-batch 1
where it matters. `--framework loop` is a hand-written loop (with `--blocks` it hands the
run its blocks; without, the run has no lever and gives up at micro-batch 1);
`--framework hf` an adapted Trainer on a GPT-2 whose own
``gradient_checkpointing_enable()`` is the lever; `--framework lightning` an
AdaptiveModule whose ``activation_checkpointing(on)`` hook is. Prints one JSON line: the
steps done and whether checkpointing was on at the end."""

from __future__ import annotations

import json

import capped
import torch

import headroom

D = 64


class Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Stack(torch.nn.Module):
    """Blocks whose activations (ten floats per token and block) outweigh everything
    else: a long sequence's are what the cap refuses."""

    def __init__(self, d: int = D, layers: int = 16):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.recompute = False  # set by the Lightning module's hook

    def forward(self, x):
        for block in self.blocks:
            if self.recompute:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x

    def loss(self, x):
        return self(x).pow(2).mean()


def samples() -> list[torch.Tensor]:
    """Two short batches of 2, one of 2 long sequences, two short again."""
    g = torch.Generator().manual_seed(0)
    short = [torch.randn(2, 16, D, generator=g) for _ in range(2)]
    return short + [torch.randn(2, 8192, D, generator=g)] + short


def loop(args) -> dict:
    model = Stack()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = samples()
    model.loss(data[0]).backward()
    opt.zero_grad(set_to_none=True)
    run = headroom.Run(
        "lever-capped",
        model=model,
        effective_batch=2,
        micro_batch=2,
        memory_budget=str(capped.budget(args.room)),
        hard_limit=True,
        log=args.log,
        checkpoint_blocks=model.blocks if args.blocks else None,
    )
    with run:
        for x in data:
            run.backward(x, model.loss, seq_len=x.shape[1])
            run.step(opt)
    return {"steps": run.step_count, "checkpointing": run._levers.checkpointing == "blocks"}


def hf(args) -> dict:
    import transformers
    from hf_models import tiny_gpt2, training_args

    import headroom.hf

    long = 1024

    class Lengths(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.ids = [torch.randint(0, 256, (t,), generator=g) for t in (32, 32, long, 32, 32)]

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    model = tiny_gpt2(vocab=256, ctx=long, layers=32, d=128)
    ds = Lengths()
    targs = training_args(
        args.out, per_device_train_batch_size=1, max_steps=len(ds), learning_rate=1e-3
    )
    # In order: the long sample comes third, after the cap is learned on short ones.
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=ds)
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(ds)
    trainer.create_optimizer_and_scheduler(num_training_steps=len(ds))
    model(**{k: v[None] for k, v in ds[0].items()}).loss.backward()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    headroom.hf.adapt(
        trainer,
        memory_budget=str(capped.budget(args.room)),
        hard_limit=True,
        log=args.log,
        name="hf-lever-capped",
    )
    trainer.train()
    # transformers 5 names it activation checkpointing (the old name warns); 4 gradient.
    on = getattr(type(model), "is_activation_checkpointing", None)
    on = model.is_activation_checkpointing if on is not None else model.is_gradient_checkpointing
    return {"steps": trainer.state.global_step, "checkpointing": on}


def lightning(args) -> dict:
    from lightning_models import trainer

    import headroom.lightning

    class Hooked(headroom.lightning.AdaptiveModule):
        def __init__(self):
            super().__init__()
            self.net = Stack()

        def micro_batch_loss(self, batch):
            return self.net.loss(batch)

        def activation_checkpointing(self, on: bool) -> None:
            self.net.recompute = on

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Batches(torch.utils.data.Dataset):
        def __init__(self):
            self.batches = samples()

        def __len__(self):
            return len(self.batches)

        def __getitem__(self, i):
            return self.batches[i]

    data = Batches()
    model = Hooked()
    model.net.loss(data[0]).backward()
    model.zero_grad(set_to_none=True)
    cb = headroom.lightning.Adaptive(
        "pl-lever-capped",
        effective_batch=2,
        memory_budget=str(capped.budget(args.room)),
        hard_limit=True,
        log=args.log,
    )
    fit = trainer(args.out, callbacks=[cb], max_steps=len(data))
    fit.fit(model, torch.utils.data.DataLoader(data, batch_size=None))
    return {"steps": fit.global_step, "checkpointing": model.net.recompute}


def main() -> int:
    ap = capped.arguments(room="160MiB")
    ap.add_argument("--framework", choices=["loop", "hf", "lightning"], default="loop")
    ap.add_argument("--blocks", action="store_true", help="hand the loop's run its blocks")
    ap.add_argument("--out", help="the framework's output folder")
    args = ap.parse_args()
    capped.one_thread()
    done = {"loop": loop, "hf": hf, "lightning": lightning}[args.framework](args)
    print(json.dumps(done))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
