"""Tiny Hugging Face models built from a config with random weights (nothing is
downloaded), their data, and a Trainer for them: shared by test_hf.py, its capped
script and the examples' tests."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()


def tiny_gpt2(
    seed: int = 0, vocab: int = 64, ctx: int = 32, layers: int = 2, d: int = 32, dropout=0.0
):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=ctx,
        n_embd=d,
        n_layer=layers,
        n_head=2,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    return transformers.GPT2LMHeadModel(cfg)


def tiny_bert(seed: int = 0, vocab: int = 64, ctx: int = 32, labels: int = 3):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=ctx,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=labels,
    )
    return transformers.BertForSequenceClassification(cfg)


class Samples(torch.utils.data.Dataset):
    """`n` random sequences; causal LM samples (labels = input_ids, some masked with
    -100 so samples differ in their token counts) or classification samples."""

    def __init__(self, n: int, t: int = 16, vocab: int = 64, kind: str = "lm", seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, t), generator=g)
        self.kind = kind
        if kind == "lm":
            self.labels = self.ids.clone()
            cut = torch.randint(t // 2, t + 1, (n,), generator=g)
            for i, c in enumerate(cut.tolist()):
                self.labels[i, c:] = -100
        else:
            self.labels = self.ids.sum(dim=1) % 3

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def training_args(out, **kw):
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=8,
        max_steps=3,
        learning_rate=0.05,
        optim="sgd",
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
        disable_tqdm=True,
    )
    base.update(kw)
    return transformers.TrainingArguments(**base)


def fsdp_on_the_cpu() -> None:
    """Lets the Trainer's FSDP run on the CPU, as it runs on GPUs. accelerate decides a
    job's kind from its device alone: on the CPU (MULTI_CPU) it drops the FSDP plugin the
    Trainer passes and trains DDP. Here the state keeps the plugin and says FSDP, the kind
    a GPU job gets; everything after (accelerate's fully_shard of the model, its FSDP2
    clipping and DCP checkpoints, the Trainer's loop) is the real code, on gloo.
    scripts/gpu-check.sh hf-fsdp runs the same without this on a GPU."""
    import accelerate.state
    from accelerate.utils import DistributedType

    cls = accelerate.state.AcceleratorState
    if getattr(cls, "_headroom_fsdp_on_cpu", False):
        return
    init = cls.__init__

    def patched(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            # As accelerate's own FSDP branch does: a later AcceleratorState() copies it.
            accelerate.state.PartialState._shared_state["distributed_type"] = self.distributed_type

    cls.__init__ = patched
    cls._headroom_fsdp_on_cpu = True
