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

The residual stream's gradient: a layer's input ``x`` feeds the norm and the skip connection, so
autograd would add the two gradients in a pass of its own. The input and pre-MLP norms instead
return the layer's residual as an alias of ``x`` (through :func:`residual_bda`, the torch backend's
bias-dropout-add), and the backward kernel adds the alias's gradient into ``dx`` as it writes it.
Only while autograd records (not under megatron's recompute-without-output, which runs the norm
under ``no_grad``); a residual that is not the norm's input (fp32 residuals) stays as it is.
"""
from __future__ import annotations

import functools
import threading

import torch

from ._triton import import_triton, triton_runs_on

__all__ = ["FastRMSNorm", "residual_bda", "rms_norm", "take_residual_alias", "use_fast_rms_norms"]

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
    def rms_bwd(dy_ptr, x_ptr, w_ptr, dr_ptr, dx_ptr, dwp_ptr, R, H, sdy, sx, sdr, sdx, eps, BLOCK_R: tl.constexpr,
                BLOCK_H: tl.constexpr, ITERS: tl.constexpr, HAS_DR: tl.constexpr):
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
            dx = rstd * (wdy - xh * c)
            if HAS_DR:  # the residual branch's gradient (x's alias), added here instead of by autograd
                dx += tl.load(dr_ptr + r64 * sdr + cols[None, :], mask=m, other=0.0).to(tl.float32)
            tl.store(dx_ptr + r64 * sdx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)
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
    """``x / rms(x) * w`` over the last dim (module docstring). With ``alias`` it also returns a
    view of ``x`` for the residual branch, whose gradient the backward kernel adds into ``dx``."""

    @staticmethod
    def forward(ctx, x, w, eps: float, alias: bool = False):
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
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None (no zero-filled [R, H])
        return (y.view(x.shape), x.view(x.shape)) if alias else y.view(x.shape)

    @staticmethod
    def backward(ctx, dy, dres=None):
        import triton

        x2, w = ctx.saved_tensors
        R, H = x2.shape
        if dy is None:  # only the alias was used: the norm adds nothing
            return (None if dres is None else dres), None, None, None
        dy2 = _rows(dy)
        dr2 = None if dres is None else _rows(dres)
        dx = torch.empty_like(x2)
        br, bh = _blocks(H)
        programs = triton.cdiv(R, br * _BWD_ITERS)
        # every program writes its row; no programs (R = 0): a zero gradient
        dw_parts = (torch.empty if R else torch.zeros)(max(programs, 1), H, dtype=torch.float32, device=x2.device)
        if R:
            _kernels()[1][(programs,)](dy2, x2, w, dy2 if dr2 is None else dr2, dx, dw_parts, R, H, dy2.stride(0),
                                       x2.stride(0), 0 if dr2 is None else dr2.stride(0), dx.stride(0), ctx.eps,
                                       BLOCK_R=br, BLOCK_H=bh, ITERS=_BWD_ITERS, HAS_DR=dr2 is not None, num_warps=8)
        return dx.view(ctx.shape), dw_parts.sum(0).to(w.dtype), None, None


def _fast(x: torch.Tensor, weight) -> bool:
    return weight is not None and triton_runs_on(x.is_cuda) and _kernels() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim: the one-pass kernels where they run (CUDA, Triton,
    ``MGRPO_TRITON_NORM`` not 0), ``F.rms_norm`` elsewhere."""
    if not _fast(x, weight):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    return _RMSNormFn.apply(x, weight, float(eps))


class FastRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (same parameters and state dict) whose forward and backward are one
    Triton pass each on CUDA; torch's elsewhere (module docstring). With ``residual_alias`` set
    (:func:`use_fast_rms_norms` sets it on the input and pre-MLP norms) and autograd recording,
    it hands :func:`residual_bda` a view of its input to use as the layer's residual."""

    residual_alias = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1 or not _fast(x, self.weight):
            return super().forward(x)
        eps = float(self.eps if self.eps is not None else torch.finfo(x.dtype).eps)
        if not (self.residual_alias and torch.is_grad_enabled() and x.requires_grad):
            return _RMSNormFn.apply(x, self.weight, eps)
        y, alias = _RMSNormFn.apply(x, self.weight, eps, True)
        _STATE.pending = (x, alias)
        return y


_STATE = threading.local()
"""``pending``: ``(x, alias)`` of the last norm that made a residual alias, until a bda takes it."""


def take_residual_alias(residual: torch.Tensor) -> torch.Tensor:
    """The alias of ``residual`` if the last aliasing norm's input was this very tensor (its
    gradient then joins the norm's backward); ``residual`` itself otherwise. Clears the pending alias."""
    pending = getattr(_STATE, "pending", None)
    _STATE.pending = None
    return pending[1] if pending is not None and pending[0] is residual else residual


def residual_bda(training: bool, fused: bool):
    """megatron's ``get_bias_dropout_add(training, fused)`` for the torch backend's layer spec
    (``self_attn_bda`` / ``mlp_bda``): the same function, given the residual's alias from the norm
    that read it (:func:`take_residual_alias`). Without it autograd sums the residual stream's two
    gradients (the norm's and the skip connection's) in a separate pass over ``[T, h]``: 4 such
    passes of ~63 us in a 2-layer step at 22.8k tokens on an H200.

    A plain function, as megatron's ``build_module`` requires of a spec entry; megatron's layer
    calls it at every forward, so the wrapper is made once per ``(training, fused)``."""
    return _aliasing_bda(bool(training), bool(fused))


@functools.lru_cache(maxsize=None)
def _aliasing_bda(training: bool, fused: bool):
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    bda = get_bias_dropout_add(training, fused)

    def bias_dropout_add(x_with_bias, residual, prob):
        return bda(x_with_bias, take_residual_alias(residual), prob)

    return bias_dropout_add


_HIDDEN_NORMS = ("input_layernorm", "pre_mlp_layernorm", "final_layernorm")
"""megatron's names of the norms over the hidden size (the q/k norms are ``q_layernorm``/``k_layernorm``)."""


def use_fast_rms_norms(model: torch.nn.Module) -> int:
    """Switch the plain ``torch.nn.RMSNorm`` modules among megatron's hidden-size norms of ``model``
    (:data:`_HIDDEN_NORMS`) to :class:`FastRMSNorm` (same objects); returns how many."""
    n = 0
    for name, m in model.named_modules():
        if type(m) is torch.nn.RMSNorm and name.rsplit(".", 1)[-1] in _HIDDEN_NORMS:
            m.__class__ = FastRMSNorm
            # the final norm's input has no residual branch
            m.residual_alias = name.rsplit(".", 1)[-1] != "final_layernorm"
            n += 1
    return n
