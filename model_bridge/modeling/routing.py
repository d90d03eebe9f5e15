"""The MoE router's softmax top-k selection in one Triton kernel each way (the torch backend, CUDA).

Shapes: ``T`` tokens, ``E`` experts, ``k`` experts per token; inside the kernels a program holds
``BT`` rows of ``BE = next_power_of_2(E)`` columns (the columns ``>= E`` are masked) and
``BK = next_power_of_2(k)`` slots of the selection.

megatron's ``topk_routing_with_score_function`` spends ~0.25 ms per layer at 22.8k tokens x 128
experts, k = 8, on an H200: ``torch.topk`` (~175 us: gatherTopK + a bitonic sort) and ~10 small
kernels (the softmax over the k, ``zeros_like`` + ``scatter`` for the dense probabilities,
``zeros_like().int().scatter().bool()`` for the routing map). :func:`fused_topk_routing` computes
the same two ``[T, E]`` outputs in one kernel and their gradient in one more, for the case our
model uses: ``score_function="softmax"``, no expert bias, no expert groups, no routing replay, no
precomputed indices (:func:`fused_routing_ok` says whether a call is that case; anything else is
megatron's function). Measured there (bf16, kernel time): forward 19 us, backward 10 us, against
~210 us of megatron's kernels for both. The semantics are megatron-core 0.19's (fp32 math, one
rounding at the end):

* ``use_pre_softmax=False``: the k largest logits, probabilities = their softmax (fp32);
* ``use_pre_softmax=True``: scores = softmax over all E logits (fp32), probabilities = the k
  largest scores;
* then ``* scaling_factor`` when it is truthy (fp32), one cast to the logits' dtype, scattered into
  a dense ``[T, E]`` (0 elsewhere); the routing map is the bool ``[T, E]`` of the selected experts.

Selection: each of the k picks is one max over a per-column int64 key, the logit's fp32 bits made
order-preserving as a signed int above the reversed column index: the largest logit, among equal
ones the lowest column (a pick's key is then replaced by one below every column's, which is the
"available" mask: keys are unique, so a pick is one available, in-range column and no row, NaN or
-inf, can repeat or lose one).

Differences from megatron, all below what its own two backends (CPU/CUDA) differ by:

* Selection is made on the logits in both modes (softmax is monotonic: the same set as megatron's
  top-k of the fp32 scores, except where two different logits round to equal fp32 scores, where
  ``torch.topk``'s pick is unspecified and ours is the larger logit). Exact ties go to the lowest
  expert index (``torch.topk``'s tie order is unspecified, and differs between CPU and CUDA).
  NaN ranks above everything (+inf included), as in ``torch.topk``; -0.0 ties with +0.0.
* ``tl.exp`` and the order of the softmax sums are Triton's: probabilities and gradients agree
  with torch's to a few fp32 ulps (after a bf16 cast: equal, or one bf16 ulp apart where the fp32
  values straddle a rounding boundary; on the H200, bf16, against 0.19: mostly bit-exact).
* megatron-core 0.16 rounds to the logits' dtype before the top-k (``use_pre_softmax``) and
  before the scaling; 0.19 (the GPU machines') and this kernel round once, at the end.

The backward takes the gradient of the dense probabilities (the routing map has none) and returns
the logits' gradient: the softmax Jacobian over the k selected (``use_pre_softmax=False``) or over
all E (``use_pre_softmax=True``, where every logit gets a gradient), fp32 math. It saves the
``[T, k]`` int32 expert indices and, without pre-softmax, the ``[T, k]`` fp32 probabilities; with
pre-softmax the logits (a reference, no copy) from which it recomputes the scores. One launch each
way, no host sync, no atomics (deterministic, so megatron's ``torch.are_deterministic_algorithms_
enabled()`` branch, which only changes how its dense outputs are built, has no counterpart here).
``MGRPO_TRITON_ROUTING=0`` switches it off (the router then calls megatron's function). CUDA only
(or Triton's interpreter in tests).

:func:`fused_topk_routing_with_aux` also computes megatron's load-balancing loss
(``switch_load_balancing_loss_func`` over the fp32 softmax of all E logits and the routing map's
token counts) in the same kernels: the forward kernel writes each program's column sums of the
softmax and of the map, a two-stage reduction (``aux_reduce``, twice) sums them in a fixed order
and forms the loss, and the backward kernel adds the loss's gradient (the softmax backward of
``aux_scale * count_e`` times the loss's incoming gradient) to the routing's, in fp32. That replaces
megatron's ~7 small ops (a ``[T, E]`` softmax, two column sums, products; and their backward) in
the MoE layer's host-bound stretch. The router uses it where megatron's loss is the plain
per-micro-batch one (router.py).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ._triton import import_triton, triton_runs_on

__all__ = ["fused_topk_routing", "fused_topk_routing_with_aux", "fused_routing_ok"]

MAX_EXPERTS = 512
"""Widest row a program holds in registers (``BE`` columns; the selection keeps an int64 key tile
and the fp32 logits live)."""
_FWD_TILE, _FWD_WARPS = 2048, 4
"""Forward: elements per program (``BT = _FWD_TILE // BE`` rows: 16 of 128 experts, 1425 programs
at 22.8k tokens; 4 of 512) and warps (a 128-expert row is one warp, 4 columns a thread: a pick's
max is in-thread then warp shuffles). Measured on an H200 at [22800, 128], k = 8, bf16: 19 us;
a sweep of 4-64 rows x 1-8 warps gave 19-330 us (8 rows x 2 warps: 19 us too; 4 rows x 4 warps:
27 us; 64 rows x 1 warp: 330 us)."""
_BWD_TILE, _BWD_WARPS = 1024, 8
"""Backward (no selection loop, ~12 MB moved): 8 rows of 128 a program, 8 warps: 10 us there
(16 rows x 4 warps: 14.5 us)."""
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Logit dtypes the kernel takes (fp32 math inside); fp64 logits (``moe_router_dtype="fp64"``)
stay with megatron's function."""
_KNOWN_KWARGS = frozenset({"use_pre_softmax", "num_groups", "group_topk", "scaling_factor", "score_function",
                           "expert_bias", "fused", "router_replay", "dense_output", "precomputed_indices"})
