"""Token permutation by expert for the torch backend's dispatchers, and the gather-sum under it.

:func:`sort_by_expert` / :func:`unsort_combine` replace megatron's permutation (``argsort`` over
``[T * E]`` and a ``scatter_add`` of bf16 rows): one ``argsort`` over the ``T * k`` (token, expert)
pairs, and gathers in both directions (the combine sums each token's ``k`` rows in fp32), no
atomics. :func:`gather_sum` is that combine (one fused Triton pass on CUDA); ``_GatherRows`` /
``_CombineRows`` are the gather and the gather-sum as each other's backward, also used by the EP
exchange (``ep_dispatch.py``), whose tables have empty slots (-1).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ._triton import import_triton, triton_runs_on
from .recompute import ROWS_OF_ATTR

__all__ = ["gather_sum", "gather_rows", "select_rows", "sort_by_expert", "unsort_combine", "topk_indices"]


@functools.lru_cache(maxsize=None)
def _triton_gather_sum_kernel():
    """``out[t] = sum_j y[idx[t, j]]`` (fp32 accumulation), one pass; None without Triton."""
    if (mods := import_triton("MGRPO_TRITON_GLU")) is None:
        return None
    triton, tl = mods

    @triton.jit
    def gather_sum(y_ptr, idx_ptr, out_ptr, H, stride_y, stride_o, K: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        cmask = cols < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(idx_ptr + t * K + j).to(tl.int64)
            # a negative index is an empty slot (the EP dispatcher's tokens with < K rows here);
            # the test is broadcast to a vector (Triton's interpreter takes no scalar in a mask)
            ok = (cols * 0 + row) >= 0
            acc += tl.load(y_ptr + row * stride_y + cols, mask=cmask & ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + t.to(tl.int64) * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)

    return gather_sum


def gather_sum(y: torch.Tensor, idx: torch.Tensor, k: int, has_empty: bool = False) -> torch.Tensor:
    """``[T, h]`` with row t = sum over j < k of ``y[idx[t * k + j]]`` (``idx`` int64 ``[T * k]``),
    accumulated in fp32; one fused Triton pass on CUDA (no ``[T * k, h]`` temporary). With
    ``has_empty`` a negative index is an empty slot (adds nothing)."""
    n = idx.shape[0] // k
    kern = _triton_gather_sum_kernel() if triton_runs_on(y.is_cuda) else None
    if kern is None or y.dim() != 2:
        if has_empty:
            rows = y.index_select(0, idx.clamp(min=0)) * (idx >= 0).unsqueeze(-1).to(y.dtype)
            return rows.view(n, k, y.shape[-1]).sum(1)
        return y.index_select(0, idx).view(n, k, y.shape[-1]).sum(1)  # fp32 accumulation inside
    y = y if y.stride(-1) == 1 else y.contiguous()
    H = y.shape[1]
    out = torch.empty(n, H, dtype=y.dtype, device=y.device)
    if n:
        import triton

        block = min(1024, triton.next_power_of_2(H))
        kern[(n, triton.cdiv(H, block))](y, idx.contiguous(), out, H, y.stride(0), out.stride(0), K=k, BLOCK_H=block,
                                         num_warps=4)
    return out




@functools.lru_cache(maxsize=None)
def _triton_select_rows_kernel():
    """``out[r] = x[idx[r]]``, ``BLOCK_R`` rows x ``BLOCK_H`` columns per program; None without Triton."""
    if (mods := import_triton("MGRPO_TRITON_GLU")) is None:
        return None
    triton, tl = mods

    @triton.jit
    def select_rows(x_ptr, idx_ptr, out_ptr, n, H, stride_x, stride_o, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rm = r < n
        src = tl.load(idx_ptr + r, mask=rm, other=0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        m = rm[:, None] & (cols < H)[None, :]
        v = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=m)
        tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_o + cols[None, :], v, mask=m)

    return select_rows


_SELECT_BLOCK_R, _SELECT_BLOCK_H = 8, 512
"""Rows and columns per program of the row gather: a program per row (2 KB) left ``index_select``'s
182k-row gathers at ~2.3 TB/s on an H200; ~4k elements per program amortise the scheduling."""


def select_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x.index_select(0, rows)`` (bit-identical, a plain copy): one Triton pass on CUDA
    (``index_select`` of 182k rows of 2048 bf16 ran at about half the copy bandwidth of an H200)."""
    kern = _triton_select_rows_kernel() if x.dim() == 2 and triton_runs_on(x.is_cuda) else None
    if kern is None:
        return x.index_select(0, rows)
    import triton

    x = x if x.stride(-1) == 1 else x.contiguous()
    n, H = rows.shape[0], x.shape[1]
    out = torch.empty(n, H, dtype=x.dtype, device=x.device)
    if n:
        block_h = min(_SELECT_BLOCK_H, triton.next_power_of_2(H))
        kern[(triton.cdiv(n, _SELECT_BLOCK_R), triton.cdiv(H, block_h))](
            x, rows.contiguous(), out, n, H, x.stride(0), out.stride(0), BLOCK_R=_SELECT_BLOCK_R, BLOCK_H=block_h,
            num_warps=4)
    return out


