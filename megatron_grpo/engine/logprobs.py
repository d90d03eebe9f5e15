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

The per-chunk forward statistics, the backward formula and the chunk loops (``engine.logprob_chunks``)
are shared with ``engine.fused_logprobs``, which multiplies each chunk's logits from the final hidden
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

from .logprob_chunks import DEFAULT_CHUNK_TOKENS, backward_chunks, check_chunk, finish_forward, forward_chunks, prepare

__all__ = ["DEFAULT_CHUNK_TOKENS", "vocab_parallel_logprobs", "token_logprobs", "segment_starts",
           "shift_right_within_samples"]

class _VocabParallelLogprobs(torch.autograd.Function):
    """logits [T, Vl] (local shard), rows [R], targets [R] -> (logprobs [R], entropy [R]) in float32
    (float64 for float64 logits)."""

    @staticmethod
    def forward(ctx, logits_TV, rows_R, targets_R, vocab_start, n_real, group, tp_size, chunk, with_entropy):
        ct = torch.promote_types(logits_TV.dtype, torch.float32)  # fp32 math (fp64 for fp64 logits)
        logp_R, logz_R, ent_R, local_t_R, owned_R = forward_chunks(
            lambda rows: _real_logits(logits_TV, rows, n_real, ct), rows_R, targets_R, vocab_start, n_real, group,
            tp_size, chunk, with_entropy, ct)
        ctx.save_for_backward(logits_TV, rows_R, local_t_R, owned_R, logz_R, ent_R)
        ctx.n_real, ctx.chunk, ctx.with_entropy = n_real, chunk, with_entropy
        return finish_forward(ctx, logp_R, ent_R, with_entropy)

    @staticmethod
    def backward(ctx, g_logp_R, g_ent_R):
        logits_TV, rows_R, local_t_R, owned_R, logz_R, ent_R = ctx.saved_tensors
        n_real = ctx.n_real
        grad_TV = torch.zeros_like(logits_TV)
        if n_real == 0:
            return grad_TV, None, None, None, None, None, None, None, None
        use_ent = ctx.with_entropy and g_ent_R is not None
        ct = logz_R.dtype
        for rows, xs in backward_chunks(lambda rows: _real_logits(logits_TV, rows, n_real, ct), rows_R, local_t_R,
                                        owned_R, logz_R, ent_R, g_logp_R, g_ent_R if use_ent else None, ctx.chunk):
            # rows are distinct (a row is asked for once), so index_copy_ is exact
            sub = grad_TV.index_select(0, rows)
            sub[:, :n_real] = xs.to(grad_TV.dtype)
            grad_TV.index_copy_(0, rows, sub)
            del xs, sub
        return grad_TV, None, None, None, None, None, None, None, None


def _real_logits(logits_TV: torch.Tensor, rows_c: torch.Tensor, n_real: int, ct: torch.dtype) -> torch.Tensor:
    """``[c, n_real]`` logits of ``rows_c`` in ``ct``: a fresh copy (index_select), so the in-place
    ops of the chunk math never touch the logits; ``[c, 0]`` when this rank's columns are all padding."""
    if n_real == 0:
        return torch.empty(rows_c.shape[0], 0, dtype=ct, device=logits_TV.device)
    return logits_TV.index_select(0, rows_c)[:, :n_real].to(ct)


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
    check_chunk(chunk_size)
    T, Vl = logits.shape
    group, tp, vocab_start, n_real, rows, targets = prepare(T, Vl, targets, rows, vocab_size, group, logits.device,
                                                             "logits hold")
    logp, ent = _VocabParallelLogprobs.apply(logits, rows, targets, vocab_start, n_real, group, tp,
                                             int(chunk_size), bool(with_entropy))
    return logp, (ent if with_entropy else None)


def segment_starts(cu_seqlens_S: torch.Tensor, T: int, device=None) -> torch.Tensor:
    """bool ``[T]``: True at the first token of every segment of ``cu_seqlens_S``."""
    # one spare slot takes the offsets equal to T (empty trailing segments), so no boolean-mask
    # indexing (a device-to-host read of its size) is needed to drop them
    starts = torch.zeros(T + 1, dtype=torch.bool, device=device)
    cu = cu_seqlens_S.to(device=device, dtype=torch.long)[:-1].clamp(max=T)
    return starts.index_fill_(0, cu, True)[:T]


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
                   lm_head_weight: Optional[torch.Tensor] = None, num_scored: Optional[int] = None
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
    segment start are never evaluated. ``num_scored``: how many tokens that leaves, when the
    caller knows it on the host (``MicroBatch.scored_tokens``): their positions are then found
    without reading the count back from the device.
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
    # tokens to score; each is predicted from row tok - 1 (nonzero's size is a device read)
    tok = (want_T.nonzero() if num_scored is None else torch.nonzero_static(want_T, size=int(num_scored))).view(-1)
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