"""megatron-core's keyword arguments of ``topk_routing_with_score_function`` (0.16: up to
``router_replay``; 0.19 adds ``dense_output`` and ``precomputed_indices``); an unknown one (a
later release) sends the call to megatron's function."""


@functools.lru_cache(maxsize=None)
def _kernels():
    """``(fwd, bwd, aux_reduce)`` Triton kernels; None without Triton or with ``MGRPO_TRITON_ROUTING=0``."""
    if (mods := import_triton("MGRPO_TRITON_ROUTING")) is None:
        return None
    triton, tl = mods

    # (the two kernels share no @triton.jit helper: a nested one is not found by Triton's
    # interpreter, which resolves names in the module's globals; the few shared lines are repeated)

    @triton.jit
    def routing_fwd(x_ptr, probs_ptr, map_ptr, idx_ptr, ptop_ptr, asc_ptr, pcol_ptr, pcnt_ptr, T, E, sx, sp, sm,
                    scale, K: tl.constexpr, PRE_SOFTMAX: tl.constexpr, AUX: tl.constexpr, BT: tl.constexpr,
                    BE: tl.constexpr, BK: tl.constexpr):
        rows_T = tl.program_id(0) * BT + tl.arange(0, BT)
        cols_E = tl.arange(0, BE)
        slots_K = tl.arange(0, BK)
        rmask_T = rows_T < T
        cmask_E = cols_E < E
        r64_T = rows_T.to(tl.int64)
        tmask_TE = rmask_T[:, None] & cmask_E[None, :]
        # fp32 logits; 0 in the rows >= T (finite: no NaN in rows never stored), -inf in the
        # columns >= E (no probability in a softmax; never selected: not available below)
        x_TE = tl.load(x_ptr + r64_T[:, None] * sx + cols_E[None, :], mask=tmask_TE, other=0.0).to(tl.float32)
        x_TE = tl.where(cmask_E[None, :], x_TE, float("-inf"))
        # one int64 key per column, ordered as the selection ranks them: the logit's fp32 bits made
        # order-preserving as a signed int (negatives: the 31 low bits flipped) above, the reversed
        # column below (equal logits: the lower column ranks higher). NaN is made the positive
        # quiet NaN first (above +inf: first, as in torch.topk), -0.0 made +0.0 (a tie with it)
        canon_TE = tl.where(x_TE != x_TE, float("nan"), tl.where(x_TE == 0.0, 0.0, x_TE))
        bits_TE = canon_TE.to(tl.int32, bitcast=True)
        ord_TE = tl.where(bits_TE < 0, bits_TE ^ 0x7FFFFFFF, bits_TE)
        key_TE = (ord_TE.to(tl.int64) << 32) | (BE - 1 - cols_E[None, :]).to(tl.int64)
        # taken (and masked) columns: below every column's key (the lowest, -inf's, has the high
        # word -0x7F800001): the max is always an available column, so k <= E picks are distinct
        # and in range whatever the row holds (the "available" mask is key != TAKEN; no fallback
        # is needed: keys are unique, every available column ranks above every taken one)
        taken_TE = tl.full([BT, BE], -0x7FFFFFFF, tl.int64) << 32
        key_TE = tl.where(cmask_E[None, :], key_TE, taken_TE)
        val_TK = tl.zeros([BT, BK], dtype=tl.float32)  # the selected logits, in selection order
        idx_TK = tl.zeros([BT, BK], dtype=tl.int32)
        for j in tl.static_range(K):
            # one max per pick: the largest logit, the lowest column among equal ones
            best_T = tl.max(key_TE, 1)
            pick_T = (BE - 1 - (best_T & (BE - 1))).to(tl.int32)
            hi_T = (best_T >> 32).to(tl.int32)
            val_T = tl.where(hi_T < 0, hi_T ^ 0x7FFFFFFF, hi_T).to(tl.float32, bitcast=True)
            key_TE = tl.where(key_TE == best_T[:, None], taken_TE, key_TE)  # keys are unique: one column
            val_TK = tl.where(slots_K[None, :] == j, val_T[:, None], val_TK)
            idx_TK = tl.where(slots_K[None, :] == j, pick_T[:, None], idx_TK)
        sel_TE = cmask_E[None, :] & (key_TE == taken_TE)
        smask_K = slots_K < K
        if PRE_SOFTMAX:
            # softmax over the E real columns (the masked ones hold -inf: 0)
            e_TE = tl.where(cmask_E[None, :], tl.exp(x_TE - tl.max(x_TE, 1)[:, None]), 0.0)
            p_TE = tl.where(sel_TE, e_TE / tl.sum(e_TE, 1)[:, None], 0.0)
        else:
            # softmax over the k selected: the first selected is their max (NaN first, as torch's
            # softmax then gives NaN throughout); the denominator summed in selection order
            m_T = tl.sum(tl.where(slots_K[None, :] == 0, val_TK, 0.0), 1)
            den_T = tl.sum(tl.where(smask_K[None, :], tl.exp(val_TK - m_T[:, None]), 0.0), 1)
            # the backward's fp32 probabilities, unscaled: the same expression as the dense ones
            ptop_TK = tl.exp(val_TK - m_T[:, None]) / den_T[:, None]
            tl.store(ptop_ptr + r64_T[:, None] * K + slots_K[None, :], ptop_TK,
                     mask=rmask_T[:, None] & smask_K[None, :])
            p_TE = tl.where(sel_TE, tl.exp(x_TE - m_T[:, None]) / den_T[:, None], 0.0)
        # scale is 1.0 without a scaling factor (exact); one rounding to the logits' dtype
        tl.store(probs_ptr + r64_T[:, None] * sp + cols_E[None, :], (p_TE * scale).to(probs_ptr.dtype.element_ty),
                 mask=tmask_TE)
        tl.store(map_ptr + r64_T[:, None] * sm + cols_E[None, :], sel_TE.to(tl.int8), mask=tmask_TE)
        tl.store(idx_ptr + r64_T[:, None] * K + slots_K[None, :], idx_TK, mask=rmask_T[:, None] & smask_K[None, :])
        # the same experts ascending, int64 (what the dispatcher's permutation reads, permute.py's
        # topk_indices): slot j holds the column whose running count of selected columns is j + 1
        rank_TE = tl.cumsum(sel_TE.to(tl.int32), 1)
        asc_TK = tl.zeros([BT, BK], dtype=tl.int64)
        for j in tl.static_range(K):
            col_T = tl.sum(tl.where(sel_TE & (rank_TE == j + 1), cols_E[None, :], 0), 1)
            asc_TK = tl.where(slots_K[None, :] == j, col_T[:, None].to(tl.int64), asc_TK)
        tl.store(asc_ptr + r64_T[:, None] * K + slots_K[None, :], asc_TK, mask=rmask_T[:, None] & smask_K[None, :])
        if AUX:
            # the load-balancing loss's inputs, this program's part: the column sums of the fp32
            # softmax over all E (megatron's scores for the aux loss) and of the routing map, over
            # the real rows (summed over the programs, in order, by aux_reduce)
            ea_TE = tl.where(cmask_E[None, :], tl.exp(x_TE - tl.max(x_TE, 1)[:, None]), 0.0)
            sa_TE = tl.where(rmask_T[:, None], ea_TE / tl.sum(ea_TE, 1)[:, None], 0.0)
            part = tl.program_id(0).to(tl.int64) * BE + cols_E
            tl.store(pcol_ptr + part, tl.sum(sa_TE, 0))
            tl.store(pcnt_ptr + part, tl.sum((sel_TE & rmask_T[:, None]).to(tl.int32), 0))

    @triton.jit
    def aux_reduce(pcol_ptr, pcnt_ptr, qcol_ptr, qcnt_ptr, cnt_ptr, aux_ptr, n_parts, E, aux_scale, CH,
                   FINAL: tl.constexpr, BE: tl.constexpr, BP: tl.constexpr):
        # program g sums the partial rows [g*CH, (g+1)*CH) in a fixed order (deterministic) into
        # row g of q*; FINAL (one program over all rows): the counts per expert and
        # aux_scale * sum_e P_e * C_e (megatron's switch_load_balancing_loss_func)
        cols_E = tl.arange(0, BE)
        cmask_E = cols_E < E
        first = tl.program_id(0) * CH
        end = tl.minimum(first + CH, n_parts)
        p_E = tl.zeros([BE], dtype=tl.float32)
        c_E = tl.zeros([BE], dtype=tl.int32)
        for start in range(first, end, BP):
            parts_P = start + tl.arange(0, BP)
            o_PE = parts_P.to(tl.int64)[:, None] * BE + cols_E[None, :]
            m_PE = (parts_P < end)[:, None] & cmask_E[None, :]
            p_E += tl.sum(tl.load(pcol_ptr + o_PE, mask=m_PE, other=0.0), 0)
            c_E += tl.sum(tl.load(pcnt_ptr + o_PE, mask=m_PE, other=0), 0)
        if FINAL:
            tl.store(cnt_ptr + cols_E, c_E, mask=cmask_E)
            tl.store(aux_ptr, tl.sum(p_E * c_E.to(tl.float32), 0) * aux_scale)
        else:
            row = tl.program_id(0).to(tl.int64) * BE + cols_E
            tl.store(qcol_ptr + row, p_E)
            tl.store(qcnt_ptr + row, c_E)

    @triton.jit
    def routing_bwd(g_ptr, x_ptr, idx_ptr, ptop_ptr, dx_ptr, cnt_ptr, gaux_ptr, T, E, sg, sx, sdx, scale, aux_scale,
                    K: tl.constexpr, PRE_SOFTMAX: tl.constexpr, AUX: tl.constexpr, BT: tl.constexpr,
                    BE: tl.constexpr):
        rows_T = tl.program_id(0) * BT + tl.arange(0, BT)
        cols_E = tl.arange(0, BE)
        rmask_T = rows_T < T
        cmask_E = cols_E < E
        r64_T = rows_T.to(tl.int64)
        tmask_TE = rmask_T[:, None] & cmask_E[None, :]
        # the gradient of the scaled probabilities -> of the unscaled ones (autograd's order)
        gc_TE = tl.load(g_ptr + r64_T[:, None] * sg + cols_E[None, :], mask=tmask_TE, other=0.0).to(tl.float32) * scale
        # the selection, dense (and without pre-softmax the saved probabilities at their columns)
        sel_TE = cols_E[None, :] < 0
        p_TE = tl.zeros([BT, BE], dtype=tl.float32)
        for j in tl.static_range(K):
            idx_T = tl.load(idx_ptr + r64_T * K + j, mask=rmask_T, other=-1)  # -1: no column
            hit_TE = cols_E[None, :] == idx_T[:, None]
            sel_TE = sel_TE | hit_TE
            if not PRE_SOFTMAX:
                p_T = tl.load(ptop_ptr + r64_T * K + j, mask=rmask_T, other=0.0)
                p_TE = tl.where(hit_TE, p_T[:, None], p_TE)
        if PRE_SOFTMAX:
            # the scores over all E, recomputed as the forward computed them; the top-k passes the
            # gradient to the selected scores only, the softmax to every logit
            x_TE = tl.load(x_ptr + r64_T[:, None] * sx + cols_E[None, :], mask=tmask_TE, other=0.0).to(tl.float32)
            x_TE = tl.where(cmask_E[None, :], x_TE, float("-inf"))
            e_TE = tl.where(cmask_E[None, :], tl.exp(x_TE - tl.max(x_TE, 1)[:, None]), 0.0)
            p_TE = e_TE / tl.sum(e_TE, 1)[:, None]
        gs_TE = tl.where(sel_TE, gc_TE, 0.0)
        dot_T = tl.sum(tl.where(sel_TE, p_TE * gs_TE, 0.0), 1)
        # softmax backward, as torch's: p * (g - sum(g * p)); with pre-softmax over every column,
        # without it 0 outside the selection (the top-k's scatter; p * (g - dot) would be NaN
        # there, not 0, when the row's dot is not finite)
        dx_TE = p_TE * (gs_TE - dot_T[:, None])
        if not PRE_SOFTMAX:
            dx_TE = tl.where(sel_TE, dx_TE, 0.0)
        if AUX:
            # the load-balancing loss: aux = aux_scale * sum_e C_e * sum_t s_te with s the fp32
            # softmax over all E, so d aux / d s_te = aux_scale * C_e (times its incoming gradient),
            # through the softmax's backward; added in fp32 (megatron adds the two branches' rounded
            # gradients: one rounding more)
            xa_TE = tl.load(x_ptr + r64_T[:, None] * sx + cols_E[None, :], mask=tmask_TE, other=0.0).to(tl.float32)
            xa_TE = tl.where(cmask_E[None, :], xa_TE, float("-inf"))
            ea_TE = tl.where(cmask_E[None, :], tl.exp(xa_TE - tl.max(xa_TE, 1)[:, None]), 0.0)
            sa_TE = ea_TE / tl.sum(ea_TE, 1)[:, None]
            ca_E = tl.load(cnt_ptr + cols_E, mask=cmask_E, other=0).to(tl.float32) * (tl.load(gaux_ptr) * aux_scale)
            dota_T = tl.sum(sa_TE * ca_E[None, :], 1)
            dx_TE += tl.where(cmask_E[None, :], sa_TE * (ca_E[None, :] - dota_T[:, None]), 0.0)
        tl.store(dx_ptr + r64_T[:, None] * sdx + cols_E[None, :], dx_TE.to(dx_ptr.dtype.element_ty), mask=tmask_TE)

    return routing_fwd, routing_bwd, aux_reduce