def topk_indices(routing_map: torch.Tensor, topk: int) -> torch.Tensor:
    """int64 ``[T, k]``: the experts each token is routed to, ascending, from a ``[T, E]`` bool map
    with exactly ``k`` True per row (dropless top-k routing). No top-k (a ``[T, E]`` top-k costs
    ~150 us per layer at 22.8k tokens on an H200): an expert's column is its rank among the row's
    routed experts (a row cumsum), and one scatter puts it there."""
    T, E = routing_map.shape
    col_TE = routing_map.to(torch.int32).cumsum(1, dtype=torch.int32) - 1
    # experts a token is not routed to go to a spill column ``k``, written many times and dropped;
    # zeros, not empty: a row with fewer than k routed experts (not dropless top-k) can never
    # index out of range
    col_TE = torch.where(routing_map, col_TE, topk).long()
    out_TK1 = torch.zeros(T, topk + 1, dtype=torch.long, device=routing_map.device)
    out_TK1.scatter_(1, col_TE, torch.arange(E, device=routing_map.device).expand(T, E))
    return out_TK1[:, :topk].contiguous()


class _GatherRows(torch.autograd.Function):
    """``x[src_rows]`` (a token once per row it has); backward: ``out[t] = sum_j grad[inv[t * k + j]]``
    (``has_empty``: -1 slots add nothing)."""

    @staticmethod
    def forward(ctx, x, src_rows, inv, k, has_empty=False):
        ctx.save_for_backward(inv)
        ctx.k, ctx.has_empty = k, has_empty
        return select_rows(x, src_rows)

    @staticmethod
    def backward(ctx, grad):
        (inv,) = ctx.saved_tensors
        return gather_sum(grad.contiguous(), inv, ctx.k, ctx.has_empty), None, None, None, None


def gather_rows(x: torch.Tensor, src_rows: torch.Tensor, inv: torch.Tensor, k: int, has_empty: bool = False
                ) -> torch.Tensor:
    """``x[src_rows]`` with the gather-sum backward (:class:`_GatherRows`); the output carries
    ``(x, src_rows)`` so the experts can recompute it in the backward instead of saving it
    (``recompute.py``)."""
    out = _GatherRows.apply(x, src_rows, inv, k, has_empty)
    setattr(out, ROWS_OF_ATTR, (x, src_rows))
    return out


class _CombineRows(torch.autograd.Function):
    """``out[t] = sum_j y[inv[t * k + j]]`` (fp32 sum; ``has_empty``: -1 slots add nothing);
    backward gathers ``grad[src_rows]``."""

    @staticmethod
    def forward(ctx, y, inv, src_rows, k, has_empty=False):
        ctx.save_for_backward(src_rows)
        return gather_sum(y.contiguous(), inv, k, has_empty)

    @staticmethod
    def backward(ctx, grad):
        (src_rows,) = ctx.saved_tensors
        return select_rows(grad.contiguous(), src_rows), None, None, None, None


