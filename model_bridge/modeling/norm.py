"""The torch backend's hidden-size RMSNorms (input, pre-MLP and final) in one Triton pass each way.

Shapes: ``R`` rows (tokens), ``H`` hidden size; ``x [R, H]``, weight ``w [H]``.

torch's fused RMSNorm took ~0.27 ms per norm (forward + backward) at 22.8k tokens x 2048 on an
H200, two thirds of it in the backward, whose weight gradient is a separate column reduction. Here
the forward is one pass (fp32 math, one rounding to the output dtype); the backward is one pass
that writes ``dx`` and a per-program fp32 partial of ``dw`` (summed by the caller: no atomics,
deterministic), recomputing ``1/rms`` from ``x`` (which it reads anyway). ``MGRPO_TRITON_NORM=0``
keeps torch's. CUDA only (or Triton's interpreter in tests).

:func:`use_fast_rms_norms` switches megatron's input, pre-MLP and final ``torch.nn.RMSNorm`` modules
(what ``WrappedTorchNorm`` builds) to :class:`FastRMSNorm`: same objects, parameters (and their
``sequence_parallel`` tags) and state dict. The q/k norms (over the head dim) are left alone: the
RoPE kernel fuses them (rope.py).
"""
from __future__ import annotations

import functools

import torch

from ._triton import import_triton, triton_runs_on

__all__ = ["FastRMSNorm", "use_fast_rms_norms"]

_TILE = 4096
"""Elements per row block (rows per program = ``_TILE // BLOCK_H``: 2 rows of 2048)."""
_BWD_ITERS = 16
"""Row blocks per backward program: 32 rows of 2048 per ``dw`` partial (713 partials of 8 KB at 22.8k tokens)."""


@functools.lru_cache(maxsize=None)
def _kernels():
    """``(fwd, bwd)`` Triton kernels; None without Triton or with ``MGRPO_TRITON_NORM=0``."""
    if (mods := import_triton("MGRPO_TRITON_NORM")) is None:
        return None
    triton, tl = mods

    @triton.jit
    def rms_fwd(x_ptr, w_ptr, y_ptr, R, H, sx, sy, eps, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_H)
        m = (rows < R)[:, None] & (cols < H)[None, :]
        r64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + r64 * sx + cols[None, :], mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :]
        rstd = tl.rsqrt(tl.sum(x * x, 1) / H + eps)[:, None]
        tl.store(y_ptr + r64 * sy + cols[None, :], (x * rstd * w).to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def rms_bwd(dy_ptr, x_ptr, w_ptr, dx_ptr, dwp_ptr, R, H, sdy, sx, sdx, eps, BLOCK_R: tl.constexpr,
                BLOCK_H: tl.constexpr, ITERS: tl.constexpr):
        cols = tl.arange(0, BLOCK_H)
        cm = cols < H
        w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        dw = tl.zeros([BLOCK_H], dtype=tl.float32)
        for it in range(ITERS):
            rows = (tl.program_id(0) * ITERS + it) * BLOCK_R + tl.arange(0, BLOCK_R)
            m = (rows < R)[:, None] & cm[None, :]
            r64 = rows.to(tl.int64)[:, None]
            x = tl.load(x_ptr + r64 * sx + cols[None, :], mask=m, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + r64 * sdy + cols[None, :], mask=m, other=0.0).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x * x, 1) / H + eps)[:, None]
            xh = x * rstd
            dw += tl.sum(dy * xh, 0)
            wdy = dy * w
            c = (tl.sum(xh * wdy, 1) / H)[:, None]
            tl.store(dx_ptr + r64 * sdx + cols[None, :], (rstd * (wdy - xh * c)).to(dx_ptr.dtype.element_ty), mask=m)
        tl.store(dwp_ptr + tl.program_id(0).to(tl.int64) * H + cols, dw, mask=cm)

    return rms_fwd, rms_bwd


def _blocks(H: int) -> tuple[int, int]:
    import triton

    block_h = triton.next_power_of_2(H)
    return max(1, _TILE // block_h), block_h


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class _RMSNormFn(torch.autograd.Function):
    """``x / rms(x) * w`` over the last dim (module docstring)."""

    @staticmethod
    def forward(ctx, x, w, eps: float):
        import triton

        x2 = _rows(x)
        R, H = x2.shape
        y = torch.empty(R, H, dtype=x.dtype, device=x.device)
        if R:
            br, bh = _blocks(H)
            _kernels()[0][(triton.cdiv(R, br),)](x2, w, y, R, H, x2.stride(0), y.stride(0), eps,
                                                BLOCK_R=br, BLOCK_H=bh, num_warps=8)
        ctx.save_for_backward(x2, w)
        ctx.eps, ctx.shape = eps, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        import triton

        x2, w = ctx.saved_tensors
        dy2 = _rows(dy)
        R, H = x2.shape
        dx = torch.empty_like(x2)
        br, bh = _blocks(H)
        programs = triton.cdiv(R, br * _BWD_ITERS)
        # every program writes its row; no programs (R = 0): a zero gradient
        dw_parts = (torch.empty if R else torch.zeros)(max(programs, 1), H, dtype=torch.float32, device=x2.device)
        if R:
            _kernels()[1][(programs,)](dy2, x2, w, dx, dw_parts, R, H, dy2.stride(0), x2.stride(0), dx.stride(0),
                                       ctx.eps, BLOCK_R=br, BLOCK_H=bh, ITERS=_BWD_ITERS, num_warps=8)
        return dx.view(ctx.shape), dw_parts.sum(0).to(w.dtype), None


class FastRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (same parameters and state dict) whose forward and backward are one
    Triton pass each on CUDA; torch's elsewhere (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.weight is None or len(self.normalized_shape) != 1 or not triton_runs_on(x.is_cuda)
                or _kernels() is None):
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return _RMSNormFn.apply(x, self.weight, float(eps))


_HIDDEN_NORMS = ("input_layernorm", "pre_mlp_layernorm", "final_layernorm")
"""megatron's names of the norms over the hidden size (the q/k norms are ``q_layernorm``/``k_layernorm``)."""


def use_fast_rms_norms(model: torch.nn.Module) -> int:
    """Switch the plain ``torch.nn.RMSNorm`` modules among megatron's hidden-size norms of ``model``
    (:data:`_HIDDEN_NORMS`) to :class:`FastRMSNorm` (same objects); returns how many."""
    n = 0
    for name, m in model.named_modules():
        if type(m) is torch.nn.RMSNorm and name.rsplit(".", 1)[-1] in _HIDDEN_NORMS:
            m.__class__ = FastRMSNorm
            n += 1
    return n
