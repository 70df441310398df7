#!/usr/bin/env bash
# The GPU checks of docs/GPU.md, for a lent machine with a CUDA GPU and PyTorch 2.11 (its
# /opt/torch/.venv, Python 3.12) but no Rust toolchain and no network. Build here first,
# then carry target/gpu/ over:
#
#   ./dev build && ./dev cargo bench --no-run --bench overhead --bench telemetry
#   mkdir -p target/gpu && cp target/release/headroom target/gpu/
#   for b in overhead telemetry; do   # only the overhead and telemetry sections use these
#     cp "$(ls -t target/release/deps/$b-* | grep -v '\.d$' | head -1)" target/gpu/$b; done
#   HEADROOM_STAGE=$PWD/target/gpu/python ./dev python -c 1   # the Python package, staged
#   # The hf and lightning sections' frameworks, as wheels for the device's Python 3.12:
#   # the tools venv's own pins (transformers, accelerate, lightning and what they need)
#   # less the test tools and fsspec[http]'s aiohttp family, which nothing here imports;
#   # torch and its own dependencies stay the device's.
#   site=$(./dev python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
#   ./dev python -m pip freeze --path "$site" | grep -viE '^(pip|setuptools|pytest|pytest[-_]timeout|iniconfig|pluggy|ruff|maturin|aiohttp|aiohappyeyeballs|aiosignal|frozenlist|multidict|propcache|yarl)==' \
#     > target/gpu/frameworks.txt
#   ./dev python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#     -d target/gpu/wheels -r target/gpu/frameworks.txt
#   strip target/gpu/headroom target/gpu/python/headroom/_native.abi3.so   # 66 → 58 MiB
#   du -shc target/gpu/headroom target/gpu/python target/gpu/wheels   # a carry holds 64 MiB
#       # in all, the tracked tree's 5 MiB included (stripped: about 6.5 + 4.3 + 48 MB; the
#       # wheels' numpy is 16 of them): for `all`, carry those three paths; the benches only
#       # for overhead and telemetry, which `all` leaves out. Without the wheels, hf and
#       # lightning are SKIP lines unless the device's Python has the frameworks itself.
#   (on the GPU machine)  OUT=$OUT bash scripts/gpu-check.sh all
#                         OUT=$OUT bash scripts/gpu-check.sh info|run|oom|ramp|dash|fidelity|overhead|telemetry|nvml|py-oom|py-dash|levers|plan|keys|oom-snapshot|py-levers|py-eval|py-alloc|py-snapshot|hints|hf|hf-fsdp|lightning|ddp-nccl|fsdp-nccl|hardcap ...
#
# (Use the lent machine's own $OUT, whose files come back; OUT=out keeps them there.) The
# command runs in the repository root, so the carried files are at $ROOT/target/gpu/. The
# Python sections find the staged package through PYTHONPATH=$ROOT/target/gpu/python
# (headroom/ with its _native.abi3.so, which finds libtorch through LD_LIBRARY_PATH below),
# plus the helper scripts this file writes into $WORK/py, plus, for hf and lightning, the
# carried wheels installed with `pip install --no-index --no-deps --target $WORK/site`
# when the device's Python cannot import transformers, accelerate and lightning itself.
#
# Each section writes its JSONL logs and console output under $OUT and one line to
# $OUT/summary.txt: `PASS|FAIL|SKIP section — the number that shows it`, read from its own
# logs (the device's Python parses them). Checkpoints and the frameworks' install go to
# $WORK (a scratch folder, removed at the end): a 86M-parameter checkpoint is 1 GiB.
#
# `all` runs info levers py-levers py-eval plan keys oom-snapshot py-alloc py-snapshot hints hf hf-fsdp
# lightning ddp-nccl fsdp-nccl hardcap, then run fidelity nvml, within ALL_BUDGET seconds (450; every timeout
# is cut to what is left, and a section that no longer fits is a SKIP line), with run at
# RUN_STEPS=10 and nvml at NVML_STEPS=12 steps. It leaves out oom ramp dash overhead
# telemetry py-oom py-dash (each over a minute; a SKIP line says why): name them to run them.
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BIN=${BIN:-$ROOT/target/gpu/headroom}
STAGE=${STAGE:-$ROOT/target/gpu/python}
OUT=${OUT:-$ROOT/gpu-out}
PY=${PY:-/opt/torch/.venv/bin/python}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
TORCH_LIB=$("$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null ||
  echo /opt/torch/.venv/lib/python3.12/site-packages/torch/lib)
export LD_LIBRARY_PATH=$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if [[ -z ${WORK:-} ]]; then
  WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
  trap 'rm -rf "$WORK"' EXIT
fi
mkdir -p "$WORK/py"
PYP=$STAGE:$WORK/py

section() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }

# The time budget of `all`: seconds left, a timeout cut to them, and a section's floor.
DEADLINE=0
left() { if ((DEADLINE)); then echo $((DEADLINE - SECONDS)); else echo 100000; fi; }
tmo() { local l; l=$(left); if ((l < $1)); then echo $((l > 1 ? l : 1)); else echo "$1"; fi; }
line() { printf '%s %s — %s\n' "$1" "$2" "$3" | tee -a "$OUT/summary.txt"; }
need() {
  local l; l=$(left)
  ((l >= $1)) || { line SKIP "$2" "out of the time budget of all (${l}s left, needs about $1s)"; return 1; }
}
have_bin() { [[ -x $BIN ]] || { line SKIP "$1" "no binary at $BIN: build it here and carry target/gpu/headroom"; return 1; }; }
have_py() {
  [[ -f $STAGE/headroom/__init__.py ]] ||
    { line SKIP "$1" "no staged package at $STAGE: stage it here (HEADROOM_STAGE=\$PWD/target/gpu/python ./dev python -c 1) and carry target/gpu/python"; return 1; }
}
# The exit status of the command just before it, kept as $OUT/NAME.rc for the summary.
ran() { local rc=$?; echo "$rc" > "$OUT/$1.rc"; echo "$1 rc=$rc"; }
summarize() { "$PY" "$WORK/py/summary.py" "$OUT" "$@" | tee -a "$OUT/summary.txt"; }

# configs/gpu.toml at a fixed micro-batch: a lever's effect is then a difference at one shape.
fixed_config() {
  { cat configs/gpu.toml; printf '\n[memory]\nadaptive = false\n'; } > "$OUT/fixed.toml"
}
# One lever run: NAME PRECISION CHECKPOINTING, LEVER_STEPS steps at micro-batch LEVER_BATCH.
lever_run() {
  timeout "$(tmo 60)" "$BIN" train --config "$OUT/fixed.toml" --headless --steps "${LEVER_STEPS:-4}" \
    --batch-size "${LEVER_BATCH:-16}" --effective-batch "${LEVER_BATCH:-16}" --precision "$2" \
    --activation-checkpoint "$3" --checkpoint-every 0 --checkpoint-dir "$WORK/ck-$1" \
    --log "$OUT/$1.jsonl" > "$OUT/$1.out" 2>&1
  ran "$1"; tail -3 "$OUT/$1.out"; rm -rf "$WORK/ck-$1"
}
lever_runs() { fixed_config; lever_run levers-fp32 fp32 none; lever_run levers-bf16 bf16 blocks; }

# transformers + accelerate (hf) and lightning: the device's own when its Python has them,
# else the wheels carried in target/gpu/wheels, installed once into $WORK/site. Sets
# FW_PATH (for PYTHONPATH) and FW_FROM, or FW_MISSING (the reason to skip).
frameworks() {
  [[ -n ${FW_FROM:-}${FW_MISSING:-} ]] && return 0
  FW_PATH=
  if "$PY" -c 'import transformers, accelerate, lightning' > /dev/null 2>&1; then
    FW_FROM="the device's own"; return 0
  fi
  local wheels=$ROOT/target/gpu/wheels need
  if ! compgen -G "$wheels/*.whl" > /dev/null; then
    FW_MISSING="$PY cannot import transformers, accelerate and lightning, and no wheels were carried in target/gpu/wheels (the header says how to make them)"
    return 0
  fi
  # Only the distributions the device's Python lacks: its torch's dependencies stay its own.
  mapfile -t need < <("$PY" "$WORK/py/wheels_needed.py" "$wheels")
  if ((${#need[@]} == 0)); then
    FW_MISSING="$PY has every carried wheel's distribution yet cannot import transformers, accelerate and lightning"
    return 0
  fi
  FW_PATH=$WORK/site
  mkdir -p "$FW_PATH"
  local how="pip install --target"
  if "$PY" -m pip --version > /dev/null 2>&1; then
    timeout "$(tmo 120)" "$PY" -m pip install --quiet --no-index --no-deps --no-compile \
      --disable-pip-version-check --target "$FW_PATH" "${need[@]}" > "$OUT/frameworks.out" 2>&1
  else # no pip in the device's venv: a wheel is a zip of what goes into site-packages
    how="unzipped (no pip in $PY's venv)"
    for w in "${need[@]}"; do "$PY" -m zipfile -e "$w" "$FW_PATH" || break; done > "$OUT/frameworks.out" 2>&1
  fi || { FW_MISSING="installing the carried wheels failed: $(tail -1 "$OUT/frameworks.out")"; return 0; }
  FW_FROM="${#need[@]} carried wheels, $how"
}
# Whether the frameworks' modules MODULE... import; else a SKIP line for SECTION.
imports() {
  local what=$1 err; shift
  frameworks
  if [[ -n ${FW_MISSING:-} ]]; then line SKIP "$what" "$FW_MISSING"; return 1; fi
  err=$(PYTHONPATH=$PYP${FW_PATH:+:$FW_PATH} "$PY" -c "import $*" 2>&1 > /dev/null) ||
    { line SKIP "$what" "$* not importable ($FW_FROM): $(tail -1 <<< "$err")"; return 1; }
}

# The sections `all` runs, in order, and those it leaves out with the reason.
# What never ran on a GPU comes first; run, fidelity and nvml (passed on the first loan)
# come last, so that a slow machine spends the budget on the new paths.
ALL=(info levers py-levers py-eval plan keys oom-snapshot py-alloc py-snapshot hints hf hf-fsdp lightning ddp-nccl fsdp-nccl hardcap run fidelity nvml)
NOT_IN_ALL=(oom ramp dash overhead telemetry py-oom py-dash)
left_out() {
  case "$1" in
    oom) echo "not in all: about 100 s (16 steps of 256 sequences after an OOM at 256); oom-snapshot recovers a real OOM at 256 in 2 steps" ;;
    ramp) echo "not in all: about 100 s (24 steps growing to 117 × 1024 tokens); run it by name" ;;
    dash) echo "not in all: about 60 s (45 s of dashboard on a pty); keys drives the dashboard on a pty instead" ;;
    overhead) echo "not in all: over 200 s (3 rounds of bare and headroom runs of 40 steps); run it by name with target/gpu/overhead carried" ;;
    telemetry) echo "not in all: about 100 s (8 s of training at each of 6 sampling rates); run it by name with target/gpu/telemetry carried" ;;
    py-oom) echo "not in all: about 150 s (12-layer nanoGPT, 20 steps of 256 × 1024); py-alloc is its small version" ;;
    py-dash) echo "not in all: about 60 s (a 12-layer nanoGPT watched 30 s from a dashboard); run it by name" ;;
  esac
}

