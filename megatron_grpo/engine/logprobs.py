"""Per-token log-probabilities and entropy from vocab-parallel logits, computed in chunks of tokens.

Shapes: ``T`` tokens of one packed micro-batch, ``R`` rows (positions) asked for, ``c`` rows of
one chunk, ``Vl`` this tensor-parallel rank's slice of the padded vocab (``Vp / tp``), ``V`` the
real vocab.

The thinker's last pipeline stage gives logits ``[T, 1, Vl]`` (each TP rank holds the columns
``[tp_rank * Vl, (tp_rank + 1) * Vl)`` of the padded vocab). A log-softmax over the full vocab is
computed without ever gathering the vocab and without a float32 ``[T, Vl]`` tensor: rows are taken
``chunk_size`` at a time, and per chunk

1. ``m = max`` over the local real columns, all-reduce MAX over TP;
2. ``S = sum exp(x - m)``, ``D = sum exp(x - m) * (x - m)`` and the target's shifted logit
   (``x[target] - m`` on the rank that owns the target column, 0 elsewhere), one all-reduce SUM
   over TP of the stacked ``[3, c]``;
3. ``logp = (x[target] - m) - log S`` and ``H = log S - D / S`` (entropy in nats).

Columns at or beyond the real vocab ``V`` (megatron's vocab padding) never enter: they are sliced
off before the max, so they cannot leak into the softmax even if the model did not mask them.

Backward (a custom ``autograd.Function`` over the whole micro-batch, so autograd sees one node and
the gradient is written chunk by chunk into one ``[T, Vl]`` buffer of the logits' dtype) recomputes
``p = exp(x - logZ)`` per chunk, with ``logZ = m + log S`` and ``H`` saved from the forward
(``[R]`` floats each), and needs no communication::

    d logp / d x_j = 1[j = target] - p_j
    d H    / d x_j = -p_j * (x_j - E_p[x]),   E_p[x] = logZ - H

Memory: the largest float32 temporaries are ``[c, Vl]`` (two of them at once); nothing of size
``[T, Vl]`` is allocated besides the gradient of the logits themselves, in the logits' dtype.
Collectives: two per chunk in the forward (same count on every TP rank: the chunking is a function
of ``R`` only), none in the backward.

The per-chunk forward statistics (``_chunk_stats``) and backward formula (``_chunk_dlogits``) are
shared with ``engine.fused_logprobs``, which multiplies each chunk's logits from the final hidden
states and the output weight itself, so that neither the logits nor their gradient ever exist
(``token_logprobs(..., lm_head_weight=W)``).

Alignment (:func:`token_logprobs`): the logits at position ``t`` predict token ``t + 1``.
The result is aligned to the *tokens*, like ``Trajectory.rollout_logprobs_T``: ``logprobs_T[t] =
log p(input_ids[t] | input_ids[:t] of the same sample)``, taken from the logits at ``t - 1``; the
first token of every packed segment (sample start, padding start) has no prediction and gets 0.
``entropy_T[t]`` is the entropy of that same predicted distribution.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["DEFAULT_CHUNK_TOKENS", "vocab_parallel_logprobs", "token_logprobs", "segment_starts",
           "shift_right_within_samples"]

DEFAULT_CHUNK_TOKENS = 1024
"""Rows per chunk: 1024 x 152064 / tp float32 is 0.6 GB at tp=1, two such temporaries at once."""


def _tp_info(group) -> tuple[int, int]:
    """(size, rank) of ``group``; ``None`` means megatron's TP group if initialised, else (1, 0)."""
    import torch.distributed as dist

    if group is None:
        try:
            from megatron.core import parallel_state as ps

            if ps.model_parallel_is_initialized():
                group = ps.get_tensor_model_parallel_group()
        except ImportError:  # pragma: no cover - megatron is a dependency
            group = None
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _resolve_group(group):
    if group is not None:
        return group
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()


