"""GRPO-family algorithms as pure tensor functions: advantages, policy losses, KL, rollout IS.

See docs/training.md for every variant's formula. Nothing here touches torch.distributed: the
losses take the step's global normalisers as arguments so that micro-batch losses simply add up.
"""
from .advantages import (ADV_STD_EPS, Advantages, broadcast_to_tokens, compute_advantages, dapo_keep_mask,
                         dr_grpo_advantages, group_stats, grpo_advantages)
from .importance import ISConfig, ISResult, importance_weights
from .kl import KL_ESTIMATORS, kl_estimate
from .losses import LossConfig, aggregate, metric_reduce_op, policy_loss, reduce_metrics

__all__ = [
    "ADV_STD_EPS", "Advantages", "broadcast_to_tokens", "compute_advantages", "dapo_keep_mask",
    "dr_grpo_advantages", "group_stats", "grpo_advantages",
    "ISConfig", "ISResult", "importance_weights",
    "KL_ESTIMATORS", "kl_estimate",
    "LossConfig", "aggregate", "metric_reduce_op", "policy_loss", "reduce_metrics",
]
