#!/bin/bash
# `make demo`: until `mgrpo train` lands, build what exists — the tiny Qwen3-Omni checkpoint and
# the synthetic audio-agent data — into the cache dir and print what was made.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${MGRPO_CACHE:-$HOME/.cache/megatron-grpo}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
MGRPO=.venv/bin/mgrpo
t0=$(date +%s)
$MGRPO make-tiny --out "$CACHE/tiny-omni"
$MGRPO make-data --out "$CACHE/audio-agent-data"
echo
echo "== demo output (in $(( $(date +%s) - t0 )) s) =="
echo "checkpoint: $CACHE/tiny-omni"
ls -l "$CACHE/tiny-omni" | sed 's/^/  /'
echo "data:       $CACHE/audio-agent-data"
ls -l "$CACHE/audio-agent-data" | sed 's/^/  /'
echo "first train row:"
head -n 1 "$CACHE/audio-agent-data/train.jsonl" | cut -c1-400 | sed 's/^/  /'