_AUX_REDUCE_ROWS = 32
"""Partial rows (programs of the forward) per step of :func:`aux_reduce`, and per program of its
first stage. In one program the 1425 rows of 22.8k tokens took 45 dependent steps, 91 us on an
H200; two stages (45 programs of 32 rows, then one program over their 45 rows: 2 steps) take a
few us, in the same fixed order of additions for a given token count."""


def _aux_reduce(kernel, pcol_PE, pcnt_PE, cnt_E, aux_loss, parts: int, E: int, be: int, aux_scale: float) -> None:
    """The aux loss and the counts per expert from the forward's ``parts`` partial rows (rows
    ``parts:`` of ``pcol_PE``/``pcnt_PE`` hold the first stage's sums)."""
    import triton

    ch = _AUX_REDUCE_ROWS
    groups = triton.cdiv(parts, ch)
    qcol_GE, qcnt_GE = pcol_PE[parts:], pcnt_PE[parts:]
    kernel[(groups,)](pcol_PE, pcnt_PE, qcol_GE, qcnt_GE, cnt_E, aux_loss, parts, E, aux_scale, ch,
                      FINAL=False, BE=be, BP=ch, num_warps=4)
    kernel[(1,)](qcol_GE, qcnt_GE, qcol_GE, qcnt_GE, cnt_E, aux_loss, groups, E, aux_scale, groups,
                 FINAL=True, BE=be, BP=ch, num_warps=4)


