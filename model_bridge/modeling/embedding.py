"""Token-embedding backward by sorted segments: the torch backend's word embeddings.

Shapes: ``T`` tokens of a micro-batch, ``V`` vocab rows (of this TP rank), ``h`` hidden.

torch's ``embedding_dense_backward`` took ~0.95 ms per step on an H200 for 22,800 tokens of a
152,064 x 2,048 bf16 table (~2% of a 2-layer step), most of it not the 623 MB zero-fill of the
gradient but its partial-segment bookkeeping. Here the backward is: a stable argsort of the ids,
each run of equal ids found with ``searchsorted``, and one Triton pass in which the first position
of every run sums that run's gradient rows in fp32 (in token order: deterministic) and writes the
row once. No atomics, no host sync. CUDA only (or Triton's interpreter in tests);
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


@functools.lru_cache(maxsize=None)
def _triton_embed_bwd_kernel():
    """``out[sid[i]] = sum_{j in [i, end[i])} g[order[j]]`` for every run start ``i``; None without Triton."""
    if (mods := import_triton("MGRPO_TRITON_EMBED")) is None:
        return None
    triton, tl = mods

    @triton.jit
    def embed_bwd(g_ptr, order_ptr, sid_ptr, end_ptr, out_ptr, H, stride_g, stride_o, BLOCK_H: tl.constexpr):
        i = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        cm = cols < H
        tok = tl.load(sid_ptr + i)
        prev = tl.load(sid_ptr + tl.maximum(i - 1, 0))
        if (i == 0) | (prev != tok):  # the first position of a run of equal ids owns the row
            end = tl.load(end_ptr + i)
            acc = tl.zeros([BLOCK_H], dtype=tl.float32)
            for j in range(i, end):
                row = tl.load(order_ptr + j).to(tl.int64)
                acc += tl.load(g_ptr + row * stride_g + cols, mask=cm, other=0.0).to(tl.float32)
            tl.store(out_ptr + tok.to(tl.int64) * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=cm)

    return embed_bwd


def _sorted_grad(ids_T: torch.Tensor, grad_Th: torch.Tensor, V: int) -> torch.Tensor:
    """``[V, h]`` weight gradient of ``weight[ids_T]`` (rows no id hits are zero)."""
    import triton

    grad_Th = grad_Th if grad_Th.stride(-1) == 1 else grad_Th.contiguous()
    T, H = grad_Th.shape
    out_Vh = torch.zeros(V, H, dtype=grad_Th.dtype, device=grad_Th.device)
    if T:
        order_T = torch.argsort(ids_T, stable=True)  # equal ids keep token order: a fixed summation order
        sid_T = ids_T.index_select(0, order_T)
        end_T = torch.searchsorted(sid_T, sid_T, right=True)  # one past each run's last position
        block = min(1024, triton.next_power_of_2(H))
        _triton_embed_bwd_kernel()[(T, triton.cdiv(H, block))](
            grad_Th, order_T, sid_T, end_T, out_Vh, H, grad_Th.stride(0), out_Vh.stride(0), BLOCK_H=block, num_warps=4)
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
