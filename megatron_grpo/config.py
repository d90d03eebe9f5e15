"""The one typed config tree of `mgrpo train`: sections for model, parallel layout, data, rollout,
the local vLLM server, loss, rollout correction, optimizer, packing, checkpoints, logging, guards.

Load order: defaults (the embedded tiny CPU job) <- YAML file <- dotted CLI overrides
(`mgrpo train --config run.yaml optimizer.lr=1e-6 parallel.tp=2`). Every section checks itself in
`__post_init__`; `TrainConfig.__post_init__` checks what spans sections. docs/configuration.md is
generated from the field docstrings: `python -m megatron_grpo.config --docs`.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

import torch

from megatron_grpo.algo.importance import ISConfig
from megatron_grpo.algo.losses import LossConfig
from megatron_grpo.configtree import ConfigKeyError, load_config, render_markdown
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
    """HF Qwen3-Omni checkpoint directory. None: the embedded tiny checkpoint after its agentic cold
    start (`mgrpo make-tiny`, then ``sft.steps`` of `mgrpo sft` on the synthetic expert trajectories),
    built into the cache dir on first use and rebuilt when the sft section, the trajectories or
    their source change (megatron_grpo/run/embedded.py)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Training dtype: auto = float32 on CPU, bfloat16 (fp32 master weights) on GPU."""
    backend: str = "auto"
    """Layer-spec backend (model_bridge/modeling/specs.py): auto, te, torch, local."""
    recompute: Literal["none", "experts", "full"] = "none"
    """Activation recomputation in the backward: none; experts = the MoE experts' sorted input rows
    and SwiGLU output (torch backend; ~44 KB less per token and layer for ~2% more time); full =
    megatron's full recomputation of every decoder layer (least memory, ~1/3 more compute)."""


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

    max_model_len: Union[int, Literal["auto"]] = "auto"
    """Longest conversation the server accepts, in tokens. auto: sized by `mgrpo train` from the
    data before start-up: the longest prompt (its audio counted by the processor's rule) plus
    rollout.max_turns turns of rollout.max_new_tokens, at least 4096, capped by the model's positions; rows
    that cannot fit are refused then, one line each (megatron_grpo/run/sizing.py)."""
    max_audio_seconds: Optional[float] = None
    """Longest clip the server decodes (vLLM's VLLM_MAX_AUDIO_DECODE_DURATION_S and its clip-size
    limits follow it). None: the data's longest recording, at least vLLM's 600 s."""
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

    def __post_init__(self):
        m = self.max_model_len
        if m != "auto" and (isinstance(m, bool) or not isinstance(m, int) or m < 16):
            raise ValueError(f"serve.max_model_len must be auto or a number of tokens >= 16, got {m!r}")
        a = self.max_audio_seconds
        if a is not None and (isinstance(a, bool) or not isinstance(a, (int, float)) or not a > 0):
            raise ValueError(f"serve.max_audio_seconds must be unset or a number of seconds > 0, got {a!r}")


@dataclass
class WeightSyncSection:
    """How the new weights reach the vLLM servers after every step (megatron_grpo/weight_sync/)."""

    mode: Literal["auto", "gather", "multisource"] = "auto"
    """gather: the shards are streamed to trainer rank 0, which sends every byte
    (weight_sync/gather.py, push.py). multisource: every trainer rank that owns a unique shard (a
    TP/ETP slice, an EP rank's experts, a pipeline stage's layers) sends it itself, so the push is
    not bound by rank 0's one link: on CPU (gloo) servers through our engine, which merges the
    shards (weight_sync/multisource.py); on GPU servers started with vLLM's nccl_m2n engine
    (rollout.weight_transfer: nccl_m2n, needs nccl-extensions) through vLLM's many-to-many
    reshard (weight_sync/m2n.py; not run yet: needs two GPUs with vLLM), when the job fits its
    contract: no pipeline parallelism, one split size (TP, EP or ETP, at most 16); nccl_m2n servers
    take nothing else, so a job that does not fit is refused before step 1, naming the fix. On
    dense nccl servers it falls back to gather, saying why once. auto: multisource for a
    multi-rank job on gloo servers and for any job on nccl_m2n servers, else gather. All or nothing
    on gloo; a failed nccl_m2n push leaves a partly updated server paused (docs/rollout.md)."""


