"""Evaluation batches far larger than a real cap (headroom's hard_limit) allows, while
training fits: run by test_eval.py in its own process (the cap is process-wide), once
capped and once with room to spare, and by docs/BENCHMARKS.md ("Evaluation under a cap").

`--mode loop`: a hand-written loop's `run.evaluate`; `--mode hf`: `headroom.hf.adapt`'s
Trainer, evaluating during `train()` and by `trainer.evaluate()` after it; `--mode
lightning`: `headroom.lightning.Adaptive`'s validation during the fit. `--how headroom`
(the default) under the cap; `uncapped`: the same with room to spare (nothing splits);
`alone`: the framework's own evaluation under the same cap, with a watch-only run setting
it (the comparison: it fails); `hand`: the framework's own evaluation under the cap with
the eval batch set by hand to `--hand-batch`. Prints one JSON line: the evaluation
results in order, the seconds they took, and the error if one ended the script."""

from __future__ import annotations

import json
import sys
import time

import capped
import torch

import headroom

EVAL_BATCH = {"loop": 256, "hf": 512, "lightning": 512}


def loop(args, budget):
    from lever_capped import Stack

    model = Stack(d=64, layers=4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    train = [torch.randn(2, 16, 64, generator=g) for _ in range(4)]
    evals = [torch.randn(args.eval_batch, 512, 64, generator=g)]
    model.loss(train[0]).backward()
    opt.zero_grad(set_to_none=True)
    budget = budget()

    def result(x):
        out = model(x)
        return {"loss": out.pow(2).mean(), "norms": out.flatten(1).norm(dim=1)}

    results = []
    if args.how in ("alone", "hand"):
        headroom.Run("eval-alone", memory_budget=str(budget), hard_limit=True, log=args.log)
        for step, x in enumerate(train):
            model.loss(x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % 2 == 1:
                for b in evals:
                    n = args.hand_batch if args.how == "hand" else len(b)
                    with torch.no_grad():
                        parts = [(len(c), result(c)) for c in b.split(n)]
                    loss = sum(float(r["loss"]) * k for k, r in parts) / len(b)
                    results.append([loss, torch.cat([r["norms"] for _, r in parts]).tolist()])
        return results
    run = headroom.Run(
        "eval-loop",
        model=model,
        effective_batch=2,
        micro_batch=2,
        memory_budget=None if args.how == "uncapped" else str(budget),
        hard_limit=args.how != "uncapped",
        log=args.log,
    )
    with run:
        for step, x in enumerate(train):
            run.backward(x, model.loss, seq_len=x.shape[1])
            run.step(opt)
            if step % 2 == 1:
                with run.evaluation("validation"):
                    for b in evals:
                        r = run.evaluate(b, result, seq_len=b.shape[1])
                        results.append([float(r["loss"]), r["norms"].tolist()])
    return results


def hf(args, budget):
    import transformers
    from hf_models import Samples, tiny_gpt2, training_args

    import headroom.hf

    model = tiny_gpt2(vocab=256, ctx=128, d=64)
    train = Samples(8 * 4, t=128, vocab=256)
    evals = Samples(2 * args.eval_batch, t=128, vocab=256, seed=1)
    per_eval = args.hand_batch if args.how == "hand" else args.eval_batch
    targs = training_args(
        args.out,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=per_eval,
        max_steps=4,
        eval_strategy="steps",
        eval_steps=2,
        optim="adamw_torch",
    )
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=train, eval_dataset=evals)
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    model(**train[0:2]).loss.backward()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    budget = budget()
    results = []

    class Keep(transformers.TrainerCallback):
        def on_evaluate(self, a, state, control, metrics=None, **kw):
            results.append(metrics["eval_loss"])

    trainer.add_callback(Keep())
    if args.how in ("alone", "hand"):
        headroom.Run("eval-alone", memory_budget=str(budget), hard_limit=True, log=args.log)
    else:
        capped_kw = (
            {} if args.how == "uncapped" else {"memory_budget": str(budget), "hard_limit": True}
        )
        headroom.hf.adapt(trainer, micro_batch=8, log=args.log, name="eval-hf", **capped_kw)
    trainer.train()
    trainer.evaluate()
    return results


def lightning(args, budget):
    import lightning as L
    from lightning_models import TinyAdaptive, loader, trainer

    import headroom.lightning

    class Validated(TinyAdaptive):
        def validation_step(self, batch, batch_idx):
            loss = self.net.loss(batch)
            self.log("val_loss", loss)
            return loss

    gpt = dict(vocab=256, d=64, t=128, layers=2)
    model = Validated(**gpt)
    data = loader(4, 8, t=128, vocab=256)
    per_eval = args.hand_batch if args.how == "hand" else args.eval_batch
    val = loader(2 * args.eval_batch // per_eval, per_eval, t=128, vocab=256, seed=1)
    model.net.loss(next(iter(loader(1, 2, t=128, vocab=256)))).backward()
    model.zero_grad(set_to_none=True)
    budget = budget()
    results = []

    class Keep(L.Callback):
        def on_validation_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                results.append(float(trainer.callback_metrics["val_loss"]))

    if args.how in ("alone", "hand"):
        headroom.Run("eval-alone", memory_budget=str(budget), hard_limit=True, log=args.log)
        callbacks = [headroom.lightning.Adaptive("eval-pl-alone")]
        # Its own validation: the callback's chunking taken back off the module.
        callbacks[0].setup = lambda *a, **k: None
    else:
        capped_kw = (
            {} if args.how == "uncapped" else {"memory_budget": str(budget), "hard_limit": True}
        )
        callbacks = [headroom.lightning.Adaptive("eval-pl", log=args.log, **capped_kw)]
    fit = trainer(args.out, max_steps=4, val_check_interval=2, callbacks=[*callbacks, Keep()])
    fit.fit(model, data, val)
    return results


def main() -> int:
    ap = capped.arguments(room="160MiB")
    ap.add_argument("--mode", choices=["loop", "hf", "lightning"], required=True)
    ap.add_argument("--how", choices=["headroom", "uncapped", "alone", "hand"], default="headroom")
    ap.add_argument("--out", default=".")
    ap.add_argument("--eval-batch", type=int)
    ap.add_argument("--hand-batch", type=int, default=16)
    args = ap.parse_args()
    args.eval_batch = args.eval_batch or EVAL_BATCH[args.mode]
    capped.one_thread()
    t0 = time.perf_counter()
    error = None
    results = []
    try:
        results = globals()[args.mode](args, lambda: capped.budget(args.room))
    except Exception as e:  # the comparison's failure is a result, said
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    print(json.dumps({"results": results, "seconds": time.perf_counter() - t0, "error": error}))
    return 0 if error is None else 1


if __name__ == "__main__":
    sys.exit(main())
