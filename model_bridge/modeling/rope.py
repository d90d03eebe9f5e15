"""RoPE of packed (THD) sequences without host syncs, fused on CUDA: the torch backend's attention.

Shapes: ``T`` packed tokens, ``n`` heads (q or k), ``d`` head dim (``HALF = d // 2``);
``x [T, n, d]``, rotary angles ``freqs [T, 1, 1, d]`` (per token: our MRoPE), ``cos/sin [T, d]`` fp32.

* :func:`install_fast_rope` wraps megatron's ``apply_rotary_pos_emb`` (as the attention module sees
  it). Inside :class:`~model_bridge.modeling.torch_backend.TorchSelfAttention`'s forward, with
  per-token angles for all T tokens and no context parallelism, megatron's THD RoPE (a loop over
  samples with ``.tolist()``/``.item()``) *is* the BSHD RoPE over the buffer: the wrapper applies it
  in one Triton pass each way on CUDA (:class:`_FusedRope`; ``MGRPO_TRITON_ROPE=0`` falls back to
  megatron's unfused BSHD RoPE), with no host sync.
* q/k RMSNorm fused into the RoPE (:class:`_FusedNormRope`, on by default where the RoPE kernel runs;
  ``MGRPO_TRITON_QK_NORM_ROPE=0`` runs the norms separately; 1.6 ms of a 48.7 ms 2-layer step on an H200):
  Qwen3 normalises every q and k head (RMSNorm over d) just before the RoPE; megatron runs the
  norm (one pass to write the normed copy, two in the backward) and the RoPE as separate kernels.
  Fused, q and k are read once and written once each way. The attention defers its q/k norms
  (:func:`defer_qk_norms` decides, :func:`deferring_qk_norms` does it: wherever megatron calls a
  norm, it gets its input back and the norm joins a queue) and this wrapper pops and applies them
  in order; anything it cannot fuse gets the norm module first, so a deferred norm is never
  skipped, and one left in the queue at the end of the forward raises.
* Deferred angles (:func:`defer_angles`): for the torch backend (whose RoPE is this wrapper) the
  MRoPE kernel (mrope.py) is not launched in megatron's GPT-model prologue but by the first RoPE
  that needs its output (:func:`materialize_angles`, at the top of the wrapper and in
  :func:`_cos_sin`): in a step's prologue the GPU waits for the host, and this moves one kernel
  launch and its host work (~0.2 ms on an H200 node) behind layer 0's qkv GEMM, which the GPU
  then runs meanwhile.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Optional

import torch

from ._triton import import_triton, triton_runs_on

__all__ = ["install_fast_rope", "fast_rope_installed", "fast_rope_scope", "defer_qk_norms", "deferring_qk_norms",
           "qk_norm_rope_wanted", "grouped_query_wanted", "attach_cos_sin", "defer_angles", "materialize_angles"]

_STATE = threading.local()
_PENDING = "_mgrpo_pending_angles"


def defer_angles(freqs: torch.Tensor, launch) -> torch.Tensor:
    """Mark ``freqs`` (allocated, not yet written) as written by ``launch()`` on first use
    (:func:`materialize_angles`); returns ``freqs``."""
    setattr(freqs, _PENDING, launch)
    return freqs


def materialize_angles(freqs) -> None:
    """Run the pending launch that writes ``freqs`` (and its cos/sin), once; anything else: nothing."""
    launch = getattr(freqs, _PENDING, None)
    if launch is not None:
        delattr(freqs, _PENDING)
        launch()


def _fast_rope_active() -> bool:
    return getattr(_STATE, "depth", 0) > 0


@contextlib.contextmanager
def fast_rope_scope(deferred_norms: Optional[list] = None, grouped_query: bool = False):
    """The fast path's scope (one attention forward): the wrapper acts only inside it.
    ``deferred_norms``: the list the attention fills with its q and k norm modules (in that order)
    when it defers them; the wrapper pops them. Raises if one was left unapplied.
    ``grouped_query``: the attention hands the query over as megatron's split leaves it,
    ``[T, groups, hpg * d]`` (no reshape copy; :func:`grouped_query_wanted`)."""
    prev = getattr(_STATE, "norms", None), getattr(_STATE, "grouped_query", False)
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    _STATE.norms, _STATE.grouped_query = deferred_norms, grouped_query
    try:
        yield
    finally:
        _STATE.depth -= 1
        _STATE.norms, _STATE.grouped_query = prev
    if deferred_norms:
        raise RuntimeError(f"{len(deferred_norms)} q/k norm(s) were deferred to the RoPE but no RoPE ran: "
                           f"set MGRPO_TRITON_QK_NORM_ROPE=0 and report this")


class _DeferredNorm(torch.nn.Module):
    """Stands in for a q/k norm module during one attention forward: hands the input back
    unchanged and queues the real norm for the next RoPE call (which fuses or applies it).
    A module because megatron >= 0.19 checks what it calls (``typed_torch.apply_module``); the
    norm and queue are plain attributes, so the real norm never becomes its child."""

    def __init__(self, norm, queue: list):
        super().__init__()
        object.__setattr__(self, "norm", norm)
        object.__setattr__(self, "queue", queue)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.queue.append(self.norm)
        return x


@contextlib.contextmanager
def deferring_qk_norms(attention, queue: list):
    """Within the block, ``attention.q_layernorm`` / ``k_layernorm`` defer to the RoPE wherever
    megatron calls them (instance attributes shadow the registered submodules, which stay as they
    are for state dicts, hooks and checkpoints)."""
    q_norm, k_norm = attention._modules["q_layernorm"], attention._modules["k_layernorm"]
    made = attention.__dict__.get("_mgrpo_deferred_norms")
    if made is None or made[0].norm is not q_norm or made[1].norm is not k_norm:
        # made once per attention (a module's construction is ~20 us of host time, per layer and
        # step, in the forward's prologue while the GPU waits), then pointed at this forward's queue
        made = attention.__dict__["_mgrpo_deferred_norms"] = (_DeferredNorm(q_norm, queue), _DeferredNorm(k_norm, queue))
    for d in made:
        object.__setattr__(d, "queue", queue)
    attention.__dict__["q_layernorm"], attention.__dict__["k_layernorm"] = made
    try:
        yield
    finally:
        del attention.__dict__["q_layernorm"], attention.__dict__["k_layernorm"]


def grouped_query_wanted() -> bool:
    """Inside :func:`fast_rope_scope` with ``grouped_query``: the attention may skip the query's
    reshape copy (its RoPE wrapper takes the grouped layout)."""
    return _fast_rope_active() and getattr(_STATE, "grouped_query", False)


def qk_norm_rope_wanted() -> bool:
    """On unless ``MGRPO_TRITON_QK_NORM_ROPE=0`` (measured faster on an H200: docs/performance.md)."""
    return os.environ.get("MGRPO_TRITON_QK_NORM_ROPE", "1") != "0"


def defer_qk_norms(q_norm, k_norm, head_dim: int, config, on_device: bool) -> bool:
    """Whether the attention may leave its q/k norms to the RoPE: both plain ``torch.nn.RMSNorm``
    with a weight over the head dim, a RoPE the fused kernel covers, and the kernel runnable."""
    def plain(m) -> bool:
        return type(m) is torch.nn.RMSNorm and m.weight is not None and tuple(m.normalized_shape) == (head_dim,)

    half = head_dim // 2
    return (qk_norm_rope_wanted() and triton_runs_on(on_device) and plain(q_norm) and plain(k_norm)
            and head_dim % 2 == 0 and half & (half - 1) == 0
            and not getattr(config, "rotary_interleaved", False) and not getattr(config, "apply_rope_fusion", False)
            and not getattr(config, "multi_latent_attention", False) and _triton_kernels() is not None)


# ------------------------------------------------------------------------------------------------
# Triton kernels
# ------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _triton_kernels():
    """``(rope, norm_rope_fwd, norm_rope_bwd)`` Triton kernels; None without Triton or with
    ``MGRPO_TRITON_ROPE=0``. RoPE is megatron's non-interleaved halves form:
    ``y = x * cos + rotate_half(x) * sin``; its backward is the transpose rotation."""
    if (mods := import_triton("MGRPO_TRITON_ROPE")) is None:
        return None
    triton, tl = mods

    @triton.jit
    def rope(x_ptr, cos_ptr, sin_ptr, o_ptr, n_heads, sx0, sx1, so0, so1, HALF: tl.constexpr,
             BLOCK_N: tl.constexpr, BWD: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        hm = (heads < n_heads)[:, None]
        d = tl.arange(0, HALF)
        cb = cos_ptr + t * (2 * HALF)
        sb = sin_ptr + t * (2 * HALF)
        c1 = tl.load(cb + d)[None, :]
        c2 = tl.load(cb + HALF + d)[None, :]
        s1 = tl.load(sb + d)[None, :]
        s2 = tl.load(sb + HALF + d)[None, :]
        xp = x_ptr + t * sx0 + heads[:, None] * sx1 + d[None, :]
        x1 = tl.load(xp, mask=hm, other=0.0).to(tl.float32)
        x2 = tl.load(xp + HALF, mask=hm, other=0.0).to(tl.float32)
        if BWD:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        op = o_ptr + t * so0 + heads[:, None] * so1 + d[None, :]
        tl.store(op, y1.to(o_ptr.dtype.element_ty), mask=hm)
        tl.store(op + HALF, y2.to(o_ptr.dtype.element_ty), mask=hm)

    @triton.jit
    def norm_rope_fwd(x_ptr, w_ptr, cos_ptr, sin_ptr, o_ptr, n_heads, hpg, sx0, sxg, sxh, so0, so1, eps,
                      HALF: tl.constexpr, BLOCK_N: tl.constexpr):
        # x's head h sits at (h // hpg) * sxg + (h % hpg) * sxh: megatron's q is [T, groups, hpg * d]
        # inside the qkv buffer (read in place, no reshape copy); a plain [T, n, d] has hpg = n
        t = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        hm = (heads < n_heads)[:, None]
        d = tl.arange(0, HALF)
        c1 = tl.load(cos_ptr + t * (2 * HALF) + d)[None, :]
        c2 = tl.load(cos_ptr + t * (2 * HALF) + HALF + d)[None, :]
        s1 = tl.load(sin_ptr + t * (2 * HALF) + d)[None, :]
        s2 = tl.load(sin_ptr + t * (2 * HALF) + HALF + d)[None, :]
        w1 = tl.load(w_ptr + d).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + d).to(tl.float32)[None, :]
        xp = x_ptr + t * sx0 + ((heads // hpg) * sxg + (heads % hpg) * sxh)[:, None] + d[None, :]
        x1 = tl.load(xp, mask=hm, other=0.0).to(tl.float32)
        x2 = tl.load(xp + HALF, mask=hm, other=0.0).to(tl.float32)
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        # rounded to the output dtype between norm and RoPE, as the two unfused kernels round
        n1 = (x1 * r * w1).to(o_ptr.dtype.element_ty).to(tl.float32)
        n2 = (x2 * r * w2).to(o_ptr.dtype.element_ty).to(tl.float32)
        op = o_ptr + t * so0 + heads[:, None] * so1 + d[None, :]
        tl.store(op, (n1 * c1 - n2 * s1).to(o_ptr.dtype.element_ty), mask=hm)
        tl.store(op + HALF, (n2 * c2 + n1 * s2).to(o_ptr.dtype.element_ty), mask=hm)

    @triton.jit
    def norm_rope_bwd(g_ptr, x_ptr, w_ptr, cos_ptr, sin_ptr, dx_ptr, dwp_ptr, n_rows, n_heads, hpg, sg0, sg1, sx0,
                      sxg, sxh, sd0, sd1, eps, HALF: tl.constexpr, BLOCK_R: tl.constexpr):
        # one program: BLOCK_R (token, head) rows at once (no serial loop: all its loads are in
        # flight together); its partial weight gradient goes to row ``pid`` of dwp [programs, 2 * HALF]
        # (summed by the caller: no atomics, deterministic)
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rm = rows < n_rows
        t = tl.where(rm, rows // n_heads, 0).to(tl.int64)  # past the end: token 0's angles, g and x load as 0
        h32 = rows % n_heads
        h = h32.to(tl.int64)[:, None]
        # x's head split in 32 bits: a 64-bit division tests the high words and branches per row
        hx = ((h32 // hpg).to(tl.int64) * sxg + (h32 % hpg).to(tl.int64) * sxh)[:, None]
        m = rm[:, None]
        d = tl.arange(0, HALF)[None, :]
        cb = cos_ptr + t[:, None] * (2 * HALF) + d
        sb = sin_ptr + t[:, None] * (2 * HALF) + d
        c1 = tl.load(cb)
        c2 = tl.load(cb + HALF)
        s1 = tl.load(sb)
        s2 = tl.load(sb + HALF)
        w1 = tl.load(w_ptr + d).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d).to(tl.float32)
        gp = g_ptr + t[:, None] * sg0 + h * sg1 + d
        g1 = tl.load(gp, mask=m, other=0.0).to(tl.float32)
        g2 = tl.load(gp + HALF, mask=m, other=0.0).to(tl.float32)
        xp = x_ptr + t[:, None] * sx0 + hx + d  # x's layout as in the forward
        x1 = tl.load(xp, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(xp + HALF, mask=m, other=0.0).to(tl.float32)
        dn1 = g1 * c1 + g2 * s2  # the RoPE's transpose rotation: gradient of the normed x
        dn2 = g2 * c2 - g1 * s1
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        xh1 = x1 * r
        xh2 = x2 * r
        row = dwp_ptr + tl.program_id(0).to(tl.int64) * (2 * HALF) + tl.arange(0, HALF)
        tl.store(row, tl.sum(dn1 * xh1, 0))
        tl.store(row + HALF, tl.sum(dn2 * xh2, 0))
        gw1 = dn1 * w1
        gw2 = dn2 * w2
        dot = ((tl.sum(gw1 * xh1, 1) + tl.sum(gw2 * xh2, 1)) / (2 * HALF))[:, None]
        dp = dx_ptr + t[:, None] * sd0 + h * sd1 + d
        tl.store(dp, (r * (gw1 - xh1 * dot)).to(dx_ptr.dtype.element_ty), mask=m)
        tl.store(dp + HALF, (r * (gw2 - xh2 * dot)).to(dx_ptr.dtype.element_ty), mask=m)

    return rope, norm_rope_fwd, norm_rope_bwd


_NORM_ROPE_BLOCK_ROWS = 64
"""(token, head) rows per program of the fused norm+RoPE backward: the weight-gradient partials
are ``ceil(T * n / 64)`` rows of d floats (5.8 MB for q at 22.8k tokens x 32 heads), summed once.
(A program per 16 tokens x 16 heads looping over its tokens ran at ~40% of the copy bandwidth.)"""


def _head_block(n: int) -> int:
    import triton

    return min(16, triton.next_power_of_2(n))


def _rope_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bwd: bool) -> torch.Tensor:
    import triton

    x = x if x.stride(-1) == 1 else x.contiguous()
    T, n, d = x.shape
    out = torch.empty(T, n, d, dtype=x.dtype, device=x.device)
    if T:
        bn = _head_block(n)
        _triton_kernels()[0][(T, triton.cdiv(n, bn))](x, cos, sin, out, n, x.stride(0), x.stride(1),
                                                      out.stride(0), out.stride(1), HALF=d // 2,
                                                      BLOCK_N=bn, BWD=bwd, num_warps=4)
    return out


def _heads_layout(x: torch.Tensor, d: int) -> tuple[int, int, int, int]:
    """``(heads, heads per group, group stride, head stride)`` of ``x``: ``[T, n, d]``, or megatron's
    grouped query ``[T, groups, hpg * d]`` (each group's heads contiguous, d apart)."""
    if x.shape[-1] == d:
        return x.shape[1], x.shape[1], 0, x.stride(1)
    hpg = x.shape[-1] // d
    return x.shape[1] * hpg, hpg, x.stride(1), d


def _norm_rope_fwd(x, w, cos, sin, eps: float) -> torch.Tensor:
    """``[T, n, d]`` normed and rotated heads of ``x`` (``[T, n, d]`` or grouped, :func:`_heads_layout`)."""
    import triton

    T, d = x.shape[0], w.shape[0]
    n, hpg, sxg, sxh = _heads_layout(x, d)
    out = torch.empty(T, n, d, dtype=x.dtype, device=x.device)
    if T:
        bn = _head_block(n)
        _triton_kernels()[1][(T, triton.cdiv(n, bn))](x, w, cos, sin, out, n, hpg, x.stride(0), sxg, sxh,
                                                      out.stride(0), out.stride(1), eps, HALF=d // 2,
                                                      BLOCK_N=bn, num_warps=4)
    return out


def _norm_rope_bwd(g, x, w, cos, sin, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dw)``: ``dx`` contiguous in ``x``'s shape (grouped or not), ``g`` ``[T, n, d]``."""
    import triton

    g = g if g.stride(-1) == 1 else g.contiguous()
    T, d = x.shape[0], w.shape[0]
    n, hpg, sxg, sxh = _heads_layout(x, d)
    dx = torch.empty(T, n, d, dtype=x.dtype, device=x.device)
    programs = triton.cdiv(T * n, _NORM_ROPE_BLOCK_ROWS)
    # every program writes its row; no programs (T = 0): a zero gradient
    dw_parts = (torch.empty if T else torch.zeros)(max(programs, 1), d, dtype=torch.float32, device=x.device)
    if T:
        _triton_kernels()[2][(programs,)](g, x, w, cos, sin, dx, dw_parts, T * n, n, hpg, g.stride(0), g.stride(1),
                                          x.stride(0), sxg, sxh, dx.stride(0), dx.stride(1), eps, HALF=d // 2,
                                          BLOCK_R=_NORM_ROPE_BLOCK_ROWS, num_warps=4)
    return dx.view(x.shape), dw_parts.sum(0).to(w.dtype)


class _FusedRope(torch.autograd.Function):
    """``x * cos + rotate_half(x) * sin`` (megatron's non-interleaved RoPE) in one Triton pass each way."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rope_launch(x, cos, sin, bwd=False)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rope_launch(grad, cos, sin, bwd=True), None, None


class _FusedNormRope(torch.autograd.Function):
    """``rope(RMSNorm_w(x))`` over each head's d values in one Triton pass each way. Saves ``x``
    (the unfused norm saves it too) and recomputes the ``1/rms`` in the backward. ``x`` is
    ``[T, n, d]`` or megatron's grouped query ``[T, groups, hpg * d]`` (a view of the qkv buffer,
    read in place); the output is ``[T, n, d]``."""

    @staticmethod
    def forward(ctx, x, w, cos, sin, eps: float):
        x = x if x.stride(-1) == 1 else x.contiguous()
        ctx.save_for_backward(x, w, cos, sin)
        ctx.eps = eps
        return _norm_rope_fwd(x, w, cos, sin, eps)

    @staticmethod
    def backward(ctx, grad):
        x, w, cos, sin = ctx.saved_tensors
        dx, dw = _norm_rope_bwd(grad, x, w, cos, sin, ctx.eps)
        return dx, dw, None, None, None


# ------------------------------------------------------------------------------------------------
# the wrapper of megatron's apply_rotary_pos_emb
# ------------------------------------------------------------------------------------------------

def attach_cos_sin(freqs: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
    """Hand ``cos``/``sin`` ``[T, d]`` (fp32, of ``freqs`` times ``mscale``) to :func:`_cos_sin`'s
    cache on the angles tensor (the MRoPE kernel computes all three at once); returns ``freqs``."""
    try:
        freqs._mgrpo_cos_sin = (float(mscale), freqs._version, cos, sin)
    except (AttributeError, RuntimeError):
        pass
    return freqs


def _cos_sin(freqs: torch.Tensor, mscale: float):
    """fp32 ``(cos, sin) [T, d]`` of rotary angles ``[T, 1, 1, d]``, cached on the freqs tensor (the
    same tensor reaches every layer of a forward, for q and for k)."""
    materialize_angles(freqs)
    cached = getattr(freqs, "_mgrpo_cos_sin", None)
    if cached is not None and cached[0] == mscale and cached[1] == freqs._version:
        return cached[2], cached[3]
    f = freqs.reshape(freqs.shape[0], freqs.shape[-1]).float()
    cos, sin = (torch.cos(f) * mscale).contiguous(), (torch.sin(f) * mscale).contiguous()
    attach_cos_sin(freqs, cos, sin, mscale)
    return cos, sin


def _fused_rope_ok(t: torch.Tensor, freqs: torch.Tensor, config) -> bool:
    """The kernels cover ``t``'s RoPE with angles ``freqs`` (head dim ``d = freqs.shape[-1]``; the
    callers check that ``t``'s heads are ``d`` wide, plain or grouped)."""
    d = freqs.shape[-1]
    return (triton_runs_on(t.is_cuda) and d % 2 == 0 and (d // 2) & (d // 2 - 1) == 0
            and not getattr(config, "rotary_interleaved", False)
            and not getattr(config, "multi_latent_attention", False) and _triton_kernels() is not None)


def _is_grouped_query(t: torch.Tensor, freqs: torch.Tensor) -> bool:
    """``t`` is a grouped query ``[T, groups, hpg * d]`` (only inside the fast path's scope: there
    megatron never hands the RoPE heads wider than the angles otherwise)."""
    return (_fast_rope_active() and getattr(_STATE, "grouped_query", False) and t.dim() == 3 and freqs.dim() == 4
            and t.shape[-1] > freqs.shape[-1] and t.shape[-1] % freqs.shape[-1] == 0)


def _pop_deferred_norm():
    norms = getattr(_STATE, "norms", None)
    return norms.pop(0) if norms else None


def _make_fast_rope(orig):
    @functools.wraps(orig)
    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None, **kw):
        materialize_angles(freqs)  # every path below reads them (deferred by mrope.py)
        norm = _pop_deferred_norm() if _fast_rope_active() else None  # q's first, then k's
        if _is_grouped_query(t, freqs):
            # the query as TorchSelfAttention hands it over when the norm is deferred: [T, groups,
            # hpg * d], a view of the qkv buffer; the fused kernel reads it in place
            if norm is not None and cu_seqlens is not None and freqs.shape[0] == t.shape[0] and freqs.shape[1] == 1 \
                    and (cp_group is None or cp_group.size() == 1) and _fused_rope_ok(t, freqs, config):
                eps = norm.eps if norm.eps is not None else torch.finfo(t.dtype).eps
                return _FusedNormRope.apply(t, norm.weight, *_cos_sin(freqs, float(mscale)), float(eps))
            t = t.reshape(t.shape[0], -1, freqs.shape[-1])  # megatron's [T, heads, d] (a copy)
        if (cu_seqlens is not None and _fast_rope_active() and t.dim() == 3 and freqs.dim() == 4
                and freqs.shape[0] == t.shape[0] and freqs.shape[1] == 1
                and not getattr(config, "apply_rope_fusion", False)
                and (cp_group is None or cp_group.size() == 1)):
            # per-token angles for every packed token and no CP: megatron's THD path (cp=1, packed
            # freqs) applies exactly these angles row by row, after reading cu_seqlens to the host
            if t.shape[-1] == freqs.shape[-1] and _fused_rope_ok(t, freqs, config):
                cos, sin = _cos_sin(freqs, float(mscale))
                if norm is not None:
                    eps = norm.eps if norm.eps is not None else torch.finfo(t.dtype).eps
                    return _FusedNormRope.apply(t, norm.weight, cos, sin, float(eps))
                return _FusedRope.apply(t, cos, sin)
            if norm is not None:
                t = norm(t)
            return orig(t.unsqueeze(1), freqs, config, None, mscale=mscale, cp_group=cp_group, **kw).squeeze(1)
        if norm is not None:  # a deferred norm is never skipped
            t = norm(t)
        return orig(t, freqs, config, cu_seqlens, mscale=mscale, cp_group=cp_group, **kw)

    apply_rotary_pos_emb._mgrpo_fast_rope = True
    return apply_rotary_pos_emb


def fast_rope_installed() -> bool:
    """Whether megatron's attention calls its RoPE through this module's wrapper."""
    import megatron.core.transformer.attention as attn_mod

    return getattr(attn_mod.apply_rotary_pos_emb, "_mgrpo_fast_rope", False)


def install_fast_rope() -> None:
    """Wrap ``megatron.core.transformer.attention.apply_rotary_pos_emb`` (idempotent). The wrapper
    changes nothing outside :func:`fast_rope_scope`."""
    import megatron.core.transformer.attention as attn_mod

    if not fast_rope_installed():
        attn_mod.apply_rotary_pos_emb = _make_fast_rope(attn_mod.apply_rotary_pos_emb)
