"""Per-sample (segment) reductions over flat token tensors, shared by the losses and IS code.

Shapes: ``T`` tokens of one micro-batch; ``G`` distinct ids in ``sample_index_T``.

A sample is identified by any integer in ``sample_index_T`` (global sample ids, local indices, or
-1 for padding all work); ids need not be contiguous or sorted. Every reduction is differentiable
(``index_add``), so a loss built on it back-propagates to the per-token inputs.
"""
from __future__ import annotations

import torch

__all__ = ["segment_ids", "packed_segment_ids", "segment_sum", "check_flat"]


def check_flat(name: str, x: torch.Tensor, T: int | None = None) -> int:
    """Raise unless ``x`` is a 1-D tensor (of length ``T`` when given); return its length."""
    if not torch.is_tensor(x):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"{name} must be a flat [T] tensor, got shape {tuple(x.shape)}")
    if T is not None and x.shape[0] != T:
        raise ValueError(f"{name} has {x.shape[0]} tokens, expected T={T} like the other inputs")
    return x.shape[0]


def segment_ids(sample_index_T: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(inverse_T, G)``: ``inverse_T[t]`` in ``[0, G)`` numbers token t's sample densely.

    On CUDA ``torch.unique`` synchronises with the host once (its output size is data-dependent).
    """
    unique_G, inverse_T = torch.unique(sample_index_T, return_inverse=True)
    return inverse_T, int(unique_G.numel())


def packed_segment_ids(cu_seqlens_S: torch.Tensor, T: int) -> tuple[torch.Tensor, int]:
    """:func:`segment_ids` of a packed micro-batch from its segment offsets (int ``[S + 1]``, on
    the tokens' device), without a host sync: ``G = S`` is the offsets' length. Valid where each
    segment is one sample and no sample spans two segments (the packer's micro-batches: padding
    is its own last segment). The ids number the segments in order, not the samples by id; every
    per-sample reduction over them is the same."""
    G = cu_seqlens_S.numel() - 1
    lens_S = (cu_seqlens_S[1:] - cu_seqlens_S[:-1]).to(torch.int64)
    inverse_T = torch.repeat_interleave(torch.arange(G, device=cu_seqlens_S.device), lens_S, output_size=T)
    return inverse_T, G


def segment_sum(values_T: torch.Tensor, inverse_T: torch.Tensor, G: int) -> torch.Tensor:
    """``[G]`` sums of ``values_T`` per dense segment id (differentiable)."""
    out_G = torch.zeros(G, dtype=values_T.dtype, device=values_T.device)
    return out_G.index_add(0, inverse_T, values_T)