def _chunk_stats(x_cV: torch.Tensor, local_t_c: torch.Tensor, own_c: torch.Tensor, group, tp_size: int,
                 with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 1-3 of the module doc for one chunk: ``(logp [c], logZ [c], H [c])``.

    ``x_cV``: ``[c, n_real]`` logits of the chunk's rows over this rank's *real* columns, in the
    compute dtype, a fresh tensor (overwritten with ``x - m``); ``[c, 0]`` when all of this rank's
    columns are padding. ``local_t_c``: the target's local column (0 where not owned), ``own_c``:
    whether this rank owns it. Issues the two TP all-reduces (every rank, same order). ``H`` is
    meaningless (``log S``) when ``with_entropy`` is off. Shared by the logits path and the fused
    output-layer path (``engine.fused_logprobs``)."""
    c, n_real = x_cV.shape
    ct, dev = x_cV.dtype, x_cV.device
    if n_real > 0:
        m = x_cV.max(dim=-1).values
    else:
        m = torch.full((c,), float("-inf"), dtype=ct, device=dev)
    if tp_size > 1:
        torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
    x_cV.sub_(m[:, None])  # x - m
    ex = torch.exp(x_cV)
    stats = torch.empty(3, c, dtype=ct, device=dev)
    stats[0] = ex.sum(dim=-1)
    if with_entropy:
        stats[1] = torch.bmm(ex.unsqueeze(1), x_cV.unsqueeze(2)).view(c)  # sum exp(x-m) * (x-m)
    else:
        stats[1] = 0.0
    del ex
    tgt = x_cV.gather(1, local_t_c[:, None]).view(c) if n_real > 0 else torch.zeros(c, dtype=ct, device=dev)
    stats[2] = torch.where(own_c, tgt, torch.zeros_like(tgt))
    if tp_size > 1:
        torch.distributed.all_reduce(stats, group=group)
    log_s = torch.log(stats[0])
    return stats[2] - log_s, m + log_s, log_s - stats[1] / stats[0]


def _chunk_dlogits(x_cV: torch.Tensor, logz_c: torch.Tensor, ent_c: torch.Tensor, g_logp_c: torch.Tensor,
                   g_ent_c: Optional[torch.Tensor], local_t_c: torch.Tensor, own_c: torch.Tensor) -> torch.Tensor:
    """The backward's formula (module doc) for one chunk: ``d loss / d x`` ``[c, n_real]`` in the
    compute dtype, computed in place in ``x_cV`` (the chunk's recomputed real-column logits, a fresh
    tensor, ``n_real > 0``). ``g_ent_c`` None: no entropy gradient. No communication."""
    x_cV.sub_(logz_c[:, None])  # x - logZ = log p
    p = torch.exp(x_cV)
    gl = g_logp_c[:, None]
    if g_ent_c is not None:
        # grad = -p * (g_logp + g_H * (x - E_p[x])),  x - E_p[x] = (x - logZ) + H
        x_cV.add_(ent_c[:, None]).mul_(g_ent_c[:, None]).add_(gl).mul_(p).neg_()
    else:
        x_cV = p.mul_(gl).neg_()
    del p
    onehot = torch.where(own_c, g_logp_c, torch.zeros_like(g_logp_c))
    x_cV.scatter_add_(1, local_t_c[:, None], onehot[:, None])
    return x_cV


class _VocabParallelLogprobs(torch.autograd.Function):
    """logits [T, Vl] (local shard), rows [R], targets [R] -> (logprobs [R], entropy [R]) in float32
    (float64 for float64 logits)."""

    @staticmethod
    def forward(ctx, logits_TV, rows_R, targets_R, vocab_start, n_real, group, tp_size, chunk, with_entropy):
        R = rows_R.shape[0]
        dev = logits_TV.device
        ct = torch.promote_types(logits_TV.dtype, torch.float32)  # fp32 math (fp64 for fp64 logits)
        logp_R = torch.empty(R, dtype=ct, device=dev)
        logz_R = torch.empty(R, dtype=ct, device=dev)
        ent_R = torch.empty(R, dtype=ct, device=dev)
        local_t_R = targets_R - vocab_start
        owned_R = (local_t_R >= 0) & (local_t_R < n_real)
        local_t_R = torch.where(owned_R, local_t_R, torch.zeros_like(local_t_R))
        for s in range(0, R, chunk):
            e = min(R, s + chunk)
            rows = rows_R[s:e]
            if n_real > 0:
                # a fresh copy (index_select), so the in-place ops of _chunk_stats never touch the logits
                x = logits_TV.index_select(0, rows)[:, :n_real].to(ct)
            else:  # this rank's columns are all vocab padding
                x = torch.empty(e - s, 0, dtype=ct, device=dev)
            logp_R[s:e], logz_R[s:e], ent_R[s:e] = _chunk_stats(x, local_t_R[s:e], owned_R[s:e], group, tp_size,
                                                               with_entropy)
            del x
        ctx.save_for_backward(logits_TV, rows_R, local_t_R, owned_R, logz_R, ent_R)
        ctx.n_real, ctx.chunk, ctx.with_entropy = n_real, chunk, with_entropy
        if not with_entropy:
            ent_R = torch.zeros_like(ent_R)
        ctx.mark_non_differentiable(*(() if with_entropy else (ent_R,)))
        return logp_R, ent_R

    @staticmethod
    def backward(ctx, g_logp_R, g_ent_R):
        logits_TV, rows_R, local_t_R, owned_R, logz_R, ent_R = ctx.saved_tensors
        n_real, chunk = ctx.n_real, ctx.chunk
        use_ent = ctx.with_entropy and g_ent_R is not None
        grad_TV = torch.zeros_like(logits_TV)
        R = rows_R.shape[0]
        ct = logz_R.dtype
        if g_logp_R is None:
            g_logp_R = torch.zeros(R, dtype=ct, device=logits_TV.device)
        g_logp_R = g_logp_R.to(ct)
        if use_ent:
            g_ent_R = g_ent_R.to(ct)
        if n_real == 0:
            return grad_TV, None, None, None, None, None, None, None, None
        for s in range(0, R, chunk):
            e = min(R, s + chunk)
            rows = rows_R[s:e]
            xs = logits_TV.index_select(0, rows)[:, :n_real].to(ct)
            xs = _chunk_dlogits(xs, logz_R[s:e], ent_R[s:e], g_logp_R[s:e], g_ent_R[s:e] if use_ent else None,
                                local_t_R[s:e], owned_R[s:e])
            # rows are distinct (a row is asked for once), so index_copy_ is exact
            sub = grad_TV.index_select(0, rows)
            sub[:, :n_real] = xs.to(grad_TV.dtype)
            grad_TV.index_copy_(0, rows, sub)
            del xs, sub
        return grad_TV, None, None, None, None, None, None, None, None


def _check_chunk(chunk_size) -> None:
    if int(chunk_size) != chunk_size or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def _prepare(T: int, Vl: int, targets: torch.Tensor, rows: Optional[torch.Tensor], vocab_size: int, group,
             device, what: str):
    """Checks and normalises what both logprob paths get: ``(group, tp, vocab_start, n_real,
    rows [R], targets [R])`` for a ``[T, Vl]`` local vocab shard."""
    tp, tp_rank = _tp_info(group)
    if tp > 1:
        group = _resolve_group(group)
    if Vl * tp < vocab_size:
        raise ValueError(f"{what} {Vl} columns x tp={tp} = {Vl * tp} < vocab_size={vocab_size}: "
                         "are these TP-sharded logits with the right group?")
    vocab_start = tp_rank * Vl
    n_real = max(0, min(Vl, vocab_size - vocab_start))
    if rows is None:
        rows = torch.arange(T, device=device)
    rows = rows.to(device=device, dtype=torch.long).reshape(-1)
    targets = targets.to(device=device, dtype=torch.long).reshape(-1)
    if targets.shape[0] != rows.shape[0]:
        if targets.shape[0] == T:
            targets = targets.index_select(0, rows)
        else:
            raise ValueError(f"targets has {targets.shape[0]} entries; need T={T} or one per row ({rows.shape[0]})")
    return group, tp, vocab_start, n_real, rows, targets


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int,
                            rows: Optional[torch.Tensor] = None, chunk_size: int = DEFAULT_CHUNK_TOKENS,
                            with_entropy: bool = False, group=None
                            ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probability of ``targets`` (and entropy) under the softmax of vocab-parallel ``logits``.

    ``logits``: ``[T, 1, Vl]`` or ``[T, Vl]``, this TP rank's slice of the padded vocab (the
    thinker's output, any float dtype). ``targets``: int64 ``[T]`` (position-aligned: the token each
    row should predict) or ``[R]`` when ``rows`` is given. ``rows``: int64 ``[R]`` distinct row
    indices to evaluate (default: all ``T``). ``vocab_size``: the real vocab ``V``; padded columns
    are excluded. ``group``: the TP process group (default: megatron's).

    Returns float32 (float64 for float64 logits) ``(logprobs [R], entropy [R] or None)``,
    differentiable in ``logits`` (module doc for the math, memory bound and collectives). A target
    outside ``[0, V)`` gives a finite meaningless value: mask it.
    """
    if logits.dim() == 3:
        if logits.shape[1] != 1:
            raise ValueError(f"logits must be [T, 1, Vl] (packed, batch 1) or [T, Vl], got {tuple(logits.shape)}")
        logits = logits.reshape(logits.shape[0], logits.shape[2])
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, 1, Vl] or [T, Vl], got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    _check_chunk(chunk_size)
    T, Vl = logits.shape
    group, tp, vocab_start, n_real, rows, targets = _prepare(T, Vl, targets, rows, vocab_size, group, logits.device,
                                                             "logits hold")
    logp, ent = _VocabParallelLogprobs.apply(logits, rows, targets, vocab_start, n_real, group, tp,
                                             int(chunk_size), bool(with_entropy))
    return logp, (ent if with_entropy else None)


