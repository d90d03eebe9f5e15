"""The layer-spec seam: which megatron modules build the thinker's decoder layers.

``thinker_layer_spec(config, backend="auto")`` returns the decoder block spec
(``TransformerBlockSubmodules``: one layer spec per layer of this pipeline stage plus the final
norm) that ``GPTModel(transformer_layer_spec=...)`` takes. Backends:

* ``"te"``: megatron's Transformer Engine spec (fused kernels; THD via TE's own attention). Used by
  ``"auto"`` whenever ``transformer_engine`` imports.
* ``"torch"``: the torch-native fast path (:mod:`model_bridge.modeling.torch_backend`): packed
  attention on ``varlen_attn`` without host syncs, experts on ``grouped_mm``. ``"auto"`` on CUDA
  when Transformer Engine does not import. Registered on first use (lazy import).
* ``"local"``: megatron's local (pure PyTorch) spec with :class:`PackedCoreAttention` as core
  attention (megatron's ``DotProductAttention`` refuses packed sequences), RMSNorm through
  ``WrappedTorchNorm``, and ``SequentialMLP`` experts. ``"auto"`` otherwise (CPU).

Other backends (e.g. a ``"torch"`` fast path with varlen attention and grouped-GEMM experts) plug
in with ``register_backend(name, fn)``; ``fn(config, vp_stage=None, pp_rank=None)`` returns the
block spec. Every backend must keep the local spec's parameter names (``docs/bridge.md``)
so that weight loading, export and checkpoints work unchanged.
"""
from __future__ import annotations

import copy
import importlib.util
from typing import Callable, Optional

__all__ = ["thinker_layer_spec", "register_backend", "available_backends", "resolve_backend",
           "te_available", "local_block_spec", "te_block_spec"]

BlockSpecFn = Callable[..., object]
_BACKENDS: dict[str, BlockSpecFn] = {}
_LAZY_BACKENDS = {"torch": "model_bridge.modeling.torch_backend"}
"""Backends registered by importing their module on first use (keeps this module light)."""


def _ensure_registered(name: str) -> None:
    if name not in _BACKENDS and name in _LAZY_BACKENDS:
        importlib.import_module(_LAZY_BACKENDS[name])


def te_available() -> bool:
    """True when Transformer Engine can be imported (it needs CUDA)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


def register_backend(name: str, fn: BlockSpecFn, *, overwrite: bool = False) -> None:
    """Register ``fn(config, vp_stage=None, pp_rank=None) -> block spec`` under ``name``."""
    if not name or name == "auto":
        raise ValueError(f"invalid backend name {name!r}")
    if name in _BACKENDS and not overwrite and _BACKENDS[name] is not fn:
        raise ValueError(f"layer-spec backend {name!r} is already registered (pass overwrite=True)")
    _BACKENDS[name] = fn


def available_backends() -> list[str]:
    """Names of the registered (and lazily registered) backends."""
    return sorted(set(_BACKENDS) | set(_LAZY_BACKENDS))


def resolve_backend(backend: str = "auto") -> str:
    """``"auto"`` -> ``"te"`` when Transformer Engine imports, else ``"torch"`` on CUDA, else
    ``"local"``; others are checked."""
    if backend == "auto":
        if te_available():
            return "te"
        import torch

        backend = "torch" if torch.cuda.is_available() else "local"
    _ensure_registered(backend)
    if backend not in _BACKENDS:
        raise ValueError(f"unknown layer-spec backend {backend!r}; registered: {available_backends()} "
                         "(or 'auto')")
    return backend


def _check_config(config) -> None:
    problems = []
    if getattr(config, "normalization", None) != "RMSNorm":
        problems.append(f"normalization={config.normalization!r} (need 'RMSNorm')")
    if not getattr(config, "qk_layernorm", False):
        problems.append("qk_layernorm=False (Qwen3-Omni has q/k RMSNorm)")
    if getattr(config, "multi_latent_attention", False):
        problems.append("multi_latent_attention=True")
    if problems:
        raise ValueError("thinker TransformerConfig does not describe a Qwen3-Omni decoder: " + "; ".join(problems))


def _gpt_block_spec(config, use_te: bool, vp_stage, pp_rank):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    try:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm",
                                          vp_stage=vp_stage, pp_rank=pp_rank)
    except TypeError:  # a megatron-core without pp_rank/vp_stage on this function
        if pp_rank is not None or vp_stage is not None:
            raise
        return get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm")


def local_block_spec(config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None):
    """megatron's local spec with packed-sequence core attention (pure PyTorch; CPU and GPU)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from .attention import PackedCoreAttention

    _check_config(config)
    if getattr(config, "moe_grouped_gemm", False):
        raise ValueError("the 'local' layer-spec backend uses SequentialMLP experts: set moe_grouped_gemm=False "
                         "(grouped GEMM experts come with the 'te' or a registered fast-path backend)")
    block = copy.deepcopy(_gpt_block_spec(config, False, vp_stage, pp_rank))
    for layer in block.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = PackedCoreAttention
    # the final norm: torch RMSNorm (megatron picks apex's FusedLayerNorm when apex imports,
    # which has no RMSNorm)
    block.layer_norm = WrappedTorchNorm
    return block


def te_block_spec(config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None):
    """megatron's Transformer Engine spec (needs transformer_engine and CUDA)."""
    if not te_available():
        raise RuntimeError("layer-spec backend 'te' needs transformer_engine, which does not import here; "
                           "use backend='local' (or 'auto')")
    _check_config(config)
    return _gpt_block_spec(config, True, vp_stage, pp_rank)


register_backend("local", local_block_spec)
register_backend("te", te_block_spec)


def thinker_layer_spec(config, backend: str = "auto", *, vp_stage: Optional[int] = None,
                       pp_rank: Optional[int] = None):
    """Decoder block spec (``TransformerBlockSubmodules``) of this pipeline stage for ``config``."""
    name = resolve_backend(backend)
    return _BACKENDS[name](config, vp_stage=vp_stage, pp_rank=pp_rank)
