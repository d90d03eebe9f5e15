"""Micro-batch gradients into megatron's fp32 grad buffers at the memory's speed.

megatron's DDP adds every parameter's gradient into its fp32 ``main_grad`` (a view of the grad
buffer) from a hook on the parameter's gradient accumulator: ``main_grad.add_(grad)``. With bf16
parameters that is a mixed-dtype add, which torch runs through its unvectorised elementwise
kernel, and it runs once per micro-batch over every parameter: with k micro-batches a step passes
k times over 10 bytes per parameter (read fp32 and bf16, write fp32). megatron's answer,
gradient-accumulation fusion, needs Apex's wgrad kernels (absent here) and covers only its own
linears, not our grouped experts (``model_bridge/modeling/experts.py``). A Triton grouped wgrad that
accumulates into ``main_grad`` was no faster at the trainer's budgets than ``grouped_mm`` plus this
add (docs/performance.md, "The experts' weight gradients accumulated in their GEMM").

:func:`install` puts a tensor hook on each CUDA parameter of at least :data:`MIN_NUMEL` elements
whose gradient is half precision and whose ``main_grad`` is fp32. Tensor hooks run before the
accumulator, so before DDP's hook: ours adds the gradient into ``main_grad`` with one vectorised Triton kernel and sets
``param.grad_added_to_main_grad``, megatron's flag for "already accumulated" (DDP resets it at
``zero_grad_buffer``). DDP's hook then skips its add, frees the gradient and reports the
parameter ready to its bucket as before, so overlapped grad reduction and the distributed
optimizer see the same buffers. The arithmetic is the same (fp32 + float(half), one rounding),
so ``main_grad`` is bit-identical to DDP's own add.

Autograd also runs tensor hooks for gradients that ``torch.autograd.grad`` returns instead of
accumulating (CUDA-graph warm-up and capture, ``engine/graphs.py``): those go through
:func:`paused`, under which the hooks do nothing.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Optional

import torch

from model_bridge.modeling._triton import import_triton, triton_runs_on

__all__ = ["install", "paused", "accumulate_"]

_BLOCK = 4096
"""Elements per Triton program: 16 KiB of fp32, so each thread moves whole 16-byte vectors."""
MIN_NUMEL = int(os.environ.get("MGRPO_GRAD_ACCUM_MIN_NUMEL", 1 << 20))
"""Smaller parameters keep DDP's own add. A Triton launch from Python costs tens of microseconds
of host time, more than torch's add of a million elements takes on the device, and the biases
and norms (1,280 or 2,048 values each) are most of a model's parameters by count: hooking them
added hundreds of launches per micro-batch for nothing the device would notice."""
_paused = 0


@contextlib.contextmanager
def paused():
    """No accumulation by the hooks inside (gradients taken with ``torch.autograd.grad``)."""
    global _paused
    _paused += 1
    try:
        yield
    finally:
        _paused -= 1


@functools.lru_cache(maxsize=None)
def _kernel():
    got = import_triton("MGRPO_TRITON_GRAD_ACCUM")
    if got is None:
        return None
    triton, tl = got

    @triton.jit
    def add_into(acc_ptr, g_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        acc = tl.load(acc_ptr + offs, mask=mask)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        tl.store(acc_ptr + offs, acc + g, mask=mask)

    return triton, add_into


def accumulate_(acc: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``acc += grad`` for an fp32 ``acc`` and a gradient of its shape: the Triton kernel where it
    runs (both contiguous, on CUDA), else torch's add. Returns ``acc``."""
    if acc.shape != grad.shape:
        raise ValueError(f"gradient of shape {tuple(grad.shape)} for a main_grad of shape {tuple(acc.shape)}")
    k = _kernel()
    if (k is None or not triton_runs_on(acc.is_cuda) or acc.dtype != torch.float32
            or not (acc.is_contiguous() and grad.is_contiguous()) or acc.device != grad.device):
        return acc.add_(grad)
    triton, add_into = k
    n = acc.numel()
    if n:
        add_into[(triton.cdiv(n, _BLOCK),)](acc, grad, n, BLOCK=_BLOCK)
    return acc


def _eligible(p: torch.nn.Parameter) -> bool:
    mg = getattr(p, "main_grad", None)
    # zero_out_wgrad (a tied embedding on one stage): DDP adds its gradient whatever the flag says
    return (p.requires_grad and mg is not None and mg.dtype == torch.float32 and not getattr(p, "zero_out_wgrad", False)
            and p.dtype in (torch.bfloat16, torch.float16) and p.numel() >= MIN_NUMEL and triton_runs_on(p.is_cuda))


def install(model_chunks) -> int:
    """Hook every eligible parameter of the DDP-wrapped ``model_chunks`` (module doc). Returns how
    many parameters were hooked (0 where Triton does not run: DDP's own add stays)."""
    if _kernel() is None:
        return 0
    hooked = 0
    for chunk in model_chunks:
        for p in chunk.parameters():
            if _eligible(p) and not getattr(p, "_mgrpo_grad_accum", False):
                p.register_hook(functools.partial(_hook, p))
                p._mgrpo_grad_accum = True
                hooked += 1
    return hooked


def _hook(p: torch.nn.Parameter, grad: Optional[torch.Tensor]):
    # None: a node that only anchors the parameter in the graph gave it no gradient (the pooled
    # audio clips' _RecomputeTower); its gradient arrives through another backward
    if _paused or grad is None:
        return None
    accumulate_(p.main_grad, grad)
    p.grad_added_to_main_grad = True
    return None