# The helpers the Python sections run, written where PYTHONPATH finds them.
cat > "$WORK/py/hrgpu.py" << 'PY'
"""gpu-check.sh's shared pieces: a small causal transformer whose causal mask is SDPA's
(made on the input's device, so it runs on CUDA as on the CPU), and random token batches."""

import torch
import torch.nn.functional as F


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)
        )

    def forward(self, x):
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    def __init__(self, vocab=256, d=256, t=256, layers=4, heads=4):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.randn(t, d) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x):
        h = self.tok(x) + self.pos[: x.shape[1]]
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.ln(h))

    def loss(self, batch):
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())


def batches(steps, n, t=256, vocab=256, device="cuda", seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, vocab, (n, t), generator=g)
        yield x.to(device), torch.roll(x, -1, dims=1).to(device)
PY

cat > "$WORK/py/py_run.py" << 'PY'
"""py-alloc and py-snapshot: an adaptive Python loop on CUDA from a micro-batch that its
memory_budget (the caching allocator's per-process fraction) cannot hold: real
torch.OutOfMemoryErrors, recovered within the step."""

import argparse
import json
import time

import torch
from hrgpu import GPT, batches

import headroom

ap = argparse.ArgumentParser()
ap.add_argument("--log", required=True)
ap.add_argument("--name", default="gpu-py")
ap.add_argument("--steps", type=int, default=8)
ap.add_argument("--batch", type=int, default=1024)
ap.add_argument("--budget", default="4GiB")
ap.add_argument("--hold", type=float, default=0.3, help="seconds per step for the sampler")
ap.add_argument("--snapshot", action="store_true")
args = ap.parse_args()
torch.manual_seed(0)
model = GPT().cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
losses = []
with headroom.Run(
    args.name,
    model=model,
    effective_batch=args.batch,
    micro_batch=args.batch,
    memory_budget=args.budget,
    log=args.log,
    total_steps=args.steps,
    oom_snapshot=args.snapshot,
) as run:
    for b in batches(args.steps, args.batch):
        losses.append(run.backward(b, model.loss))
        run.step(opt)
        time.sleep(args.hold)
    micro = run.micro_batch
print(json.dumps({"losses": losses, "micro_batch": micro}))
PY

cat > "$WORK/py/hints.py" << 'PY'
"""hints: the fragmentation and outside-allocator hints, each from its real cause on
CUDA: a cached 2 GiB segment half handed to a tensor kept all run (the other half an
inactive split block emptying the cache cannot return), and another process holding a
share of the device through its own CUDA context."""

import json
import os
import subprocess
import sys
import time

import torch
from hrgpu import GPT, batches

import headroom

HOG = """
import os, sys, time, torch
parent = os.getppid()
x = torch.empty(int(torch.cuda.mem_get_info()[1] * float(sys.argv[1])), dtype=torch.uint8, device="cuda")
print(x.numel(), flush=True)
while os.getppid() == parent:  # dies with the check, whatever ends it
    time.sleep(0.5)
"""
log, result = sys.argv[1], sys.argv[2]
hog = subprocess.Popen(
    [sys.executable, "-c", HOG, os.environ.get("HINTS_HOG", "0.25")],
    stdout=subprocess.PIPE,
    text=True,
)
try:
    hog_bytes = int(hog.stdout.readline())
    torch.manual_seed(0)
    model = GPT(d=128, t=128, layers=2).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    big = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    del big
    held = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    stats = torch.cuda.memory_stats()
    steps = 12
    with headroom.Run(
        "gpu-hints", model=model, effective_batch=16, log=log, total_steps=steps, sample_hz=8
    ) as run:
        for b in batches(steps, 16, t=128):
            run.backward(b, model.loss)
            run.step(opt)
            time.sleep(0.25)
    with open(result, "w") as f:
        json.dump(
            {
                "hog_bytes": hog_bytes,
                "held_bytes": held.numel(),
                "inactive_split": stats["inactive_split_bytes.all.current"],
                "reserved": stats["reserved_bytes.all.current"],
            },
            f,
        )
finally:
    hog.kill()
    hog.wait()
PY

cat > "$WORK/py/hf_cuda.py" << 'PY'
"""hf: headroom.hf.adapt on a Hugging Face Trainer on CUDA: a GPT-2 built from a config
with random weights (nothing downloaded), its per-device batch past its memory_budget."""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
import torch  # noqa: E402
import transformers  # noqa: E402

import headroom  # noqa: E402
import headroom.hf  # noqa: E402

log, out, result = sys.argv[1:4]
batch = int(os.environ.get("HF_BATCH", "512"))
steps = int(os.environ.get("HF_STEPS", "4"))
transformers.logging.set_verbosity_error()
torch.manual_seed(0)
cfg = transformers.GPT2Config(
    vocab_size=256, n_positions=256, n_embd=256, n_layer=4, n_head=4,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
)
model = transformers.GPT2LMHeadModel(cfg)


class Samples(torch.utils.data.Dataset):
    def __init__(self, n, t=256):
        self.ids = torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


# HF_FSDP=1 (the hf-fsdp section, under torchrun): the Trainer's own FSDP2, each block a
# unit; accelerate picks FSDP by itself here, as it does not on the CPU.
fsdp = os.environ.get("HF_FSDP") == "1"
sharding = dict(
    fsdp="full_shard",
    fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]},
    ddp_backend="nccl",
) if fsdp else {}
args = transformers.TrainingArguments(
    output_dir=out, per_device_train_batch_size=batch, max_steps=steps, learning_rate=1e-3,
    optim="adamw_torch", logging_steps=1, save_strategy="no", report_to=[],
    dataloader_num_workers=0, seed=0, disable_tqdm=True, **sharding,
)
trainer = transformers.Trainer(model=model, args=args, train_dataset=Samples(batch * steps))
headroom.hf.adapt(
    trainer, memory_budget=os.environ.get("HF_BUDGET", "4GiB"), log=log, name="gpu-hf"
)
trainer.train()
with open(result, "w") as f:
    json.dump(
        {
            "global_step": trainer.state.global_step,
            "max_steps": steps,
            "batch": batch,
            "device": str(next(model.parameters()).device),
            "version": transformers.__version__,
            "distributed": str(trainer.accelerator.distributed_type),
            "fsdp2": type(trainer.model_wrapped).__name__.startswith("FSDP"),
        },
        f,
    )
PY

cat > "$WORK/py/pl_cuda.py" << 'PY'
"""lightning: headroom.lightning.Adaptive with an AdaptiveModule on one GPU, its loader's
batch past its memory_budget."""

import json
import os
import sys

import lightning as L
import torch
from hrgpu import GPT

import headroom
import headroom.lightning

log, out, result = sys.argv[1:4]
batch = int(os.environ.get("PL_BATCH", "512"))
steps = int(os.environ.get("PL_STEPS", "4"))


class LM(headroom.lightning.AdaptiveModule):
    def __init__(self):
        super().__init__()
        self.net = GPT()

    def micro_batch_loss(self, batch):
        return self.net.loss(batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


x = torch.randint(0, 256, (batch * steps, 256), generator=torch.Generator().manual_seed(0))
data = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=batch
)
torch.manual_seed(0)
trainer = L.Trainer(
    accelerator="gpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
    callbacks=[
        headroom.lightning.Adaptive(
            "gpu-pl", memory_budget=os.environ.get("PL_BUDGET", "4GiB"), log=log
        )
    ],
)
trainer.fit(LM(), data)
with open(result, "w") as f:
    json.dump(
        {"global_step": trainer.global_step, "max_steps": steps, "batch": batch,
         "version": L.__version__},
        f,
    )
PY

