#!/bin/bash
# `make demo`: the main job on the embedded default — GRPO of a tiny Qwen3-Omni audio agent on
# synthetic audio data, rolled out by a real vLLM CPU server, trained by 2 Megatron ranks (TP2).
# Inputs are built into $MGRPO_CACHE on first use; outputs go to $RUN_DIR (default runs/demo).
set -euo pipefail
cd "$(dirname "$0")/.."
export MGRPO_CACHE=${MGRPO_CACHE:-$HOME/.cache/megatron-grpo}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
RUN_DIR=${RUN_DIR:-runs/demo}
resume=()
if [ -e "$RUN_DIR" ]; then  # a fresh demo each time, but only ever over an earlier run's directory
    if [ ! -f "$RUN_DIR/config.json" ]; then
        echo "make demo: RUN_DIR=$RUN_DIR exists and is not a run directory (no config.json); choose another RUN_DIR" >&2
        exit 2
    fi
    if [ -f "$RUN_DIR/PREEMPTED" ] && [ $# -eq 0 ]; then  # stopped by Ctrl-C / SIGTERM after a checkpoint
        step=$(sed -n 's/.*"step": *\([0-9]*\).*/\1/p' "$RUN_DIR/PREEMPTED")
        echo "make demo: resuming the interrupted demo in $RUN_DIR from its checkpoint of step $step" \
             "(remove $RUN_DIR for a fresh one)"
        resume=(--resume "$RUN_DIR")
    else
        rm -rf "$RUN_DIR"
    fi
fi
t0=$(date +%s)
if [ ${#resume[@]} -gt 0 ]; then
    .venv/bin/mgrpo train "${resume[@]}"
else
    .venv/bin/mgrpo train trainer.run_dir="$RUN_DIR" logging.trajectories.every=5 "$@"
fi
echo
echo "== demo finished in $(( $(date +%s) - t0 )) s (the reward curve: $RUN_DIR/curves.png) =="
