#!/bin/bash
# `make demo`: the main job on the embedded default — GRPO of a tiny Qwen3-Omni audio agent on
# synthetic audio data, rolled out by a real vLLM CPU server, trained by 2 Megatron ranks (TP2).
# Inputs are built into $MGRPO_CACHE on first use; outputs go to $RUN_DIR (default runs/demo).
set -euo pipefail
cd "$(dirname "$0")/.."
export MGRPO_CACHE=${MGRPO_CACHE:-$HOME/.cache/megatron-grpo}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
RUN_DIR=${RUN_DIR:-runs/demo}
if [ -e "$RUN_DIR" ]; then  # a fresh demo each time, but only ever over an earlier run's directory
    if [ ! -f "$RUN_DIR/config.json" ]; then
        echo "make demo: RUN_DIR=$RUN_DIR exists and is not a run directory (no config.json); choose another RUN_DIR" >&2
        exit 2
    fi
    rm -rf "$RUN_DIR"
fi
t0=$(date +%s)
.venv/bin/mgrpo train trainer.run_dir="$RUN_DIR" "$@"
echo
echo "== demo finished in $(( $(date +%s) - t0 )) s =="
.venv/bin/python - "$RUN_DIR" <<'PY'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
m = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
print(f"reward: step 1 {m[0]['reward/mean']:.3f} -> step {m[-1]['step']} {m[-1]['reward/mean']:.3f}")
avg = lambda k: sum(x[k] for x in m) / len(m)
print(f"mean step {avg('time/step'):.1f} s = rollout {avg('time/rollout'):.1f} + train {avg('time/train'):.1f}"
      f" + push {avg('time/push'):.2f}")
print(f"run dir:     {run}/  (metrics.jsonl, curves.png, tensorboard/, checkpoints/, vllm-server.log)")
print(f"curves:      {run}/curves.png")
PY