cat > "$WORK/py/ddp_nccl.py" << 'PY'
"""ddp-nccl: one rank of a torchrun job on NCCL (world size 1 on one GPU): DDP over the
small transformer (1 MiB buckets), an adaptive headroom.Run on the DDP model, then one
all_reduce. At world size 1 the run joins no job, so headroom's overlapped all-reduce is
not in play (it needs 2 GPUs for NCCL); with WORLD>1 the summary counts its buckets."""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hrgpu import GPT, batches

import headroom

out = sys.argv[1]
steps = int(os.environ.get("DDP_STEPS", "6"))
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
local = int(os.environ.get("LOCAL_RANK", "0"))
torch.cuda.set_device(local)
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(
    GPT().cuda(local), device_ids=[local], bucket_cap_mb=1
)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def loss_fn(mb):
    x, y = mb
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


with headroom.Run(
    "gpu-ddp",
    model=model,
    effective_batch=64,
    micro_batch=16,
    memory_budget=os.environ.get("DDP_BUDGET") or None,
    total_steps=steps,
    log=f"{out}/rank{rank}.jsonl",
) as run:
    for b in batches(steps, 64, device=f"cuda:{local}", seed=rank):
        if run.should_stop:
            break
        run.backward(b, loss_fn)
        run.step(opt)
    done = run.step_count
    ov = run._job.overlap if run._job is not None else None
    early, buckets = (ov.early_total, len(ov.buckets)) if ov is not None else (0, 0)
t = torch.tensor([done], device=f"cuda:{local}")
dist.all_reduce(t)
with open(f"{out}/done-rank{rank}.json", "w") as f:
    json.dump(
        {"steps": done, "want": steps, "world": world, "backend": dist.get_backend(),
         "allreduce": int(t.item()), "early_buckets": early, "buckets": buckets},
        f,
    )
dist.destroy_process_group()
PY

cat > "$WORK/py/fsdp_nccl.py" << 'PY'
"""fsdp-nccl: one rank of a torchrun job on NCCL (world size 1 on one GPU): the small
transformer with fully_shard on each block and the root, an adaptive headroom.Run from a
micro-batch its memory_budget (the caching allocator's fraction) cannot hold, so a real
torch.OutOfMemoryError inside FSDP2's units is recovered by the gates and the redo."""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hrgpu import GPT, batches
from torch.distributed.fsdp import fully_shard

import headroom

out = sys.argv[1]
steps = int(os.environ.get("FSDP_STEPS", "6"))
start = int(os.environ.get("FSDP_MICRO", "128"))
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
local = int(os.environ.get("LOCAL_RANK", "0"))
torch.cuda.set_device(local)
torch.manual_seed(0)
model = GPT().cuda(local)
for block in model.blocks:
    fully_shard(block)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def loss_fn(mb):
    x, y = mb
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


with headroom.Run(
    "gpu-fsdp",
    model=model,
    effective_batch=start,
    micro_batch=start,
    memory_budget=os.environ.get("FSDP_BUDGET", "1GiB"),
    total_steps=steps,
    log=f"{out}/rank{rank}.jsonl",
) as run:
    for b in batches(steps, start, device=f"cuda:{local}", seed=rank):
        if run.should_stop:
            break
        run.backward(b, loss_fn)
        run.step(opt)
    done = run.step_count
with open(f"{out}/done-rank{rank}.json", "w") as f:
    json.dump({"steps": done, "want": steps, "world": world, "backend": dist.get_backend()}, f)
dist.destroy_process_group()
PY

cat > "$WORK/py/keys.py" << 'PY'
"""keys: the dashboard on a COLS x ROWS pseudo-terminal; after 2 steps in the log it
presses a (activation checkpointing), waits for the trainer's lever decision, presses m
(bf16), waits for the second, then q. Exits with the dashboard's status, 3 when a wait ran
out. Usage: keys.py COLS ROWS LOG OUT.raw -- CMD [ARGS...]"""

import fcntl
import json
import os
import pty
import select
import signal
import struct
import sys
import termios
import time

cols, rows, log, raw = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
cmd = sys.argv[sys.argv.index("--") + 1 :]
size = struct.pack("HHHH", rows, cols, 0, 0)
pid, fd = pty.fork()
if pid == 0:
    fcntl.ioctl(0, termios.TIOCSWINSZ, size)
    os.environ["TERM"] = "xterm-256color"
    os.execvp(cmd[0], cmd)
fcntl.ioctl(fd, termios.TIOCSWINSZ, size)
data = bytearray()
status = None


def pump(seconds):
    global status
    end = time.time() + seconds
    while time.time() < end and status is None:
        if select.select([fd], [], [], 0.1)[0]:
            try:
                data.extend(os.read(fd, 65536))
            except OSError:
                pass
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st


def records():
    try:
        text = open(log).read()
    except FileNotFoundError:
        return []
    out = []
    for line in text[: text.rfind("\n") + 1].splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def levers(rs):
    return sum(r.get("kind") == "decision" and r["decision"].get("decision") == "lever" for r in rs)


def wait(what, pred, limit):
    end = time.time() + limit
    while time.time() < end and status is None:
        if pred(records()):
            print(f"keys: {what}", flush=True)
            return True
        pump(0.2)
    print(f"keys: never saw {what}", flush=True)
    return False


ok = wait("2 steps", lambda rs: sum(r.get("kind") == "step" for r in rs) >= 2, 120)
if ok:
    os.write(fd, b"a")
    ok = wait("the lever decision after a", lambda rs: levers(rs) >= 1, 60)
if ok:
    os.write(fd, b"m")
    ok = wait("the lever decision after m", lambda rs: levers(rs) >= 2, 60)
if status is None:
    os.write(fd, b"q")
    pump(60)
if status is None:
    os.kill(pid, signal.SIGTERM)
    pump(15)
with open(raw, "wb") as f:
    f.write(data)
code = os.waitstatus_to_exitcode(status) if status is not None else 124
print(f"keys: dashboard exit {code}", flush=True)
sys.exit(code if ok else 3)
PY

cat > "$WORK/py/wheels_needed.py" << 'PY'
"""The carried wheels whose distribution this Python lacks, one path a line."""

import importlib.metadata as md
import pathlib
import sys

for w in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    try:
        md.version(w.name.split("-")[0])
    except md.PackageNotFoundError:
        print(w)
PY

cat > "$WORK/py/py_levers.py" << 'PY'
"""py-levers: a hand-written loop's levers on CUDA. The GPT at a fixed micro-batch, fp32
and no checkpointing; a viewer's `checkpointing:blocks` before step 2 and `precision:bf16`
before step 4, carried out as the run's poll does. Each switch is a lever decision whose
before/after peaks are the caching allocator's (torch.cuda.max_memory_allocated)."""

import json
import sys

import torch
from hrgpu import GPT, batches

import headroom

log, batch = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
model = GPT().cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
losses = []
with headroom.Run(
    "gpu-py-levers",
    model=model,
    effective_batch=batch,
    micro_batch=batch,
    adaptive=False,
    memory_budget="40GiB",
    log=log,
    total_steps=6,
    checkpoint_blocks=model.blocks,
    precision="fp32",
) as run:
    for i, b in enumerate(batches(6, batch)):
        if i in (2, 4):
            print(run._carry_out("checkpointing:blocks" if i == 2 else "precision:bf16"))
        losses.append(run.backward(b, model.loss))
        run.step(opt)
print(json.dumps({"losses": losses}))
PY

cat > "$WORK/py/py_eval.py" << 'PY'
"""py-eval: run.evaluate on CUDA. The GPT trains 4 steps of 64 under memory_budget 4GiB
(the caching allocator's per-process fraction) and evaluates twice, 2 batches of 4096 ×
256 tokens each (far past the budget in one piece); then the same evaluation by hand in
chunks of 256, for the results to compare."""

import json
import sys

import torch
from hrgpu import GPT, batches

import headroom

log = sys.argv[1]
torch.manual_seed(0)
model = GPT().cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
evals = list(batches(2, 4096, seed=1))
results = []
with headroom.Run(
    "gpu-py-eval", model=model, effective_batch=64, memory_budget="4GiB", log=log, total_steps=4
) as run:
    for i, b in enumerate(batches(4, 64)):
        run.backward(b, model.loss)
        run.step(opt)
        if i % 2 == 1:
            with run.evaluation("validation"):
                results.append([float(run.evaluate(e, model.loss)) for e in evals])
with torch.no_grad():
    hand = [
        sum(float(model.loss((x[i : i + 256], y[i : i + 256]))) * len(x[i : i + 256])
            for i in range(0, len(x), 256)) / len(x)
        for x, y in evals
    ]
print(json.dumps({"results": results, "hand": hand}))
PY

cat > "$WORK/py/summary.py" << 'PY'
"""One summary line for a section of gpu-check.sh, from its own logs under OUT:
`PASS|FAIL|SKIP section — the number that shows it`. Usage: summary.py OUT SECTION [ARG]"""

import json
import math
import pickle
import re
import sys
from pathlib import Path

OUT, SECTION, ARGS = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
MiB, GiB = 1 << 20, 1 << 30


class Fail(Exception):
    pass


def check(ok, text):
    if not ok:
        raise Fail(text)
    return text


def recs(name):
    out = []
    p = OUT / name
    if p.exists():
        for line in p.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a line cut by a timeout
                pass
    return out


def kind(rs, k):
    return [r for r in rs if r.get("kind") == k]


def rc(name):
    p = OUT / f"{name}.rc"
    return int(p.read_text().split()[0]) if p.exists() else None


