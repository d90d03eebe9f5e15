"""Zero weight gradients for the experts that received no rows.

``F.grouped_mm``'s weight gradient (the 2-D x 2-D grouped GEMM, ``[E, out, in]``) is allocated
uninitialised, and some of its kernels skip the groups of zero rows: an expert that received no
tokens in a micro-batch then gets whatever the memory held as its gradient (PyTorch issue 172439 on
Blackwell, ROCm pull 174314, MSLK pull 158; not every GPU and version, so it is not left to chance).
Fresh memory happens to be zeros, so short runs look right; reused memory (a CUDA graph's pool,
a long run's caching allocator) can hold anything, NaN included. With 128 experts and micro-batches
of a few thousand tokens, later layers routinely leave tens of experts empty.

:func:`zero_empty_group_grads` is an identity on the expert weight whose backward zeroes the
gradient slices of the empty groups in place: one Triton launch on CUDA whose programs return at
once for experts with rows (no pass over the whole gradient), ``masked_fill_`` elsewhere.
"""
from __future__ import annotations

import functools

import torch

from ._triton import import_triton, triton_runs_on

__all__ = ["zero_empty_group_grads"]

_STRIPES = 16
"""Programs per expert: an empty expert's slice (up to ~3M elements at full width) is zeroed by
this many programs, each looping over its stripe."""
_BLOCK = 4096


@functools.lru_cache(maxsize=None)
def _kernels():
    if (mods := import_triton("MGRPO_TRITON_EMPTY_GROUPS")) is None:
        return None
    triton, tl = mods

    @triton.jit
    def zero_empty(g_ptr, offs_ptr, n, STRIPES: tl.constexpr, BLOCK: tl.constexpr):
        e = tl.program_id(0)
        hi = tl.load(offs_ptr + e)
        lo = tl.load(offs_ptr + tl.maximum(e - 1, 0))
        lo = tl.where(e > 0, lo, 0)
        if hi == lo:
            base = g_ptr + e.to(tl.int64) * n
            for start in range(tl.program_id(1) * BLOCK, n, STRIPES * BLOCK):
                idx = start + tl.arange(0, BLOCK)
                tl.store(base + idx, tl.zeros([BLOCK], dtype=g_ptr.dtype.element_ty), mask=idx < n)

    return zero_empty


def _expert_blocks(g: torch.Tensor):
    """``g [E, a, b]`` as ``[E, a * b]`` over its storage, when each expert's slice is one
    contiguous block (contiguous, or its last two dims transposed); else None."""
    E, a, b = g.shape
    n = a * b
    if g.stride(0) == n and sorted(((g.stride(1), a), (g.stride(2), b))) in ([(1, b), (b, a)], [(1, a), (a, b)]):
        return g.as_strided((E, n), (n, 1))
    return None


def _zero_empty_(g_EAB: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    flat = _expert_blocks(g_EAB)
    kernel = _kernels() if flat is not None and triton_runs_on(g_EAB.is_cuda) else None
    if kernel is not None:
        E, n = flat.shape
        kernel[(E, _STRIPES)](flat, offs_E, n, STRIPES=_STRIPES, BLOCK=_BLOCK)
        return g_EAB
    counts_E = torch.diff(offs_E.long(), prepend=offs_E.new_zeros(1).long())
    return g_EAB.masked_fill_((counts_E == 0)[:, None, None], 0)


class _ZeroEmptyGroupGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w_EAB, offs_E):
        ctx.save_for_backward(offs_E)
        return w_EAB.view_as(w_EAB)

    @staticmethod
    def backward(ctx, grad_EAB):
        (offs_E,) = ctx.saved_tensors
        if grad_EAB is None:
            return None, None
        return _zero_empty_(grad_EAB, offs_E), None


def zero_empty_group_grads(w_EAB: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """``w_EAB`` unchanged; in backward, the gradient of every expert ``e`` with no rows
    (``offs_E[e] == offs_E[e - 1]``, int32 cumulative row counts) is set to zero in place."""
    if not w_EAB.requires_grad:
        return w_EAB
    return _ZeroEmptyGroupGrads.apply(w_EAB, offs_E)