def segment_starts(cu_seqlens_S: torch.Tensor, T: int, device=None) -> torch.Tensor:
    """bool ``[T]``: True at the first token of every segment of ``cu_seqlens_S``."""
    starts = torch.zeros(T, dtype=torch.bool, device=device)
    cu = cu_seqlens_S.to(device=device, dtype=torch.long)[:-1]
    starts[cu[cu < T]] = True
    return starts


def shift_right_within_samples(values_T: torch.Tensor, cu_seqlens_S: torch.Tensor, fill: float = 0.0
                               ) -> torch.Tensor:
    """``out[t] = values_T[t - 1]`` unless t starts a segment (then ``fill``); differentiable.

    Turns position-aligned values (what the logits at t predict) into token-aligned ones.
    """
    T = values_T.shape[0]
    shifted = torch.cat([values_T.new_full((1,), fill), values_T[:-1]])
    starts = segment_starts(cu_seqlens_S, T, values_T.device)
    return torch.where(starts, torch.full_like(shifted, fill), shifted)


def token_logprobs(logits: torch.Tensor, input_ids_T: torch.Tensor, cu_seqlens_S: torch.Tensor, *,
                   vocab_size: int, token_mask_T: Optional[torch.Tensor] = None,
                   chunk_size: int = DEFAULT_CHUNK_TOKENS, with_entropy: bool = False, group=None,
                   lm_head_weight: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Token-aligned ``(logprobs_T, entropy_T)`` (float32 ``[T]``; float64 for float64 logits) of a
    packed micro-batch.

    ``logits``: the thinker's vocab-parallel logits ``[T, 1, Vl]``, or, with ``lm_head_weight``
    (this TP rank's output-layer weight ``[Vl, H]``), its final hidden states ``[T, 1, H]``
    (``OmniThinker.forward(return_hidden=True)``): then the fused path of
    ``engine.fused_logprobs`` computes the same values without ever materialising the logits.

    ``logprobs_T[t] = log p(input_ids_T[t] | earlier tokens of its sample)`` (module doc,
    "Alignment"); 0 at every segment start. ``token_mask_T`` (bool ``[T]``, token-aligned, e.g. the
    loss mask) restricts the work to those tokens: others get 0 (and no gradient). Tokens at a
    segment start are never evaluated.
    """
    T = input_ids_T.shape[0]
    if logits.shape[0] != T:
        raise ValueError(f"logits have {logits.shape[0]} rows but the micro-batch has {T} tokens")
    dev = logits.device
    ids = input_ids_T.to(dev)
    starts = segment_starts(cu_seqlens_S, T, dev)
    want_T = ~starts
    if token_mask_T is not None:
        want_T = want_T & token_mask_T.to(device=dev, dtype=torch.bool)
    tok = want_T.nonzero().view(-1)  # tokens to score; each is predicted from row tok - 1
    rows = tok - 1
    kw = dict(vocab_size=vocab_size, rows=rows, chunk_size=chunk_size, with_entropy=with_entropy, group=group)
    if lm_head_weight is None:
        logp_R, ent_R = vocab_parallel_logprobs(logits, ids.index_select(0, tok), **kw)
    else:
        from .fused_logprobs import fused_vocab_parallel_logprobs

        logp_R, ent_R = fused_vocab_parallel_logprobs(logits, lm_head_weight, ids.index_select(0, tok), **kw)
    logp_T = torch.zeros(T, dtype=logp_R.dtype, device=dev).index_put((tok,), logp_R)
    ent_T = None
    if with_entropy:
        ent_T = torch.zeros(T, dtype=ent_R.dtype, device=dev).index_put((tok,), ent_R)
    return logp_T, ent_T