def gib(b):
    return "?" if b is None else f"{b / GiB:.2f} GiB"


def size(b):
    return f"{b / 1024:.0f} KiB" if b < MiB else f"{b / MiB:.1f} MiB" if b < GiB else gib(b)


def pct(x):
    return f"{100 * x:.1f}%"


def finished(rs):
    f = kind(rs, "finished")
    return f[-1] if f else None


def steps_of(rs):
    """(steps done, steps asked) from the finished record, else from the step records."""
    f = finished(rs)
    if f:
        return f["steps_done"], f["total_steps"]
    s = kind(rs, "step")
    return len(s), (s[-1]["total_steps"] if s else 0)


def target_of(rs):
    t = kind(rs, "thresholds_changed")
    return t[-1]["thresholds"]["target"] if t else 0.90


def device_of(rs):
    s = kind(rs, "run_started")
    return s[0]["device"] if s else "?"


def tail(name, n=1):
    p = OUT / name
    lines = [x for x in p.read_text().splitlines() if x.strip()] if p.exists() else []
    return " / ".join(lines[-n:])[:200] if lines else "no output"


def snapshot(path):
    with open(path, "rb") as f:
        snap = pickle.load(f)
    segs = snap.get("segments", []) if isinstance(snap, dict) else []
    traces = sum(len(t) for t in snap.get("device_traces", [])) if isinstance(snap, dict) else 0
    return segs, traces, isinstance(snap, dict) and "device_traces" in snap


def info():
    d = json.loads((OUT / "info.json").read_text())
    check(d.get("cuda"), f"torch {d.get('torch')} sees no CUDA device")
    linked = "libtorch_cuda" in (OUT / "ldd.txt").read_text()
    text = (
        f"{d['name']}, {gib(d['total'])}, torch {d['torch']} (CUDA {d['cuda_version']}), "
        f"Python {d['python']}, the binary links libtorch_cuda: {'yes' if linked else 'no'}"
    )
    return check(linked, text)


def run():
    rs = recs("run.jsonl")
    done, total = steps_of(rs)
    f = finished(rs)
    samples = kind(rs, "sample")
    full = [s for s in samples if s.get("gpu") and s.get("allocator")]
    segs = kind(rs, "segments")
    m = f["memory"] if f else {}
    text = (
        f"{done}/{total} steps on {device_of(rs)}, peak {pct(m.get('peak_usage', 0))} "
        f"({gib(m.get('peak_bytes'))}), {len(full)}/{len(samples)} samples with NVML and "
        f"allocator figures, {len(segs)} segments records, exit {rc('run')}"
    )
    return check(rc("run") == 0 and f and done == total and full and segs, text)


def fidelity():
    c, i = recs("fid-clean.jsonl"), recs("fid-inject.jsonl")
    lc = {s["step"]: s["loss"] for s in kind(c, "step")}
    li = {s["step"]: s["loss"] for s in kind(i, "step")}
    common = sorted(set(lc) & set(li))
    diff = max((abs(li[k] - lc[k]) / abs(lc[k]) for k in common), default=math.inf)
    ooms = len(kind(i, "oom"))
    vc, vi = (kind(r, "eval")[-1]["val_loss"] if kind(r, "eval") else math.nan for r in (c, i))
    text = (
        f"{ooms} injected OOMs recovered, {len(li)} and {len(lc)} steps, largest relative loss "
        f"difference {diff:.1e} (bound 1e-5), val {vi:.7f} vs {vc:.7f}"
    )
    ok = rc("fid-clean") == 0 and rc("fid-inject") == 0 and ooms == 3
    return check(ok and len(common) == len(lc) > 0 and diff <= 1e-5, text)


def nvml():
    rs = recs("nvml.jsonl")
    said = [n for n in kind(rs, "notice") if n.get("source") == "nvml" or "NVML" in n["text"]]
    samples = kind(rs, "sample")
    with_gpu = sum(1 for s in samples if s.get("gpu"))
    done, total = steps_of(rs)
    text = (
        f"{len(said)} NVML notice(s), {with_gpu} of {len(samples)} samples with NVML figures, "
        f"{done}/{total} steps, exit {rc('nvml')}"
    )
    ok = rc("nvml") == 0 and said and 0 < with_gpu < len(samples) and finished(rs)
    return check(ok and done == total, text)


def oom():
    rs = recs("oom.jsonl")
    ooms, mem = kind(rs, "oom"), kind(rs, "step_memory")
    done, total = steps_of(rs)
    check(ooms, f"no OOM at micro-batch {mem[0]['micro_batch'] if mem else '?'}, exit {rc('oom')}")
    last = max((m["usage"] for m in mem[-5:]), default=math.inf)
    target = target_of(rs)
    text = (
        f"{len(ooms)} OOM(s) recovered (first at micro-batch {ooms[0]['micro_batch']}, retry "
        f"{ooms[0]['retry_with']}), settled at {mem[-1]['micro_batch'] if mem else '?'}, last 5 "
        f"steps' peak ≤ {pct(last)} (target {pct(target)}), {done}/{total} steps"
    )
    ok = rc("oom") == 0 and "out of memory" in ooms[0]["error"].lower() and last < target
    return check(ok and done == total, text)


def ramp():
    rs = recs("ramp.jsonl")
    mem = kind(rs, "step_memory")
    done, total = steps_of(rs)
    top = max((m["usage"] for m in mem), default=math.inf)
    t = kind(rs, "thresholds_changed")
    crit = t[-1]["thresholds"]["critical"] if t else 0.95
    warn = sum(1 for d in kind(rs, "decision") if d["decision"]["decision"] == "warning")
    ooms = len(kind(rs, "oom"))
    text = (
        f"highest step peak {pct(top)} (critical {pct(crit)}), {ooms} OOMs, {warn} warnings, "
        f"{done}/{total} steps"
    )
    return check(rc("ramp") == 0 and top < crit and not ooms and done == total, text)


def screen(name):
    p = OUT / f"{name}.raw"
    data = p.read_bytes() if p.exists() else b""
    text = f"{size(len(data))} drawn on 160×50, allocator panel: {'yes' if b'alloc' in data else 'no'}"
    return check(rc(name) == 0 and data, f"{text}, exit {rc(name)}")


def bench(name):
    return check(rc(name) == 0, f"{tail(name + '.txt')} (exit {rc(name)})")


def py_oom():
    rs = recs("py-oom.jsonl")
    ooms = kind(rs, "oom")
    done, total = steps_of(rs)
    text = f"{len(ooms)} CUDA OOM(s) recovered, {done}/{total} steps, exit {rc('py-oom')}"
    return check(rc("py-oom") == 0 and ooms and done == total, text)


def levers():
    got = {}
    for name in ("levers-fp32", "levers-bf16"):
        rs = recs(f"{name}.jsonl")
        mem = kind(rs, "step_memory")
        losses = [s["loss"] for s in kind(rs, "step")]
        check(mem and losses, f"{name}: no step measured, exit {rc(name)}: {tail(name + '.out')}")
        got[name] = (steps_of(rs), mem[-1], losses[-1], rc(name))
    (fd, ft), fm, fl, frc = got["levers-fp32"]
    (bd, bt), bm, bl, brc = got["levers-bf16"]
    change = (bm["peak_bytes"] - fm["peak_bytes"]) / fm["peak_bytes"]
    text = (
        f"bf16·blocks step peak {gib(bm['peak_bytes'])} vs fp32·none {gib(fm['peak_bytes'])} "
        f"at micro-batch {fm['micro_batch']} × {fm['seq_len']} tokens ({change:+.0%}), last "
        f"loss {bl:.4f} vs {fl:.4f}, {bd}/{bt} and {fd}/{ft} steps"
    )
    ok = frc == 0 and brc == 0 and fd == ft and bd == bt and math.isfinite(bl + fl)
    return check(ok and change < 0 and abs(bl - fl) <= 0.03 * abs(fl), text)


UNIT = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse(s):
    v, u = s.split()
    return float(v) * UNIT[u]


def cli_row(txt, prec, ck, mb):
    """The CLI plan's prediction for a lever at `mb`, as scripts/plan_vs_measured.sh reads it."""
    row = next(x for x in txt.splitlines() if re.match(rf"[* ] {prec} · {ck}\b", x))
    cells = re.findall(r"([\d.]+ (?:B|KiB|MiB|GiB))", row)
    floor = re.search(r"never below ([\d.]+ (?:B|KiB|MiB|GiB))", txt)
    return max(parse(cells[0]) + parse(cells[1]) * mb, parse(floor.group(1)) if floor else 0)


def plan():
    txt = (OUT / "plan.txt").read_text() if (OUT / "plan.txt").exists() else ""
    check(
        rc("plan") == 0 and "headroom plan on cuda" in txt,
        f"headroom plan --device cuda: exit {rc('plan')}: {tail('plan.err')}",
    )
    parts, ok = [], True
    for name, prec, ck, bound in (("levers-fp32", "fp32", "none", 0.10), ("levers-bf16", "bf16", "blocks", 0.20)):
        rs = recs(f"{name}.jsonl")
        mem = kind(rs, "step_memory")
        check(mem, f"no measured step in {name}.jsonl to hold the plan against")
        peak, mb = mem[-1]["peak_bytes"], mem[-1]["micro_batch"]
        cli = cli_row(txt, prec, ck, mb)
        pc = kind(rs, "plan_check")
        own = pc[-1]["planned_bytes"] if pc else None
        e_cli = (cli - peak) / peak
        e_own = (own - peak) / peak if own else math.nan
        ok &= abs(e_cli) <= bound and abs(e_own) <= 0.10
        parts.append(
            f"{prec}·{ck} CLI {gib(cli)} vs measured {gib(peak)} ({e_cli:+.1%}), the run's own "
            f"plan_check {e_own:+.1%}"
        )
    text = f"at micro-batch {mb}: " + "; ".join(parts)
    return check(ok, text + " (bounds: CLI ±10% probed row, ±20% scaled row; plan_check ±10%)")


