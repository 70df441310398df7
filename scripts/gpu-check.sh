#!/usr/bin/env bash
# The GPU checks of docs/GPU.md, for a lent machine with a CUDA GPU and PyTorch 2.11 but no
# Rust toolchain. Build here first, then carry target/gpu/ over:
#
#   ./dev build && ./dev cargo bench --no-run --bench overhead --bench telemetry
#   mkdir -p target/gpu && cp target/release/headroom target/gpu/
#   for b in overhead telemetry; do
#     cp "$(ls -t target/release/deps/$b-* | grep -v '\.d$' | head -1)" target/gpu/$b; done
#   HEADROOM_STAGE=$PWD/target/gpu/python ./dev python -c 1   # the Python package, staged
#   (on the GPU machine)  OUT=out bash scripts/gpu-check.sh info|run|oom|ramp|dash|fidelity|overhead|telemetry|nvml|py-oom|py-dash ...
#
# Each section writes its JSONL logs and console output under $OUT.
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BIN=${BIN:-$ROOT/target/gpu/headroom}
OUT=${OUT:-$ROOT/gpu-out}
PY=${PY:-/opt/torch/.venv/bin/python}
mkdir -p "$OUT"
TORCH_LIB=$("$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null ||
  echo /opt/torch/.venv/lib/python3.12/site-packages/torch/lib)
export LD_LIBRARY_PATH=$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

section() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }

for what in "$@"; do
  case "$what" in
    info)
      section info
      nvidia-smi | tee "$OUT/nvidia-smi.txt"
      "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
      ldd "$BIN" | grep -E 'torch|cuda|nvidia' | head
      ;;
    run)
      # Walking skeleton on CUDA: NVML and allocator figures in the samples.
      section run
      timeout 150 "$BIN" train --config configs/gpu.toml --headless --steps 30 \
        --checkpoint-dir "$OUT/ck-run" --log "$OUT/run.jsonl" > "$OUT/run.out" 2>&1
      echo "rc=$?"; tail -15 "$OUT/run.out"
      ;;
    oom)
      # A micro-batch that does not fit: a real CUDA OOM, recovery, settling near target.
      section oom
      timeout 240 "$BIN" train --config configs/gpu.toml --headless --steps ${OOM_STEPS:-16} \
        --batch-size ${OOM_BATCH:-256} --effective-batch ${OOM_BATCH:-256} \
        --checkpoint-dir "$OUT/ck-oom" --log "$OUT/oom.jsonl" > "$OUT/oom.out" 2>&1
      echo "rc=$?"; grep -iE 'oom|out of memory|resize|warn|step +[0-9]+' "$OUT/oom.out" | head -40; tail -5 "$OUT/oom.out"
      ;;
    ramp)
      # Sequence lengths ramping 128 -> 1024 while the controller grows from 32: the
      # per-token stretch must keep every step under critical.
      section ramp
      sed '/^\[data\]/a lengths = "ramp"\nmin_seq_len = 128\nramp_steps = 12' configs/gpu.toml > "$OUT/ramp.toml"
      timeout 240 "$BIN" train --config "$OUT/ramp.toml" --headless --steps ${RAMP_STEPS:-24} \
        --batch-size 32 --effective-batch 256 \
        --checkpoint-dir "$OUT/ck-ramp" --log "$OUT/ramp.jsonl" > "$OUT/ramp.out" 2>&1
      echo "rc=$?"; grep -E 'micro-batch|out of memory|warn' "$OUT/ramp.out" | head -30; tail -3 "$OUT/ramp.out"
      ;;
    dash)
      # The dashboard on a 160x50 pseudo-terminal: allocator panel and segment map.
      section dash
      "$PY" scripts/pty_capture.py 160 50 ${DASH_SECONDS:-45} "$OUT/dash.raw" -- \
        "$BIN" train --config configs/gpu.toml --steps 2000 \
        --checkpoint-dir "$OUT/ck-dash" --log "$OUT/dash.jsonl"
      echo "rc=$?"
      ;;
    fidelity)
      # Injected OOMs on CUDA against the same run without them.
      section fidelity
      for v in clean inject; do
        extra=(); [[ $v == inject ]] && extra=(--inject-oom 3,5,6)
        timeout 120 "$BIN" train --config configs/gpu.toml --headless --steps 8 \
          --batch-size 16 --effective-batch 32 "${extra[@]}" \
          --checkpoint-dir "$OUT/ck-$v" --log "$OUT/fid-$v.jsonl" > "$OUT/fid-$v.out" 2>&1
        echo "$v rc=$?"
      done
      ;;
    overhead)
      section overhead
      HEADROOM_BIN=$BIN timeout 500 "$ROOT/target/gpu/overhead" ${OVERHEAD_ARGS:-3 60 configs/gpu.toml} 2>&1 |
        tee "$OUT/overhead.txt"
      ;;
    nvml)
      # NVML "loses the GPU" after 20 reads (5 s at the default rate): one notice, GPU
      # figures hidden, the run goes on to the end with exit 0.
      section nvml
      HEADROOM_INJECT_NVML_FAILURE=20 timeout 200 "$BIN" train --config configs/gpu.toml \
        --headless --steps 20 --checkpoint-dir "$OUT/ck-nvml" --log "$OUT/nvml.jsonl" \
        > "$OUT/nvml.out" 2>&1
      echo "rc=$?"; grep -iE 'nvml|completed' "$OUT/nvml.out"
      ;;
    telemetry)
      section telemetry
      HEADROOM_BIN=$BIN timeout 400 "$ROOT/target/gpu/telemetry" ${TELEMETRY_ARGS:-configs/gpu.toml} 2>&1 |
        tee "$OUT/telemetry.txt"
      ;;
    py-oom)
      # The Python package (issue 13): the nanoGPT example on CUDA in adaptive mode from a
      # micro-batch that cannot fit under a budget (the caching allocator's per-process
      # fraction): a real torch.OutOfMemoryError, recovered mid-step.
      section py-oom
      PYTHONPATH=$ROOT/target/gpu/python timeout 400 "$PY" examples/python/nanogpt.py --device cuda \
        --n-layer ${PY_LAYERS:-12} --n-head 12 --n-embd 768 --seq-len 1024 \
        --effective-batch ${PY_BATCH:-256} --micro-batch ${PY_BATCH:-256} \
        --memory-budget ${PY_BUDGET:-24GiB} --steps ${PY_STEPS:-20} --log "$OUT/py-oom.jsonl" \
        > "$OUT/py-oom.out" 2>&1
      echo "rc=$?"; tail -15 "$OUT/py-oom.out"
      grep -c '"kind":"oom"' "$OUT/py-oom.jsonl"
      ;;
    py-dash)
      # The same run attached to from a dashboard on a pseudo-terminal: the allocator panel
      # and segment map come from torch.cuda through the Python package.
      section py-dash
      PYTHONPATH=$ROOT/target/gpu/python "$PY" examples/python/nanogpt.py --device cuda \
        --n-layer ${PY_LAYERS:-12} --n-head 12 --n-embd 768 --seq-len 1024 \
        --effective-batch ${PY_BATCH:-256} --micro-batch ${PY_BATCH:-256} \
        --memory-budget ${PY_BUDGET:-24GiB} --steps 400 --log "$OUT/py-dash.jsonl" \
        > "$OUT/py-dash.out" 2>&1 &
      train=$!
      sleep ${PY_DASH_WAIT:-20}
      "$PY" scripts/pty_capture.py 160 50 ${DASH_SECONDS:-30} "$OUT/py-dash.raw" -- "$BIN" attach
      echo "rc=$?"
      kill -TERM $train; wait $train; echo "train rc=$?"; tail -5 "$OUT/py-dash.out"
      ;;
    *) echo "unknown section $what (info run oom ramp dash fidelity overhead telemetry nvml py-oom py-dash)"; exit 2 ;;
  esac
done