def _blocks(E: int, topk: int, tile: int) -> tuple[int, int, int]:
    """``(BT, BE, BK)`` (shape legend) for ``tile`` elements a program."""
    import triton

    block_e = triton.next_power_of_2(E)
    return max(1, tile // block_e), block_e, triton.next_power_of_2(topk)


def _routing_forward(ctx, logits_TE, topk: int, pre_softmax: bool, scale: float, aux_scale: Optional[float]):
    """The forward of both functions below: ``(probs, map, aux or None, counts or None)``."""
    import triton

    x_TE = logits_TE if logits_TE.stride(-1) == 1 else logits_TE.contiguous()
    T, E = x_TE.shape
    dev = x_TE.device
    aux = aux_scale is not None
    probs_TE = torch.empty(T, E, dtype=x_TE.dtype, device=dev)
    map_TE = torch.empty(T, E, dtype=torch.bool, device=dev)
    idx_Tk = torch.empty(T, topk, dtype=torch.int32, device=dev)
    asc_Tk = torch.empty(T, topk, dtype=torch.long, device=dev)
    # the backward's probabilities: only without pre-softmax (with it, the scores are recomputed)
    ptop_Tk = torch.empty(T if not pre_softmax else 0, topk, dtype=torch.float32, device=dev)
    bt, be, bk = _blocks(E, topk, _FWD_TILE)
    parts = triton.cdiv(T, bt)
    # the aux loss's per-program column sums (softmax, counts), its value and the counts per expert
    # (and, in rows ``parts:``, the first stage of their sums: _aux_reduce)
    rows = parts + triton.cdiv(parts, _AUX_REDUCE_ROWS) if aux else 0
    pcol_PE = torch.empty(rows, be, dtype=torch.float32, device=dev)
    pcnt_PE = torch.empty(rows, be, dtype=torch.int32, device=dev)
    # written by the reduction when there are tokens (no memset launches), zeros otherwise
    new = torch.empty if T else torch.zeros
    cnt_E = new(E if aux else 0, dtype=torch.int32, device=dev)
    aux_loss = new((), dtype=torch.float32, device=dev) if aux else None
    kernels = _kernels()
    if T:
        # the map through an int8 view: Triton stores bytes, not i1; unused pointers: any tensor
        kernels[0][(parts,)](
            x_TE, probs_TE, map_TE.view(torch.int8), idx_Tk, ptop_Tk if not pre_softmax else idx_Tk, asc_Tk,
            pcol_PE if aux else idx_Tk, pcnt_PE if aux else idx_Tk, T, E, x_TE.stride(0), probs_TE.stride(0),
            map_TE.stride(0), scale, K=topk, PRE_SOFTMAX=pre_softmax, AUX=aux, BT=bt, BE=be, BK=bk,
            num_warps=_FWD_WARPS)
        if aux:
            _aux_reduce(kernels[2], pcol_PE, pcnt_PE, cnt_E, aux_loss, parts, E, be, float(aux_scale))
    ctx.mark_non_differentiable(map_TE, *([cnt_E] if aux else []))
    ctx.set_materialize_grads(False)  # no [T, E] zeros for the map's (nonexistent) gradient
    # pre-softmax or the aux loss keep the logits (a reference) to recompute the scores; without
    # pre-softmax the [T, k] probabilities stand for the top-k's scores
    ctx.save_for_backward(idx_Tk, x_TE if (pre_softmax or aux) else None, ptop_Tk if not pre_softmax else None,
                          cnt_E if aux else None)
    ctx.pre_softmax, ctx.scale, ctx.shape, ctx.dtype, ctx.aux_scale = pre_softmax, scale, (T, E), x_TE.dtype, aux_scale
    # the map's experts, ascending, ride on it to the dispatcher (torch_backend.py), which would
    # otherwise recover them from the map (topk_indices: 4 launches in a host-bound stretch)
    map_TE._mgrpo_topk_idx = asc_Tk
    return probs_TE, map_TE, aux_loss, (cnt_E if aux else None)


def _routing_backward(ctx, grad_probs_TE, grad_aux):
    """The logits' gradient ``[T, E]`` (None when neither output was used)."""
    import triton

    if grad_probs_TE is None and grad_aux is None:
        return None
    idx_Tk, x_TE, ptop_Tk, cnt_E = ctx.saved_tensors
    T, E = ctx.shape
    topk = idx_Tk.shape[1]
    aux = grad_aux is not None
    dev = idx_Tk.device
    # no gradient for the probabilities (only the aux loss was used): zeros, which the kernel reads
    g_TE = (grad_probs_TE if grad_probs_TE is not None else torch.zeros(T, E, dtype=ctx.dtype, device=dev))
    g_TE = g_TE if g_TE.stride(-1) == 1 else g_TE.contiguous()
    gaux = grad_aux.float().reshape(1) if aux else None
    dx_TE = torch.empty(T, E, dtype=ctx.dtype, device=dev)
    if T:
        bt, be, _ = _blocks(E, topk, _BWD_TILE)
        _kernels()[1][(triton.cdiv(T, bt),)](
            g_TE, x_TE if x_TE is not None else g_TE, idx_Tk, ptop_Tk if ptop_Tk is not None else idx_Tk, dx_TE,
            cnt_E if aux else idx_Tk, gaux if aux else g_TE, T, E, g_TE.stride(0),
            x_TE.stride(0) if x_TE is not None else 0, dx_TE.stride(0), ctx.scale,
            float(ctx.aux_scale) if aux else 0.0, K=topk, PRE_SOFTMAX=ctx.pre_softmax, AUX=aux, BT=bt, BE=be,
            num_warps=_BWD_WARPS)
    return dx_TE


class _FusedTopKRouting(torch.autograd.Function):
    """``(routing_probs [T, E], routing_map [T, E])`` of ``logits [T, E]`` (module docstring)."""

    @staticmethod
    def forward(ctx, logits_TE, topk: int, pre_softmax: bool, scale: float):
        probs_TE, map_TE, _, _ = _routing_forward(ctx, logits_TE, topk, pre_softmax, scale, None)
        return probs_TE, map_TE

    @staticmethod
    def backward(ctx, grad_probs_TE, _grad_map):
        return _routing_backward(ctx, grad_probs_TE, None), None, None, None


class _FusedTopKRoutingAux(torch.autograd.Function):
    """:class:`_FusedTopKRouting` and megatron's load-balancing loss of the same logits:
    ``(routing_probs [T, E], routing_map [T, E], aux_loss [], tokens_per_expert [E] int32)``."""

    @staticmethod
    def forward(ctx, logits_TE, topk: int, pre_softmax: bool, scale: float, aux_scale: float):
        return _routing_forward(ctx, logits_TE, topk, pre_softmax, scale, aux_scale)

    @staticmethod
    def backward(ctx, grad_probs_TE, _grad_map, grad_aux, _grad_counts):
        return _routing_backward(ctx, grad_probs_TE, grad_aux), None, None, None, None


def fused_routing_ok(logits: torch.Tensor, topk: int, **kw) -> bool:
    """Whether :func:`fused_topk_routing` computes ``topk_routing_with_score_function(logits, topk,
    **kw)``: a softmax score function without expert bias, expert groups, routing replay, TE's
    fused kernel, precomputed indices or dense (``[T, k]``) outputs; 2-D fp32/bf16/fp16 logits with
    ``1 <= topk <= E <= 512``; CUDA (or Triton's interpreter); Triton importable and not switched
    off (``MGRPO_TRITON_ROUTING=0``)."""
    if not set(kw) <= _KNOWN_KWARGS:
        return False
    if (kw.get("score_function", "softmax") != "softmax" or kw.get("expert_bias") is not None
            or kw.get("num_groups") or kw.get("group_topk") or kw.get("fused", False)
            or kw.get("router_replay") is not None or kw.get("dense_output", False)
            or kw.get("precomputed_indices") is not None):
        return False
    scaling = kw.get("scaling_factor")
    if scaling is not None and not isinstance(scaling, (int, float)):
        return False
    return (logits.dim() == 2 and logits.dtype in _DTYPES and 1 <= int(topk) <= logits.shape[1] <= MAX_EXPERTS
            and triton_runs_on(logits.is_cuda) and _kernels() is not None)


def fused_topk_routing(logits_TE: torch.Tensor, topk: int, use_pre_softmax: bool = False,
                       scaling_factor: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(routing_probs [T, E] in the logits' dtype, routing_map [T, E] bool)``: megatron's
    ``topk_routing_with_score_function`` for a softmax score function (module docstring), one
    Triton kernel forward and one backward. Callers check :func:`fused_routing_ok` first."""
    # megatron scales when the factor is truthy (0 and None: no scaling); x 1.0 is exact
    scale = float(scaling_factor) if scaling_factor else 1.0
    return _FusedTopKRouting.apply(logits_TE, int(topk), bool(use_pre_softmax), scale)


def fused_topk_routing_with_aux(logits_TE: torch.Tensor, topk: int, aux_scale: float, use_pre_softmax: bool = False,
                                scaling_factor: Optional[float] = None):
    """:func:`fused_topk_routing` plus megatron's load-balancing loss of the same logits, in the
    same kernels: ``(probs [T, E], routing_map [T, E], aux_loss [] fp32, tokens_per_expert [E] int32)``
    with ``aux_loss = aux_scale * sum_e (sum_t softmax(logits)_te) * tokens_per_expert_e``
    (``switch_load_balancing_loss_func`` with ``aux_scale = E * coeff / (k * T_total^2)``; the
    softmax over all E in fp32). One more launch forward (the sums over the programs, in a fixed
    order), none backward: its gradient joins the routing's in the same kernel. Replaces ~7 small
    ops of megatron's aux loss (a softmax, two column sums, products) where the host paces the GPU."""
    scale = float(scaling_factor) if scaling_factor else 1.0
    return _FusedTopKRoutingAux.apply(logits_TE, int(topk), bool(use_pre_softmax), scale, float(aux_scale))