def keys():
    rs = recs("keys.jsonl")
    lev = [d for d in kind(rs, "decision") if d["decision"]["decision"] == "lever"]
    parts = []
    for d in lev:
        x = d["decision"]
        before, after = (x.get(k) or {} for k in ("before", "after"))
        freed = x.get("freed_bytes")
        parts.append(
            f"{x['change']} ({x['source']}, step {d['step']}): {gib(before.get('peak_bytes'))} → "
            f"{gib(after.get('peak_bytes'))}, freed {gib(freed) if freed is not None else 'n/a'}"
        )
    text = "; ".join(parts) or "no lever decision"
    text += f"; {tail('keys.out')}"
    ok = rc("keys") == 0 and len(lev) >= 2
    if ok:
        a, m = lev[0]["decision"], lev[1]["decision"]
        ok = (
            a["change"] == "activation checkpointing none → blocks"
            and (a.get("freed_bytes") or 0) > 0
            and m["change"] == "precision fp32 → bf16"
            and m.get("freed_bytes") is not None
            and a["source"] == m["source"] == "command"
        )
    return check(ok, text)


def oom_snapshot():
    rs = recs("oom-snapshot.jsonl")
    ooms = kind(rs, "oom")
    said = [n["text"] for n in kind(rs, "notice") if "oom-step" in n["text"]]
    files = sorted((OUT / "oom-snapshot").glob("oom-step*.pickle"))
    done, total = steps_of(rs)
    check(ooms, f"no OOM in {done} steps, exit {rc('oom-snapshot')}: {tail('oom-snapshot.out')}")
    check(said and files, f"{len(ooms)} OOM(s) but no snapshot: {said[:1] or tail('oom-snapshot.out')}")
    segs, _, _ = snapshot(files[0])
    # The section injects at step 2 (--inject-oom 2: the allocator asked for 2^52 bytes,
    # whose error reads as any CUDA OOM's); an OOM at step 1 is the device's own.
    how = ", ".join(
        f"step {o['step']} × {o['micro_batch']} ({'injected' if o['step'] == 2 else 'natural'})"
        for o in ooms
    )
    text = (
        f"OOMs at {how}; {len(files)} snapshot(s), {files[0].name} {size(files[0].stat().st_size)} "
        f"with {len(segs)} segments ({gib(sum(s.get('total_size', 0) for s in segs))}) read by "
        f"pickle; {done}/{total} steps, exit {rc('oom-snapshot')}"
    )
    return check(rc("oom-snapshot") == 0 and segs and done == total, text)


def py_alloc():
    rs = recs("py-alloc.jsonl")
    ooms, mem = kind(rs, "oom"), kind(rs, "step_memory")
    done, total = steps_of(rs)
    samples = kind(rs, "sample")
    alloc = [s["allocator"] for s in samples if s.get("allocator")]
    segs = kind(rs, "segments")
    check(ooms, f"no OOM ({done}/{total} steps, exit {rc('py-alloc')}): {tail('py-alloc.out')}")
    last = max((m["usage"] for m in mem[-3:]), default=math.inf)
    target = target_of(rs)
    text = (
        f"{len(ooms)} CUDA OOMs recovered (micro-batch {ooms[0]['micro_batch']} → "
        f"{mem[-1]['micro_batch'] if mem else '?'}), last 3 steps' peak ≤ {pct(last)} of "
        f"{gib(mem[-1]['limit_bytes'] if mem else None)} (target {pct(target)}), {done}/{total} "
        f"steps; allocator figures in {len(alloc)}/{len(samples)} samples (reserved up to "
        f"{gib(max((a['reserved'] for a in alloc), default=0))}, num_ooms "
        f"{max((a['num_ooms'] for a in alloc), default=0)}), {len(segs)} segments records"
    )
    ok = rc("py-alloc") == 0 and "out of memory" in ooms[0]["error"].lower() and done == total
    return check(ok and last < target and alloc and segs, text)


def py_snapshot():
    rs = recs("py-snapshot.jsonl")
    ooms = kind(rs, "oom")
    said = [n["text"] for n in kind(rs, "notice") if ".oom-step" in n["text"]]
    done, total = steps_of(rs)
    check(ooms, f"no OOM ({done}/{total} steps, exit {rc('py-snapshot')}): {tail('py-snapshot.out')}")
    check(said, f"{len(ooms)} OOM(s) but no snapshot notice: {tail('py-snapshot.out')}")
    path = OUT / Path(said[0].split(" is in ")[1].split(" (")[0]).name
    segs, traces, has_traces = snapshot(path)
    text = (
        f"{path.name} {size(path.stat().st_size)}: {len(segs)} segments, {traces} trace "
        f"entries; {len(ooms)} OOM(s) recovered, {done}/{total} steps"
    )
    return check(rc("py-snapshot") == 0 and segs and has_traces and done == total, text)


def hints():
    rs = recs("hints.jsonl")
    up = {}
    for h in kind(rs, "hint"):
        if h["raised"]:
            up.setdefault(h["hint"], h)
    res = json.loads((OUT / "hints.result.json").read_text()) if (OUT / "hints.result.json").exists() else {}
    frag, outside = up.get("fragmentation"), up.get("outside_allocator")
    text = (
        "fragmentation "
        + (f"raised at step {frag['step']} ({gib(frag['figure_bytes'])} reserved unused)" if frag else "not raised")
        + f" from {gib(res.get('inactive_split'))} split of {gib(res.get('reserved'))} reserved; "
        + "outside_allocator "
        + (f"raised at step {outside['step']} ({gib(outside['figure_bytes'])} outside)" if outside else "not raised")
        + f" with another process holding {gib(res.get('hog_bytes'))}"
    )
    return check(rc("hints") == 0 and frag and outside, text + f", exit {rc('hints')}")


def framework(name, package, result):
    rs = recs(f"{name}.jsonl")
    res = json.loads((OUT / result).read_text()) if (OUT / result).exists() else {}
    ooms, mem = kind(rs, "oom"), kind(rs, "step_memory")
    check(res, f"the fit did not end (exit {rc(name)}): {tail(name + '.out')}")
    src = f" ({ARGS[0]})" if ARGS else ""
    text = (
        f"{package} {res['version']}{src}, on {device_of(rs)}: {len(ooms)} CUDA OOM(s) recovered from batch "
        f"{res['batch']} → micro-batch {mem[-1]['micro_batch'] if mem else '?'}, "
        f"{res['global_step']}/{res['max_steps']} steps, {len(mem)} measured"
    )
    ok = rc(name) == 0 and device_of(rs).startswith("cuda") and ooms
    return check(ok and res["global_step"] == res["max_steps"] == len(mem), text)


def hf_fsdp():
    text = framework("hf-fsdp", "transformers", "hf-fsdp.result.json")
    res = json.loads((OUT / "hf-fsdp.result.json").read_text())
    check(
        res["fsdp2"] and res["distributed"].endswith("FSDP"),
        f"the Trainer's model is not FSDP2 ({res['distributed']}): accelerate did not shard it; {text}",
    )
    return f"{text}; the Trainer's FSDP2 root gated under torchrun"


def ddp_nccl():
    p = OUT / "ddp" / "done-rank0.json"
    check(p.exists(), f"rank 0 did not finish (exit {rc('ddp-nccl')}): {tail('ddp/torchrun.out', 2)}")
    d = json.loads(p.read_text())
    rs = recs("ddp/rank0.jsonl")
    mem = kind(rs, "step_memory")
    name = (kind(rs, "run_started") or [{}])[0].get("run_name", "?")
    text = (
        f"torchrun world size {d['world']}, backend {d['backend']}: {d['steps']}/{d['want']} steps "
        f"on {device_of(rs)} as {name}, micro-batch {mem[0]['micro_batch'] if mem else '?'} → "
        f"{mem[-1]['micro_batch'] if mem else '?'}, all_reduce after it {d['allreduce']}"
        + (
            f"; {d.get('early_buckets', 0)} buckets launched during last backwards "
            f"({d.get('buckets', 0)} a step)"
            if d["world"] > 1
            else ""
        )
    )
    ok = rc("ddp-nccl") == 0 and d["backend"] == "nccl"
    ok = ok and (d["world"] == 1 or d.get("early_buckets", 0) > 0)
    return check(ok and d["steps"] == d["want"] == d["allreduce"], text)


def fsdp_nccl():
    p = OUT / "fsdp" / "done-rank0.json"
    check(p.exists(), f"rank 0 did not finish (exit {rc('fsdp-nccl')}): {tail('fsdp/torchrun.out', 2)}")
    d = json.loads(p.read_text())
    rs = recs("fsdp/rank0.jsonl")
    mem = kind(rs, "step_memory")
    ooms = kind(rs, "oom")
    text = (
        f"torchrun world size {d['world']}, backend {d['backend']}, FSDP2: "
        f"{d['steps']}/{d['want']} steps on {device_of(rs)}, {len(ooms)} CUDA OOM(s) "
        f"recovered, micro-batch {ooms[0]['micro_batch'] if ooms else '?'} → "
        f"{mem[-1]['micro_batch'] if mem else '?'}"
    )
    ok = rc("fsdp-nccl") == 0 and d["world"] == 1 and d["backend"] == "nccl"
    return check(ok and d["steps"] == d["want"] and len(ooms) >= 1, text)


