"""headroom for the Hugging Face ``transformers.Trainer``: watch a run, or let headroom's
controller choose its micro-batches. Needs transformers (``import headroom`` does not).

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[headroom.hf.Watch()])        # watch: one line
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    headroom.hf.adapt(trainer)                                # adaptive: one line

What `adapt` overrides and what it keeps: docs/PYTHON.md, "Hugging Face Trainer".
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import random
import types
from typing import Any

import torch

try:
    import transformers
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "headroom.hf needs the transformers package (pip install transformers); "
        "`import headroom` alone works without it"
    ) from e

import numpy as np  # transformers needs it
from accelerate.utils import DistributedType

from . import _args, _batch, _dist, _eval, _torch
from ._errors import RunError
from ._run import Run, _default_name

__all__ = ["Watch", "adapt"]


class _SteppedByFramework:
    """What `Run.step` is handed when the framework has already stepped the optimizer
    itself: its step and zero_grad are the framework's, so here they do nothing (and
    headroom says nothing about undoing them: it never runs them); the learning rate is
    the one the step used, the state the framework's optimizer's (what the step's fixed
    memory is made of)."""

    headroom_steps_it = False

    def __init__(self, lr: float | None, optimizer: Any = None):
        self.param_groups = [] if lr is None else [{"params": [], "lr": lr}]
        self.state: dict = getattr(optimizer, "state", None) or {}

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


class _LossTap:
    """The model's own loss (``outputs.loss``) over the forwards of one Trainer step,
    read from a forward hook, so watching costs no extra computation. When the Trainer
    passed ``num_items_in_batch`` (4.46+), each forward's loss is already a share of the
    step's and they add up; otherwise each is a batch's mean and they average, as the
    Trainer's own logged loss does."""

    def __init__(self, model: torch.nn.Module):
        self.losses: list[torch.Tensor] = []
        self.shares = False
        self.samples = 0
        self.seq_len = 1
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output) -> None:
        if not module.training:
            return
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self.losses.append(loss.detach())
            self.shares = kwargs.get("num_items_in_batch") is not None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and ids.dim() >= 1:
            self.samples += int(ids.shape[0])
            self.seq_len = int(ids.shape[1]) if ids.dim() >= 2 else 1

    def take(self) -> tuple[float | None, int, int]:
        """The step's loss (None when the model returned none), samples and length."""
        loss = None
        if self.losses:
            total = torch.stack(self.losses).sum()
            loss = float(total if self.shares else total / len(self.losses))
        out = (loss, self.samples, self.seq_len)
        self.losses, self.samples = [], 0
        return out


