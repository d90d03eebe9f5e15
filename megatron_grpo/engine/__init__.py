"""The Megatron-Core training engine: model setup, packed micro-batches, logprobs, the training step.

* ``setup``: ``OptimConfig``, ``build_engine`` (thinker + HF weights + DDP + distributed Adam + LR
  schedule), ``build_model`` (also a frozen reference policy with ``wrap=False``);
* ``batch``: ``TrainMicroBatch`` and ``build_train_microbatches`` (trajectories + pack plan ->
  this DP rank's micro-batches with audio features);
* ``logprobs``: chunked vocab-parallel log-softmax / entropy (``token_logprobs``);
  ``fused_logprobs``: the same fused with the output layer, never materialising ``[T, V]`` logits;
* ``forward``: ``run_schedule`` (megatron's forward-backward schedule), ``compute_logprobs``
  (no-grad old / reference policy logprobs);
* ``step``: ``StepConfig``, ``train_step`` (loss with global normalisers, MoE aux loss, clipping,
  skipped non-finite updates), ``forward_backward``, ``optimizer_update``; ``nonfinite``:
  ``NonFiniteSkips``, the skipped-update counters;
* ``checkpoint`` / ``signals``: distributed checkpoints with exact resume, preemption signals.

Submodules import megatron-core; this package itself imports nothing heavy.
"""
from __future__ import annotations

import importlib

_WHERE = {
    "OptimConfig": "setup", "Engine": "setup", "build_engine": "setup", "build_model": "setup",
    "build_optimizer": "setup",
    "TrainMicroBatch": "batch", "build_train_microbatches": "batch", "featurizer_from_extractor": "batch",
    "token_logprobs": "logprobs", "vocab_parallel_logprobs": "logprobs",
    "fused_vocab_parallel_logprobs": "fused_logprobs",
    "compute_logprobs": "forward", "fill_old_logprobs": "forward", "fill_ref_logprobs": "forward",
    "run_schedule": "forward",
    "StepConfig": "step", "train_step": "step", "forward_backward": "step", "optimizer_update": "step",
    "NonFiniteGradError": "nonfinite", "NonFiniteSkips": "nonfinite", "StepError": "step",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
