"""Recipes: Python functions returning a complete `TrainConfig`, named for model and hardware.

``mgrpo launch slurm --recipe NAME`` uses one instead of ``--config FILE`` (dotted overrides still
apply after it); a recipe also fills ``launch.*`` (node counts, GPUs, vLLM layout), so
``--trainer-nodes`` and friends become optional. In Python::

    from launch.recipes import get_recipe
    cfg = get_recipe("qwen3_omni_30b_a3b_audio_agent_4x8_h200")

Add one with the ``@recipe`` decorator; `RECIPES` maps names to functions.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Callable

__all__ = ["RECIPES", "recipe", "get_recipe", "tiny_cpu", "qwen3_omni_30b_a3b_audio_agent_4x8_h200"]

_REPO = Path(__file__).resolve().parents[2]
"""The source tree (for the example plugin; a run reads it from there)."""

RECIPES: dict[str, Callable] = {}
"""recipe name -> function returning a TrainConfig."""


def recipe(fn: Callable) -> Callable:
    """Register `fn` under its own name."""
    RECIPES[fn.__name__] = fn
    return fn


def get_recipe(name: str):
    """The config of recipe `name`; KeyError listing the recipes (closest first) otherwise."""
    if name not in RECIPES:
        close = difflib.get_close_matches(name, list(RECIPES), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise KeyError(f"unknown recipe {name!r}; {hint}recipes: {', '.join(sorted(RECIPES))}")
    return RECIPES[name]()


def _config(tree: dict):
    """A checked TrainConfig: the defaults (the embedded tiny job) updated with `tree`."""
    from megatron_grpo.config import TrainConfig
    from megatron_grpo.configtree import load_config

    return load_config(TrainConfig, None, None, base=tree)


@recipe
def tiny_cpu():
    """The embedded tiny CPU job (tiny Qwen3-Omni, synthetic data, TP2) as a slurm run: 1 CPU trainer
    node with 2 ranks, 1 CPU rollout node with a vLLM CPU server; 4 steps, a checkpoint every 2."""
    return _config({
        "rollout": {"server": "remote"},
        "trainer": {"steps": 4, "run_dir": "runs/slurm-tiny"},
        "checkpoint": {"every": 2},
        "logging": {"progress": False},  # a progress bar in a log file is noise
        "launch": {"trainer_nodes": 1, "rollout_nodes": 1, "gpus_per_node": 0,
                   "exclusive": False,  # both jobs fit on one small node
                   "health_timeout_s": 900.0, "time": "01:00:00"},
    })


@recipe
def qwen3_omni_30b_a3b_audio_agent_4x8_h200():
    """examples/qwen3_omni_30b_a3b_audio_agent.yaml on H200 nodes: 4 trainer nodes x 8 GPUs
    (32 ranks, TP2 x EP8 x PP2; the memory estimate is in that file) and 2 rollout nodes x 8 GPUs,
    each serving vLLM TP4 x DP2 (the audio tower's 20 heads rule out TP8)."""
    return _config({
        "model": {"hf_dir": "/data/models/Qwen3-Omni-30B-A3B-Instruct", "dtype": "bfloat16"},
        "parallel": {"nproc": 32, "tp": 2, "ep": 8, "pp": 2},
        "data": {"train_jsonl": "/data/audio_agent/train.jsonl", "dev_jsonl": "/data/audio_agent/dev.jsonl",
                 "max_audio_seconds": 600, "skip_bad_rows": True, "audio_roots": ["/data/audio_agent"]},
        "rollout": {"server": "remote", "num_generations": 8, "max_turns": 5, "max_new_tokens": 2048,
                    "max_total_tokens": 32768, "temperature": 1.0,
                    "plugin": str(_REPO / "examples" / "plugins" / "audio_agent.py"),
                    "reward_funcs": ["format", "iou", "think_length"], "reward_weights": [1.0, 1.0, 0.2]},
        "loss": {"variant": "grpo", "eps_low": 0.2, "eps_high": 0.28},
        "importance": {"mode": "tis", "tis_cap": 2.0},
        "optimizer": {"lr": 1.0e-6, "warmup_steps": 10, "clip_grad": 1.0, "use_distributed_optimizer": True},
        "packing": {"max_tokens_per_microbatch": "auto"},
        "trainer": {"steps": 500, "prompts_per_step": 32, "run_dir": "/checkpoints/qwen3_omni_audio_agent"},
        "checkpoint": {"every": 20, "keep_last": 3},
        "guard": {"step_timeout_s": 3600},
        # the rollout nodes' vLLM (`mgrpo serve`): a whole conversation fits
        "serve": {"max_model_len": 32768, "max_num_seqs": 64, "startup_timeout_s": 1800.0},
        "launch": {"trainer_nodes": 4, "rollout_nodes": 2, "gpus_per_node": 8, "serve_tp": 4,
                   "health_timeout_s": 1800.0},
    })
