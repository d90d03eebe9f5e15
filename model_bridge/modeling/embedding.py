"""Token-embedding backward by sorted segments: the torch backend's word embeddings.

Shapes: ``T`` tokens of a micro-batch, ``V`` vocab rows (of this TP rank), ``h`` hidden.

torch's ``embedding_dense_backward`` took ~0.95 ms per step on an H200 for 22,800 tokens of a
152,064 x 2,048 bf16 table (~2% of a 2-layer step), most of it not the 623 MB zero-fill of the
gradient but its partial-segment bookkeeping. Here the backward is: a stable argsort of the ids,
each run of equal ids found with ``searchsorted``, and two Triton passes over windows of
:data:`RUN_WINDOW` sorted positions. The first sums each run's gradient rows in fp32 (in token
order), writing a run that lies inside one window to its row and keeping the partial sums of a
run that crosses windows; the second adds those partials in window order and writes the row. So a
long run (a micro-batch's audio placeholders, 16k+ positions of one id) is summed in parallel, not
by one program. No atomics, no host sync; the summation order is fixed, so the result is
deterministic. CUDA only (or Triton's interpreter in tests);
``MGRPO_TRITON_EMBED=0`` keeps torch's backward.

:func:`use_sorted_embedding_backward` switches megatron's ``VocabParallelEmbedding`` to it (the
same instance, class swapped) where its forward is a plain lookup: one TP rank, no sequence-parallel
reduce-scatter, no deterministic-mode indexing, no GTP rematerialisation; anything else runs
megatron's forward unchanged.
"""
from __future__ import annotations

import functools

import torch

from ._triton import import_triton, triton_runs_on

__all__ = ["sorted_embedding", "use_sorted_embedding_backward"]


RUN_WINDOW = 64
"""Sorted positions one program sums: a run of equal ids longer than this (the audio placeholder of
a micro-batch full of recordings, its padding) is summed by several programs in parallel, in
window-sized partial sums that a second pass adds in order."""


