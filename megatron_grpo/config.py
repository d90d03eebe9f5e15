"""The one typed config tree of `mgrpo train`: sections for model, parallel layout, data, rollout,
the local vLLM server, loss, rollout correction, optimizer, packing, checkpoints, logging, guards.

Load order: defaults (the embedded tiny CPU job) <- YAML file <- dotted CLI overrides
(`mgrpo train --config run.yaml optimizer.lr=1e-6 parallel.tp=2`). Every section checks itself in
`__post_init__`; `TrainConfig.__post_init__` checks what spans sections. docs/configuration.md is
generated from the field docstrings: `python -m megatron_grpo.config --docs`.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import torch

from megatron_grpo.algo.importance import ISConfig
from megatron_grpo.algo.losses import LossConfig
from megatron_grpo.configtree import load_config, render_markdown
from megatron_grpo.data.config import DataConfig
from megatron_grpo.engine.setup import OptimConfig, default_dtype
from megatron_grpo.rollout.config import RolloutConfig


def default_cache_dir() -> Path:
    """Where the embedded default's checkpoint and data are built ($MGRPO_CACHE)."""
    return Path(os.environ.get("MGRPO_CACHE", Path.home() / ".cache" / "megatron-grpo"))


@dataclass
class ModelConfig:
    """The policy checkpoint."""

    hf_dir: Optional[str] = None
    """HF Qwen3-Omni checkpoint directory. None: the embedded tiny checkpoint (built into the
    cache dir on first use with `mgrpo make-tiny`)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Training dtype: auto = float32 on CPU, bfloat16 (fp32 master weights) on GPU."""
    backend: str = "auto"
    """Layer-spec backend (model_bridge/modeling/specs.py): auto, te, torch, local."""


@dataclass
class ParallelConfig:
    """Trainer ranks and their layout; data parallelism is what remains."""

    nproc: int = 2
    """Trainer ranks `mgrpo train` spawns itself (gloo on CPU, nccl on GPU); ignored under
    torchrun/srun, which provide the ranks."""
    tp: int = 2
    """Tensor parallel size."""
    ep: int = 1
    """Expert parallel size."""
    etp: Optional[int] = None
    """Expert tensor parallel size (None = tp)."""
    pp: int = 1
    """Pipeline parallel size."""

    def __post_init__(self):
        for k in ("nproc", "tp", "ep", "pp"):
            if getattr(self, k) < 1:
                raise ValueError(f"parallel.{k} must be >= 1, got {getattr(self, k)}")


@dataclass
class ServeConfig:
    """The vLLM server `mgrpo train` starts itself when rollout.server is "local"."""

    max_model_len: int = 4096
    """Longest conversation the server accepts, in tokens."""
    max_num_seqs: int = 32
    """Sequences the server decodes at once."""
    dtype: str = "auto"
    """Server dtype (vLLM's --dtype). auto = the trainer's dtype (``model.dtype``: float32 on CPU,
    bfloat16 on GPU), so rollout and training logprobs come from the same numerics; vLLM's own
    "auto" would serve a float32 checkpoint in bfloat16, even on CPU."""
    cpu_kvcache_gib: int = 1
    """KV-cache size on CPU servers, GiB."""
    max_audio_per_prompt: int = 4
    """Audio clips one conversation may hold (1 + tool clips)."""
    startup_timeout_s: float = 900.0
    """Seconds to wait for the server's /health."""
    extra_args: list[str] = field(default_factory=list)
    """Further vLLM arguments, verbatim."""


@dataclass
class PackingSection:
    """How a step's samples become THD micro-batches (megatron_grpo/packing.py)."""

    max_tokens_per_microbatch: int = 4096
    """Token budget of one micro-batch, padding included (rounded to the TP size)."""
    allow_oversized: bool = True
    """A sample longer than the budget gets a micro-batch of its own (False: error)."""