class Watch(TrainerCallback):
    """A ``TrainerCallback`` that puts the Trainer's run on headroom's stream.

    Each optimizer step is reported (the model's loss, the samples, the learning rate,
    the step's peak memory); the Trainer's logs and eval metrics reach the dashboard; the
    dashboard's commands are carried out the Trainer's way: stop sets
    ``control.should_training_stop`` with a save, checkpoint sets ``control.should_save``
    (the Trainer's own ``checkpoint-N``, which ``resume_from_checkpoint`` loads), pause
    waits at the step's end. Keyword arguments go to :class:`headroom.Run` (``name``,
    ``log``, ``memory_budget``, ``thresholds``, ``listen``, …).
    """

    def __init__(self, name: str | None = None, **run_kwargs: Any):
        self._name = name
        self._run_kwargs = run_kwargs
        self.run: Run | None = None
        self._save_asked = False
        self._lr: float | None = None
        self._tap: _LossTap | None = None
        self._last_loss: float | None = None

    # ---- the run -------------------------------------------------------------------------

    def _make_run(self, args, state, model, **extra) -> Run:
        kw = {"total_steps": int(state.max_steps or 0), **extra, **self._run_kwargs}
        if "checkpoint_blocks" in self._run_kwargs:
            # The script named its blocks: they are the lever, not the model's own switch.
            kw.pop("checkpointing", None)
        return Run(
            _run_name(self._name, args), model=model, on_checkpoint=self._ask_checkpoint, **kw
        )

    def _ask_checkpoint(self, step: int) -> str | None:
        # The save itself is the Trainer's (at this step's end, as checkpoint-N, with the
        # optimizer, scheduler and RNG states its resume needs); on_save tells the
        # dashboard where it went.
        self._save_asked = True

    _stop_saved = False  # the stop's checkpoint was saved when the step was given up

    def _carry_out(self, control) -> None:
        if self.run.should_stop:
            control.should_training_stop = True
            control.should_save = not self._stop_saved
        if self._save_asked:
            self._save_asked = False
            control.should_save = True

    # ---- the Trainer's events --------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.run = self._make_run(args, state, model)
        self._say_fsdp_not_applied(args)
        self._tap = _LossTap(model)

    def _say_fsdp_not_applied(self, args) -> None:
        text = _fsdp_not_applied(args)
        if text is not None:
            self.run.notice(text, level="warn")

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        # The learning rate this step used (the scheduler moves it right after).
        if optimizer is not None and optimizer.param_groups:
            self._lr = optimizer.param_groups[0].get("lr")

    def on_step_end(self, args, state, control, **kwargs):
        loss, samples, seq_len = self._tap.take()
        if loss is None:
            # A model that returns no loss: the Trainer's last logged one, else none.
            loss = self._last_loss
        self.run.report(loss, samples=samples or None, seq_len=seq_len, lr=self._lr)
        self._carry_out(control)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" in logs:
            self._last_loss = float(logs["loss"])
            figures = ", ".join(
                f"{k} {logs[k]:.4g}"
                for k in ("loss", "grad_norm", "learning_rate", "epoch")
                if isinstance(logs.get(k), (int, float))
            )
            self.run.notice(f"trainer step {state.global_step}: {figures}")

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics = metrics or {}
        if isinstance(metrics.get("eval_loss"), (int, float)):
            self.run.eval(metrics["eval_loss"], train_loss=self._last_loss)

    def on_save(self, args, state, control, **kwargs):
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(path):
            self.run.checkpoint_saved(path)

    def on_train_end(self, args, state, control, **kwargs):
        if self._tap is not None:
            self._tap.handle.remove()
        if self.run is not None:
            self.run.finish()


class _Adaptive(Watch):
    """The callback half of :func:`adapt`: the run is adaptive, its steps are the
    Trainer's batches (ended by the patched ``training_step`` or at the Trainer's step
    end), and nothing is reported from a hook."""

    trainer: transformers.Trainer | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # A train() after one a stop ended (the same trainer, a new run) trains again.
        self.halted = self._stop_saved = False
        per_device = int(args.per_device_train_batch_size)
        total = int(state.max_steps or 0) * int(args.gradient_accumulation_steps)
        kw = {"effective_batch": per_device, "total_steps": total}
        if args.world_size > 1:
            # Under torchrun the run joins the job through the Trainer's DDP wrapper (made
            # by now): every micro-batch under its no_sync, the gradients averaged once per
            # batch inside the last backward after the ranks agree, so one rank's OOM never
            # strands the others.
            model = self.trainer.model_wrapped
        self.run = self._make_run(args, state, model, **kw, **_hf_levers(args, model))
        self._say_fsdp_not_applied(args)
        self._optimizer = kwargs.get("optimizer") or self.trainer.optimizer
        if self._optimizer is not None:
            self.run.notice(
                f"the optimizer step is the Trainer's ({_torch.optimizer_name(self._optimizer)}"
                f"{', fused' if _torch.is_fused(self._optimizer) else ''}): headroom splits "
                "forward and backward into micro-batches and retries an out-of-memory error "
                "there; one inside the Trainer's optimizer.step() is not retried"
            )

    _optimizer: Any = None
    shares: bool | None = None  # whether the loss honours num_items_in_batch (probed once)
    halted = False  # a stop gave the Trainer's step up: its other batches do nothing

    _rng_at_step: dict | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        # The random states a checkpoint at the last step's end holds (the Trainer saves
        # them for an exact resume): a stop that gives this step up saves these, not the
        # states its dropout has moved on since.
        self._rng_at_step = _rng_states()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self.halted:  # the Trainer's figures of a step given up are of nothing
            super().on_log(args, state, control, logs=logs, **kwargs)

    def _ask_checkpoint(self, step: int) -> str | None:
        if self.run is not None and self.run.stop_gave_up_a_step and self.trainer is not None:
            return self._save_now()
        return super()._ask_checkpoint(step)

    def _save_now(self) -> str:
        """The Trainer's own checkpoint, at once: a stop gave the step in progress up, and
        the Trainer would not save it at the step's end (one process exits in
        run.backward; a job's ranks go on to an optimizer step with no gradients). Its
        model, optimizer, scheduler and RNG are still the last completed step's, saved
        as checkpoint-<global_step>, which resume_from_checkpoint continues from, redoing
        the step given up."""
        t = self.trainer
        now = _rng_states()
        if self._rng_at_step is not None:
            _set_rng_states(self._rng_at_step)
        try:
            t._save_checkpoint(t.model_wrapped, None)
        finally:
            _set_rng_states(now)
        self._stop_saved = True
        return os.path.join(t.args.output_dir, f"checkpoint-{t.state.global_step}")

    def end_step(self) -> None:
        """Ends the run's step of the last batch: at the next batch of the same optimizer
        step (the Trainer's own accumulation), or once the Trainer stepped (so its peak
        holds the optimizer's update)."""
        run = self.run
        if run is not None and run.in_step:
            run.step(_SteppedByFramework(self._lr, self._optimizer), zero_grad=False)

    def on_step_end(self, args, state, control, **kwargs):
        self.end_step()
        self._carry_out(control)

    def on_train_end(self, args, state, control, **kwargs):
        self.end_step()
        super().on_train_end(args, state, control, **kwargs)