@functools.lru_cache(maxsize=None)
def _triton_embed_bwd_kernel():
    """``(windows, join)``: the two passes of :func:`_sorted_grad`; None without Triton."""
    if (mods := import_triton("MGRPO_TRITON_EMBED")) is None:
        return None
    triton, tl = mods

    @triton.jit
    def windows(g_ptr, order_ptr, sid_ptr, start_ptr, end_ptr, out_ptr, head_ptr, tail_ptr, T, H, stride_g,
                stride_o, C: tl.constexpr, BLOCK_H: tl.constexpr):
        # window k = sorted positions [k C, k C + C): a run wholly inside is written to its row; the
        # part of a run that entered from the left is the window's head partial, the part of a run
        # that starts inside and leaves on the right its tail partial (fp32, summed in token order)
        k = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        cm = cols < H  # a scalar condition joins it through tl.where (the interpreter's & does not broadcast it)
        lo = k * C
        hi = tl.minimum(lo + C, T)
        cur = tl.load(sid_ptr + lo)
        start = tl.load(start_ptr + lo)
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in range(lo, hi):
            t = tl.load(sid_ptr + j)
            flush = t != cur
            tl.store(out_ptr + cur.to(tl.int64) * stride_o + cols, acc.to(out_ptr.dtype.element_ty),
                     mask=tl.where(flush & (start >= lo), cm, False))
            tl.store(head_ptr + k.to(tl.int64) * H + cols, acc, mask=tl.where(flush & (start < lo), cm, False))
            acc = tl.where(flush, 0.0, acc)
            start = tl.where(flush, j, start)
            cur = t
            row = tl.load(order_ptr + j).to(tl.int64)
            acc += tl.load(g_ptr + row * stride_g + cols, mask=cm, other=0.0).to(tl.float32)
        closed = tl.load(end_ptr + hi - 1) <= hi
        tl.store(out_ptr + cur.to(tl.int64) * stride_o + cols, acc.to(out_ptr.dtype.element_ty),
                 mask=tl.where(closed & (start >= lo), cm, False))
        tl.store(head_ptr + k.to(tl.int64) * H + cols, acc, mask=tl.where(start < lo, cm, False))
        tl.store(tail_ptr + k.to(tl.int64) * H + cols, acc, mask=tl.where((closed == 0) & (start >= lo), cm, False))

    @triton.jit
    def join(sid_ptr, start_ptr, end_ptr, out_ptr, head_ptr, tail_ptr, T, H, stride_o, C: tl.constexpr,
             BLOCK_H: tl.constexpr):
        # a run that leaves window k on the right: its tail partial plus the heads of the windows
        # it covers, in order, written to its row
        k = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        cm = cols < H
        last = tl.minimum(k * C + C, T) - 1
        end = tl.load(end_ptr + last)
        has_tail = (tl.load(start_ptr + last) >= k * C) & (end > last + 1)
        acc = tl.load(tail_ptr + k.to(tl.int64) * H + cols, mask=tl.where(has_tail, cm, False), other=0.0)
        more = tl.where(has_tail, (end + C - 1) // C - (k + 1), 0)
        for m in range(0, more):
            acc += tl.load(head_ptr + (k + 1 + m).to(tl.int64) * H + cols, mask=cm, other=0.0)
        tok = tl.load(sid_ptr + last).to(tl.int64)
        tl.store(out_ptr + tok * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=tl.where(has_tail, cm, False))

    return windows, join


def _sorted_grad(ids_T: torch.Tensor, grad_Th: torch.Tensor, V: int) -> torch.Tensor:
    """``[V, h]`` weight gradient of ``weight[ids_T]`` (rows no id hits are zero)."""
    import triton

    grad_Th = grad_Th if grad_Th.stride(-1) == 1 else grad_Th.contiguous()
    T, H = grad_Th.shape
    out_Vh = torch.zeros(V, H, dtype=grad_Th.dtype, device=grad_Th.device)
    if T:
        order_T = torch.argsort(ids_T, stable=True)  # equal ids keep token order: a fixed summation order
        sid_T = ids_T.index_select(0, order_T)
        start_T = torch.searchsorted(sid_T, sid_T).to(torch.int32)  # each run's first position
        end_T = torch.searchsorted(sid_T, sid_T, right=True).to(torch.int32)  # one past its last
        windows = triton.cdiv(T, RUN_WINDOW)
        head_WH = torch.empty(windows, H, dtype=torch.float32, device=grad_Th.device)
        tail_WH = torch.empty_like(head_WH)
        block = min(1024, triton.next_power_of_2(H))
        grid = (windows, triton.cdiv(H, block))
        k_windows, k_join = _triton_embed_bwd_kernel()
        k_windows[grid](grad_Th, order_T, sid_T, start_T, end_T, out_Vh, head_WH, tail_WH, T, H, grad_Th.stride(0),
                        out_Vh.stride(0), C=RUN_WINDOW, BLOCK_H=block, num_warps=4)
        k_join[grid](sid_T, start_T, end_T, out_Vh, head_WH, tail_WH, T, H, out_Vh.stride(0), C=RUN_WINDOW,
                     BLOCK_H=block, num_warps=4)
    return out_Vh


class _SortedEmbedding(torch.autograd.Function):
    """``weight[ids]``; backward by sorted segments (module docstring)."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.vocab = weight.shape[0]
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        return None, _sorted_grad(ids.reshape(-1), grad.reshape(-1, grad.shape[-1]), ctx.vocab)


def sorted_embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, weight)`` whose weight gradient comes from :func:`_sorted_grad` where the
    kernel runs (CUDA, Triton, ``MGRPO_TRITON_EMBED`` not 0); plain ``F.embedding`` otherwise."""
    if not (weight.requires_grad and triton_runs_on(weight.is_cuda) and _triton_embed_bwd_kernel() is not None):
        return torch.nn.functional.embedding(ids, weight)
    return _SortedEmbedding.apply(ids, weight)


def _plain_lookup(emb) -> bool:
    """Whether megatron's forward would be ``F.embedding(input, weight)`` and nothing else."""
    return (emb.tp_group.size() == 1 and not getattr(emb, "reduce_scatter_embeddings", False)
            and not getattr(emb, "deterministic_mode", False) and getattr(emb, "gtp_remat_size", 1) <= 1)


def _sorted_forward(self, input_):
    if not _plain_lookup(self):
        return type(self).__mro__[1].forward(self, input_)
    return sorted_embedding(input_, self.weight)


@functools.lru_cache(maxsize=None)
def _sorted_class(base: type) -> type:
    return type(f"Sorted{base.__name__}", (base,), {"forward": _sorted_forward, "__doc__":
                f"megatron ``{base.__name__}`` with the sorted-segment weight gradient (model_bridge/modeling/embedding.py)."})


def use_sorted_embedding_backward(emb: torch.nn.Module) -> torch.nn.Module:
    """Swap a megatron ``VocabParallelEmbedding`` (``emb``) to the sorted-segment backward: same
    object, parameters and state dict; returns it."""
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    if not isinstance(emb, VocabParallelEmbedding):
        raise TypeError(f"use_sorted_embedding_backward: expected megatron's VocabParallelEmbedding, got "
                        f"{type(emb).__name__}")
    if type(emb).forward is not _sorted_forward:
        emb.__class__ = _sorted_class(type(emb))
    return emb
