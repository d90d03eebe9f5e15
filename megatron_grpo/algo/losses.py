"""Policy losses of the GRPO family on the flat tokens of one micro-batch.

Shapes: ``T`` tokens of one packed micro-batch (padding included; the loss mask removes it).

Per loss token t of sample i, with ``rho_t = exp(logp_t - old_logp_t)`` (current over behaviour
policy), advantage ``A_t`` (sample i's scalar broadcast to its tokens), optional detached IS weight
``w_t`` (:mod:`.importance`, 1 when absent) and clip range ``[1 - eps_low, 1 + eps_high]``::

    pg_t  = -w_t * min(rho_t * A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) * A_t)
            (with dual_clip_c = c: for A_t < 0, pg_t = min(pg_t, -w_t * c * A_t); Ye et al. 2020)
    l_t   = pg_t + kl_coef * KL_t - entropy_coef * H_t          (KL_t: :mod:`.kl`, H_t: entropy)

The variants differ in how the l_t are aggregated (and in their advantages, :mod:`.advantages`):

* GRPO (DeepSeekMath, Shao et al. 2024), sequence-mean of token-means, ``eps_high = eps_low``::

      L = (1 / N) * sum_i (1 / |o_i|) * sum_{t in o_i} l_t

* DAPO (Yu et al. 2025), token-mean over all loss tokens, clip-higher (default eps_high = 0.28)::

      L = (1 / sum_i |o_i|) * sum_i sum_{t in o_i} l_t

* Dr.GRPO (Liu et al. 2025), token-sum over a constant, advantages without std division::

      L = (1 / (L_max * N)) * sum_i sum_{t in o_i} l_t          (L_max = max_response_len)

``N`` (``global_num_samples``) and ``sum_i |o_i|`` (``global_num_tokens``) are counted over the
*whole step*: all micro-batches of all data-parallel ranks. Every sample lies wholly inside one
micro-batch (the packer guarantees it), so each micro-batch's L is its exact share and the
sum over micro-batches and ranks equals the full-batch loss; so do the gradients. The engine
must therefore SUM (not average) micro-batch losses and DP gradients. ``|o_i|`` counts sample
i's loss tokens; a sample with none contributes 0 (and still counts in N if the caller counts it).

Metrics (0-dim detached tensors): means over loss tokens are sums divided by ``global_num_tokens``
(``clip_frac_low/high``, ``clip_frac``, ``dual_clip_frac``, ``ratio_mean``, ``kl``, ``entropy``),
``pg_loss``/``kl_loss``/``entropy_loss``/``loss`` are the aggregated terms, ``tokens`` the local
count of loss tokens; all of these reduce by SUM, ``ratio_max``/``ratio_min`` by MAX/MIN
(:func:`metric_reduce_op`, :func:`reduce_metrics`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Literal, Optional, Union

import torch

from .kl import KL_ESTIMATORS, kl_estimate
from .segments import check_flat, segment_ids, segment_sum

__all__ = ["LossConfig", "LOG_RATIO_CLAMP", "DAPO_EPS_HIGH", "EMPTY_SAMPLE_TOKENS", "policy_loss", "aggregate",
           "metric_reduce_op", "reduce_metrics"]

Number = Union[int, float, torch.Tensor]

LOG_RATIO_CLAMP = 20.0
"""|logp - old_logp| is clamped to this before exp(): exp(20) ~ 4.9e8 is finite in fp32/bf16 while
exp(89) is inf in fp32, and one inf ratio with a negative advantage makes the loss inf. Below the
bound nothing changes; beyond it the token gets no gradient from the ratio (already true for
A > 0, where the clipped branch wins)."""

DAPO_EPS_HIGH = 0.28
"""DAPO's clip-higher upper epsilon (Yu et al. 2025, section 3.1), used when eps_high is unset."""

EMPTY_SAMPLE_TOKENS = 1.0
"""GRPO divides a sample's token-sum by max(|o_i|, 1): a sample without loss tokens (all prompt,
or an empty response) then contributes 0 instead of 0/0."""

