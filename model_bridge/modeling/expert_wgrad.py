"""The grouped experts' weight gradients added straight into megatron's fp32 grad buffers.

Shapes: ``N`` expert-sorted rows, ``E`` local experts, ``offs_E`` their int32 cumulative row counts
(``grouped_mm``'s ``offs``), ``w_EOI`` a stacked expert weight (``O`` outputs, ``I`` inputs),
``x_NI`` its input and ``dy_NO`` the gradient at its output.

Why: with gradient accumulation the weight gradient of an expert linear is written once per
micro-batch as a bf16 ``[E, O, I]`` tensor (``grouped_mm``'s backward) and then added into the fp32
``main_grad`` (10 more bytes per element: read fp32 and bf16, write fp32). At micro-batch shapes
the add costs more than the GEMM: on one H100 (2026-12-06), the fc1 weight gradient of 128 experts
at 2048 x 1536 took 0.51 ms for a 4,096-token micro-batch and its add into fp32 1.61 ms (1.34 and
1.64 ms at 16,896 tokens). This is megatron's gradient-accumulation fusion (Apex's and TE's fused
wgrad GEMMs, which cover only dense linears) for ``grouped_mm``'s experts: one Triton pass per
weight computes ``main_grad[e] += dy_e^T x_e`` for every expert, each output tile loaded once,
accumulated in fp32 over the expert's rows and stored once (8 bytes per element, no bf16 copy).

The arithmetic differs from the unfused path only by the bf16 rounding of each micro-batch's
gradient, which the fused pass skips (its products are exact in fp32 and summed in fp32): closer
to the exact sum, not bit-identical to DDP's add. Every output tile belongs to one program, so
the result is deterministic. Experts with no rows are left as they are (``grouped_mm`` would
leave their slice uninitialised, ``empty_groups.py``).

Megatron's contract (``LinearWithGradAccumulationAndAsyncCommunication``): the backward sets
``weight.grad_added_to_main_grad`` and returns an uninitialised placeholder gradient, so that
DDP's hook still fires (bucket readiness with ``overlap_grad_reduce``) but skips its add and frees
the placeholder; the engine's own accumulate hook (``megatron_grpo/engine/grad_accum.py``) skips
it through :func:`take_placeholder`. Applies on CUDA (or Triton's interpreter in tests) to a
weight with an fp32 ``main_grad`` of its shape, outside :func:`paused` (gradients taken with
``torch.autograd.grad``: CUDA-graph warm-up and capture) and with ``MGRPO_TRITON_EXPERT_WGRAD``
not ``0``.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch

from ._triton import import_triton, triton_runs_on

__all__ = ["applies", "grouped_linear_into_main_grad", "paused", "take_placeholder", "wgrad_into_"]

_TILE = (128, 128, 64, 8, 3)
"""(BM, BN, BK, warps, stages) of a program's output tile ``[BM, BN]`` of one expert and its steps
of BK rows: 128 x 128 fp32 is the accumulator wgmma keeps in registers with 8 warps."""
_paused = 0
_PLACEHOLDER = "_mgrpo_wgrad_placeholder"


@contextlib.contextmanager
def paused():
    """Inside: expert linears built here take the plain ``grouped_mm`` path (their weight gradient
    returned, not added into ``main_grad``)."""
    global _paused
    _paused += 1
    try:
        yield
    finally:
        _paused -= 1


@functools.lru_cache(maxsize=None)
def _kernel():
    got = import_triton("MGRPO_TRITON_EXPERT_WGRAD")
    if got is None:
        return None
    triton, tl = got

    @triton.jit
    def wgrad_into(acc_ptr, dy_ptr, x_ptr, offs_ptr, O, I, s_dy, s_x, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, F32: tl.constexpr):
        e = tl.program_id(1)
        hi = tl.load(offs_ptr + e)
        lo = tl.load(offs_ptr + tl.maximum(e - 1, 0))
        lo = tl.where(e > 0, lo, 0)
        if hi > lo:
            tiles_n = tl.cdiv(I, BN)
            m = (tl.program_id(0) // tiles_n) * BM + tl.arange(0, BM)
            n = (tl.program_id(0) % tiles_n) * BN + tl.arange(0, BN)
            acc = tl.zeros([BM, BN], tl.float32)
            for k0 in range(lo, hi, BK):
                k = k0 + tl.arange(0, BK)
                rows = (k < hi)[:, None]
                a = tl.load(dy_ptr + k.to(tl.int64)[:, None] * s_dy + m[None, :], mask=rows & (m < O)[None, :],
                            other=0.0)  # [BK, BM]: dy_e's rows, read along the outputs
                b = tl.load(x_ptr + k.to(tl.int64)[:, None] * s_x + n[None, :], mask=rows & (n < I)[None, :],
                            other=0.0)  # [BK, BN]
                if F32:  # fp32 products exactly (tl.dot would round fp32 inputs to tf32)
                    acc = tl.dot(tl.trans(a.to(tl.float32)), b.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(tl.trans(a), b, acc)
            keep = (m < O)[:, None] & (n < I)[None, :]
            ptrs = acc_ptr + e.to(tl.int64) * O * I + m[:, None] * I + n[None, :]
            tl.store(ptrs, tl.load(ptrs, mask=keep) + acc, mask=keep)

    return triton, wgrad_into


def wgrad_into_(acc_EOI: torch.Tensor, dy_NO: torch.Tensor, x_NI: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """``acc_EOI[e] += dy_e^T @ x_e`` over the rows ``[offs_E[e-1], offs_E[e])`` of each expert, in
    fp32 (``acc_EOI`` fp32 and contiguous; rows past ``offs_E[-1]`` are not read). Returns ``acc_EOI``."""
    E, O, I = acc_EOI.shape
    if acc_EOI.dtype != torch.float32 or not acc_EOI.is_contiguous():
        raise ValueError(f"the accumulator must be a contiguous fp32 [E, O, I], got {acc_EOI.dtype} "
                         f"{tuple(acc_EOI.shape)} with strides {acc_EOI.stride()}")
    if dy_NO.shape[-1] != O or x_NI.shape[-1] != I or dy_NO.shape[0] != x_NI.shape[0] or offs_E.shape != (E,):
        raise ValueError(f"dy {tuple(dy_NO.shape)} and x {tuple(x_NI.shape)} with offsets {tuple(offs_E.shape)} "
                         f"do not match an accumulator of {tuple(acc_EOI.shape)}")
    got = _kernel()
    if got is None:
        raise RuntimeError("wgrad_into_ needs Triton (MGRPO_TRITON_EXPERT_WGRAD is 0 or Triton does not import)")
    triton, kernel = got
    dy_NO, x_NI = dy_NO.contiguous(), x_NI.contiguous()
    # F32 on CPU (the interpreter, tests only): its half-precision tl.dot returns garbage (Triton 3.9);
    # half-precision products are exact in fp32, so the sums are the tensor cores' up to order
    bm, bn, bk, warps, stages = _TILE
    grid = (triton.cdiv(O, bm) * triton.cdiv(I, bn), E)
    kernel[grid](acc_EOI, dy_NO, x_NI, offs_E, O, I, dy_NO.stride(0), x_NI.stride(0), BM=bm, BN=bn, BK=bk,
                 F32=dy_NO.dtype == torch.float32 or not dy_NO.is_cuda, num_warps=warps, num_stages=stages)
    return acc_EOI


def applies(x_NI: torch.Tensor, w_EOI: torch.Tensor) -> bool:
    """Whether :func:`grouped_linear_into_main_grad` takes this weight's gradient (module doc)."""
    mg = getattr(w_EOI, "main_grad", None)
    return (not _paused and torch.is_grad_enabled() and w_EOI.requires_grad and mg is not None
            and mg.dtype == torch.float32 and mg.shape == w_EOI.shape and mg.is_contiguous()
            and not getattr(w_EOI, "zero_out_wgrad", False) and x_NI.dtype == w_EOI.dtype
            and triton_runs_on(x_NI.is_cuda) and _kernel() is not None)