def hardcap():
    cuda = (OUT / "hardcap-cuda.out").read_text() if (OUT / "hardcap-cuda.out").exists() else ""
    py = (OUT / "hardcap-py.out").read_text() if (OUT / "hardcap-py.out").exists() else ""
    runs = sorted(d for d in (OUT / "hardcap").glob("*") if d.is_dir())
    gave_up, aborted, seen = 0, 0, []
    for d in runs:
        code = int((d / "rc").read_text())
        log = recs(f"hardcap/{d.name}/run.jsonl")
        ends = log[-1]["kind"] if log else "nothing"
        ck = (d / "ckpt").read_text().strip() == "yes"
        gave_up += code == 1 and ends == "failed" and ck
        aborted += code in (134, 139)
        seen.append(f"{code}/{ends}/{'ck' if ck else 'no ck'}")
    text = (
        f"CUDA: the cap is not used (binary exit {rc('hardcap-cuda')}, Python "
        f"{'refused' if 'CPU runs only' in py else 'not refused' if py else 'not run'}: hard_limit applies to CPU runs "
        f"only); CPU give-up under a full cap {gave_up}/{len(runs)}: exit 1, log ends failed, "
        f"checkpoint written; {aborted} aborts ({', '.join(seen)})"
    )
    if runs and gave_up < len(runs):
        text += f"; give-up 1 said: {tail('hardcap/1/out', 2)}"
    ok = rc("hardcap-cuda") in (1, 2) and "CPU runs only" in cuda and "CPU runs only" in py
    return check(ok and runs and gave_up == len(runs), text)


def py_levers():
    rs = recs("py-levers.jsonl")
    done, total = steps_of(rs)
    levers = [d["decision"] for d in kind(rs, "decision") if d["decision"]["decision"] == "lever"]
    check(len(levers) == 2, f"{len(levers)} lever decisions, not 2 ({done}/{total} steps, exit "
          f"{rc('py-levers')}): {tail('py-levers.out')}")
    parts = []
    for d in levers:
        b, a = d["before"], d["after"]
        parts.append(f"{d['change']}: step {b['step']} {gib(b['peak_bytes'])} → step {a['step']} "
                     f"{gib(a['peak_bytes'])} (freed {gib(d['freed_bytes'])})")
    ok = all((d["freed_bytes"] or 0) > 0 for d in levers) and rc("py-levers") == 0
    return check(ok and done == total, "; ".join(parts) + f"; {done}/{total} steps")


def py_eval():
    rs = recs("py-eval.jsonl")
    passes = kind(rs, "eval_memory")
    out = [json.loads(x) for x in (OUT / "py-eval.out").read_text().splitlines() if x.startswith("{")]
    check(len(passes) == 2 and out, f"{len(passes)} evaluation passes, exit {rc('py-eval')}: {tail('py-eval.out')}")
    first, second = passes
    res, hand = out[-1]["results"], out[-1]["hand"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(res[-1], hand))
    text = (
        f"pass 1: {first['ooms']} CUDA OOM(s), batch {first['asked']} in chunks of {first['size']}, "
        f"peak {pct(first['usage'])} of {gib(first['limit_bytes'])}; pass 2: {second['ooms']} OOMs, "
        f"chunks of {second['size']}; last losses {res[-1]} vs by hand {hand} (largest relative "
        f"difference {worst:.1e}, bound 1e-5)"
    )
    ok = first["ooms"] >= 1 and first["size"] < first["asked"] and second["ooms"] == 0
    return check(ok and worst < 1e-5 and rc("py-eval") == 0, text)


SECTIONS = {
    "info": info, "run": run, "fidelity": fidelity, "nvml": nvml, "oom": oom, "ramp": ramp,
    "dash": lambda: screen("dash"), "py-dash": lambda: screen("py-dash"),
    "overhead": lambda: bench("overhead"), "telemetry": lambda: bench("telemetry"),
    "py-oom": py_oom, "levers": levers, "plan": plan, "keys": keys,
    "oom-snapshot": oom_snapshot, "py-alloc": py_alloc, "py-snapshot": py_snapshot,
    "hints": hints, "hf": lambda: framework("hf", "transformers", "hf.result.json"),
    "hf-fsdp": hf_fsdp,
    "lightning": lambda: framework("lightning", "lightning", "lightning.result.json"),
    "ddp-nccl": ddp_nccl, "fsdp-nccl": fsdp_nccl, "hardcap": hardcap, "py-levers": py_levers, "py-eval": py_eval,
}

def one_line(text):
    return " / ".join(x.strip() for x in str(text).splitlines() if x.strip())


try:
    print(f"PASS {SECTION} — {one_line(SECTIONS[SECTION]())}")
except Fail as e:
    print(f"FAIL {SECTION} — {one_line(e)}")
except Exception as e:  # a log missing or cut short is a failure of the section, said
    print(f"FAIL {SECTION} — its logs do not read ({type(e).__name__}: {one_line(e)})")
PY

# `all`: the sections above in order, then a SKIP line for each one it leaves out.
ALL_MODE=0
args=()
for what in "$@"; do
  if [[ $what == all ]]; then
    ALL_MODE=1
    args+=("${ALL[@]}")
    for h in "${NOT_IN_ALL[@]}"; do [[ " $* " == *" $h "* ]] || args+=("skip:$h"); done
  else
    args+=("$what")
  fi
done
if ((ALL_MODE)); then
  : > "$OUT/summary.txt"
  DEADLINE=$((SECONDS + ${ALL_BUDGET:-450}))
  RUN_STEPS=${RUN_STEPS:-10}
  NVML_STEPS=${NVML_STEPS:-12}
fi

for what in "${args[@]}"; do
  case "$what" in
    skip:*)
      line SKIP "${what#skip:}" "$(left_out "${what#skip:}")"
      ;;
    info)
      section info
      nvidia-smi | tee "$OUT/nvidia-smi.txt"
      "$PY" - "$OUT/info.json" << 'PY'
import json, platform, sys
import torch
d = {"python": platform.python_version(), "torch": torch.__version__,
     "cuda_version": torch.version.cuda, "cuda": torch.cuda.is_available()}
if d["cuda"]:
    p = torch.cuda.get_device_properties(0)
    d.update(name=p.name, total=p.total_memory)