@functools.lru_cache(maxsize=None)
def _triton_sort_plan_kernel():
    """``(sort_plan, expert_scan)``: the counting sort of :func:`_sort_plan_counting`; None without Triton."""
    if (mods := import_triton("MGRPO_TRITON_GLU")) is None:
        return None
    triton, tl = mods

    @triton.jit
    def sort_plan(idx_ptr, csum_ptr, start_ptr, inv_ptr, src_ptr, exp_ptr, flat_ptr, n_pairs, T, E,
                  K: tl.constexpr, BLOCK: tl.constexpr):
        pair = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # (token, slot) pairs, t * K + j
        m = pair < n_pairs
        t = (pair // K).to(tl.int64)
        e = tl.load(idx_ptr + pair, mask=m, other=0).to(tl.int64)
        # the pair's row: its expert's first row + the tokens before t (and t) routed to that expert
        dst = tl.load(start_ptr + e, mask=m, other=0).to(tl.int64) + tl.load(csum_ptr + e * T + t, mask=m, other=1) - 1
        tl.store(inv_ptr + pair, dst, mask=m)
        tl.store(src_ptr + dst, t, mask=m)
        tl.store(exp_ptr + dst, e, mask=m)
        tl.store(flat_ptr + dst, t * E + e, mask=m)  # where the row's probability sits in [T, E]

    @triton.jit
    def expert_scan(map_ptr, csum_ptr, T, E, BLOCK_T: tl.constexpr):
        # one program per expert: the running count of its tokens along T, in blocks with a carry
        e = tl.program_id(0).to(tl.int64)
        carry = tl.sum(tl.zeros([BLOCK_T], dtype=tl.int32), 0)
        for start in range(0, T, BLOCK_T):
            t = start + tl.arange(0, BLOCK_T)
            m = t < T
            v = tl.load(map_ptr + t.to(tl.int64) * E + e, mask=m, other=0).to(tl.int32)
            tl.store(csum_ptr + e * T + t, tl.cumsum(v, 0) + carry, mask=m)
            carry += tl.sum(v, 0)

    return sort_plan, expert_scan


_SCAN_BLOCK_T = 1024
"""Tokens per step of the per-expert scan (23 steps per expert at 22.8k tokens)."""
_SORT_PLAN_BLOCK = 1024
"""(token, slot) pairs per program of the counting sort (182k pairs: 178 programs)."""


def _sort_plan_counting(topk_idx: torch.Tensor, routing_map: torch.Tensor, probs: Optional[torch.Tensor]):
    """``(inv, src_rows, experts_sorted, permuted probs or None, counts [E] int32, offsets [E]
    int32)`` of :func:`sort_by_expert` by a
    counting sort (CUDA): the (expert, token) order is each expert's first row plus the running
    count of its tokens (a scan per expert of the routing map), so there is no sort at all: 4
    launches in place of the argsort's ~15 (radix passes, memsets, index arithmetic), in the MoE
    layer's host-bound stretch between the router and the experts."""
    import triton

    T, k = topk_idx.shape
    E = routing_map.shape[1]
    # [E, T]: tokens <= t routed to e, one program per expert (torch's cumsum along dim 0 of the
    # [T, E] map took ~4 ms at 22.8k x 128 on an H200: one serial thread per column)
    sort_plan, expert_scan = _triton_sort_plan_kernel()
    rmap = routing_map if routing_map.is_contiguous() else routing_map.contiguous()
    csum_ET = torch.empty(E, T, dtype=torch.int32, device=topk_idx.device)
    expert_scan[(E,)](rmap.view(torch.int8), csum_ET, T, E, BLOCK_T=_SCAN_BLOCK_T, num_warps=4)
    counts_E = csum_ET[:, -1]
    offs_E = counts_E.cumsum(0, dtype=torch.int32)  # one past each expert's last row (grouped_mm's offs)
    start_E = offs_E - counts_E  # each expert's first row
    n = T * k
    dev = topk_idx.device
    inv, src_rows, experts_sorted, flat = (torch.empty(n, dtype=torch.long, device=dev) for _ in range(4))
    sort_plan[(triton.cdiv(n, _SORT_PLAN_BLOCK),)](
        topk_idx.contiguous(), csum_ET, start_E, inv, src_rows, experts_sorted, flat, n, T, E, K=k,
        BLOCK=_SORT_PLAN_BLOCK, num_warps=4)
    # one differentiable gather (backward: an index_add into [T * E], as the argsort path's gather)
    pprobs = None if probs is None else probs.reshape(-1).index_select(0, flat)
    return inv, src_rows, experts_sorted, pprobs, counts_E, offs_E


def sort_by_expert(tokens: torch.Tensor, topk_idx: torch.Tensor, probs: Optional[torch.Tensor] = None,
                   routing_map: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor], dict]:
    """Tokens ``[T, h]`` routed by ``topk_idx [T, k]`` -> rows sorted by (expert, token) ``[T*k, h]``
    (megatron's permute order), their probabilities ``probs[t, e]`` from a dense ``[T, E]`` map,
    and the plan :func:`unsort_combine` needs. No host sync. With the bool ``routing_map [T, E]``
    (its True entries exactly ``topk_idx``'s, distinct per token) on CUDA: a counting sort
    (:func:`_sort_plan_counting`; the plan then also has the rows per expert, ``"counts"``, and
    their int32 cumulative sums, ``"offsets"``); else one argsort over ``T * k`` keys. Both give
    the same order."""
    T, k = topk_idx.shape
    if (routing_map is not None and T and triton_runs_on(tokens.is_cuda) and tokens.dim() == 2
            and _triton_sort_plan_kernel() is not None):
        inv, src_rows, experts_sorted, pprobs, counts, offs = _sort_plan_counting(topk_idx, routing_map, probs)
        out = gather_rows(tokens, src_rows, inv, k)
        return out, pprobs, {"inv": inv, "src_rows": src_rows, "k": k, "experts_sorted": experts_sorted,
                             "counts": counts, "offsets": offs}
    experts = topk_idx.reshape(-1)
    key = experts * T + torch.arange(T, device=experts.device).repeat_interleave(k)
    order = torch.argsort(key)  # keys are unique: the order is (expert, token)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    src_rows = torch.div(order, k, rounding_mode="floor")
    out = gather_rows(tokens, src_rows, inv, k)
    pprobs = None
    if probs is not None:
        pprobs = probs.gather(1, topk_idx).reshape(-1).index_select(0, order)
    return out, pprobs, {"inv": inv, "src_rows": src_rows, "k": k, "experts_sorted": experts.index_select(0, order)}


def unsort_combine(rows: torch.Tensor, plan: dict) -> torch.Tensor:
    """Inverse of :func:`sort_by_expert`: ``[T*k, h]`` expert outputs -> ``[T, h]`` (sum over each
    token's k rows, in fp32)."""
    return _CombineRows.apply(rows, plan["inv"], plan["src_rows"], plan["k"])