def _rng_states() -> dict:
    """The random states the Trainer's checkpoint saves (`_save_rng_state`): Python's,
    NumPy's, torch's CPU generator and, once CUDA is in use, every device's."""
    states = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.random.get_rng_state_all()
    return states


def _set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.random.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.random.set_rng_state_all(states["cuda"])


def _hf_levers(args, model) -> dict:
    """The levers an adapted Trainer hands its run, through its own seams: activation
    checkpointing by the model's ``gradient_checkpointing_enable()``/``disable()`` (when
    the model supports it and the Trainer does not checkpoint already), and the precision
    of the forward by the run's autocast in ``run.backward`` (when the Trainer runs in
    float32: its own bf16/fp16 is fixed once accelerate has prepared it)."""
    levers: dict = {}
    model = getattr(model, "module", model)
    if getattr(model, "supports_gradient_checkpointing", False) and not args.gradient_checkpointing:
        # transformers 5 names it activation checkpointing; 4 gradient checkpointing.
        new = hasattr(model, "activation_checkpointing_enable")
        prefix = "activation" if new else "gradient"
        enable = getattr(model, f"{prefix}_checkpointing_enable")
        disable = getattr(model, f"{prefix}_checkpointing_disable")

        def switch(on: bool) -> None:
            if on:
                enable(**{f"{prefix}_checkpointing_kwargs": {"use_reentrant": False}})
            else:
                disable()

        levers["checkpointing"] = switch
    if not (args.bf16 or args.fp16):
        levers["precision"] = "fp32"
    return levers


def _run_name(given: str | None, args) -> str:
    """The run's name: the callback's `name=`, else `TrainingArguments(run_name=)` when the
    script set one, else the script's name, as for any run (docs/PYTHON.md, `Run`). Not
    output_dir's last folder: "out" or "checkpoints" names nothing."""
    if given:
        return given
    run_name = getattr(args, "run_name", None)
    if run_name and os.path.normpath(run_name) != os.path.normpath(str(args.output_dir)):
        return run_name
    return _default_name()


