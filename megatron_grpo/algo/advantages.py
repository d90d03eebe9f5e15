"""Group-relative advantages: one scalar per sample, from its reward and its group's rewards.

Shapes: ``N`` samples of one step (all ranks' samples, in one agreed order); ``T`` tokens.

A *group* is the G completions of one prompt; ``group_ids_N`` says which group each sample is in
(any integers, need not be contiguous or sorted). With ``mean_g``, ``std_g`` the mean and the
Bessel-corrected (n-1) standard deviation of the rewards in sample i's group g (as TRL and verl):

* GRPO (DeepSeekMath, Shao et al. 2024):  ``A_i = (r_i - mean_g) / (std_g + eps)``
* Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"):  ``A_i = r_i - mean_g``
* DAPO (Yu et al. 2025) uses GRPO's ``A_i`` and its *dynamic sampling* drops every group whose
  rewards are all equal (``max_g - min_g <= min_spread``): :func:`dapo_keep_mask`.

A *degenerate* group (all rewards equal, including a group of one) gets exactly ``A_i = 0`` in
every variant, not ``0 / eps`` rounding noise. Statistics are computed in float64 and returned in
the rewards' dtype. The scalars become per-token advantages with :func:`broadcast_to_tokens`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .segments import segment_ids, segment_sum

__all__ = ["ADV_STD_EPS", "Advantages", "GroupStats", "group_stats", "grpo_advantages", "dr_grpo_advantages",
           "dapo_keep_mask", "compute_advantages", "broadcast_to_tokens"]

Variant = Literal["grpo", "dapo", "dr_grpo"]

ADV_STD_EPS = 1e-6
"""Added to std_g in GRPO's denominator so a group with a tiny but non-zero spread gets large but
finite advantages (verl's default; TRL uses 1e-4). Degenerate groups never reach it (they are 0)."""


def _check_inputs(rewards_N: torch.Tensor, group_ids_N: torch.Tensor) -> None:
    if rewards_N.dim() != 1 or group_ids_N.dim() != 1 or rewards_N.shape != group_ids_N.shape:
        raise ValueError(f"rewards_N and group_ids_N must both be [N]; got {tuple(rewards_N.shape)} "
                         f"and {tuple(group_ids_N.shape)}")
    if not rewards_N.is_floating_point():
        raise TypeError(f"rewards_N must be floating point, got {rewards_N.dtype}")
    if group_ids_N.is_floating_point() or group_ids_N.dtype == torch.bool:
        raise TypeError(f"group_ids_N must be an integer tensor, got {group_ids_N.dtype}")
    if not bool(torch.isfinite(rewards_N).all()):
        bad = torch.nonzero(~torch.isfinite(rewards_N)).flatten().tolist()
        raise ValueError(f"rewards of samples {bad[:10]} are not finite; fix the reward function")


@dataclass(frozen=True)
class GroupStats:
    """Per-sample views of each sample's group statistics (float64, all ``[N]``)."""

    mean_N: torch.Tensor
    """Mean reward of the sample's group."""
    std_N: torch.Tensor
    """Bessel-corrected std of the group's rewards (0 for a group of one)."""
    spread_N: torch.Tensor
    """max - min reward of the group; 0 means degenerate."""
    size_N: torch.Tensor
    """Number of samples in the group (int64)."""


def group_stats(rewards_N: torch.Tensor, group_ids_N: torch.Tensor) -> GroupStats:
    """Statistics of each sample's group, broadcast back to the samples."""
    _check_inputs(rewards_N, group_ids_N)
    r = rewards_N.detach().to(torch.float64)
    inv, G = segment_ids(group_ids_N)
    size_G = segment_sum(torch.ones_like(r), inv, G)
    mean_G = segment_sum(r, inv, G) / size_G
    dev = r - mean_G[inv]
    var_G = segment_sum(dev.square(), inv, G) / (size_G - 1).clamp(min=1)  # size 1 -> dev 0 -> var 0
    max_G = torch.full((G,), -torch.inf, dtype=r.dtype).scatter_reduce(0, inv, r, "amax")
    min_G = torch.full((G,), torch.inf, dtype=r.dtype).scatter_reduce(0, inv, r, "amin")
    return GroupStats(mean_N=mean_G[inv], std_N=var_G.sqrt()[inv], spread_N=(max_G - min_G)[inv],
                      size_N=size_G[inv].long())


def grpo_advantages(rewards_N: torch.Tensor, group_ids_N: torch.Tensor,
                    eps: float = ADV_STD_EPS) -> torch.Tensor:
    """GRPO: ``A_i = (r_i - mean_g) / (std_g + eps)``; 0 for degenerate groups. ``[N]``."""
    s = group_stats(rewards_N, group_ids_N)
    adv = (rewards_N.detach().to(torch.float64) - s.mean_N) / (s.std_N + eps)
    return torch.where(s.spread_N > 0, adv, torch.zeros_like(adv)).to(rewards_N.dtype)


def dr_grpo_advantages(rewards_N: torch.Tensor, group_ids_N: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO: ``A_i = r_i - mean_g`` (no std division); 0 for degenerate groups. ``[N]``."""
    s = group_stats(rewards_N, group_ids_N)
    adv = rewards_N.detach().to(torch.float64) - s.mean_N
    return torch.where(s.spread_N > 0, adv, torch.zeros_like(adv)).to(rewards_N.dtype)


def dapo_keep_mask(rewards_N: torch.Tensor, group_ids_N: torch.Tensor,
                   min_spread: float = 0.0) -> torch.Tensor:
    """DAPO dynamic sampling: ``[N]`` bool, False for every sample of a group whose rewards are all
    equal (``max_g - min_g <= min_spread``), i.e. a group that carries no gradient signal."""
    if min_spread < 0:
        raise ValueError(f"min_spread must be >= 0, got {min_spread}")
    return group_stats(rewards_N, group_ids_N).spread_N > min_spread


@dataclass(frozen=True)
class Advantages:
    """Per-sample advantages of one step and which samples to train on."""

    values_N: torch.Tensor
    """Scalar advantage of each sample (the rewards' dtype)."""
    keep_N: torch.Tensor
    """bool; False for samples DAPO's filter drops (all True for GRPO and Dr.GRPO)."""

    def __post_init__(self):
        if self.values_N.shape != self.keep_N.shape or self.values_N.dim() != 1:
            raise ValueError(f"values_N {tuple(self.values_N.shape)} and keep_N "
                             f"{tuple(self.keep_N.shape)} must both be [N]")
        if self.keep_N.dtype != torch.bool:
            raise TypeError(f"keep_N must be bool, got {self.keep_N.dtype}")


def compute_advantages(rewards_N: torch.Tensor, group_ids_N: torch.Tensor, variant: Variant,
                       *, eps: float = ADV_STD_EPS, min_spread: float = 0.0) -> Advantages:
    """The advantages of ``variant`` (``"grpo"``, ``"dapo"``, ``"dr_grpo"``); formulas in the module doc."""
    if variant == "grpo":
        return Advantages(grpo_advantages(rewards_N, group_ids_N, eps),
                          torch.ones_like(rewards_N, dtype=torch.bool))
    if variant == "dapo":
        return Advantages(grpo_advantages(rewards_N, group_ids_N, eps),
                          dapo_keep_mask(rewards_N, group_ids_N, min_spread))
    if variant == "dr_grpo":
        return Advantages(dr_grpo_advantages(rewards_N, group_ids_N),
                          torch.ones_like(rewards_N, dtype=torch.bool))
    raise ValueError(f"unknown variant {variant!r}; choose 'grpo', 'dapo' or 'dr_grpo'")


def broadcast_to_tokens(values_N: torch.Tensor, sample_index_T: torch.Tensor,
                        fill: float = 0.0) -> torch.Tensor:
    """``[T]`` per-token copy of per-sample scalars: ``out[t] = values_N[sample_index_T[t]]``, and
    ``fill`` where ``sample_index_T[t] < 0`` (padding)."""
    if values_N.dim() != 1 or sample_index_T.dim() != 1:
        raise ValueError(f"need values_N [N] and sample_index_T [T], got {tuple(values_N.shape)} "
                         f"and {tuple(sample_index_T.shape)}")
    valid_T = sample_index_T >= 0
    if bool((sample_index_T >= values_N.shape[0]).any()):
        raise IndexError(f"sample_index_T refers to sample {int(sample_index_T.max())} but only "
                         f"{values_N.shape[0]} values were given")
    gathered_T = values_N[sample_index_T.clamp(min=0)]
    return torch.where(valid_T, gathered_T, torch.full_like(gathered_T, fill))
