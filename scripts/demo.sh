#!/bin/bash
# `make demo`: the main job at tiny scale. An agentic cold start (`mgrpo sft` of a tiny Qwen3-Omni on
# synthetic expert crop_audio trajectories, cached in $MGRPO_CACHE after the first run), then GRPO of
# that model as an audio agent: multi-turn rollouts by a real vLLM CPU server with the crop_audio
# tool (max_turns 3), rewards format + iou + think_length, trained by 2 Megatron ranks (TP2).
# Inputs are built into $MGRPO_CACHE on first use; outputs go to $RUN_DIR (default runs/demo).
set -euo pipefail
cd "$(dirname "$0")/.."
export MGRPO_CACHE=${MGRPO_CACHE:-$HOME/.cache/megatron-grpo}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
RUN_DIR=${RUN_DIR:-runs/demo}
SFT_DIR=$MGRPO_CACHE/tiny-omni-sft
if [ -e "$RUN_DIR" ]; then  # a fresh demo each time, but only ever over an earlier run's directory
    if [ ! -f "$RUN_DIR/config.json" ]; then
        echo "make demo: RUN_DIR=$RUN_DIR exists and is not a run directory (no config.json); choose another RUN_DIR" >&2
        exit 2
    fi
    rm -rf "$RUN_DIR"
fi
t0=$(date +%s)
if [ ! -f "$SFT_DIR/hf/model.safetensors.index.json" ]; then  # the cold start, once
    rm -rf "$SFT_DIR"
    echo "== SFT cold start: tiny Qwen3-Omni on synthetic expert trajectories -> $SFT_DIR/hf =="
    .venv/bin/mgrpo sft --nproc 1 parallel.tp=1 sft.run_dir="$SFT_DIR" checkpoint.every=0 logging.tensorboard=false
else
    echo "== SFT cold start: cached in $SFT_DIR/hf (remove it to run the SFT again) =="
fi
t1=$(date +%s)
.venv/bin/mgrpo train model.hf_dir="$SFT_DIR/hf" data.train_jsonl="$MGRPO_CACHE/audio-agent-sft/train.jsonl" \
    trainer.run_dir="$RUN_DIR" trainer.steps=10 logging.trajectories.every=3 \
    'rollout.reward_funcs=[format,iou,think_length]' 'rollout.reward_weights=[1.0,1.0,1.0]' \
    rollout.max_turns=3 rollout.max_new_tokens=160 rollout.num_generations=8 rollout.temperature=1.0 "$@"
echo
echo "== demo finished in $(( $(date +%s) - t0 )) s (SFT $(( t1 - t0 )) s; reward curve and turns/mean: $RUN_DIR/curves.png, $RUN_DIR/metrics.jsonl) =="