def adapt(trainer: transformers.Trainer, **run_kwargs: Any) -> transformers.Trainer:
    """Lets headroom's controller choose the Trainer's micro-batches.

    ``per_device_train_batch_size`` becomes the batch each of the Trainer's steps learns
    from (its effective batch); headroom cuts each such batch into micro-batches that
    grow while memory allows and shrink before it runs out, and an out-of-memory error in
    forward or backward is retried smaller within the step, without a restart. Overridden:
    the instance's ``training_step`` (its body is the Trainer's: the same
    ``compute_loss``, loss normalisation and ``accelerator.backward``, per micro-batch).
    Kept: the Trainer's own gradient accumulation, mixed precision, clipping, optimizer
    and LR schedule, logging, checkpoints and ``resume_from_checkpoint``. Evaluation
    (``evaluate``, ``predict``, evaluation during ``train()``) runs each
    ``per_device_eval_batch_size`` batch in chunks that fit (``prediction_step`` per
    chunk, the results joined), so an eval batch larger than memory allows completes.
    Under ``torchrun`` with the Trainer's DDP, each rank cuts its own per-device batch
    (a tighter rank cuts finer) and the gradients are averaged once per batch, inside each
    rank's last backward after the ranks agree. With the Trainer's FSDP2
    (``fsdp_config={"fsdp_version": 2}``) the ranks agree on each step's micro-batch count
    and every unit's collectives are gated, so an OOM on one rank is redone by all;
    FSDP1 and DeepSpeed are refused. Keyword
    arguments go to :class:`headroom.Run` (``micro_batch`` to start from,
    ``memory_budget``, ``hard_limit``, ``log``, …).
    Returns the trainer.
    """
    if getattr(trainer, "_headroom", None) is not None:
        raise RunError("headroom.hf.adapt(trainer) was already called on this trainer")
    if trainer.args.auto_find_batch_size:
        raise RunError(
            "headroom.hf.adapt: auto_find_batch_size=True would restart the loop at a smaller "
            "per-device batch after an OOM; headroom recovers within the step instead. Set "
            "auto_find_batch_size=False"
        )
    if str(trainer.args.optim).lower().endswith("lomo"):
        raise RunError(
            "headroom.hf.adapt: the LOMO optimizers update the parameters inside backward, "
            "which cannot be split into micro-batches; use another optimizer"
        )
    _refuse_sharding(trainer)
    _args.framework_half("headroom.hf.adapt", run_kwargs, "the Trainer takes itself")
    cb = _Adaptive(**run_kwargs)
    cb.trainer = trainer
    trainer.add_callback(cb)
    trainer._headroom = cb
    trainer.training_step = types.MethodType(_training_step, trainer)
    _chunk_evaluation(trainer, cb)
    return trainer


def _refuse_sharding(trainer: transformers.Trainer) -> None:
    """What adaptive mode cannot split, refused before training starts: DeepSpeed, and
    the Trainer's FSDP1 (accelerate's FullyShardedDataParallel wrapper). Its FSDP2
    (``fsdp_config={"fsdp_version": 2}``) is gated as a hand-sharded model is."""
    accelerator = getattr(trainer, "accelerator", None)
    kind = getattr(accelerator, "distributed_type", None)
    if kind == DistributedType.DEEPSPEED:
        raise RunError("headroom.hf.adapt: " + _dist.deepspeed_refusal("of the Trainer"))
    if kind == DistributedType.FSDP and not getattr(accelerator, "is_fsdp2", False):
        raise RunError(
            "headroom.hf.adapt: the Trainer's FSDP is FSDP1 (FullyShardedDataParallel), whose "
            "collectives headroom cannot gate; ask for FSDP2 with TrainingArguments(fsdp="
            '"full_shard", fsdp_config={"fsdp_version": 2, ...}): headroom then gates '
            "every unit's all-gather and reduce-scatter, so an out-of-memory error on one rank "
            "is redone by every rank. Or watch the run with callbacks=[headroom.hf.Watch()]"
        )