json.dump(d, open(sys.argv[1], "w"))
print(d)
PY
      { ldd "$BIN" 2>&1 || true; } > "$OUT/ldd.txt"
      grep -E 'torch|cuda|nvidia' "$OUT/ldd.txt" | head
      summarize info
      ;;
    run)
      # Walking skeleton on CUDA: NVML and allocator figures in the samples.
      section run; have_bin run && need 30 run || continue
      timeout "$(tmo 150)" "$BIN" train --config configs/gpu.toml --headless --steps "${RUN_STEPS:-30}" \
        --checkpoint-dir "$WORK/ck-run" --log "$OUT/run.jsonl" > "$OUT/run.out" 2>&1
      ran run; tail -15 "$OUT/run.out"; rm -rf "$WORK/ck-run"
      summarize run
      ;;
    oom)
      # A micro-batch that does not fit: a real CUDA OOM, recovery, settling near target.
      section oom; have_bin oom && need 120 oom || continue
      timeout "$(tmo 240)" "$BIN" train --config configs/gpu.toml --headless --steps "${OOM_STEPS:-16}" \
        --batch-size "${OOM_BATCH:-256}" --effective-batch "${OOM_BATCH:-256}" \
        --checkpoint-dir "$WORK/ck-oom" --log "$OUT/oom.jsonl" > "$OUT/oom.out" 2>&1
      ran oom; grep -iE 'oom|out of memory|resize|warn|step +[0-9]+' "$OUT/oom.out" | head -40; tail -5 "$OUT/oom.out"
      rm -rf "$WORK/ck-oom"
      summarize oom
      ;;
    ramp)
      # Sequence lengths ramping 128 -> 1024 while the controller grows from 32: the
      # per-token stretch must keep every step under critical.
      section ramp; have_bin ramp && need 120 ramp || continue
      sed '/^\[data\]/a lengths = "ramp"\nmin_seq_len = 128\nramp_steps = 12' configs/gpu.toml > "$OUT/ramp.toml"
      timeout "$(tmo 240)" "$BIN" train --config "$OUT/ramp.toml" --headless --steps "${RAMP_STEPS:-24}" \
        --batch-size 32 --effective-batch 256 \
        --checkpoint-dir "$WORK/ck-ramp" --log "$OUT/ramp.jsonl" > "$OUT/ramp.out" 2>&1
      ran ramp; grep -E 'micro-batch|out of memory|warn' "$OUT/ramp.out" | head -30; tail -3 "$OUT/ramp.out"
      rm -rf "$WORK/ck-ramp"
      summarize ramp
      ;;
    dash)
      # The dashboard on a 160x50 pseudo-terminal: allocator panel and segment map.
      section dash; have_bin dash || continue
      "$PY" scripts/pty_capture.py 160 50 "${DASH_SECONDS:-45}" "$OUT/dash.raw" -- \
        "$BIN" train --config configs/gpu.toml --steps 2000 \
        --checkpoint-dir "$WORK/ck-dash" --log "$OUT/dash.jsonl"
      ran dash; rm -rf "$WORK/ck-dash"
      summarize dash
      ;;
    fidelity)
      # Injected OOMs on CUDA against the same run without them.
      section fidelity; have_bin fidelity && need 40 fidelity || continue
      for v in clean inject; do
        extra=(); [[ $v == inject ]] && extra=(--inject-oom 3,5,6)
        timeout "$(tmo 120)" "$BIN" train --config configs/gpu.toml --headless --steps 8 \
          --batch-size 16 --effective-batch 32 "${extra[@]}" \
          --checkpoint-dir "$WORK/ck-$v" --log "$OUT/fid-$v.jsonl" > "$OUT/fid-$v.out" 2>&1
        ran "fid-$v"; rm -rf "$WORK/ck-$v"
      done
      summarize fidelity
      ;;
    overhead)
      section overhead; need 240 overhead || continue
      [[ -x $ROOT/target/gpu/overhead ]] || { line SKIP overhead "no bench binary at target/gpu/overhead: build and carry it (the header)"; continue; }
      HEADROOM_BIN=$BIN timeout "$(tmo 500)" "$ROOT/target/gpu/overhead" ${OVERHEAD_ARGS:-3 60 configs/gpu.toml} 2>&1 |
        tee "$OUT/overhead.txt"
      echo "${PIPESTATUS[0]}" > "$OUT/overhead.rc"
      summarize overhead
      ;;
    nvml)
      # NVML "loses the GPU" after 20 reads (5 s at the default rate): one notice, GPU
      # figures hidden, the run goes on to the end with exit 0.
      section nvml; have_bin nvml && need 25 nvml || continue
      HEADROOM_INJECT_NVML_FAILURE=20 timeout "$(tmo 200)" "$BIN" train --config configs/gpu.toml \
        --headless --steps "${NVML_STEPS:-20}" --checkpoint-dir "$WORK/ck-nvml" --log "$OUT/nvml.jsonl" \
        > "$OUT/nvml.out" 2>&1
      ran nvml; grep -iE 'nvml|completed' "$OUT/nvml.out"; rm -rf "$WORK/ck-nvml"
      summarize nvml
      ;;
    telemetry)
      section telemetry; need 120 telemetry || continue
      [[ -x $ROOT/target/gpu/telemetry ]] || { line SKIP telemetry "no bench binary at target/gpu/telemetry: build and carry it (the header)"; continue; }
      HEADROOM_BIN=$BIN timeout "$(tmo 400)" "$ROOT/target/gpu/telemetry" ${TELEMETRY_ARGS:-configs/gpu.toml} 2>&1 |
        tee "$OUT/telemetry.txt"
      echo "${PIPESTATUS[0]}" > "$OUT/telemetry.rc"
      summarize telemetry
      ;;
    py-oom)
      # The Python package (issue 13): the nanoGPT example on CUDA in adaptive mode from a
      # micro-batch that cannot fit under a budget (the caching allocator's per-process
      # fraction): a real torch.OutOfMemoryError, recovered mid-step.
      section py-oom; have_py py-oom && need 120 py-oom || continue
      PYTHONPATH=$STAGE timeout "$(tmo 400)" "$PY" examples/python/nanogpt.py --device cuda \
        --n-layer "${PY_LAYERS:-12}" --n-head 12 --n-embd 768 --seq-len 1024 \
        --effective-batch "${PY_BATCH:-256}" --micro-batch "${PY_BATCH:-256}" \
        --memory-budget "${PY_BUDGET:-24GiB}" --steps "${PY_STEPS:-20}" --log "$OUT/py-oom.jsonl" \
        > "$OUT/py-oom.out" 2>&1
      ran py-oom; tail -15 "$OUT/py-oom.out"
      grep -c '"kind":"oom"' "$OUT/py-oom.jsonl"
      summarize py-oom
      ;;
    py-dash)
      # The same run attached to from a dashboard on a pseudo-terminal: the allocator panel
      # and segment map come from torch.cuda through the Python package.
      section py-dash; have_bin py-dash && have_py py-dash || continue
      PYTHONPATH=$STAGE "$PY" examples/python/nanogpt.py --device cuda \
        --n-layer "${PY_LAYERS:-12}" --n-head 12 --n-embd 768 --seq-len 1024 \
        --effective-batch "${PY_BATCH:-256}" --micro-batch "${PY_BATCH:-256}" \
        --memory-budget "${PY_BUDGET:-24GiB}" --steps 400 --log "$OUT/py-dash.jsonl" \
        > "$OUT/py-dash.out" 2>&1 &
      train=$!
      sleep "${PY_DASH_WAIT:-20}"
      "$PY" scripts/pty_capture.py 160 50 "${DASH_SECONDS:-30}" "$OUT/py-dash.raw" -- "$BIN" attach
      ran py-dash
      kill -TERM $train; wait $train; echo "train rc=$?"; tail -5 "$OUT/py-dash.out"
      summarize py-dash
      ;;
    levers)
      # bf16 and activation checkpointing on CUDA, from the flags: LEVER_STEPS (4) steps of
      # configs/gpu.toml at a fixed micro-batch LEVER_BATCH (16) × 1024 tokens, fp32 with no
      # checkpointing and bf16 with blocks. PASS: both complete, the bf16·blocks step peak
      # is below fp32·none's, the last losses within 3%.
      section levers; have_bin levers && need 40 levers || continue
      lever_runs
      summarize levers
      ;;
    plan)
      # `headroom plan --device cuda`: the probe against the caching allocator, its rows
      # against the step peaks levers measured at the same micro-batch, and each of those
      # runs' own plan (its plan_check records). Runs levers first when its logs are absent.
      section plan; have_bin plan || continue
      if [[ -s $OUT/levers-fp32.jsonl && -s $OUT/levers-bf16.jsonl ]]; then
        need 20 plan || continue
      else
        need 60 plan || continue
        lever_runs
      fi
      fixed_config
      timeout "$(tmo 90)" "$BIN" plan --config "$OUT/fixed.toml" --device cuda \
        --batch-size "${LEVER_BATCH:-16}" > "$OUT/plan.txt" 2> "$OUT/plan.err"
      ran plan; cat "$OUT/plan.txt"
      summarize plan
      ;;
    keys)
      # The live levers from the dashboard's keys on CUDA: a on a pty (activation
      # checkpointing), then m (bf16), each confirmed by the trainer and recorded as a lever
      # decision with the step peaks before and after; q stops the run.
      section keys; have_bin keys && need 40 keys || continue
      fixed_config
      timeout "$(tmo 120)" "$PY" "$WORK/py/keys.py" 160 50 "$OUT/keys.jsonl" "$OUT/keys.raw" -- \
        "$BIN" train --config "$OUT/fixed.toml" --steps 2000 --batch-size "${LEVER_BATCH:-16}" \
        --effective-batch "${LEVER_BATCH:-16}" --checkpoint-dir "$WORK/ck-keys" \
        --log "$OUT/keys.jsonl" > "$OUT/keys.out" 2>&1
      ran keys; cat "$OUT/keys.out"; rm -rf "$WORK/ck-keys"
      summarize keys
      ;;
    oom-snapshot)
      # --oom-snapshot: a real CUDA OOM at micro-batch SNAP_BATCH (256: 256 × 1024 tokens
      # of configs/gpu.toml need about 150 GiB) in step 1, and an injected one (the
      # allocator asked for 2^52 bytes) in step 2; each writes the caching allocator's
      # snapshot beside the checkpoints, copied here to $OUT/oom-snapshot/.
      section oom-snapshot; have_bin oom-snapshot && need 40 oom-snapshot || continue
      timeout "$(tmo 120)" "$BIN" train --config configs/gpu.toml --headless --steps 2 \
        --batch-size "${SNAP_BATCH:-256}" --effective-batch "${SNAP_BATCH:-256}" --inject-oom 2 \
        --oom-snapshot --checkpoint-dir "$WORK/ck-snap" --log "$OUT/oom-snapshot.jsonl" \
        > "$OUT/oom-snapshot.out" 2>&1
      ran oom-snapshot; grep -iE 'out of memory|oom-step' "$OUT/oom-snapshot.out" | head; tail -3 "$OUT/oom-snapshot.out"
      mkdir -p "$OUT/oom-snapshot"
      cp "$WORK"/ck-snap/oom-step*.pickle "$OUT/oom-snapshot/" 2> /dev/null
      rm -rf "$WORK/ck-snap"
      summarize oom-snapshot
      ;;
    py-alloc)
      # The Python package's CUDA allocator source and a real CUDA OOM recovered in a
      # Python loop: micro-batch 1024 of a 4-layer, 256-wide model at 256 tokens (about
      # 17 GiB of activations) under memory_budget 4GiB.
      section py-alloc; have_py py-alloc && need 25 py-alloc || continue
      PYTHONPATH=$PYP timeout "$(tmo 90)" "$PY" "$WORK/py/py_run.py" --name gpu-py-alloc \
        --log "$OUT/py-alloc.jsonl" > "$OUT/py-alloc.out" 2>&1
      ran py-alloc; tail -3 "$OUT/py-alloc.out"
      summarize py-alloc
      ;;
    py-levers)
      # The Python package's levers on CUDA (py_levers.py): activation checkpointing of the
      # GPT's blocks, then autocast bf16, switched as a viewer would, PYLEVER_BATCH (256).
      section py-levers; have_py py-levers && need 25 py-levers || continue
      PYTHONPATH=$PYP timeout "$(tmo 90)" "$PY" "$WORK/py/py_levers.py" "$OUT/py-levers.jsonl" \
        "${PYLEVER_BATCH:-256}" > "$OUT/py-levers.out" 2>&1
      ran py-levers; tail -3 "$OUT/py-levers.out"
      summarize py-levers
      ;;
    py-eval)
      # run.evaluate on CUDA (py_eval.py): evaluation batches of 4096 × 256 tokens under
      # memory_budget 4GiB split after real CUDA OOMs, the size kept, the results against
      # the same evaluation chunked by hand.
      section py-eval; have_py py-eval && need 25 py-eval || continue
      PYTHONPATH=$PYP timeout "$(tmo 90)" "$PY" "$WORK/py/py_eval.py" "$OUT/py-eval.jsonl" \
        > "$OUT/py-eval.out" 2>&1
      ran py-eval; tail -3 "$OUT/py-eval.out"
      summarize py-eval
      ;;
    py-snapshot)
      # Run(oom_snapshot=True) on CUDA: the same loop; the OOM writes memory_viz's pickle
      # beside the log ($OUT/py-snapshot.oom-stepN.pickle) with the allocations' history.
      section py-snapshot; have_py py-snapshot && need 25 py-snapshot || continue
      PYTHONPATH=$PYP timeout "$(tmo 90)" "$PY" "$WORK/py/py_run.py" --name gpu-py-snapshot \
        --snapshot --steps 4 --log "$OUT/py-snapshot.jsonl" > "$OUT/py-snapshot.out" 2>&1
      ran py-snapshot; tail -3 "$OUT/py-snapshot.out"
      summarize py-snapshot
      ;;
    hints)
      # The fragmentation and outside-allocator hints from their real causes (hints.py).
      section hints; have_py hints && need 25 hints || continue
      env -u PYTORCH_CUDA_ALLOC_CONF PYTHONPATH="$PYP" timeout "$(tmo 90)" "$PY" "$WORK/py/hints.py" \
        "$OUT/hints.jsonl" "$OUT/hints.result.json" > "$OUT/hints.out" 2>&1
      ran hints; tail -3 "$OUT/hints.out"
      summarize hints
      ;;
    hf)
      # headroom.hf.adapt on a Trainer on CUDA: per-device batch HF_BATCH (512) past
      # HF_BUDGET (4GiB), HF_STEPS (4) steps.
      section hf; have_py hf && need 40 hf || continue
      imports hf transformers, accelerate, headroom.hf || continue
      PYTHONPATH=$PYP${FW_PATH:+:$FW_PATH} timeout "$(tmo 120)" "$PY" "$WORK/py/hf_cuda.py" \
        "$OUT/hf.jsonl" "$WORK/hf" "$OUT/hf.result.json" > "$OUT/hf.out" 2>&1
      ran hf; tail -5 "$OUT/hf.out"
      summarize hf "$FW_FROM"
      ;;
    hf-fsdp)
      # The same Trainer with its own FSDP2 (fsdp_config fsdp_version 2) under torchrun at
      # world size 1 with NCCL (issue 31): the FSDP root gated, a real CUDA OOM recovered.
      section hf-fsdp; have_py hf-fsdp && need 45 hf-fsdp || continue
      imports hf-fsdp transformers, accelerate, headroom.hf || continue
      HF_FSDP=1 NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} PYTHONPATH=$PYP${FW_PATH:+:$FW_PATH} \
        timeout "$(tmo 150)" "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
        "$WORK/py/hf_cuda.py" "$OUT/hf-fsdp.jsonl" "$WORK/hf-fsdp" "$OUT/hf-fsdp.result.json" \
        > "$OUT/hf-fsdp.out" 2>&1
      ran hf-fsdp; tail -5 "$OUT/hf-fsdp.out"
      summarize hf-fsdp "$FW_FROM"
      ;;
    lightning)
      # headroom.lightning.Adaptive on one GPU: loader batch PL_BATCH (512) past PL_BUDGET
      # (4GiB), PL_STEPS (4) steps.
      section lightning; have_py lightning && need 40 lightning || continue
      imports lightning lightning, headroom.lightning || continue
      PYTHONPATH=$PYP${FW_PATH:+:$FW_PATH} timeout "$(tmo 120)" "$PY" "$WORK/py/pl_cuda.py" \
        "$OUT/lightning.jsonl" "$WORK/pl" "$OUT/lightning.result.json" > "$OUT/lightning.out" 2>&1
      ran lightning; tail -5 "$OUT/lightning.out"
      summarize lightning "$FW_FROM"
      ;;
    ddp-nccl)
      # torchrun --standalone at world size 1 with NCCL, launched as py/tests/conftest.py's
      # torchrun helper does: DDP_STEPS (6) steps of 64 sequences from micro-batch 16.
      section ddp-nccl; have_py ddp-nccl && need 30 ddp-nccl || continue
      mkdir -p "$OUT/ddp"
      NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} PYTHONPATH=$PYP timeout "$(tmo 120)" \
        "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
        "$WORK/py/ddp_nccl.py" "$OUT/ddp" > "$OUT/ddp/torchrun.out" 2>&1
      ran ddp-nccl; tail -3 "$OUT/ddp/torchrun.out"
      summarize ddp-nccl
      ;;
    fsdp-nccl)
      # FSDP2 under torchrun at world size 1 with NCCL (issue 31): FSDP_STEPS (6) steps of
      # FSDP_MICRO (128) sequences from that micro-batch under FSDP_BUDGET (1GiB): a real
      # CUDA OOM inside the gated units, recovered.
      section fsdp-nccl; have_py fsdp-nccl && need 30 fsdp-nccl || continue
      mkdir -p "$OUT/fsdp"
      NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} PYTHONPATH=$PYP timeout "$(tmo 120)" \
        "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
        "$WORK/py/fsdp_nccl.py" "$OUT/fsdp" > "$OUT/fsdp/torchrun.out" 2>&1
      ran fsdp-nccl; tail -3 "$OUT/fsdp/torchrun.out"
      summarize fsdp-nccl
      ;;
    hardcap)
      # The hard cap (--hard-limit, hard_limit=True) is RLIMIT_DATA on host memory, so on
      # CUDA it is not used: a CUDA run is refused it (binary and Python alike; Python's
      # memory_budget caps the caching allocator instead). What host/src/own_heap.rs does
      # under it (headroom's own allocations served from pages the cap does not count) is
      # run on this machine's CPU: issue 33's give-up case with the cap held full
      # (HEADROOM_INJECT_FULL_CAP), HARDCAP_RUNS (3) times.
      section hardcap; have_bin hardcap && need 30 hardcap || continue
      timeout "$(tmo 60)" "$BIN" train --config configs/gpu.toml --headless --device cuda --hard-limit \
        --memory-budget 4GiB --steps 1 --checkpoint-dir "$WORK/ck-hardcap" \
        --log "$OUT/hardcap-cuda.jsonl" > "$OUT/hardcap-cuda.out" 2>&1
      ran hardcap-cuda; tail -2 "$OUT/hardcap-cuda.out"
      if [[ -f $STAGE/headroom/__init__.py ]]; then
        PYTHONPATH=$PYP timeout "$(tmo 60)" "$PY" - > "$OUT/hardcap-py.out" 2>&1 << 'PY'