_AGGREGATION = {"grpo": "seq_mean_token_mean", "dapo": "token_mean", "dr_grpo": "token_sum_const"}


@dataclass(frozen=True)
class LossConfig:
    """The policy loss of one run (formulas in the module doc)."""

    variant: Literal["grpo", "dapo", "dr_grpo"] = "grpo"
    """Aggregation (and, through :attr:`scale_advantages_by_std`, advantage) rule: "grpo", "dapo" or "dr_grpo"
    (formulas in the module doc)."""
    eps_low: float = 0.2
    """Lower clip: ratios below 1 - eps_low stop pushing a negative advantage further."""
    eps_high: Optional[float] = None
    """Upper clip. Unset: eps_low for GRPO/Dr.GRPO (the 0.2 shown), :data:`DAPO_EPS_HIGH` (0.28) for DAPO."""
    dual_clip_c: Optional[float] = None
    """Dual-clip bound c > 1 on -ratio * A for negative advantages; None disables it."""
    kl_coef: float = 0.0
    """Coefficient of the KL-to-reference term (0 disables it; the ref logprobs are then unused)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (:mod:`.kl`); GRPO uses k3."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (the loss subtracts entropy_coef * H_t)."""
    max_response_len: Optional[int] = None
    """Dr.GRPO's constant L_max (the generation budget in tokens); required for dr_grpo."""

    def __post_init__(self):
        if self.variant not in _AGGREGATION:
            raise ValueError(f"LossConfig.variant must be one of {sorted(_AGGREGATION)}, got {self.variant!r}")
        if self.eps_high is None:
            object.__setattr__(self, "eps_high", DAPO_EPS_HIGH if self.variant == "dapo" else self.eps_low)
        if not 0.0 < self.eps_low < 1.0:
            raise ValueError(f"LossConfig.eps_low must be in (0, 1), got {self.eps_low}")
        if not (0.0 < self.eps_high and math.isfinite(self.eps_high)):
            raise ValueError(f"LossConfig.eps_high must be a finite number > 0, got {self.eps_high}")
        if self.dual_clip_c is not None and not (self.dual_clip_c > 1.0 and math.isfinite(self.dual_clip_c)):
            raise ValueError(f"LossConfig.dual_clip_c must be None or a finite number > 1, got {self.dual_clip_c}")
        if not (self.kl_coef >= 0.0 and math.isfinite(self.kl_coef)):
            raise ValueError(f"LossConfig.kl_coef must be finite and >= 0, got {self.kl_coef}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"LossConfig.kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if not (self.entropy_coef >= 0.0 and math.isfinite(self.entropy_coef)):
            raise ValueError(f"LossConfig.entropy_coef must be finite and >= 0, got {self.entropy_coef}")
        if self.variant == "dr_grpo":
            if self.max_response_len is None or int(self.max_response_len) != self.max_response_len \
                    or self.max_response_len < 1:
                raise ValueError("loss.variant=dr_grpo needs loss.max_response_len=N, a positive int: the "
                                 "constant that normalises the token sum (the generation budget in tokens), "
                                 f"got {self.max_response_len!r}")

    @property
    def aggregation(self) -> str:
        """``"seq_mean_token_mean"`` (GRPO), ``"token_mean"`` (DAPO) or ``"token_sum_const"`` (Dr.GRPO)."""
        return _AGGREGATION[self.variant]

    @property
    def scale_advantages_by_std(self) -> bool:
        """Whether the variant divides advantages by the group std (False only for Dr.GRPO)."""
        return self.variant != "dr_grpo"


def _positive(name: str, value: Optional[Number]) -> Number:
    if value is None:
        raise ValueError(f"{name} is required")
    v = value if torch.is_tensor(value) else float(value)
    if not torch.is_tensor(v) and not v > 0:
        raise ValueError(f"{name} must be > 0, got {value} (an all-masked step has nothing to train)")
    return v


def aggregate(per_token_T: torch.Tensor, mask_T: torch.Tensor, sample_index_T: Optional[torch.Tensor],
              config: LossConfig, *, global_num_tokens: Number, global_num_samples: Number,
              segments: Optional[tuple[torch.Tensor, int]] = None) -> torch.Tensor:
    """This micro-batch's share of the variant's aggregate of ``per_token_T`` (module doc).

    ``mask_T`` is bool; ``sample_index_T`` is needed for GRPO's sequence-mean, or ``segments``, its
    ``segment_ids`` computed already (``segments.packed_segment_ids``: no host sync).
    """
    masked_T = torch.where(mask_T, per_token_T, torch.zeros_like(per_token_T))
    agg = config.aggregation
    if agg == "token_mean":
        return masked_T.sum() / _positive("global_num_tokens", global_num_tokens)
    if agg == "token_sum_const":
        return masked_T.sum() / (config.max_response_len * _positive("global_num_samples", global_num_samples))
    if sample_index_T is None and segments is None:
        raise ValueError("GRPO's sequence-mean needs sample_index_T (which sample each token belongs to)")
    inv_T, G = segments if segments is not None else segment_ids(sample_index_T)
    sum_G = segment_sum(masked_T, inv_T, G)
    count_G = segment_sum(mask_T.to(masked_T.dtype), inv_T, G)
    return (sum_G / count_G.clamp(min=EMPTY_SAMPLE_TOKENS)).sum() / _positive("global_num_samples",
                                                                               global_num_samples)


def policy_loss(logprobs_T: torch.Tensor, old_logprobs_T: torch.Tensor, advantages_T: torch.Tensor,
                loss_mask_T: torch.Tensor, sample_index_T: Optional[torch.Tensor] = None, *,
                config: LossConfig, global_num_tokens: Number, global_num_samples: Number,
                ref_logprobs_T: Optional[torch.Tensor] = None, is_weights_T: Optional[torch.Tensor] = None,
                entropy_T: Optional[torch.Tensor] = None, segments: Optional[tuple[torch.Tensor, int]] = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss, metrics)`` of ``config.variant`` for one micro-batch (formulas in the module doc).

    Differentiable in ``logprobs_T`` (and ``entropy_T`` when entropy_coef > 0); ``old_logprobs_T``,
    ``advantages_T``, ``ref_logprobs_T`` and ``is_weights_T`` are detached here. Computed in fp32
    (fp64 when ``logprobs_T`` is fp64).
    ``global_num_tokens`` (loss tokens of the whole step) and ``global_num_samples`` (samples of the
    whole step) may be numbers or 0-dim tensors (no host sync then). ``segments``: the samples'
    ``segment_ids`` of ``sample_index_T`` computed already (``segments.packed_segment_ids`` from
    the packed offsets: no host sync; else ``torch.unique`` reads its size back).
    """
    T = check_flat("logprobs_T", logprobs_T)
    for name, x in (("old_logprobs_T", old_logprobs_T), ("advantages_T", advantages_T),
                    ("loss_mask_T", loss_mask_T), ("sample_index_T", sample_index_T),
                    ("ref_logprobs_T", ref_logprobs_T), ("is_weights_T", is_weights_T),
                    ("entropy_T", entropy_T)):
        if x is not None:
            check_flat(name, x, T)
    _positive("global_num_tokens", global_num_tokens)  # metrics always use it
    if config.kl_coef > 0 and ref_logprobs_T is None:
        raise ValueError(f"kl_coef={config.kl_coef} > 0 needs ref_logprobs_T")
    if config.entropy_coef > 0 and entropy_T is None:
        raise ValueError(f"entropy_coef={config.entropy_coef} > 0 needs entropy_T")

    mask_T = loss_mask_T.to(torch.bool)
    ct = torch.promote_types(logprobs_T.dtype, torch.float32)  # fp32 at least (bf16 in -> fp32 math)
    logp_T = logprobs_T.to(ct)
    adv_T = advantages_T.detach().to(ct)
    zeros_T = torch.zeros_like(logp_T)
    log_ratio_T = (logp_T - old_logprobs_T.detach().to(ct)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio_T = torch.exp(log_ratio_T)
    clipped_T = ratio_T.clamp(1.0 - config.eps_low, 1.0 + config.eps_high)
    pg_unclipped_T = -adv_T * ratio_T
    pg_clipped_T = -adv_T * clipped_T
    pg_T = torch.maximum(pg_unclipped_T, pg_clipped_T)
    clip_active_T = pg_clipped_T > pg_unclipped_T  # the clipped branch wins (its gradient is 0)
    if config.dual_clip_c is not None:
        pg_dual_T = -adv_T * config.dual_clip_c
        dual_active_T = (adv_T < 0) & (pg_T > pg_dual_T)
        pg_T = torch.where(dual_active_T, pg_dual_T, pg_T)
    if is_weights_T is not None:
        pg_T = pg_T * is_weights_T.detach().to(ct)

    norms = dict(global_num_tokens=global_num_tokens, global_num_samples=global_num_samples, segments=segments)
    pg_loss = aggregate(pg_T, mask_T, sample_index_T, config, **norms)
    loss = pg_loss
    n_tok = global_num_tokens

    def token_mean(x_T: torch.Tensor) -> torch.Tensor:
        return torch.where(mask_T, x_T, zeros_T).sum().detach() / n_tok

    metrics: dict[str, torch.Tensor] = {"pg_loss": pg_loss.detach()}
    if ref_logprobs_T is not None:
        kl_T = kl_estimate(logp_T, ref_logprobs_T.detach().to(ct), config.kl_estimator)
        metrics["kl"] = token_mean(kl_T)
        if config.kl_coef > 0:
            kl_loss = aggregate(kl_T, mask_T, sample_index_T, config, **norms)
            loss = loss + config.kl_coef * kl_loss
            metrics["kl_loss"] = kl_loss.detach()
    if entropy_T is not None:
        ent_T = entropy_T.to(ct)
        metrics["entropy"] = token_mean(ent_T)
        if config.entropy_coef > 0:
            ent_loss = aggregate(ent_T, mask_T, sample_index_T, config, **norms)
            loss = loss - config.entropy_coef * ent_loss
            metrics["entropy_loss"] = ent_loss.detach()

    low_T = clip_active_T & (adv_T < 0)  # ratio < 1 - eps_low with a negative advantage
    high_T = clip_active_T & (adv_T > 0)  # ratio > 1 + eps_high with a positive advantage
    metrics["clip_frac_low"] = token_mean(low_T.float())
    metrics["clip_frac_high"] = token_mean(high_T.float())
    metrics["clip_frac"] = token_mean(clip_active_T.float())
    if config.dual_clip_c is not None:
        metrics["dual_clip_frac"] = token_mean(dual_active_T.float())
    ratio_d_T = ratio_T.detach()
    metrics["ratio_mean"] = token_mean(ratio_d_T)
    metrics["ratio_max"] = torch.where(mask_T, ratio_d_T, torch.full_like(ratio_d_T, -math.inf)).max() \
        if T else torch.tensor(-math.inf)
    metrics["ratio_min"] = torch.where(mask_T, ratio_d_T, torch.full_like(ratio_d_T, math.inf)).min() \
        if T else torch.tensor(math.inf)
    metrics["tokens"] = mask_T.sum().to(ct)
    metrics["loss"] = loss.detach()
    return loss, metrics


def metric_reduce_op(name: str) -> str:
    """How a metric combines across micro-batches and ranks: ``"max"``, ``"min"`` or ``"sum"``."""
    if name.endswith("_max"):
        return "max"
    if name.endswith("_min"):
        return "min"
    return "sum"


def reduce_metrics(per_microbatch: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Combine the metrics of several micro-batches by :func:`metric_reduce_op` (a metric missing
    from some micro-batches is combined over those that have it)."""
    out: dict[str, torch.Tensor] = {}
    for m in per_microbatch:
        for k, v in m.items():
            v = v.detach()
            if k not in out:
                out[k] = v.clone()
                continue
            op = metric_reduce_op(k)
            out[k] = torch.maximum(out[k], v) if op == "max" else torch.minimum(out[k], v) if op == "min" \
                else out[k] + v
    return out
