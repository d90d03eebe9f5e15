"""Rollout-correction importance sampling between the vLLM sampler and the training-side old policy.

Shapes: ``T`` tokens of one micro-batch (or of any set of whole samples).

vLLM samples with pi_rollout; the trainer's forward of the same weights gives pi_old, which differs
(kernels, precision, MoE routing). The policy-gradient term is corrected per token by a detached
weight ``w``. With ``delta_t = log pi_old(y_t) - log pi_rollout(y_t)`` over the loss tokens and the
ratio ``rho`` taken at one of three levels:

* ``token``:      ``rho_t = exp(delta_t)``
* ``sequence``:   ``rho_i = exp(sum_{t in i} delta_t)``         (the product of the token ratios)
* ``geometric``:  ``rho_i = exp(mean_{t in i} delta_t)``        (its per-token geometric mean)

(sequence levels give every token of sample i the ratio ``rho_i``), the two corrections are

* TIS, truncated IS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
  RL training"):  ``w = min(rho, C)``  with cap ``C = tis_cap``;
* MIS, masked IS (Liu et al. 2025, "When speed kills stability"):  ``w = rho * 1[lo <= rho <= hi]``
  with ``[lo, hi] = [mis_low, mis_high]`` (``lo = 0`` is the paper's one-sided form); the rejected
  tokens (sequence levels: whole samples) also leave ``keep_mask_T``.

MIS rejects: the caller should AND ``keep_mask_T`` into the loss mask *before* counting the global
normalisers, so that rejected tokens leave the denominator too (slime PR #657's lesson); the
weights alone already zero their policy-gradient term. The KL and entropy terms are not weighted.

Metrics (tokens sampled from pi_rollout, so both estimate KL(pi_rollout || pi_old)):
``mismatch_kl_k1 = mean_t(-delta_t)``, ``mismatch_kl_k3 = mean_t(exp(delta_t) - delta_t - 1)``;
``is_ratio_mean/_max/_min`` over the level's units (tokens, or samples for sequence levels);
``is_truncated_frac`` (TIS: ``rho > C``) or ``is_masked_frac`` (MIS: rejected). Means are sums
divided by the normaliser given (global count of tokens / samples; the local count by default), so
summing them over micro-batches and ranks gives the global mean; ``*_max``/``*_min`` reduce by max/min.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from .kl import kl_estimate
from .segments import check_flat, segment_ids, segment_sum

__all__ = ["ISConfig", "ISResult", "IS_LOG_RATIO_CLAMP", "importance_weights"]

IS_LOG_RATIO_CLAMP = 20.0
"""|log rho| is clamped to this before exp() for the ratio *metrics* only: a sequence-level log
ratio sums thousands of token terms and exp() of it overflows fp32 above ~88; exp(20) ~ 4.9e8 still
reads as "far off". The weights themselves never overflow: TIS compares in log space against
log C and MIS against log hi before exponentiating."""


@dataclass(frozen=True)
class ISConfig:
    """Which rollout correction to apply (formulas in the module doc)."""

    mode: Literal["off", "tis", "mis"] = "tis"
    """``"tis"`` truncates, ``"mis"`` masks, ``"off"`` gives weights 1 (metrics still computed)."""
    level: Literal["token", "sequence", "geometric"] = "token"
    """Unit of the ratio: each token, the whole sample (product), or the sample's geometric mean."""
    tis_cap: float = 2.0
    """TIS cap C (>= 1 so that an exactly on-policy token keeps weight 1)."""
    mis_low: float = 0.5
    """MIS lower bound lo (0 <= lo <= 1); 0 makes MIS one-sided."""
    mis_high: float = 2.0
    """MIS upper bound hi (>= 1)."""

    def __post_init__(self):
        if self.mode not in ("off", "tis", "mis"):
            raise ValueError(f"ISConfig.mode must be 'off', 'tis' or 'mis', got {self.mode!r}")
        if self.level not in ("token", "sequence", "geometric"):
            raise ValueError(f"ISConfig.level must be 'token', 'sequence' or 'geometric', got {self.level!r}")
        if not (math.isfinite(self.tis_cap) and self.tis_cap >= 1.0):
            raise ValueError(f"ISConfig.tis_cap must be a finite number >= 1, got {self.tis_cap}")
        if not (0.0 <= self.mis_low <= 1.0 <= self.mis_high and math.isfinite(self.mis_high)):
            raise ValueError(f"ISConfig needs 0 <= mis_low <= 1 <= mis_high < inf, got "
                             f"[{self.mis_low}, {self.mis_high}]")


@dataclass(frozen=True)
class ISResult:
    """Correction weights for one micro-batch."""

    weights_T: torch.Tensor
    """fp32 (fp64 for fp64 inputs), detached; multiplies the per-token policy-gradient term; 0 outside
    ``keep_mask_T``."""
    keep_mask_T: torch.Tensor
    """bool; the loss mask minus the tokens MIS rejected (equal to the loss mask otherwise)."""
    metrics: dict[str, torch.Tensor]
    """0-dim detached tensors, see the module doc for names and reductions."""


