"""headroom for PyTorch Lightning: watch a fit, or let headroom's controller choose a
LightningModule's micro-batches. Needs lightning (``import headroom`` does not).

    trainer = L.Trainer(..., callbacks=[headroom.lightning.Watch()])     # watch

    class LM(headroom.lightning.AdaptiveModule):                        # adaptive
        def micro_batch_loss(self, batch):                               # a micro-batch's
            x, y = batch                                                 # mean loss
            return F.cross_entropy(self(x), y)
    trainer = L.Trainer(..., callbacks=[headroom.lightning.Adaptive()])

Fabric needs neither: ``run.backward(batch, loss_fn, backward=fabric.backward)`` and
``run.step(optimizer)`` with Fabric's optimizer. docs/PYTHON.md, "PyTorch Lightning".
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from typing import Any

import torch

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - depends on the environment
    try:
        import pytorch_lightning as pl
    except ImportError as e:
        raise ImportError(
            "headroom.lightning needs the lightning package (pip install lightning); "
            "`import headroom` alone works without it"
        ) from e

from . import _args, _batch, _eval, _fsdp
from ._errors import BatchError, RunError
from ._run import Run

try:
    from lightning.pytorch.utilities.model_helpers import is_overridden
except ImportError:  # pragma: no cover - pytorch_lightning
    from pytorch_lightning.utilities.model_helpers import is_overridden

__all__ = ["Adaptive", "AdaptiveModule", "Watch"]


class Watch(pl.Callback):
    """A Lightning ``Callback`` that puts the fit on headroom's stream.

    Each training batch is reported (the loss ``training_step`` returned, its samples,
    the learning rate, the batch's peak memory); validation losses logged as
    ``val_loss`` reach the dashboard; its commands are carried out Lightning's way: stop
    sets ``trainer.should_stop`` after a ``trainer.save_checkpoint``, checkpoint calls
    ``trainer.save_checkpoint`` (loaded by ``trainer.fit(..., ckpt_path=…)``), pause waits
    at the batch's end. Checkpoints go to ``dirpath`` (default: the trainer's
    ``default_root_dir``) as ``headroom-step=N.ckpt``. Keyword arguments go to
    :class:`headroom.Run`.
    """

    def __init__(self, name: str | None = None, dirpath: str | None = None, **run_kwargs: Any):
        self._name = name
        self._dirpath = dirpath
        self._run_kwargs = run_kwargs
        self.run: Run | None = None
        self._save_asked = False

    def _make_run(self, trainer, model, **extra) -> Run:
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else 0
        kw = {"total_steps": int(total), **extra, **self._run_kwargs}
        # Under torchrun only a run that joins the job (adaptive, or job_view=True) agrees
        # on the step a stop takes effect at; an unjoined one leaves SIGTERM to Lightning,
        # whose notifier broadcasts it so every rank stops at the same batch.
        if trainer.world_size == 1 or "effective_batch" in kw or kw.get("job_view"):
            _sigterm_to_the_run(trainer)
        return Run(self._name, model=model, on_checkpoint=self._ask_checkpoint, **kw)

    _trainer: Any = None

    def _ask_checkpoint(self, step: int) -> str | None:
        # Saved at the batch's end by the trainer itself (as ModelCheckpoint does), so
        # the checkpoint holds the loops' progress its resume needs. A stop that gave the
        # batch in progress up saves at once: the batch never reaches its end (one
        # process exits in run.backward), and its progress is recorded as started, not
        # completed, so the resume redoes it.
        if self.run is not None and self.run.stop_gave_up_a_step and self._trainer is not None:
            return self._save(self._trainer)
        self._save_asked = True
        return None

    def _save(self, trainer) -> str:
        path = os.path.join(
            self._dirpath or trainer.default_root_dir,
            f"headroom-step={trainer.global_step}.ckpt",
        )
        trainer.save_checkpoint(path)
        return path

    def _carry_out(self, trainer) -> None:
        if self.run.should_stop:
            trainer.should_stop = True
        if self._save_asked:
            self._save_asked = False
            self.run.checkpoint_saved(self._save(trainer))

    def on_train_start(self, trainer, pl_module):
        self._trainer = trainer
        self.run = self._make_run(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # None: a training_step that returned no loss (a skipped batch): none reported.
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        try:
            samples, seq_len = _batch.size_of(batch), _batch.seq_len_of(batch)
        except BatchError:
            samples, seq_len = None, 1
        lr = None
        if trainer.optimizers and trainer.optimizers[0].param_groups:
            lr = trainer.optimizers[0].param_groups[0].get("lr")
        self.run.report(loss, samples=samples, seq_len=seq_len, lr=lr)
        self._carry_out(trainer)

    def on_validation_end(self, trainer, pl_module):
        val = trainer.callback_metrics.get("val_loss")
        if self.run is not None and val is not None and not trainer.sanity_checking:
            self.run.eval(val)

    def on_train_end(self, trainer, pl_module):
        if self.run is not None:
            self.run.finish()

    def on_exception(self, trainer, pl_module, exception):
        if self.run is not None:
            self.run.fail(f"{type(exception).__name__}: {exception}")


def _sigterm_to_the_run(trainer) -> None:
    """SIGTERM handled by the run for the fit, when Lightning's own handler is only its
    notifier (no SLURM requeue, no handler of the script's chained): that notifier makes
    the fit raise at the next batch, with no checkpoint and the run's log left without
    its end. The run's handler instead stops at the batch's end with Lightning's own
    checkpoint (or gives a batch in run.backward up and saves the last completed one).
    Lightning puts its originals back at its teardown, as always."""
    if threading.current_thread() is not threading.main_thread():
        return
    held = signal.getsignal(signal.SIGTERM)
    handlers = getattr(held, "signal_handlers", None)
    connector = getattr(trainer, "_signal_connector", None)
    notifier = getattr(connector, "_sigterm_notifier_fn", None)
    if type(held).__name__ == "_HandlersCompose" and handlers == [notifier]:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class Adaptive(Watch):
    """The callback of an adaptive fit: creates an adaptive :class:`headroom.Run` for the
    module (``pl_module.headroom``), whose ``training_step`` steps it (an
    :class:`AdaptiveModule` does), and carries out the dashboard's commands Lightning's
    way as :class:`Watch` does. ``effective_batch`` defaults to the train loader's
    ``batch_size``: each batch is one optimizer step, cut into micro-batches. Under
    ``torchrun`` with ``strategy="ddp"``, each rank cuts its own batch (a tighter rank
    cuts finer) and the gradients are averaged once per batch, after every rank has
    finished its micro-batches. The module's ``validation_step``, ``test_step`` and
    ``predict_step`` run each batch in chunks that fit, their results joined (a loss as a
    samples-weighted mean, tensors with a batch dimension concatenated), so a validation
    batch larger than memory allows completes.
    """

    def __init__(self, name=None, dirpath=None, effective_batch: int | None = None, **run_kwargs):
        _args.framework_half("headroom.lightning.Adaptive", run_kwargs, "Lightning takes itself")
        super().__init__(name, dirpath, **run_kwargs)
        self._effective = effective_batch

    def on_train_start(self, trainer, pl_module):
        if pl_module.automatic_optimization:
            raise RunError(
                "headroom.lightning.Adaptive needs manual optimization (the module's "
                "training_step calls run.backward and run.step): subclass "
                "headroom.lightning.AdaptiveModule, or set self.automatic_optimization = False"
            )
        effective = self._effective or getattr(trainer.train_dataloader, "batch_size", None)
        if not effective:
            raise RunError(
                "headroom.lightning.Adaptive(effective_batch=N): the train loader has no "
                "batch_size to take the effective batch from"
            )
        # Under torchrun the run joins the job through the strategy's DDP wrapper: every
        # micro-batch under its no_sync (so manual_backward arms no reducer), the gradients
        # averaged once per batch inside the last backward after the ranks agree. Under
        # ModelParallelStrategy (FSDP2) it joins with the module's FSDP root; FSDPStrategy
        # (FSDP1) and DeepSpeed are refused.
        self._trainer = trainer
        model = trainer.strategy.model if trainer.world_size > 1 else pl_module
        root = _fsdp.outermost(pl_module) if trainer.world_size > 1 else None
        if root is not None:
            # FSDP2 (ModelParallelStrategy's configure_model sharded the module, or a
            # part holding all of it): the run gates that root's collectives.
            model = root
        levers = {}
        hook = _checkpointing_hook(pl_module)
        if (
            hook is not None
            and not {"checkpoint_blocks", "checkpointing"} & self._run_kwargs.keys()
        ):
            # The module's own switch (where Lightning has no seam for checkpointing):
            # the dashboard's `a` and the last resort at micro-batch 1 call it.
            levers["checkpointing"] = hook
        if str(trainer.precision) in ("32", "32-true"):
            # The forward's precision is the run's (its autocast in run.backward) only
            # where Lightning's own precision plugin leaves float32 alone.
            levers["precision"] = "fp32"
        self.run = self._make_run(trainer, model, effective_batch=int(effective), **levers)
        pl_module.headroom = self.run

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._carry_out(trainer)

    # ---- evaluation in batches that fit -----------------------------------------------------

    _EVAL_STEPS = (
        ("validation_step", "validation"),
        ("test_step", "test"),
        ("predict_step", "predict"),
    )

    def setup(self, trainer, pl_module, stage):
        """Each evaluation step the module defines runs its batch in chunks that fit
        (`_chunked`); the validation loop during the fit is one pass in the log each time."""
        self._plain = _eval.Plain()
        for hook, _ in self._EVAL_STEPS:
            if is_overridden(hook, pl_module) and not getattr(
                getattr(pl_module, hook), "_headroom", False
            ):
                setattr(
                    pl_module, hook, self._chunked(trainer, pl_module, getattr(pl_module, hook))
                )

    def _chunked(self, trainer, pl_module, step):
        """`step` over a batch in chunks the fit's run sizes (before the run exists, as
        in the sanity check, or outside a fit: halved after an out-of-memory error, the
        size kept). Lightning's `self.log` inside it weights each chunk's value by the
        chunk's own samples (the batch its logger reads is pointed at the chunk), so an
        epoch's mean is the unsplit one's."""

        @functools.wraps(step)
        def chunked(batch, *args, **kwargs):
            run = self.run if self.run is not None and not self.run.ended else None
            results = getattr(trainer, "_results", None)

            def call(chunk, fn):
                if results is not None:
                    results.batch, results.batch_size = chunk, None
                return fn(chunk)

            def one(chunk):
                return step(chunk, *args, **kwargs)

            try:
                if run is not None:
                    return run.evaluate_chunked(batch, one, on_chunk=call)
                return _eval.run_batch(
                    self._plain, None, pl_module.device, batch, one, on_chunk=call
                )
            finally:
                if results is not None:
                    results.batch, results.batch_size = batch, None

        chunked._headroom = True
        return chunked

    def _eval_begin(self, trainer, phase: str) -> None:
        if self.run is not None and not self.run.ended and not trainer.sanity_checking:
            self.run.begin_evaluation(phase)

    def _eval_end(self) -> None:
        if self.run is not None:
            self.run.end_evaluation()

    def on_validation_start(self, trainer, pl_module):
        self._eval_begin(trainer, "validation")

    def on_validation_end(self, trainer, pl_module):
        self._eval_end()
        super().on_validation_end(trainer, pl_module)

    def on_test_start(self, trainer, pl_module):
        self._eval_begin(trainer, "test")

    def on_test_end(self, trainer, pl_module):
        self._eval_end()

    def on_predict_start(self, trainer, pl_module):
        self._eval_begin(trainer, "predict")

    def on_predict_end(self, trainer, pl_module):
        self._eval_end()


def _checkpointing_hook(module):
    """The module's `activation_checkpointing(on)`, when it defines one (an
    AdaptiveModule's own is a placeholder)."""
    hook = getattr(type(module), "activation_checkpointing", None)
    if hook is None or hook is AdaptiveModule.__dict__.get("activation_checkpointing"):
        return None
    return module.activation_checkpointing


