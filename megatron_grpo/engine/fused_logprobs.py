"""Fused output layer + vocab-parallel log-softmax: per-token logprobs / entropy from the final
hidden states and the output weight shard, never materialising the logits.

Shapes: ``T`` tokens of one packed micro-batch, ``R`` rows (positions) asked for, ``c`` rows of one
chunk, ``H`` hidden size, ``Vl`` this tensor-parallel rank's slice of the padded vocab
(``Vp / tp``), ``n_real`` its real (non-padding) columns, ``V`` the real vocab.

Inputs: ``h [T, H]`` (the thinker's final hidden states after the final norm, gathered over the
sequence when sequence parallelism is on: ``OmniThinker.forward(return_hidden=True)``) and
``W [Vl, H]`` (this rank's shard of the output layer's weight, the ``ColumnParallelLinear``
``weight``). Per chunk of ``c`` rows the forward computes ``x = h[rows] @ W[:n_real].T`` in the
compute dtype (the model's: bf16 under ``Float16Module``), upcasts to float32 and runs the very same
per-chunk statistics and TP all-reduces as the logits path (``engine.logprob_chunks.chunk_stats``: max,
sum-exp, entropy, target logit). Vocab padding columns never enter (only ``W[:n_real]`` is used).

Backward recomputes the chunk's logits, forms ``dx = d loss / d x`` ``[c, n_real]`` with the logits
path's formula (``engine.logprob_chunks.chunk_dlogits``), casts it to the compute dtype (as the logits
path's bf16 logits gradient) and accumulates::

    dh[rows] += dx @ W[:n_real]          (h's dtype)
    dW[:n_real] += dx.T @ h[rows]        (float32 accumulator, float64 for float64 weights)

``dW`` is returned as the ordinary autograd gradient of ``W`` (cast to ``W``'s dtype), so megatron's
DDP hooks add it to ``main_grad`` as for any parameter; ``dh`` flows back into the thinker, whose
sequence gather reduce-scatters it over TP (SP), or whose copy-to-TP-region all-reduces it (TP
without SP): each rank's ``dh`` is the partial sum over its vocab shard, like the output layer's.

Memory: temporaries are ``[c, n_real]`` (at most three at once: the compute-dtype product, the
float32 logits, ``exp``) plus, for non-float32 weights, one ``[n_real, H]`` product per chunk and the
float32 ``[Vl, H]`` accumulator of ``dW``; nothing of size ``[T, Vl]`` exists in the forward or the
backward. Saved for backward: ``h`` and ``W`` themselves (no copies) and ``[R]`` vectors.
Collectives: two per chunk in the forward (same count on every TP rank), none in the backward.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .logprob_chunks import DEFAULT_CHUNK_TOKENS, backward_chunks, check_chunk, finish_forward, forward_chunks, prepare

__all__ = ["fused_vocab_parallel_logprobs"]


def _chunk_logits(h_TH: torch.Tensor, w_real_VH: torch.Tensor, rows_c: torch.Tensor, ct: torch.dtype) -> torch.Tensor:
    """``[c, n_real]`` logits of ``rows_c`` in ``ct``: a fresh tensor (safe to modify in place)."""
    x = torch.matmul(h_TH.index_select(0, rows_c), w_real_VH.t())  # compute dtype, fresh
    return x if x.dtype == ct else x.to(ct)


class _FusedLMHeadLogprobs(torch.autograd.Function):
    """h [T, H], W [Vl, H], rows [R], targets [R] -> (logprobs [R], entropy [R]) in float32
    (float64 for float64 inputs)."""

    @staticmethod
    def forward(ctx, h_TH, w_VH, rows_R, targets_R, vocab_start, n_real, group, tp_size, chunk, with_entropy):
        ct = torch.promote_types(h_TH.dtype, torch.float32)
        w_real = w_VH[:n_real]
        logp_R, logz_R, ent_R, local_t_R, owned_R = forward_chunks(
            lambda rows: _chunk_logits(h_TH, w_real, rows, ct), rows_R, targets_R, vocab_start, n_real, group,
            tp_size, chunk, with_entropy, ct)
        ctx.save_for_backward(h_TH, w_VH, rows_R, local_t_R, owned_R, logz_R, ent_R)
        ctx.n_real, ctx.chunk, ctx.with_entropy = n_real, chunk, with_entropy
        return finish_forward(ctx, logp_R, ent_R, with_entropy)

    @staticmethod
    def backward(ctx, g_logp_R, g_ent_R):
        h_TH, w_VH, rows_R, local_t_R, owned_R, logz_R, ent_R = ctx.saved_tensors
        n_real = ctx.n_real
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        use_ent = ctx.with_entropy and g_ent_R is not None
        ct = logz_R.dtype
        acc = torch.promote_types(w_VH.dtype, torch.float32)
        dh = torch.zeros_like(h_TH) if need_h else None
        dw = torch.zeros(w_VH.shape, dtype=acc, device=w_VH.device) if need_w else None
        w_real = w_VH[:n_real]
        if n_real > 0 and (need_h or need_w):
            for rows, dx in backward_chunks(lambda rows: _chunk_logits(h_TH, w_real, rows, ct), rows_R, local_t_R,
                                            owned_R, logz_R, ent_R, g_logp_R, g_ent_R if use_ent else None,
                                            ctx.chunk):
                dx = dx.to(w_VH.dtype)  # the compute dtype, as the logits path's logits gradient
                if need_h:
                    dh.index_add_(0, rows, torch.matmul(dx, w_real).to(dh.dtype))
                if need_w:
                    h_c = h_TH.index_select(0, rows).to(w_VH.dtype)
                    if acc == w_VH.dtype:
                        dw[:n_real].addmm_(dx.t(), h_c)
                    elif _accumulating_mm(dw):  # the GEMM adds into the float32 accumulator itself
                        torch.addmm(dw[:n_real], dx.t(), h_c, out_dtype=acc, out=dw[:n_real])
                    else:  # bf16 GEMM per chunk, float32 accumulation across chunks
                        dw[:n_real].add_(torch.matmul(dx.t(), h_c))
                    del h_c
                del dx
        if need_w:
            dw = dw.to(w_VH.dtype)
        return dh, dw, None, None, None, None, None, None, None, None


def _accumulating_mm(acc: torch.Tensor) -> bool:
    """Whether ``torch.addmm(..., out_dtype=float32)`` adds a half-precision GEMM into ``acc`` on its
    device (CUDA, torch >= 2.9): one pass over the [V, H] accumulator per chunk instead of a bf16
    product and a mixed-dtype add (1.2 ms per chunk for a 151,936 x 2,048 head on an H200)."""
    return acc.is_cuda and _addmm_out_dtype_runs(str(acc.device))


@functools.lru_cache(maxsize=None)
def _addmm_out_dtype_runs(device: str) -> bool:
    try:
        c = torch.ones(1, 1, device=device)
        half = torch.ones(1, 1, dtype=torch.bfloat16, device=device)
        torch.addmm(c, half, half, out_dtype=torch.float32, out=c)
        return float(c) == 2.0
    except (TypeError, RuntimeError):
        return False


def fused_vocab_parallel_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                                  vocab_size: int, rows: Optional[torch.Tensor] = None,
                                  chunk_size: int = DEFAULT_CHUNK_TOKENS, with_entropy: bool = False, group=None
                                  ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``vocab_parallel_logprobs(output_layer(hidden), ...)`` without the logits (module doc).

    ``hidden``: ``[T, 1, H]`` or ``[T, H]``, the full sequence on every TP rank (sequence-gathered
    with an autograd-aware gather when SP is on). ``weight``: ``[Vl, H]``, this TP rank's shard of
    the output layer (rows ``[tp_rank * Vl, (tp_rank + 1) * Vl)`` of the padded vocab), same dtype as
    ``hidden``. The other arguments and the result are those of
    :func:`~megatron_grpo.engine.logprobs.vocab_parallel_logprobs`; differentiable in ``hidden``
    and ``weight``.
    """
    if hidden.dim() == 3:
        if hidden.shape[1] != 1:
            raise ValueError(f"hidden must be [T, 1, H] (packed, batch 1) or [T, H], got {tuple(hidden.shape)}")
        hidden = hidden.reshape(hidden.shape[0], hidden.shape[2])
    if hidden.dim() != 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"need hidden [T, H] and weight [Vl, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if not hidden.is_floating_point() or hidden.dtype != weight.dtype:
        raise TypeError(f"hidden and weight must share one floating dtype, got {hidden.dtype} and {weight.dtype}")
    check_chunk(chunk_size)
    T, Vl = hidden.shape[0], weight.shape[0]
    group, tp, vocab_start, n_real, rows, targets = prepare(T, Vl, targets, rows, vocab_size, group, hidden.device,
                                                             "the output weight holds")
    logp, ent = _FusedLMHeadLogprobs.apply(hidden, weight, rows, targets, vocab_start, n_real, group, tp,
                                           int(chunk_size), bool(with_entropy))
    return logp, (ent if with_entropy else None)
