"""Selective recomputation of the MoE experts' cheap activations (torch backend).

Of what autograd keeps per MoE layer, the two largest tensors are cheap to rebuild:

* the expert-sorted input rows ``[T*k, h]`` that the first grouped GEMM saves for its weight
  gradient (``k`` copies of every token: 32 KB per token at h=2048, k=8, bf16): one row gather
  from the ``[T, h]`` tokens they were gathered from, which stay alive anyway (the router saved
  them for its own backward);
* the SwiGLU output ``[T*k, F]`` that the second grouped GEMM saves (12 KB per token at F=768):
  one elementwise pass over the first GEMM's output, which the SwiGLU's backward keeps anyway.

:class:`RecomputeSaved` is a ``torch.autograd.graph.saved_tensors_hooks`` context that stores a
recipe instead of a given tensor when an op inside it saves that tensor, and runs the recipe when
the backward unpacks it. The recomputation is exact (same kernels, same inputs), so gradients are
bit-identical with and without it; the cost is one gather and one SwiGLU pass per layer in the
backward (memory-bound, ~2% of a full-width layer's step on an H200). Turned on per model with
``build_thinker(..., recompute="experts")`` (``model.recompute`` in the training config).
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["RecomputeSaved", "ROWS_OF_ATTR"]

ROWS_OF_ATTR = "_mgrpo_rows_of"
"""Attribute a row gather puts on its output: ``(source [N, h], row indices [R])``, so that the
experts can save the recipe ``source[rows]`` instead of the ``[R, h]`` rows (see ``permute.py``)."""


class _Recipe:
    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], torch.Tensor]):
        self.fn = fn


class RecomputeSaved(torch.autograd.graph.saved_tensors_hooks):
    """Inside this context, a saved tensor that is (the same storage view as) ``target`` is replaced
    by ``recipe`` (a no-argument callable, run without grad in the backward); every other saved
    tensor is kept as is. The recipe must not hold a reference to ``target``."""

    def __init__(self, target: torch.Tensor, recipe: Callable[[], torch.Tensor]):
        # only metadata of the target is kept: a reference would keep its memory alive
        meta = (target.device, target.dtype, tuple(target.shape), target.stride(), target.data_ptr())

        def pack(t: torch.Tensor):
            if (t.device, t.dtype, tuple(t.shape), t.stride(), t.data_ptr()) == meta:
                return _Recipe(recipe)
            return t

        def unpack(p):
            if isinstance(p, _Recipe):
                with torch.no_grad():
                    return p.fn()
            return p

        super().__init__(pack, unpack)