def take_placeholder(p: torch.nn.Parameter) -> bool:
    """True, once, when the gradient autograd is handing ``p`` is the placeholder of a weight
    gradient already added into its ``main_grad`` (an accumulate hook must then add nothing)."""
    if getattr(p, _PLACEHOLDER, False):
        setattr(p, _PLACEHOLDER, False)
        return True
    return False


class _GroupedLinearIntoMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NI, w_EOI, offs_E, linear):
        ctx.save_for_backward(x_NI, w_EOI, offs_E)
        ctx.linear, ctx.param = linear, w_EOI  # the Parameter itself: its main_grad and flags
        return linear(x_NI, w_EOI, offs_E)

    @staticmethod
    def backward(ctx, dy_NO):
        x_NI, w_EOI, offs_E = ctx.saved_tensors
        w_EOI, param = w_EOI.detach(), ctx.param
        dx = ctx.linear(dy_NO.contiguous(), w_EOI.transpose(-2, -1), offs_E) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return dx, None, None, None
        if _paused:  # a backward through autograd.grad wants the gradient itself
            dw = wgrad_into_(torch.zeros(w_EOI.shape, dtype=torch.float32, device=w_EOI.device), dy_NO, x_NI, offs_E)
            return dx, dw.to(w_EOI.dtype), None, None
        wgrad_into_(param.main_grad, dy_NO, x_NI, offs_E)
        param.grad_added_to_main_grad = True
        setattr(param, _PLACEHOLDER, True)
        # megatron's placeholder: DDP's hook fires on it, skips its add (the flag) and frees it
        return dx, torch.empty_like(w_EOI), None, None


def grouped_linear_into_main_grad(x_NI: torch.Tensor, w_EOI: torch.Tensor, offs_E: torch.Tensor,
                                  linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
                                  ) -> torch.Tensor:
    """``linear(x_NI, w_EOI, offs_E)`` (rows of expert e times ``w_EOI[e]^T``), whose backward adds
    the weight gradient into ``w_EOI.main_grad`` (:func:`wgrad_into_`) and gives the input gradient
    as ``linear(dy, w^T, offs)``. Use where :func:`applies`."""
    return _GroupedLinearIntoMainGrad.apply(x_NI, w_EOI, offs_E, linear)
