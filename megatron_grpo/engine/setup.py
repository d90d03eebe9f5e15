"""Model, optimizer and LR schedule of the trainer: megatron-core pieces, assembled once per run.

``build_engine(hf_dir, layout, optim)`` (megatron's parallel state initialised first with
``model_bridge.parallel.init_parallel``) returns an :class:`Engine` with

* ``model``: this rank's model chunks (one; no virtual pipeline), each ``build_thinker`` ->
  ``load_hf`` -> (bf16: ``Float16Module``) -> megatron ``DistributedDataParallel`` (grads in fp32
  buffers, reduce-scatter for the distributed optimizer);
* ``optimizer``: ``get_megatron_optimizer`` Adam(W) with the distributed optimizer: fp32 everywhere
  on CPU; bf16 weights with fp32 master weights, fp32 grads and fp32 Adam moments on GPU; gradient
  clipping by global norm (``clip_grad``);
* ``scheduler``: megatron's ``OptimizerParamScheduler``, stepped once per *successful* optimizer
  update, see :class:`OptimConfig` for the exact schedule.

The transformer config gets what the schedules need: ``finalize_model_grads`` (DP reduction,
sequence-parallel norm grads over TP, embedding grads), ``grad_scale_func`` (the optimizer's loss
scale, 1 without fp16) and ``variable_seq_lengths`` (packed micro-batches have different T; the
pipeline exchanges shapes first).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch

from model_bridge.config import OmniSpec, ParallelLayout

from . import fused_adamw, grad_accum
from .nonfinite import NonFiniteSkips

__all__ = ["OptimConfig", "Engine", "build_model", "build_optimizer", "build_scheduler", "build_engine",
           "default_dtype", "unwrapped", "has_float16_wrapper"]


@dataclass(frozen=True)
class OptimConfig:
    """Adam(W), gradient clipping and the LR schedule of a run.

    LR schedule (megatron's ``OptimizerParamScheduler`` evaluated at ``s = k + 1`` for the k-th
    successful update, k = 0, 1, ...; skipped updates do not advance it)::

        s <= warmup_steps:  lr(s) = warmup_init_lr + (lr - warmup_init_lr) * s / warmup_steps
        constant:           lr(s) = lr                                   after warmup
        cosine / linear:    lr(s) decays from lr to min_lr between warmup_steps and decay_steps,
                            then stays at min_lr

    So the first update already trains (``lr / warmup_steps`` with warmup, ``lr`` without), unlike
    megatron's own step-0 convention, which would spend the first update at ``warmup_init_lr``.
    """

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the cosine/linear decay (ignored by ``constant``)."""
    lr_decay_style: Literal["constant", "cosine", "linear"] = "constant"
    """Shape after warmup."""
    warmup_steps: int = 0
    """Updates of linear warmup from ``warmup_init_lr`` to ``lr``."""
    warmup_init_lr: float = 0.0
    """Where the warmup starts."""
    decay_steps: Optional[int] = None
    """Update at which cosine/linear decay reaches ``min_lr`` (required for them; > warmup_steps)."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay; megatron exempts biases and norm weights."""
    adam_beta1: float = 0.9
    """Adam first-moment decay."""
    adam_beta2: float = 0.999
    """Adam second-moment decay."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""
    use_distributed_optimizer: bool = True
    """Shard master weights and Adam states over the data-parallel ranks (ZeRO-1 style)."""
    overlap_grad_reduce: bool = False
    """Overlap the DP gradient reduce-scatter with the backward (GPU speed; off on CPU)."""
    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's parameter all-gather with the next forward."""
    bucket_size: Optional[int] = None
    """DDP bucket size in elements (None: megatron's default)."""

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"OptimConfig: {msg}")

        if not (self.lr > 0 and math.isfinite(self.lr)):
            bad(f"lr must be a finite number > 0, got {self.lr}")
        if not 0.0 <= self.min_lr <= self.lr:
            bad(f"min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        if self.lr_decay_style not in ("constant", "cosine", "linear"):
            bad(f"lr_decay_style must be 'constant', 'cosine' or 'linear', got {self.lr_decay_style!r}")
        if int(self.warmup_steps) != self.warmup_steps or self.warmup_steps < 0:
            bad(f"warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if not 0.0 <= self.warmup_init_lr <= self.lr:
            bad(f"warmup_init_lr must be in [0, lr={self.lr}], got {self.warmup_init_lr}")
        if self.lr_decay_style != "constant":
            if self.decay_steps is None or int(self.decay_steps) != self.decay_steps \
                    or self.decay_steps <= self.warmup_steps:
                bad(f"lr_decay_style={self.lr_decay_style!r} needs decay_steps, an int > warmup_steps="
                    f"{self.warmup_steps}, got {self.decay_steps!r}")
        elif self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            bad(f"decay_steps={self.decay_steps} must be > warmup_steps={self.warmup_steps}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            bad(f"weight_decay must be finite and >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                bad(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not (self.adam_eps > 0 and math.isfinite(self.adam_eps)):
            bad(f"adam_eps must be a finite number > 0, got {self.adam_eps}")
        if not (self.clip_grad >= 0 and math.isfinite(self.clip_grad)):
            bad(f"clip_grad must be finite and >= 0 (0 disables), got {self.clip_grad}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            bad("overlap_param_gather needs use_distributed_optimizer")
        if self.bucket_size is not None and (int(self.bucket_size) != self.bucket_size or self.bucket_size < 1):
            bad(f"bucket_size must be a positive int or None, got {self.bucket_size!r}")


def default_dtype() -> torch.dtype:
    """bf16 on a CUDA machine, fp32 on CPU."""
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The OmniThinker inside DDP / Float16Module wrappers."""
    from model_bridge.load import unwrap_model

    return unwrap_model(module)


def has_float16_wrapper(module: torch.nn.Module) -> bool:
    """Whether a ``Float16Module`` whose forward takes ``fp32_output`` is in the wrapper chain (the
    logits then stay in bf16 instead of a float32 ``[T, Vp/tp]`` copy)."""
    import inspect

    from megatron.core.transformer.module import Float16Module

    seen = 0
    while module is not None and seen < 8:
        if isinstance(module, Float16Module):
            return "fp32_output" in inspect.signature(type(module).forward).parameters
        module = getattr(module, "module", None)
        seen += 1
    return False


@dataclass
class Engine:
    """One rank's trainer state (see the module doc)."""

    model: list
    """Model chunks (megatron DDP modules), as megatron's schedules take them."""
    optimizer: object
    """megatron ``MegatronOptimizer`` (a ``ChainedOptimizer`` of dense and expert parts)."""
    scheduler: object
    """megatron ``OptimizerParamScheduler``."""
    spec: OmniSpec
    layout: ParallelLayout
    dtype: torch.dtype
    optim: OptimConfig
    hf_dir: Optional[str] = None
    nonfinite: Optional[NonFiniteSkips] = None
    """Skipped-update counters (:func:`~megatron_grpo.engine.step.optimizer_update` creates them;
    the trainer checkpoints and restores them)."""
    graphs: Optional[object] = None
    """The micro-batches' CUDA graphs (``engine.graphs.MicroBatchGraphs``) when
    ``trainer.cuda_graphs`` applies (:func:`~megatron_grpo.engine.graphs.enable_graphs`); None: eager."""
    graphs_fallback: Optional[str] = None
    """Why ``trainer.cuda_graphs`` did not apply (None when it did or was off)."""

    @property
    def config(self):
        """The (shared) megatron TransformerConfig of the chunks."""
        return unwrapped(self.model[0]).config

    @property
    def modules(self) -> list:
        """The unwrapped OmniThinker chunks."""
        return [unwrapped(m) for m in self.model]

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def build_model(spec: OmniSpec, layout: ParallelLayout, *, dtype: Optional[torch.dtype] = None,
                hf_dir: Optional[str | Path] = None, optim: Optional[OptimConfig] = None, wrap: bool = True,
                backend: str = "auto", **config_overrides) -> list:
    """This rank's model chunks: ``build_thinker`` (+ ``load_hf`` when ``hf_dir``), moved to the GPU
    when there is one, then (``wrap``) Float16Module for bf16/fp16 and megatron DDP per ``optim``.

    ``wrap=False`` gives bare modules (a frozen reference policy for KL: no grad buffers).
    ``config_overrides`` go to the thinker's TransformerConfig (e.g. ``moe_aux_loss_coeff``,
    ``recompute_granularity``).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    from model_bridge.load import load_hf
    from model_bridge.modeling.thinker import build_thinker

    dtype = dtype or default_dtype()
    optim = optim or OptimConfig()
    module = build_thinker(spec, layout, dtype, backend=backend, **config_overrides)
    if torch.cuda.is_available():
        module = module.cuda(torch.cuda.current_device())
    if hf_dir is not None:
        load_hf(module, hf_dir)
    config = module.config
    config.variable_seq_lengths = True  # packed micro-batches differ in T
    if not wrap:
        return [module]
    if dtype in (torch.bfloat16, torch.float16):
        module = Float16Module(config, module)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=optim.overlap_grad_reduce,
        overlap_param_gather=optim.overlap_param_gather, use_distributed_optimizer=optim.use_distributed_optimizer,
        check_for_nan_in_grad=False,  # the step skips a non-finite update (NonFiniteSkips) instead of raising
        bucket_size=optim.bucket_size)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)
    grad_accum.install([model])  # micro-batch gradients into the fp32 buffers in one vectorised pass
    config.finalize_model_grads_func = finalize_model_grads
    if optim.overlap_grad_reduce:
        config.no_sync_func = model.no_sync
    model.zero_grad_buffer()
    return [model]


def build_optimizer(model: list, optim: OptimConfig, dtype: torch.dtype):
    """``(optimizer, scheduler)`` for DDP-wrapped chunks (module doc; schedule in OptimConfig)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = OptimizerConfig(
        optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        params_dtype=dtype, use_distributed_optimizer=optim.use_distributed_optimizer,
        overlap_param_gather=optim.overlap_param_gather)
    optimizer = get_megatron_optimizer(cfg, model)
    use_fused_torch_adam(optimizer)
    fused_adamw.install(optimizer)  # AdamW + the bf16 weight write in one pass (CUDA)
    config = unwrapped(model[0]).config
    config.grad_scale_func = optimizer.scale_loss
    return optimizer, build_scheduler(optimizer, optim)


def use_fused_torch_adam(optimizer) -> int:
    """Without Transformer Engine or Apex megatron steps torch's AdamW with its default foreach
    kernels, which pass over the fp32 master weights, grads and moments several times (78 ms for a
    4-layer step against a 24 ms bandwidth bound on an H200). torch's fused kernel reads and writes
    each once. Switched on for torch Adam groups whose parameters all live on CUDA, before the first
    step (its ``step`` state is then created on the device, as the fused kernel needs); CPU runs
    keep the foreach path. Returns the number of groups switched."""
    from .ckpt_adam import inner_optimizers, is_torch_adam

    switched = 0
    for sub in inner_optimizers(optimizer):
        inner = getattr(sub, "optimizer", None)
        if not is_torch_adam(inner) or any(inner.state.values()):
            continue
        groups = [g for g in inner.param_groups
                  if g["params"] and all(p.is_cuda for p in g["params"]) and not g.get("differentiable")]
        for group in groups:
            group["fused"], group["foreach"] = True, False
        if groups:
            inner.defaults["fused"], inner.defaults["foreach"] = True, False
        switched += len(groups)
    return switched


def build_scheduler(optimizer, optim: OptimConfig):
    """megatron's ``OptimizerParamScheduler`` for ``optim``, already at s = 1 (see OptimConfig).
    Only ``optimizer.param_groups`` is touched (each group's ``lr`` and ``weight_decay``)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay = optim.decay_steps if optim.decay_steps is not None else optim.warmup_steps + 1
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=optim.warmup_init_lr, max_lr=optim.lr, min_lr=optim.min_lr,
        lr_warmup_steps=optim.warmup_steps, lr_decay_steps=decay, lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=decay, wd_incr_style="constant")
    scheduler.step(1)  # update k uses lr(k + 1): see OptimConfig
    return scheduler


def build_engine(hf_dir: str | Path, layout: ParallelLayout, optim: Optional[OptimConfig] = None, *,
                 dtype: Optional[torch.dtype] = None, spec: Optional[OmniSpec] = None, backend: str = "auto",
                 **config_overrides) -> Engine:
    """Model (loaded from ``hf_dir``), optimizer and scheduler of this rank. Collective: every rank
    calls it (``load_hf`` and the optimizer's setup communicate)."""
    from model_bridge.config import read_omni_config

    spec = spec or read_omni_config(hf_dir)
    optim = optim or OptimConfig()
    dtype = dtype or default_dtype()
    model = build_model(spec, layout, dtype=dtype, hf_dir=hf_dir, optim=optim, backend=backend, **config_overrides)
    optimizer, scheduler = build_optimizer(model, optim, dtype)
    return Engine(model=model, optimizer=optimizer, scheduler=scheduler, spec=spec, layout=layout, dtype=dtype,
                  optim=optim, hf_dir=str(hf_dir))
