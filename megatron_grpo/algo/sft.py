"""Supervised fine-tuning loss on the flat tokens of one micro-batch.

Shapes: ``T`` tokens of one packed micro-batch (padding included; the loss mask removes it).

The step loss is the token-mean negative log-likelihood over every loss token of the step (all
micro-batches of all data-parallel ranks)::

    L = -(1 / N_tok) * sum_i sum_{t in o_i} log p(x_t | x_<t)

where ``o_i`` are sample i's assistant tokens (``megatron_grpo.sft.tokens``) and ``N_tok`` is
``global_num_tokens``. Each micro-batch returns its exact share, so shares add up to the step
loss (the engine SUMs them, as for the policy losses of :mod:`.losses`).
"""
from __future__ import annotations

from typing import Optional

import torch

from .losses import Number, _positive
from .segments import check_flat

__all__ = ["sft_loss"]


def sft_loss(logprobs_T: torch.Tensor, loss_mask_T: torch.Tensor, *, global_num_tokens: Number,
             entropy_T: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss, metrics)``: this micro-batch's share of the step's token-mean NLL.

    Metrics (detached, all reduce by SUM): ``loss`` (= ``nll``, the share), ``tokens`` (local loss
    tokens), ``entropy`` (share of the token-mean entropy, when ``entropy_T`` is given)."""
    T = check_flat("logprobs_T", logprobs_T)
    check_flat("loss_mask_T", loss_mask_T, T)
    if entropy_T is not None:
        check_flat("entropy_T", entropy_T, T)
    n_tok = _positive("global_num_tokens", global_num_tokens)
    mask_T = loss_mask_T.to(torch.bool)
    ct = torch.promote_types(logprobs_T.dtype, torch.float32)
    logp_T = logprobs_T.to(ct)
    zeros_T = torch.zeros_like(logp_T)
    loss = -torch.where(mask_T, logp_T, zeros_T).sum() / n_tok
    metrics = {"loss": loss.detach(), "nll": loss.detach(), "tokens": mask_T.sum().to(ct)}
    if entropy_T is not None:
        metrics["entropy"] = torch.where(mask_T, entropy_T.to(ct), zeros_T).sum().detach() / n_tok
    return loss, metrics