import torch

import headroom

model = torch.nn.Linear(8, 8).cuda()
try:
    headroom.Run("gpu-hardcap", model=model, effective_batch=4, memory_budget="2GiB", hard_limit=True)
except Exception as e:
    print(f"refused: {type(e).__name__}: {e}")
else:
    print("not refused: a CUDA run took hard_limit=True")
PY
        cat "$OUT/hardcap-py.out"
      fi
      # The budget: 160 MiB above what the run holds before training (its refusal of 64 MiB
      # names it; 390 MiB on an H200 machine, 382 MiB on the CPU one), far below the
      # 900 MiB one sequence of 8192 tokens needs: tests/memory_control.rs does the same.
      printf '[data]\nseq_len = 8192\n' > "$WORK/long.toml"
      long=(train --headless --device cpu --threads 1 --config "$WORK/long.toml" --steps 3
        --batch-size 1 --effective-batch 2)
      held=$("$BIN" "${long[@]}" --memory-budget 64MiB --hard-limit 2>&1 |
        sed -n 's/.*already holds (\([0-9]*\) MiB.*/\1/p')
      budget=${HARDCAP_BUDGET:-$((${held:-390} + 160))MiB}
      echo "held before training: ${held:-?} MiB; budget $budget"
      for i in $(seq "${HARDCAP_RUNS:-3}"); do
        d=$OUT/hardcap/$i
        mkdir -p "$d"
        HEADROOM_INJECT_FULL_CAP=1 timeout "$(tmo 40)" "$BIN" "${long[@]}" \
          --memory-budget "$budget" --hard-limit --log "$d/run.jsonl" \
          --checkpoint-dir "$WORK/hardcap-$i" > "$d/out" 2>&1
        echo $? > "$d/rc"
        if [[ -f $WORK/hardcap-$i/step-000000/state.json ]]; then echo yes; else echo no; fi > "$d/ckpt"
        echo "give-up $i: rc=$(cat "$d/rc") checkpoint=$(cat "$d/ckpt")"
        rm -rf "$WORK/hardcap-$i"
      done
      summarize hardcap
      ;;
    *) echo "unknown section $what (all ${ALL[*]} ${NOT_IN_ALL[*]})"; exit 2 ;;
  esac
done
if ((ALL_MODE)); then
  printf '\n=== summary (%s s of %s)\n' "$SECONDS" "${ALL_BUDGET:-450}"
  cat "$OUT/summary.txt"
fi