def importance_weights(old_logprobs_T: torch.Tensor, rollout_logprobs_T: torch.Tensor,
                       loss_mask_T: torch.Tensor, sample_index_T: Optional[torch.Tensor] = None, *,
                       config: ISConfig, global_num_tokens: Optional[float] = None,
                       global_num_samples: Optional[float] = None,
                       segments: Optional[tuple[torch.Tensor, int]] = None) -> ISResult:
    """TIS / MIS weights between pi_old and pi_rollout, and mismatch metrics.

    ``sample_index_T`` is required for the sequence levels; every sample must lie wholly inside
    the given tokens (the packer never splits one). ``global_num_tokens`` / ``global_num_samples``
    normalise the mean metrics (defaults: the local counts of loss tokens / samples with any).
    ``segments``: the samples' ``segment_ids`` computed already (``segments.packed_segment_ids``:
    no host sync).
    """
    T = check_flat("old_logprobs_T", old_logprobs_T)
    check_flat("rollout_logprobs_T", rollout_logprobs_T, T)
    check_flat("loss_mask_T", loss_mask_T, T)
    mask_T = loss_mask_T.to(torch.bool)
    ct = torch.promote_types(old_logprobs_T.dtype, torch.float32)
    old_T = old_logprobs_T.detach().to(ct)
    rollout_T = rollout_logprobs_T.detach().to(ct)
    zeros_T = torch.zeros_like(old_T)
    delta_T = torch.where(mask_T, old_T - rollout_T, zeros_T)
    n_tok = float(global_num_tokens) if global_num_tokens is not None else max(float(mask_T.sum()), 1.0)
    if n_tok <= 0:
        raise ValueError(f"global_num_tokens must be > 0, got {global_num_tokens}")

    metrics = {
        "mismatch_kl_k1": (torch.where(mask_T, kl_estimate(rollout_T, old_T, "k1"), zeros_T).sum() / n_tok),
        "mismatch_kl_k3": (torch.where(mask_T, kl_estimate(rollout_T, old_T, "k3"), zeros_T).sum() / n_tok),
    }

    # log rho per token (token level) or per sample broadcast to its tokens (sequence levels)
    if config.level == "token":
        log_rho_T = delta_T
        unit_mask = mask_T
        n_units = n_tok
        log_rho_U = delta_T
    else:
        if sample_index_T is None and segments is None:
            raise ValueError(f"ISConfig.level={config.level!r} needs sample_index_T")
        if segments is None:
            check_flat("sample_index_T", sample_index_T, T)
        inv_T, G = segments if segments is not None else segment_ids(sample_index_T)
        sum_G = segment_sum(delta_T, inv_T, G)
        cnt_G = segment_sum(mask_T.to(ct), inv_T, G)
        log_rho_G = sum_G if config.level == "sequence" else sum_G / cnt_G.clamp(min=1.0)
        log_rho_T = torch.where(mask_T, log_rho_G[inv_T], zeros_T)
        unit_mask = cnt_G > 0  # a sample with no loss tokens is not a unit
        n_units = (float(global_num_samples) if global_num_samples is not None
                   else max(float(unit_mask.sum()), 1.0))
        if n_units <= 0:
            raise ValueError(f"global_num_samples must be > 0, got {global_num_samples}")
        log_rho_U = log_rho_G

    rho_U = torch.exp(log_rho_U.clamp(-IS_LOG_RATIO_CLAMP, IS_LOG_RATIO_CLAMP))
    metrics["is_ratio_mean"] = torch.where(unit_mask, rho_U, torch.zeros_like(rho_U)).sum() / n_units
    metrics["is_ratio_max"] = torch.where(unit_mask, rho_U, torch.full_like(rho_U, -math.inf)).max() \
        if rho_U.numel() else torch.tensor(-math.inf)
    metrics["is_ratio_min"] = torch.where(unit_mask, rho_U, torch.full_like(rho_U, math.inf)).min() \
        if rho_U.numel() else torch.tensor(math.inf)

    keep_T = mask_T
    if config.mode == "off":
        weights_T = mask_T.to(ct)
    elif config.mode == "tis":
        log_cap = math.log(config.tis_cap)
        weights_T = torch.where(mask_T, torch.exp(log_rho_T.clamp(max=log_cap)), zeros_T)
        truncated_U = unit_mask & (log_rho_U > log_cap)
        metrics["is_truncated_frac"] = truncated_U.float().sum() / n_units
    else:  # mis
        log_lo = math.log(config.mis_low) if config.mis_low > 0 else -math.inf
        log_hi = math.log(config.mis_high)
        inside_T = (log_rho_T >= log_lo) & (log_rho_T <= log_hi)
        keep_T = mask_T & inside_T
        weights_T = torch.where(keep_T, torch.exp(log_rho_T.clamp(max=log_hi)), zeros_T)
        rejected_U = unit_mask & ((log_rho_U < log_lo) | (log_rho_U > log_hi))
        metrics["is_masked_frac"] = rejected_U.float().sum() / n_units
    return ISResult(weights_T=weights_T.detach(), keep_mask_T=keep_T,
                    metrics={k: v.detach() for k, v in metrics.items()})