@dataclass
class PackingSection:
    """How a step's samples become THD micro-batches (megatron_grpo/packing.py)."""

    max_tokens_per_microbatch: Union[int, Literal["auto"]] = "auto"
    """Token budget of one micro-batch, padding included (rounded to the TP size). ``auto``: from
    the free GPU memory after the model and optimizer are built and the model's geometry
    (``engine/budget.py``; the smallest over the ranks; logged; at most 65,536); 4096 on CPU. Fewer,
    larger micro-batches are faster on GPU (fewer launches and fewer fp32 gradient-buffer adds:
    docs/performance.md, "Training phase"); set a number to bound activation memory by hand."""
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
    fused_lm_head: bool = True
    """Fuse the output layer into the chunked log-softmax (training step and logprob passes): the
    logits [T, vocab/tp] and their gradient are never materialised, only [chunk, vocab/tp]
    temporaries (docs/training.md, "Memory of the logprobs"). false: the output layer's logits,
    then the chunked log-softmax (same values)."""
    max_consecutive_skips: int = 3
    """Stop after this many updates in a row skipped for non-finite gradients."""
    cuda_graphs: Union[bool, Literal["auto"]] = "auto"
    """On GPU, replay each training micro-batch's decoder stack from a CUDA graph captured once per
    bucket shape (``engine/graphs.py``: micro-batches padded to a quarter, half, three quarters or
    all of the token budget); falls back to eager with one logged reason where it does not apply
    (CPU, PP > 1, EP > 1, TP > 1, recomputation, a non-torch layer spec). ``auto``: on where they
    pay, a ``packing.max_tokens_per_microbatch`` of at most 4,096 tokens where graphs apply
    (host-bound eager micro-batches: 1.13x faster at 4 layers on 2026-12-04, before the graphs' own
    shapes and padding mask, not re-measured since); off at larger budgets and at the ``auto`` budget,
    where the eager phase is GPU-bound (0.966x at 16,384 tokens, 0.958x at 65,536; one H200,
    2026-12-04/05, docs/performance.md, "Training phase")."""
    shared_clips: bool = True
    """A clip several samples of a rank's step use (a GRPO group's recording) goes through the audio
    tower once per step: a first pass, then one backward of all its uses, through the first pass's
    kept graph or a recomputation (``shared_clips_keep``; ``model_bridge/modeling/shared_audio.py``;
    the same gradients up to summation order), and the packer (``megatron_grpo/packing.py``,
    ``balance_samples``) keeps a group's samples on few data-parallel ranks while each rank stays
    within the mean token count. false: once per sample, forward and backward, and
    plain longest-first balancing."""
    shared_clips_keep: float = 0.5
    """With ``shared_clips``, > 0: every clip of a rank's step (the crops too) goes through the audio
    tower in batches of several micro-batches' clips, one call each, and the first pass keeps its
    activations for the backward: the crops' batches (at most this many micro-batch token budgets
    of audio each, a budget's tokens all audio) always, the shared recordings' while the kept ones
    hold at most this many budgets; the rest is recomputed in the backward (docs/training.md). The
    kept activations are memory the ``auto`` budget does not count (at 8 full-width layers on one
    H200, 1 ran out of memory, 0.5 peaked 4.7 GiB over 0). 0: only the shared recordings go
    through the tower once, each recomputed (the least memory)."""
    device_features: bool = True
    """On GPU, compute the audio clips' log-mel features on the device
    (``data/device_features.py``, the Whisper extractor's math in torch, within 2e-3 of it) instead
    of on the host; ignored on CPU."""

    def __post_init__(self):
        if self.steps < 1 or self.prompts_per_step < 1:
            raise ValueError(f"trainer.steps and trainer.prompts_per_step must be >= 1, got "
                             f"{self.steps}, {self.prompts_per_step}")
        if self.shared_clips_keep < 0:
            raise ValueError(f"trainer.shared_clips_keep must be >= 0 (0: recompute the shared clips), got "
                             f"{self.shared_clips_keep}")