def _fsdp_not_applied(args) -> str | None:
    """A notice when the Trainer was asked for FSDP and accelerate trains otherwise:
    on the CPU it decides by device and trains DDP, each rank holding the whole model,
    without a word."""
    if not getattr(args, "fsdp", None):
        return None
    from accelerate.state import AcceleratorState

    kind = AcceleratorState._shared_state.get("distributed_type")
    if kind is None or kind == DistributedType.FSDP:
        return None
    return (
        f"the Trainer was asked for FSDP (TrainingArguments(fsdp=...)) but accelerate runs "
        f"{getattr(kind, 'value', kind)}: it shards with FSDP only on GPUs and other "
        "accelerators, so on the CPU every rank holds the whole model, its gradients and "
        "optimizer state"
    )


def _chunk_evaluation(trainer: transformers.Trainer, cb: _Adaptive) -> None:
    """``evaluate`` and ``predict`` in batches that fit: each of the Trainer's evaluation
    batches (``per_device_eval_batch_size``) runs through ``run.evaluate``, its
    ``prediction_step`` per chunk and the chunks' (loss, logits, labels) joined: the loss
    weighted by what the model averages over (its label tokens, else samples:
    `_join_predictions`), so it is the unsplit batch's; logits and labels concatenated.
    Each ``evaluation_loop`` is one pass in the log (``eval``, ``test`` or ``predict``);
    ``evaluate`` and ``predict`` outside ``train()`` get a run of their own."""
    loop, step = trainer.evaluation_loop, trainer.prediction_step

    def own_run(call):
        """`evaluate`/`predict` outside `train()` in a run of its own; after a fit, one
        that goes on from the fit's run (its controller replayed: the evaluation size it
        learned is kept)."""

        @functools.wraps(call)
        def wrapped(*args, **kwargs):
            before = cb.run
            if before is not None and not before.ended:
                cb.end_step()
                return call(*args, **kwargs)
            cb.run = cb._make_run(
                trainer.args,
                trainer.state,
                trainer.model,
                effective_batch=int(trainer.args.per_device_train_batch_size),
                total_steps=0,
            )
            if before is not None:
                cb.run.load_state_dict(before.state_dict())
            try:
                out = call(*args, **kwargs)
            except BaseException as e:
                cb.run.fail(f"{type(e).__name__}: {e}")
                raise
            cb.run.finish()
            return out

        return wrapped

    def evaluation_loop(dataloader, description, *args, **kwargs):
        prefix = kwargs.get("metric_key_prefix", args[2] if len(args) > 2 else "eval")
        phase = "predict" if str(description).lower().startswith("predict") else str(prefix)
        run = cb.run
        if run is None or run.ended:
            return loop(dataloader, description, *args, **kwargs)
        with run.evaluation(phase):
            return loop(dataloader, description, *args, **kwargs)

    def prediction_step(model, inputs, prediction_loss_only, ignore_keys=None, **kwargs):
        run = cb.run
        if run is None or run.ended:
            return step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **kwargs)

        def one(chunk):
            out = step(model, chunk, prediction_loss_only, ignore_keys=ignore_keys, **kwargs)
            return out, _label_tokens(model, chunk)

        return run.evaluate(inputs, one, combine=_join_predictions)

    trainer.evaluate = own_run(trainer.evaluate)
    trainer.predict = own_run(trainer.predict)
    trainer.evaluation_loop = evaluation_loop
    trainer.prediction_step = prediction_step


def _join_predictions(parts: list) -> tuple:
    """The chunks' ``prediction_step`` results as the whole batch's: logits and labels
    concatenated; the loss, a mean over what the model's loss averages (a language
    model's label tokens, else samples), weighted by each chunk's count of it, so that it
    is the unsplit batch's loss and not a mean of means."""
    if len(parts) == 1:
        return parts[0][1][0]
    outs = [(n, out) for n, (out, _) in parts]
    weights = [n if w is None else w for n, (_, w) in parts]
    if sum(weights) == 0:
        weights = [n for n, _ in outs]
    losses = [out[0] for _, out in outs]
    rest = _eval.combine_parts([(n, tuple(out[1:])) for n, out in outs])
    loss = None
    if losses[0] is not None:
        loss = sum(x.double() * w for x, w in zip(losses, weights)) / sum(weights)
        loss = loss.to(losses[0].dtype)
    return (loss, *rest)