@dataclass
class TrainerSection:
    """The loop itself."""

    steps: int = 20
    """Optimizer steps to run (the run ends after this step)."""
    prompts_per_step: int = 4
    """Prompts per step; each gets rollout.num_generations samples."""
    seed: int = 1234
    """Seed of model init RNGs, data order and sampling."""
    run_dir: str = "runs/latest"
    """Where metrics, plots, checkpoints and logs go."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk of the vocab-parallel log-softmax (bounds its memory)."""
    max_consecutive_skips: int = 3
    """Stop after this many updates in a row skipped for non-finite gradients."""

    def __post_init__(self):
        if self.steps < 1 or self.prompts_per_step < 1:
            raise ValueError(f"trainer.steps and trainer.prompts_per_step must be >= 1, got "
                             f"{self.steps}, {self.prompts_per_step}")


@dataclass
class CheckpointSection:
    """Distributed checkpoints (megatron_grpo/engine/checkpoint.py)."""

    every: int = 10
    """Save every N steps (0: only at the end and on SIGTERM/SIGUSR1)."""
    keep_last: int = 2
    """Checkpoints kept; older ones are deleted only after a newer one is complete."""
    at_end: bool = True
    """Save after the last step."""


@dataclass
class LoggingSection:
    """What the run shows and writes."""

    progress: bool = True
    """A progress bar per step (reward, mismatch KL, tokens/s, step time)."""
    tensorboard: bool = True
    """TensorBoard event files in run_dir/tensorboard."""
    plot: bool = True
    """run_dir/curves.png with reward and loss, refreshed every step."""


@dataclass
class GuardSection:
    """Anti-hang watchdog (megatron_grpo/guard.py)."""

    step_timeout_s: float = 1800.0
    """A step (rollout, train, push) running longer dumps every rank's stacks and exits."""
    first_step_timeout_s: float = 3600.0
    """The first step's limit (server warm-up, allocator growth)."""


@dataclass
class TrainConfig:
    """Everything `mgrpo train` needs; the defaults are the embedded tiny CPU job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(
        num_generations=8, max_turns=2, max_new_tokens=24, temperature=1.0,
        reward_funcs=["answer_chars", "format"], reward_weights=[1.0, 1.0]))
    serve: ServeConfig = field(default_factory=ServeConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    importance: ISConfig = field(default_factory=ISConfig)
    optimizer: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-4, clip_grad=1.0))
    packing: PackingSection = field(default_factory=PackingSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    guard: GuardSection = field(default_factory=GuardSection)

    def __post_init__(self):
        p = self.parallel
        mp = p.tp * p.pp
        if p.nproc % mp:
            raise ValueError(f"parallel.nproc={p.nproc} is not a multiple of tp*pp={mp}")
        etp = p.tp if p.etp is None else p.etp
        if p.ep == 1 and etp != p.tp:
            raise ValueError(f"parallel.etp={etp} with parallel.ep=1 and parallel.tp={p.tp}: megatron-core "
                             "never syncs expert gradients then; use etp=tp or ep>1")
        if (p.nproc // p.pp) % (p.ep * etp):
            raise ValueError(f"parallel.ep*etp={p.ep * etp} must divide nproc/pp={p.nproc // p.pp}")


def train_dtype(cfg: TrainConfig) -> torch.dtype:
    """The trainer's compute dtype: ``model.dtype``, or for "auto" bf16 on a CUDA machine, fp32 on CPU."""
    if cfg.model.dtype == "auto":
        return default_dtype()
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]


def serve_dtype(cfg: TrainConfig) -> str:
    """vLLM's ``--dtype`` for the server `mgrpo train` starts: ``serve.dtype``, or for "auto" the
    trainer's dtype (`train_dtype`). Never vLLM's own "auto": it downcasts a float32 checkpoint (the
    embedded tiny one) to bfloat16 on CPU too, and the rollout logprobs then come from other numerics
    than the trainer's (tiny job, step 1: mismatch_kl_k3 ~4e-4 instead of ~1e-12)."""
    if cfg.serve.dtype != "auto":
        return cfg.serve.dtype
    return str(train_dtype(cfg)).removeprefix("torch.")


def load_train_config(path: Optional[str] = None, overrides: Optional[list[str]] = None) -> TrainConfig:
    """Defaults <- YAML <- dotted overrides; errors name the key (ConfigKeyError)."""
    return load_config(TrainConfig, path, overrides)


if __name__ == "__main__":
    if "--docs" in sys.argv:
        print(render_markdown(TrainConfig, "Configuration reference (`mgrpo train`)"))