@dataclass
class SftSection:
    """`mgrpo sft`: supervised fine-tuning on conversations with assistant and tool turns (docs/sft.md).
    It uses this tree's model, parallel, data (audio limits and roots, shuffle, seed), optimizer,
    packing, checkpoint and logging sections too; ``trainer.*`` belongs to `mgrpo train`."""

    data: Optional[str] = None
    """The SFT JSONL (docs/sft.md). Unset: the embedded synthetic expert trajectories
    (`mgrpo make-data --sft` into $MGRPO_CACHE)."""
    steps: int = 100
    """Optimizer steps (the embedded tiny model calls the tool well-formed after ~100 at lr 3e-3)."""
    samples_per_step: int = 8
    """Conversations per step (the global batch), packed over the data-parallel ranks."""
    lr: Optional[float] = 3e-3
    """Peak learning rate of the SFT run (replaces ``optimizer.lr``; None keeps it). The default
    suits the embedded tiny model (loss 12.5 -> 0.29 in 100 steps); a released model wants ~1e-5."""
    run_dir: str = "runs/sft"
    """Where metrics, checkpoints and the exported model go; the HF checkpoint (a valid
    ``model.hf_dir`` for `mgrpo train`) is written to ``RUN_DIR/hf`` at the end."""
    export: bool = True
    """Export ``RUN_DIR/hf`` after the last step (through the bridge, as `mgrpo convert mcore-to-hf`)."""

    def __post_init__(self):
        if self.steps < 1 or self.samples_per_step < 1:
            raise ValueError(f"sft.steps and sft.samples_per_step must be >= 1, got {self.steps}, "
                             f"{self.samples_per_step}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"sft.lr must be > 0 (or null to keep optimizer.lr), got {self.lr}")


@dataclass
class CheckpointSection:
    """Distributed checkpoints (megatron_grpo/engine/checkpoint.py)."""

    every: int = 10
    """Save every N steps (0: only at the end and on SIGTERM/SIGUSR1)."""
    keep_last: int = 2
    """Checkpoints kept; older ones are deleted only after a newer one is complete."""
    at_end: bool = True
    """Save after the last step."""
    async_save: Union[bool, Literal["auto"]] = "auto"
    """Write the shards in the background while training goes on (engine/checkpoint_async.py); the
    checkpoint becomes visible to ``--resume`` only once every rank's write is done. "auto": on when
    training on CUDA (the host copy is cheap there and the write is the slow part), off on CPU."""

    def __post_init__(self):
        if self.async_save not in (True, False, "auto"):
            raise ValueError(f"checkpoint.async_save must be true, false or auto, got {self.async_save!r}")


@dataclass
class TrajectoryLogSection:
    """A step's trajectories kept for `mgrpo report` (megatron_grpo/run/trajlog.py): text, token ids,
    rollout and trainer logprobs, rewards, advantages and clips, in run_dir/trajectories/."""

    every: int = 0
    """Keep steps 1, 1+every, 1+2*every, ...; 0 keeps none (rollout.record_dir keeps every step)."""
    max_samples: int = 64
    """At most this many samples of a kept step, whole groups first."""

    def __post_init__(self):
        for name in ("every", "max_samples"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "every" else 1):
                raise ValueError(f"logging.trajectories.{name} must be an int >= {0 if name == 'every' else 1}, "
                                 f"got {v!r}")

    def keeps(self, step: int) -> bool:
        return self.every > 0 and (step - 1) % self.every == 0


@dataclass
class LoggingSection:
    """What the run shows and writes."""

    progress: bool = True
    """A progress bar per step (reward, mismatch KL, tokens/s, step time)."""
    tensorboard: bool = True
    """TensorBoard event files in run_dir/tensorboard."""
    plot: bool = True
    """run_dir/curves.png with reward and loss, refreshed every step."""
    trajectories: TrajectoryLogSection = field(default_factory=TrajectoryLogSection)
    """Trajectories kept for `mgrpo report` (docs/training.md, 'Read a run: mgrpo report')."""


@dataclass
class HangGuardSection:
    """Anti-hang watchdog (megatron_grpo/hang/)."""

    step_timeout_s: float = 1800.0
    """A step (rollout, train, push) running longer dumps every rank's stacks and exits."""
    first_step_timeout_s: float = 3600.0
    """The first step's limit (server warm-up, allocator growth)."""


_SLURM_TIME = re.compile(r"^(?:(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?|(\d+)(?::(\d+)(?::(\d+))?)?)$")
_LAUNCH_SIGNAL = re.compile(r"^(R:)?(?:SIG)?(USR1|10)@(\d+)$")


def slurm_time_seconds(text: str) -> int:
    """Seconds of a slurm time limit ("MM", "MM:SS", "HH:MM:SS", "D-HH", "D-HH:MM", "D-HH:MM:SS");
    ValueError naming the accepted formats otherwise."""
    m = _SLURM_TIME.match(str(text).strip())
    if not m:
        raise ValueError(f"time limit {text!r} is not a slurm time: use MM, MM:SS, HH:MM:SS, D-HH, "
                         "D-HH:MM or D-HH:MM:SS (e.g. 24:00:00 or 2-00:00:00)")
    d, dh, dm, ds, a, b, c = m.groups()
    if d is not None:
        return ((int(d) * 24 + int(dh)) * 60 + int(dm or 0)) * 60 + int(ds or 0)
    if c is not None:
        return (int(a) * 60 + int(b)) * 60 + int(c)  # HH:MM:SS
    return int(a) * 60 + int(b or 0)                 # MM or MM:SS


@dataclass
class LaunchConfig:
    """`mgrpo launch slurm`: the generated sbatch scripts' nodes, environment, network and preemption
    (docs/slurm.md). Ignored by `mgrpo train` itself."""

    trainer_nodes: Optional[int] = None
    """Trainer nodes (`--trainer-nodes` wins); recipes set it."""
    rollout_nodes: Optional[int] = None
    """Rollout (vLLM) nodes, one `mgrpo serve` each (`--rollout-nodes` wins); recipes set it."""
    gpus_per_node: Optional[int] = None
    """GPUs per node of both jobs (`--gpus-per-node` wins); 0: CPU nodes (no --gpus-per-node line;
    torchrun starts parallel.nproc / trainer_nodes ranks per node)."""
    partition: Optional[str] = None
    """`#SBATCH --partition` (`--partition` wins); None: the cluster's default."""
    account: Optional[str] = None
    """`#SBATCH --account` (`--account` wins); None: none."""
    time: Optional[str] = None
    """`#SBATCH --time` of both jobs, e.g. "24:00:00" (`--time` wins); None: the partition's limit."""
    job_name: str = "mgrpo"
    """Job names are "<job_name>-rollout" and "<job_name>-train"."""
    exclusive: bool = True
    """`#SBATCH --exclusive`: whole nodes for both jobs (usual for GPU training). false lets the jobs
    share nodes (a one-node test cluster)."""
    cpus_per_task: Optional[int] = None
    """`--cpus-per-task` of the one task per node (sbatch and srun). None: srun gives the task every
    CPU the job holds on the node (``$SLURM_CPUS_ON_NODE``)."""
    sbatch_args: list[str] = field(default_factory=list)
    """Extra `#SBATCH` options for both jobs, verbatim, e.g. ["--qos=high", "--exclusive"]."""
    setup: Optional[list[str]] = None
    """Shell lines run first on every node (module load, conda/venv activation, cd). None: activate
    the Python environment that runs `mgrpo launch` (`source <sys.prefix>/bin/activate`), which must
    then be on a file system the nodes share; []: nothing."""
    env: dict = field(default_factory=dict)
    """Extra environment variables exported on every node, e.g. {NCCL_DEBUG: INFO}."""
    socket_ifname: Optional[str] = None
    """Network interface of the cluster network (e.g. "ib0", "eth0", "bond0"): exported as
    NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME, and the rollout servers bind to its IPv4 address.
    None: NCCL/gloo pick themselves and the servers bind to the node's first address
    (`hostname -I`)."""
    nccl_ib: bool = True
    """Use InfiniBand/RoCE for NCCL. false exports NCCL_IB_DISABLE=1 (TCP sockets only)."""
    serve_port: int = 8000
    """TCP port of each rollout node's vLLM server."""
    serve_tp: Optional[int] = None
    """vLLM tensor-parallel size on a rollout node; the node's GPUs / serve_tp become vLLM data
    parallel. None: all the node's GPUs (1 on CPU). Qwen3-Omni's audio tower has 20 heads, so vLLM
    needs a TP dividing 20 (e.g. 4 with 8 GPUs -> TP4 x DP2)."""
    serve_args: list[str] = field(default_factory=list)
    """Extra `mgrpo serve` / vLLM arguments for the rollout nodes (after the ``serve`` section's)."""
    master_port: int = 29500
    """torchrun's rendezvous port on the first trainer node (MASTER_PORT)."""
    health_timeout_s: float = 1800.0
    """Seconds the trainer job waits for every rollout server's URL file and /health before it
    fails with the missing servers and the rollout log."""
    signal: Optional[str] = "USR1@120"
    """`#SBATCH --signal` of the trainer job: SIGUSR1 this many seconds before the time limit makes
    the trainer checkpoint after the current step and exit; the job then requeues itself. Only USR1
    (optionally "R:"); never "B:" (that signals the batch shell, not the trainer). None: no signal."""
    requeue: bool = True
    """`#SBATCH --requeue` on both jobs; after a preemption checkpoint the trainer job requeues itself
    and resumes from trainer.run_dir."""

    def __post_init__(self):
        for k in ("trainer_nodes", "rollout_nodes"):
            v = getattr(self, k)
            if v is not None and v < 1:
                raise ValueError(f"launch.{k} must be >= 1, got {v}")
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise ValueError(f"launch.gpus_per_node must be >= 0, got {self.gpus_per_node}")
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise ValueError(f"launch.cpus_per_task must be >= 1, got {self.cpus_per_task}")
        if self.serve_tp is not None and self.serve_tp < 1:
            raise ValueError(f"launch.serve_tp must be >= 1, got {self.serve_tp}")
        for k in ("serve_port", "master_port"):
            if not 1 <= getattr(self, k) <= 65535:
                raise ValueError(f"launch.{k} must be a TCP port (1..65535), got {getattr(self, k)}")
        if self.health_timeout_s <= 0:
            raise ValueError(f"launch.health_timeout_s must be > 0, got {self.health_timeout_s}")
        if self.time is not None:
            slurm_time_seconds(self.time)
        if self.signal is not None:
            if str(self.signal).startswith("B:") or ":B:" in str(self.signal):
                raise ValueError(f"launch.signal={self.signal!r}: 'B:' would signal only the batch shell, "
                                 "which does not pass it on to the trainer; use e.g. 'USR1@120'")
            if not _LAUNCH_SIGNAL.match(str(self.signal)):
                raise ValueError(f"launch.signal={self.signal!r} is not of the form 'USR1@<seconds>' "
                                 "(optionally 'R:USR1@<seconds>'): the trainer checkpoints and exits on "
                                 "SIGUSR1 only")
        if not isinstance(self.env, dict) or not all(re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", str(k))
                                                      for k in self.env):
            raise ValueError(f"launch.env keys must be environment variable names, got {list(self.env)}")

    def signal_seconds(self) -> Optional[int]:
        """Seconds before the time limit that `signal` fires (None without a signal)."""
        return None if self.signal is None else int(_LAUNCH_SIGNAL.match(self.signal).group(3))


@dataclass
class TrainConfig:
    """Everything `mgrpo train` needs; the defaults are the embedded tiny CPU job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # The audio-agent task: crop_audio calls (max_turns 3: up to two crops and the answer) from the
    # cold-started tiny model. think_length at 0.2 and tool_call at 0.5: with [format, iou,
    # think_length] at equal weights the policy learns to skip the tool (think_length scores the last
    # turn either way; docs/sft.md).
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(
        num_generations=8, max_turns=3, max_new_tokens=128, temperature=0.7,
        reward_funcs=["format", "iou", "think_length", "tool_call"], reward_weights=[1.0, 1.0, 0.2, 0.5]))
    serve: ServeConfig = field(default_factory=ServeConfig)
    weight_sync: WeightSyncSection = field(default_factory=WeightSyncSection)
    loss: LossConfig = field(default_factory=LossConfig)
    importance: ISConfig = field(default_factory=ISConfig)
    # 2e-4, not more: at 5e-4 the tiny model's entropy collapses within 2-3 updates, before the reward
    # has steered it, and on some CPUs it collapsed onto zero-reward text (every group then scores the
    # same, the advantage is 0 and learning stops for good). At 2e-4 the climb from ~0.01 to 1.0 takes
    # 8-15 steps on every seed tried (docs/training.md, "The raw tiny model on a dense toy reward").
    optimizer: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-4, clip_grad=1.0))
    packing: PackingSection = field(default_factory=PackingSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    sft: SftSection = field(default_factory=SftSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    guard: HangGuardSection = field(default_factory=HangGuardSection)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

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
        if self.rollout.server == "replay":
            from megatron_grpo.run.replay import check_steps
            check_steps(self.rollout.replay_dir, self.trainer.steps)


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
    """Defaults <- YAML <- dotted overrides; errors name the key (ConfigKeyError). Without a YAML the
    defaults are the embedded job's (``TrainConfig()``), so ``mgrpo train rollout.overlap=true`` is
    that job with one change; a YAML starts from the sections' own defaults (it is the whole config).
    A relative ``rollout.plugin`` becomes the absolute path it names (:func:`resolve_plugin_path`)."""
    cfg = load_config(TrainConfig, path, overrides, base=TrainConfig() if path is None else None)
    # a plugin named on the command line is relative to where the command runs, not to the YAML
    from_yaml = path is not None and not any(o.split("=", 1)[0].strip() in ("rollout", "rollout.plugin")
                                             for o in overrides or [])
    cfg.rollout.plugin = resolve_plugin_path(cfg.rollout.plugin, Path(path).parent if from_yaml else None)
    return cfg


def resolve_plugin_path(plugin: Optional[str], config_dir: Optional[Path] = None) -> Optional[str]:
    """The absolute path of a relative ``rollout.plugin``: under the current directory, else under
    ``config_dir`` (the directory of the YAML that named it), so a config file can name a plugin
    beside it and run from any directory (config.json then holds the absolute path, for --resume).
    ConfigKeyError listing the paths tried when neither holds it; an absolute path is kept as it
    is (the plugin loader reports one that does not exist)."""
    if plugin is None or os.path.isabs(plugin):
        return plugin
    tried = [os.path.abspath(plugin)]
    if config_dir is not None and os.path.abspath(Path(config_dir) / plugin) not in tried:
        tried.append(os.path.abspath(Path(config_dir) / plugin))
    for p in tried:
        if os.path.exists(p):
            return p
    rule = ("a relative path is resolved against the current directory, then the config file's directory"
            if config_dir is not None else "a relative path given on the command line is resolved against the "
            "current directory")
    raise ConfigKeyError(f"plugin file not found: {plugin} (rollout.plugin; tried {' and '.join(tried)}: {rule})")


if __name__ == "__main__":
    if "--docs" in sys.argv:
        print(render_markdown(TrainConfig, "Configuration reference (`mgrpo train`)"))