def _label_tokens(model, inputs) -> int | None:
    """How many label tokens the model's own loss averages over in `inputs` (a causal
    LM shifts its labels by one; -100 is ignored), or None when it averages over samples
    (a classifier) or the batch has no token labels."""
    labels = inputs.get("labels") if isinstance(inputs, dict) or hasattr(inputs, "keys") else None
    if not isinstance(labels, torch.Tensor) or labels.dim() < 2 or labels.is_floating_point():
        return None
    m = getattr(model, "module", model)
    kind = str(getattr(m, "loss_type", None) or "")
    causal = "CausalLM" in kind or type(m).__name__ in _causal_lm_classes()
    if causal:
        labels = labels[..., 1:]
    return int((labels != -100).sum())


@functools.cache
def _causal_lm_classes() -> frozenset:
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # pragma: no cover - a transformers without the auto mapping
        return frozenset()
    names = set()
    for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update(v if isinstance(v, (tuple, list)) else (v,))
    return frozenset(names)


def _training_step(self, model, inputs, num_items_in_batch=None):
    """``Trainer.training_step`` with the batch cut into the controller's micro-batches.

    Each micro-batch's loss is the Trainer's: ``compute_loss`` with the same
    ``num_items_in_batch`` (so a token-normalised loss is a share of the whole batch's
    and the shares add up: ``reduction="sum"``), or, where the Trainer divides a batch's
    mean by its accumulation steps, that mean weighted by the micro-batch's share.
    """
    cb: _Adaptive = self._headroom
    cb.end_step()
    if cb.halted:
        # A stop gave this optimizer step up and its checkpoint is saved: the Trainer's
        # other batches of it compute nothing (its optimizer step finds no gradient).
        return torch.tensor(math.nan, device=self.args.device)
    cp_context = contextlib.nullcontext
    if hasattr(self, "_prepare_context_parallel_inputs"):
        cp_context, inputs = self._prepare_context_parallel_inputs(model, inputs)
    with cp_context():
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = (
                self.model_accepts_loss_kwargs and num_items_in_batch is not None
            ) or self.compute_loss_func is not None
        backward_kwargs = {}
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            backward_kwargs["scale_wrt_gas"] = False

        def loss_fn(mb, n_items=num_items_in_batch):
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, mb, num_items_in_batch=n_items)
            if self.args.n_gpu > 1:
                loss = loss.mean()
            return loss if scaled else loss / self.current_gradient_accumulation_steps

        if cb.shares is None:
            cb.shares = num_items_in_batch is not None and _loss_is_a_share(loss_fn, inputs)
        value = cb.run.backward(
            inputs,
            loss_fn,
            reduction="sum" if cb.shares and num_items_in_batch is not None else "mean",
            backward=lambda loss: self.accelerator.backward(loss, **backward_kwargs),
        )
    if cb.run.stop_gave_up_a_step:
        # Under torchrun a stop gives the step up on every rank together and run.backward
        # returns: the stop's checkpoint now (run.step), before the Trainer's optimizer
        # step and scheduler move on from the last completed step.
        cb.end_step()
        cb.halted = True
    return torch.tensor(value, device=self.args.device)


def _loss_is_a_share(loss_fn, inputs) -> bool:
    """Whether the model's loss divides by ``num_items_in_batch`` (a causal LM's does:
    each micro-batch's loss is then its share of the batch's, and they add up) or ignores
    it (a sequence classifier's mean: then each is weighted by its share of the samples).
    The Trainer passes the count to any model whose forward takes ``**kwargs`` and cannot
    tell; one sample's loss under two counts can. No gradient, and the RNG is restored,
    so dropout's masks are those of a run without the probe."""
    one = _batch.take(inputs, 0, 1)
    devices = sorted({t.device.index or 0 for _, t in _batch._leaves(one, "b") if t.is_cuda})
    with torch.no_grad():
        with torch.random.fork_rng(devices=devices):
            a = float(loss_fn(one, n_items=1))
        with torch.random.fork_rng(devices=devices):
            b = float(loss_fn(one, n_items=2))
    return abs(a - 2 * b) <= 1e-3 * abs(a) and a != b
