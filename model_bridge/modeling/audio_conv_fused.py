"""The audio conv front-end's bias + GELU fused into Triton passes (CUDA; ``MGRPO_TRITON_AUDIO_CONV=0``
turns them off).

Shapes: ``K`` chunks, ``M x L`` a chunk's mel image (bins x frames), ``Ho x Wo`` a conv's output,
``C`` channels, ``N = K * Ho * Wo`` output positions; every ``[N, C]`` tensor is a channels-last
``[K, C, Ho, Wo]`` seen flat.

Why: the first conv's output is the front-end's largest tensor (``K x 480 x 64 x 50``: 11.8 GB in
bf16 for an hour of audio), and the unfused path passes over it four times forward (GEMM out, GELU
in and out, the next conv in) and five times backward, keeping the pre-activation alive for GELU's
backward. The first conv has one input channel, so each output is 9 multiply-adds of the mel
input: :func:`conv1_gelu` computes ``GELU(conv1(x) + b)`` straight from the mel image (one write of
the output), keeps only the mel image for backward, and its backward recomputes the
pre-activation while it reduces the weight and bias gradients (one read of the incoming gradient;
the mel input takes no gradient). For the two 480-channel convs cuDNN runs the conv without bias
and :func:`bias_gelu` adds the bias and applies GELU in one pass (torch adds a conv's bias in a
separate broadcast pass, unvectorised); its backward writes the pre-activation's gradient and
reduces the bias gradient in the same pass.

Arithmetic: the first conv's products on tensor cores in the input dtype with fp32 accumulation
(products of half-precision values are exact in fp32), the rest in fp32, one rounding to the
output dtype; the gradient at a pre-activation is rounded to the input dtype before it meets the
weight-gradient dot, as the unfused path's GELU backward output is; weight and bias gradients are
fp32 partial sums per program, summed in a fixed order (deterministic). GELU is the erf one, as ``F.gelu`` and
HF's audio tower, with erf to 1.5e-7 absolute (Abramowitz & Stegun 7.1.26: a degree-5 polynomial in
``t = 1 / (1 + p x)`` times ``exp(-x^2)``, an exponential GELU's slope shares). The first conv's
passes are bound by instruction issue, not memory (at 500 chunks on an H100 the backward reads its
gradient at 1.3 TB/s; ``bias_gelu`` moves its bytes at 2.6-2.9 TB/s), and libdevice's ``erff``
picks one of two polynomials per element,
selecting their coefficients lane by lane: compiled for sm_90, each pass's loop issues ~30% fewer
instructions with this erf (per 128 x 32 tile: ``conv1_gelu`` forward 762 against 1,110 with
``erff``, backward 1,402 against 1,977; ``bias_gelu`` 875 against 1,223, 1,127 against 1,738). The
fp32 results are as close to fp64 with either (3.4e-7 and 3.2e-7 at most in the tests, which allow 2e-6).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ._triton import import_triton, triton_runs_on

__all__ = ["fused_conv_available", "conv1_gelu", "bias_gelu"]

_TAPS = 16
"""The first conv's 9 taps and its bias's tap, padded to 16: ``tl.dot`` needs every dimension >= 16."""
_CONV1_FWD_TILE = (64, 32, 4)
"""(positions, channels, warps) of the first conv's forward tile; a program gathers its positions'
3x3 windows once and loops over the channel blocks."""
_CONV1_BWD_TILE = (32, 128, 4)
"""(positions, channels, warps) of the first conv's backward tile (64 x 128 with 8 warps spills
registers: 3.5 ms)."""
_BIAS_GELU_FWD_TILE = (8, 512, 4)
"""(positions, channels, warps) of ``bias_gelu``'s forward tile: whole 480-channel rows."""
_BIAS_GELU_BWD_TILE = (32, 256, 8)
"""(positions, channels, warps) of ``bias_gelu``'s backward tile.

The four tiles are the best of 6-8 each, timed alone at 500 chunks of 480 channels in bf16 on one
H100, 2026-12-06 (``docs/performance/audio_conv_tiles_h100_2026-12-06.json``): ``conv1_gelu``
forward 0.743 ms (1,536 MB written), backward 1.147 ms (1,536 MB read); ``bias_gelu`` on the
second conv's output forward 0.261 ms (768 MB), backward 0.442 ms (1,152 MB)."""
_PROGRAMS_PER_SM = 4
"""Backward programs per SM and channel block: each loops over positions and keeps its weight and
bias partial sums in its dot's accumulator, so the partials stay a few MB however long the audio.
Program ids run channel block first (``_tile``): the programs resident at once read whole
``[N, C]`` rows, where position-first order had every program of a wave read the same 64 bytes
of each 960-byte row and DRAM served ~1 TB/s."""


