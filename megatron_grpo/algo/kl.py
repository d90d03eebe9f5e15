"""Per-token KL estimators between the policy and a reference (or between two samplers).

Shapes: ``T`` tokens. All inputs are log-probabilities of the *sampled* tokens.

With ``log r_t = logp_t - ref_logp_t`` (``logp`` = log pi_theta, ``ref_logp`` = log pi_ref) and
tokens sampled from pi_theta, each estimator's expectation is (or approximates) KL(pi_theta || pi_ref)
(Schulman, "Approximating KL Divergence", 2020):

* ``k1``: ``log r_t``                                    unbiased, high variance, can be negative
* ``k2``: ``0.5 * (log r_t)^2``                          biased, low variance, >= 0
* ``k3``: ``exp(-log r_t) + log r_t - 1``                unbiased, low variance, >= 0 (GRPO's choice,
                                                           DeepSeekMath eq. 4: pi_ref/pi - log(pi_ref/pi) - 1)

k3 is computed as ``expm1(-log r_t) + log r_t``, the same value: near the reference (|log r| ~ 1e-4,
a rollout engine against the trainer) ``exp(x) - 1`` loses the ``x^2 / 2`` it is made of to fp32
rounding, and the estimate comes out negative for ~1 token in 10 with a mean of the wrong sign;
``expm1`` keeps it (``expm1(x) >= x`` survives faithful rounding, so each token's k3 is >= 0).
"""
from __future__ import annotations

from typing import Literal

import torch

__all__ = ["KL_ESTIMATORS", "KL_LOG_RATIO_CLAMP", "kl_estimate"]

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")

KL_LOG_RATIO_CLAMP = 20.0
"""|log r| is clamped to this before k2/k3: exp(20) ~ 4.9e8 is finite in fp32 and bf16 (exp(89)
overflows fp32), so one wildly off token cannot turn the loss into inf/NaN. Tokens that far apart
are garbage anyway; the clamp zeroes their KL gradient and changes nothing below the bound.
k1 is linear and left unclamped."""


def kl_estimate(logprobs_T: torch.Tensor, ref_logprobs_T: torch.Tensor,
                estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token ``[T]`` estimate of KL(pi || pi_ref) by ``estimator`` (formulas in the module doc).

    Differentiable in ``logprobs_T``; ``ref_logprobs_T`` should be detached by the caller (it is a
    fixed reference). Unmasked: the caller multiplies by its loss mask.
    """
    if logprobs_T.shape != ref_logprobs_T.shape:
        raise ValueError(f"logprobs {tuple(logprobs_T.shape)} and ref_logprobs "
                         f"{tuple(ref_logprobs_T.shape)} differ in shape")
    log_r_T = logprobs_T - ref_logprobs_T
    if estimator == "k1":
        return log_r_T
    log_r_T = log_r_T.clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    if estimator == "k2":
        return 0.5 * log_r_T.square()
    if estimator == "k3":
        return torch.expm1(-log_r_T) + log_r_T  # = exp(-log r) + log r - 1 without the cancellation (module doc)
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {KL_ESTIMATORS}")
