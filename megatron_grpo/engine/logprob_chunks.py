"""What the two logprob paths share: the per-chunk forward statistics and their TP all-reduces,
the backward's formula, the argument checks, and the chunk loops of the forward and the backward.

The logits path (``engine.logprobs``) takes each chunk's logits from the thinker's vocab-parallel
logits; the fused path (``engine.fused_logprobs``) multiplies them from the final hidden states
and the output weight. Both hand a ``chunk_logits(rows_c)`` function to :func:`forward_chunks` and
:func:`backward_chunks`; the math is in ``engine.logprobs``' module doc. A leaf: torch only.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["DEFAULT_CHUNK_TOKENS", "chunk_stats", "chunk_dlogits", "check_chunk", "prepare", "forward_chunks",
           "backward_chunks", "finish_forward"]

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


def chunk_stats(x_cV: torch.Tensor, local_t_c: torch.Tensor, own_c: torch.Tensor, group, tp_size: int,
                 with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 1-3 of ``engine.logprobs``' module doc for one chunk: ``(logp [c], logZ [c], H [c])``.

    ``x_cV``: ``[c, n_real]`` logits of the chunk's rows over this rank's *real* columns, in the
    compute dtype, a fresh tensor (overwritten with ``x - m``); ``[c, 0]`` when all of this rank's
    columns are padding. ``local_t_c``: the target's local column (0 where not owned), ``own_c``:
    whether this rank owns it. Issues the two TP all-reduces (every rank, same order). ``H`` is
    meaningless (``log S``) when ``with_entropy`` is off."""
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


def chunk_dlogits(x_cV: torch.Tensor, logz_c: torch.Tensor, ent_c: torch.Tensor, g_logp_c: torch.Tensor,
                   g_ent_c: Optional[torch.Tensor], local_t_c: torch.Tensor, own_c: torch.Tensor) -> torch.Tensor:
    """The backward's formula (``engine.logprobs``' module doc) for one chunk: ``d loss / d x`` ``[c, n_real]`` in the
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


def check_chunk(chunk_size) -> None:
    if int(chunk_size) != chunk_size or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def prepare(T: int, Vl: int, targets: torch.Tensor, rows: Optional[torch.Tensor], vocab_size: int, group,
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


def forward_chunks(chunk_logits: Callable[[torch.Tensor], torch.Tensor], rows_R: torch.Tensor,
                   targets_R: torch.Tensor, vocab_start: int, n_real: int, group, tp_size: int, chunk: int,
                   with_entropy: bool, ct: torch.dtype):
    """The forward over all rows, ``chunk`` at a time: ``(logp [R], logZ [R], H [R], local_t [R],
    owned [R])`` in ``ct``. ``chunk_logits(rows_c)`` gives the chunk's ``[c, n_real]`` logits in
    ``ct``, a fresh tensor (:func:`chunk_stats` overwrites it)."""
    R = rows_R.shape[0]
    dev = rows_R.device
    logp_R = torch.empty(R, dtype=ct, device=dev)
    logz_R = torch.empty(R, dtype=ct, device=dev)
    ent_R = torch.empty(R, dtype=ct, device=dev)
    local_t_R = targets_R - vocab_start
    owned_R = (local_t_R >= 0) & (local_t_R < n_real)
    local_t_R = torch.where(owned_R, local_t_R, torch.zeros_like(local_t_R))
    for s in range(0, R, chunk):
        e = min(R, s + chunk)
        x = chunk_logits(rows_R[s:e])  # [c, n_real] (n_real may be 0)
        logp_R[s:e], logz_R[s:e], ent_R[s:e] = chunk_stats(x, local_t_R[s:e], owned_R[s:e], group, tp_size,
                                                          with_entropy)
        del x
    return logp_R, logz_R, ent_R, local_t_R, owned_R


def finish_forward(ctx, logp_R: torch.Tensor, ent_R: torch.Tensor, with_entropy: bool):
    """The autograd forward's outputs ``(logp, entropy)``: without ``with_entropy`` the entropy is
    zeros and not differentiable."""
    if not with_entropy:
        ent_R = torch.zeros_like(ent_R)
    ctx.mark_non_differentiable(*(() if with_entropy else (ent_R,)))
    return logp_R, ent_R


def backward_chunks(chunk_logits: Callable[[torch.Tensor], torch.Tensor], rows_R: torch.Tensor,
                    local_t_R: torch.Tensor, owned_R: torch.Tensor, logz_R: torch.Tensor, ent_R: torch.Tensor,
                    g_logp_R: Optional[torch.Tensor], g_ent_R: Optional[torch.Tensor], chunk: int):
    """Yield ``(rows_c, d loss / d x [c, n_real])`` chunk by chunk (``ct``, the dtype of ``logz_R``),
    recomputing each chunk's logits with ``chunk_logits``; ``g_ent_R`` None: no entropy gradient.
    The caller needs ``n_real > 0``. No communication."""
    R = rows_R.shape[0]
    ct = logz_R.dtype
    g_logp_R = torch.zeros(R, dtype=ct, device=rows_R.device) if g_logp_R is None else g_logp_R.to(ct)
    if g_ent_R is not None:
        g_ent_R = g_ent_R.to(ct)
    for s in range(0, R, chunk):
        e = min(R, s + chunk)
        rows = rows_R[s:e]
        dx = chunk_dlogits(chunk_logits(rows), logz_R[s:e], ent_R[s:e], g_logp_R[s:e],
                           None if g_ent_R is None else g_ent_R[s:e], local_t_R[s:e], owned_R[s:e])
        yield rows, dx