class AdaptiveModule(pl.LightningModule):
    """A LightningModule whose batches headroom cuts into micro-batches.

    Define ``micro_batch_loss(batch)`` (a micro-batch's mean loss) instead of
    ``training_step``, and ``configure_optimizers`` as usual; train with the
    :class:`Adaptive` callback. Manual optimization (Lightning's own seam for it):
    ``run.backward`` with ``self.manual_backward`` (so precision plugins and strategies
    apply), ``run.step`` with the LightningOptimizer, then the LR scheduler once per
    optimizer step. Lightning's ``accumulate_grad_batches`` and ``gradient_clip_val`` are
    automatic-optimization features; clip in ``before_optimizer_step`` if you need it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.headroom: Run | None = None

    def micro_batch_loss(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError("define micro_batch_loss(batch): a micro-batch's mean loss")

    def activation_checkpointing(self, on: bool) -> None:
        """Define it to hand the run your model's activation checkpointing: called with
        True or False at a step boundary when the dashboard's `a` (or a viewer) switches
        it, and with True when micro-batch 1 runs out of memory (the last resort). Off
        at the start. Not defined: ``Adaptive(checkpoint_blocks=...)`` names blocks
        instead, or there is no checkpointing lever."""
        raise NotImplementedError

    def training_step(self, batch, batch_idx):
        run = self.headroom
        if run is None:
            raise RunError(
                "this AdaptiveModule has no headroom run: add headroom.lightning.Adaptive() "
                "to the Trainer's callbacks"
            )
        opt = self.optimizers()
        loss = run.backward(batch, self.micro_batch_loss, backward=self.manual_backward)
        run.step(opt)
        sched = self.lr_schedulers()
        if sched is not None:
            sched.step()
        loss = torch.tensor(loss)
        self.log("train_loss", loss, prog_bar=True, batch_size=_batch.size_of(batch))
        return loss