@functools.lru_cache(maxsize=None)
def _kernels():
    got = import_triton("MGRPO_TRITON_AUDIO_CONV")
    if got is None:
        return None
    triton, tl = got

    @triton.jit
    def _gelu_and_slope(z):
        # erfc(x) at x = |z| / sqrt(2) to 1.5e-7 (Abramowitz & Stegun 7.1.26, module doc):
        # t (a1 + a2 t + ... + a5 t^4) exp(-x^2) with t = 1 / (1 + 0.3275911 x)
        t = tl.math.fdiv(1.0, 1.0 + 0.2316418882663604 * tl.abs(z))  # 0.3275911 / sqrt(2)
        e = tl.math.exp2(z * z * -0.7213475204444817)  # exp(-x^2) = exp(-z^2 / 2); 0.5 * log2(e)
        half_erfc = (0.127414796 + t * (-0.142248368 + t * (0.7107068705 + t * (-0.7265760135 + t * 0.5307027145))))
        half_erfc = half_erfc * t * e  # the a_i halved above
        cdf = tl.where(z >= 0, 1.0 - half_erfc, half_erfc)
        return z * cdf, cdf + z * e * 0.3989422804014327  # 1/sqrt(2*pi)

    @triton.jit
    def _mm(a, b, IEEE: tl.constexpr):
        """a @ b accumulated in fp32; fp32 inputs exactly (Triton would round them to tf32)."""
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _conv1_taps(x_ptr, p, n_pos, HO: tl.constexpr, WO: tl.constexpr, M: tl.constexpr, L: tl.constexpr,
                    sxk, sxm, sxl, TAPS: tl.constexpr, WIDE: tl.constexpr):
        """[P, TAPS] in x's dtype: position p's 3x3 window (zero padding 1, stride 2), then a 1 (the
        bias is the tenth tap's weight), then zeros; all zero past ``n_pos``. Integer work is most of
        the backward's instructions, so ``p`` is int32 and the chunk geometry constexpr (one
        compilation per chunk shape, in practice 128 x 100): the position's (chunk, row, column) are
        two multiply-shifts, where a 64-bit division by a runtime value tests the high words and
        branches to a 19-instruction 32-bit path (an ~80-instruction subroutine past 2^32) per
        element. The mel offsets are 64-bit only when the input spans 2^31 elements (``WIDE``)."""
        t = tl.arange(0, TAPS)
        q = p // WO
        wo = p - q * WO
        k = q // HO
        ho = q - k * HO
        r = 2 * ho[:, None] - 1 + (t // 3)[None, :]  # mel bin of each tap
        f = 2 * wo[:, None] - 1 + (t % 3)[None, :]   # frame of each tap
        live = (p < n_pos)[:, None]
        inside = live & (t < 9)[None, :] & (r >= 0) & (r < M) & (f >= 0) & (f < L)
        if WIDE:
            off = k.to(tl.int64)[:, None] * sxk + tl.maximum(r, 0).to(tl.int64) * sxm + tl.maximum(f, 0).to(tl.int64) * sxl
        else:
            off = k[:, None] * sxk + tl.maximum(r, 0) * sxm + tl.maximum(f, 0) * sxl
        taps = tl.load(x_ptr + off, mask=inside, other=0.0)
        return tl.where(live & (t == 9)[None, :], 1.0, taps).to(x_ptr.dtype.element_ty)

    @triton.jit
    def _tile(C, BLOCK_C: tl.constexpr):
        """(channel block, position program, position programs) of a flat program id, channel
        blocks fastest."""
        blocks = tl.cdiv(C, BLOCK_C)
        pid = tl.program_id(0)
        return pid % blocks, pid // blocks, tl.num_programs(0) // blocks

    # a kernel finds the helpers it calls among its module's globals (closures are not looked up)
    globals().update(_gelu_and_slope=_gelu_and_slope, _mm=_mm, _conv1_taps=_conv1_taps, _tile=_tile)

    @triton.jit
    def conv1_gelu_fwd(x_ptr, w_ptr, out_ptr, n_pos, C, HO: tl.constexpr, WO: tl.constexpr, M: tl.constexpr,
                       L: tl.constexpr, sxk, sxm, sxl, TAPS: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, IEEE: tl.constexpr, WIDE: tl.constexpr):
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)  # int32: n_pos < 2^31 (checked on the host)
        taps = _conv1_taps(x_ptr, p, n_pos, HO, WO, M, L, sxk, sxm, sxl, TAPS, WIDE)  # gathered once, all channels
        row = p.to(tl.int64)[:, None] * C  # the output's offsets pass 2^31 within an hour of audio
        t = tl.arange(0, TAPS)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            w = tl.load(w_ptr + t[:, None] * C + c[None, :], mask=(c < C)[None, :], other=0.0)
            out, _ = _gelu_and_slope(_mm(taps, w, IEEE))
            keep = (p < n_pos)[:, None] & (c < C)[None, :]
            tl.store(out_ptr + row + c[None, :], out.to(out_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def conv1_gelu_bwd(x_ptr, w_ptr, g_ptr, dw_ptr, n_pos, C, HO: tl.constexpr, WO: tl.constexpr,
                       M: tl.constexpr, L: tl.constexpr, sxk, sxm, sxl, TAPS: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, IEEE: tl.constexpr, WIDE: tl.constexpr):
        cb, pid, n_prog = _tile(C, BLOCK_C)
        c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        t = tl.arange(0, TAPS)
        w = tl.load(w_ptr + t[:, None] * C + c[None, :], mask=(c < C)[None, :], other=0.0)
        dw = tl.zeros([TAPS, BLOCK_C], tl.float32)  # row 9: the bias's gradient
        for start in range(pid * BLOCK_P, n_pos, n_prog * BLOCK_P):
            p = tl.arange(0, BLOCK_P) + start
            taps = _conv1_taps(x_ptr, p, n_pos, HO, WO, M, L, sxk, sxm, sxl, TAPS, WIDE)
            _, slope = _gelu_and_slope(_mm(taps, w, IEEE))  # the pre-activation, recomputed
            keep = (p < n_pos)[:, None] & (c < C)[None, :]
            g = tl.load(g_ptr + p.to(tl.int64)[:, None] * C + c[None, :], mask=keep, other=0.0).to(tl.float32)
            dw += _mm(tl.trans(taps), (g * slope).to(x_ptr.dtype.element_ty), IEEE)
        tl.store(dw_ptr + pid * TAPS * C + t[:, None] * C + c[None, :], dw, mask=(c < C)[None, :])

    @triton.jit
    def bias_gelu_fwd(y_ptr, b_ptr, out_ptr, n_pos, C, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        cb, pt, _ = _tile(C, BLOCK_C)
        p = pt.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
        c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        keep = (p < n_pos)[:, None] & (c < C)[None, :]
        off = p[:, None] * C + c[None, :]
        z = tl.load(y_ptr + off, mask=keep, other=0.0).to(tl.float32)
        z += tl.load(b_ptr + c, mask=c < C, other=0.0).to(tl.float32)[None, :]
        out, _ = _gelu_and_slope(z)
        tl.store(out_ptr + off, out.to(out_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def bias_gelu_bwd(y_ptr, b_ptr, g_ptr, gy_ptr, db_ptr, n_pos, C, BLOCK_P: tl.constexpr,
                      BLOCK_C: tl.constexpr, IEEE: tl.constexpr):
        cb, pid, n_prog = _tile(C, BLOCK_C)
        c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        bias = tl.load(b_ptr + c, mask=c < C, other=0.0).to(tl.float32)
        # the bias gradient as a product with a block of ones: the sum over positions stays in the
        # dot's accumulator instead of a cross-warp reduction per tile
        ones = tl.full([16, BLOCK_P], 1.0, gy_ptr.dtype.element_ty)
        acc = tl.zeros([16, BLOCK_C], tl.float32)
        for start in range(pid * BLOCK_P, n_pos, n_prog * BLOCK_P):
            p = tl.arange(0, BLOCK_P).to(tl.int64) + start
            keep = (p < n_pos)[:, None] & (c < C)[None, :]
            off = p[:, None] * C + c[None, :]
            z = tl.load(y_ptr + off, mask=keep, other=0.0).to(tl.float32) + bias[None, :]
            g = tl.load(g_ptr + off, mask=keep, other=0.0).to(tl.float32)
            _, slope = _gelu_and_slope(z)
            g_pre = tl.where(keep, g * slope, 0.0).to(gy_ptr.dtype.element_ty)
            tl.store(gy_ptr + off, g_pre, mask=keep)
            acc += _mm(ones, g_pre, IEEE)
        db = tl.sum(tl.where((tl.arange(0, 16) == 0)[:, None], acc, 0.0), axis=0)  # row 0 (all rows equal)
        tl.store(db_ptr + pid * C + c, db, mask=c < C)

    return triton, conv1_gelu_fwd, conv1_gelu_bwd, bias_gelu_fwd, bias_gelu_bwd


def fused_conv_available(x: torch.Tensor) -> bool:
    """Whether the fused passes run for this input (Triton importable and switched on, CUDA or the
    test interpreter, an input that takes no gradient)."""
    return _kernels() is not None and triton_runs_on(x.is_cuda) and not x.requires_grad


def _programs(device: torch.device, n_pos: int, block_p: int) -> int:
    """Backward programs along the positions (per channel block): a few per SM, never more than tiles."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    return max(1, min(sms * _PROGRAMS_PER_SM, -(-n_pos // block_p)))


def _channels_last_flat(t: torch.Tensor) -> torch.Tensor:
    """``[K, C, H, W]`` -> ``[K*H*W, C]`` (a view when ``t`` is channels-last)."""
    return t.permute(0, 2, 3, 1).contiguous().view(-1, t.shape[1])


_I32_MAX = 2**31 - 1


def _mel_offsets_wide(x_K1ML: torch.Tensor, n_pos: int, block_p: int) -> bool:
    """Whether the first conv's mel offsets need 64 bits (the ``WIDE`` of its kernels). Positions are
    32-bit in the kernels: ``n_pos`` plus a grid's worth of tiles past it must stay below 2^31 (an
    input of that size would have a 2 TB output at 480 channels, so this never binds in practice)."""
    if n_pos + block_p * _programs(x_K1ML.device, n_pos, block_p) > _I32_MAX:  # the backward's last start
        raise ValueError(f"conv1_gelu takes fewer than 2^31 output positions per call, got {n_pos}: "
                         "split the chunks into several calls")
    last = sum((n - 1) * st for n, st in zip(x_K1ML.shape, x_K1ML.stride()) if n > 0)
    return last > _I32_MAX


class _Conv1Gelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_K1ML: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        _, conv1_gelu_fwd, _, _, _ = _kernels()
        k, _, m, length = x_K1ML.shape
        c = weight.shape[0]
        ho, wo = (m + 1) // 2, (length + 1) // 2
        n_pos = k * ho * wo
        # the 9 weights of each channel, then its bias (the tenth tap, whose input is 1), then zeros
        w_TC = torch.zeros(_TAPS, c, dtype=x_K1ML.dtype, device=weight.device)
        w_TC[:9] = weight.reshape(c, 9).T
        w_TC[9] = bias
        out_NC = torch.empty(n_pos, c, dtype=x_K1ML.dtype, device=x_K1ML.device)
        sxk, _, sxm, sxl = x_K1ML.stride()
        block_p, block_c, warps = _CONV1_FWD_TILE
        wide = _mel_offsets_wide(x_K1ML, n_pos, max(block_p, _CONV1_BWD_TILE[0]))
        if n_pos:
            conv1_gelu_fwd[(-(-n_pos // block_p),)](x_K1ML, w_TC, out_NC, n_pos, c, ho, wo, m, length, sxk, sxm,
                                                    sxl, TAPS=_TAPS, BLOCK_P=block_p, BLOCK_C=block_c,
                                                    IEEE=x_K1ML.dtype == torch.float32, WIDE=wide, num_warps=warps)
        ctx.save_for_backward(x_K1ML, w_TC)
        ctx.geometry = (n_pos, c, ho, wo, m, length, wide)
        ctx.params = (weight.shape, weight.dtype, bias.dtype)
        return out_NC.view(k, ho, wo, c).permute(0, 3, 1, 2)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        _, _, conv1_gelu_bwd, _, _ = _kernels()
        x_K1ML, w_TC = ctx.saved_tensors
        n_pos, c, ho, wo, m, length, wide = ctx.geometry
        w_shape, w_dtype, b_dtype = ctx.params
        g_NC = _channels_last_flat(grad_out)
        block_p, block_c, warps = _CONV1_BWD_TILE
        progs = _programs(x_K1ML.device, n_pos, block_p)
        dw_PTC = torch.empty(progs, _TAPS, c, dtype=torch.float32, device=x_K1ML.device)
        sxk, _, sxm, sxl = x_K1ML.stride()
        conv1_gelu_bwd[(progs * -(-c // block_c),)](x_K1ML, w_TC, g_NC, dw_PTC, n_pos, c, ho, wo, m, length, sxk,
                                                  sxm, sxl, TAPS=_TAPS, BLOCK_P=block_p, BLOCK_C=block_c,
                                                  IEEE=x_K1ML.dtype == torch.float32, WIDE=wide, num_warps=warps)
        dw_TC = dw_PTC.sum(0)
        return None, dw_TC[:9].T.reshape(w_shape).to(w_dtype), dw_TC[9].to(b_dtype)


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_KCHW: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        _, _, _, bias_gelu_fwd, _ = _kernels()
        k, c, h, w = y_KCHW.shape
        y_NC = _channels_last_flat(y_KCHW)
        out_NC = torch.empty_like(y_NC)
        n_pos = y_NC.shape[0]
        block_p, block_c, warps = _BIAS_GELU_FWD_TILE
        if n_pos:
            bias_gelu_fwd[(-(-n_pos // block_p) * -(-c // block_c),)](y_NC, bias, out_NC, n_pos, c, BLOCK_P=block_p,
                                                                    BLOCK_C=block_c, num_warps=warps)
        ctx.save_for_backward(y_NC, bias)
        ctx.shape = (k, c, h, w)
        return out_NC.view(k, h, w, c).permute(0, 3, 1, 2)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        _, _, _, _, bias_gelu_bwd = _kernels()
        y_NC, bias = ctx.saved_tensors
        k, c, h, w = ctx.shape
        g_NC = _channels_last_flat(grad_out)
        gy_NC = torch.empty_like(y_NC)
        n_pos = y_NC.shape[0]
        block_p, block_c, warps = _BIAS_GELU_BWD_TILE
        progs = _programs(y_NC.device, n_pos, block_p)
        db_PC = torch.empty(progs, c, dtype=torch.float32, device=y_NC.device)
        bias_gelu_bwd[(progs * -(-c // block_c),)](y_NC, bias, g_NC, gy_NC, db_PC, n_pos, c, BLOCK_P=block_p,
                                                   BLOCK_C=block_c, IEEE=y_NC.dtype == torch.float32, num_warps=warps)
        return gy_NC.view(k, h, w, c).permute(0, 3, 1, 2), db_PC.sum(0).to(bias.dtype)


def conv1_gelu(x_K1ML: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``GELU(F.conv2d(x, weight, bias, stride=2, padding=1))`` for one input channel in one pass:
    x ``[K, 1, M, L]`` (any strides; takes no gradient), weight ``[C, 1, 3, 3]``, bias ``[C]`` ->
    ``[K, C, Ho, Wo]`` with channels-last strides."""
    if x_K1ML.dim() != 4 or x_K1ML.shape[1] != 1 or tuple(weight.shape[1:]) != (1, 3, 3):
        raise ValueError(f"conv1_gelu takes x [K, 1, M, L] and weight [C, 1, 3, 3], got {tuple(x_K1ML.shape)} "
                         f"and {tuple(weight.shape)}")
    return _Conv1Gelu.apply(x_K1ML, weight, bias)


def bias_gelu(y_KCHW: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``GELU(y + bias[:, None, None])`` in one pass (its backward also reduces the bias gradient);
    y ``[K, C, H, W]``, best channels-last (other strides are copied to it); output channels-last."""
    if bias is None or y_KCHW.dim() != 4 or tuple(bias.shape) != (y_KCHW.shape[1],):
        raise ValueError(f"bias_gelu takes y [K, C, H, W] and bias [C], got {tuple(y_KCHW.shape)} and "
                         f"{None if bias is None else tuple(bias.shape)}")
    return _BiasGelu.apply(y_KCHW, bias)
