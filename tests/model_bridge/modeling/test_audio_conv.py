"""The audio conv front-end's fast layout (``audio_conv.py``) against ``nn.Conv2d``: same values,
same gradients, channels-last output."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_bridge.modeling.audio_conv import conv1_as_gemm, conv_front_end


@pytest.mark.parametrize("m,length", [(128, 100), (128, 37), (128, 1), (128, 2), (127, 3), (9, 5)])
def test_conv1_as_gemm_equals_conv2d(m, length):
    g = torch.Generator().manual_seed(m * 1000 + length)
    x = torch.randn(3, 1, m, length, generator=g, dtype=torch.float64)
    w = torch.randn(7, 1, 3, 3, generator=g, dtype=torch.float64)
    b = torch.randn(7, generator=g, dtype=torch.float64)
    out = conv1_as_gemm(x, w, b)
    ref = F.conv2d(x, w, b, stride=2, padding=1)
    assert out.shape == ref.shape == (3, 7, (m + 1) // 2, (length + 1) // 2)
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_front_end_values_and_gradients_equal_three_conv2d():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 1, 128, 100, generator=g, dtype=torch.float64)
    x[-2:, :, :, 41:] = 0  # zero-padded short chunks, as the tower feeds them
    shapes = [(16, 1, 3, 3), (16, 16, 3, 3), (16, 16, 3, 3)]
    params = [(torch.randn(s, generator=g, dtype=torch.float64).mul_(0.3).requires_grad_(),
               torch.randn(s[0], generator=g, dtype=torch.float64).requires_grad_()) for s in shapes]
    out = conv_front_end(x, params)
    ref = x
    for w, b in params:
        ref = F.gelu(F.conv2d(ref, w, b, stride=2, padding=1))
    assert out.shape == ref.shape == (5, 16, 16, 13)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    up = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * up).sum(), [t for p in params for t in p])
    grads_ref = torch.autograd.grad((ref * up).sum(), [t for p in params for t in p])
    for a, r in zip(grads, grads_ref):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_front_end_on_gpu_is_as_close_to_fp32_as_conv2d():
    """The Qwen3-Omni geometry (480 channels, 128 mel bins, 100-frame chunks) in bf16 on the GPU:
    the fast layout's error against an fp32 reference stays within 1.5x of three bf16 conv2d's."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 1, 128, 100, generator=g)
    shapes = [(480, 1, 3, 3), (480, 480, 3, 3), (480, 480, 3, 3)]
    params = [(torch.randn(s, generator=g) * (0.3 if s[1] == 1 else 0.02), torch.randn(s[0], generator=g) * 0.1)
              for s in shapes]

    def run(fn, dtype):
        ps = [(w.cuda().to(dtype).requires_grad_(), b.cuda().to(dtype).requires_grad_()) for w, b in params]
        out = fn(x.cuda().to(dtype), ps)
        grads = torch.autograd.grad(out.float().square().mean(), [t for p in ps for t in p])
        return out.float(), [t.float() for t in grads]

    def three_conv2d(h, ps):
        for w, b in ps:
            h = F.gelu(F.conv2d(h, w, b, stride=2, padding=1))
        return h

    def errors(out_grads, ref_grads):
        (out, grads), (ref, ref_g) = out_grads, ref_grads
        return (float((out - ref).norm() / ref.norm()),
                max(float((a - r).norm() / r.norm()) for a, r in zip(grads, ref_g)))

    fp32 = run(three_conv2d, torch.float32)
    base_err, base_gerr = errors(run(three_conv2d, torch.bfloat16), fp32)
    err, gerr = errors(run(conv_front_end, torch.bfloat16), fp32)
    assert err < 1.5 * base_err + 1e-3 and gerr < 1.5 * base_gerr + 1e-3, (err, base_err, gerr, base_gerr)


def _fused_cases(device: str, dtype: torch.dtype) -> dict:
    """Per case: max |fused - fp64 reference| over the output and each gradient, relative to the
    reference's largest magnitude, for ``conv1_gelu``, ``bias_gelu`` and the whole front-end; and
    whether the gradients are bit-identical across two runs."""
    from model_bridge.modeling.audio_conv_fused import bias_gelu, conv1_gelu, fused_conv_available

    g = torch.Generator().manual_seed(3)
    out = {}

    def rel(a, ref):
        return float((a.detach().double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))

    # mel images: odd sizes (the last tap row/column falls in the padding), one frame, a chunk of the
    # real geometry; channels 40 (not a multiple of the 32-channel tile) and 32
    for k, m, length, c in ((3, 13, 7, 40), (2, 128, 37, 32), (1, 9, 1, 40), (2, 128, 100, 40)):
        x64 = torch.randn(k, 1, m, length, generator=g, dtype=torch.float64)
        x64[-1, :, :, length // 2:] = 0  # a zero-padded short chunk, as the tower feeds them
        w64 = torch.randn(c, 1, 3, 3, generator=g, dtype=torch.float64) * 0.3
        b64 = torch.randn(c, generator=g, dtype=torch.float64)
        # the input as the tower passes it: a transposed view of [K, L, M] frames
        x = x64.to(dtype).squeeze(1).transpose(1, 2).contiguous().transpose(1, 2).unsqueeze(1).to(device)
        assert fused_conv_available(x)
        ref_in = x.detach().double().cpu()
        wd, bd = w64.clone().requires_grad_(), b64.clone().requires_grad_()
        ref = F.gelu(F.conv2d(ref_in, wd, bd, stride=2, padding=1))
        up = torch.randn(ref.shape, generator=g, dtype=torch.float64)
        rgw, rgb = torch.autograd.grad((ref * up).sum(), [wd, bd])
        runs = []
        for _ in range(2):
            w, b = (t.to(device, dtype).requires_grad_() for t in (w64, b64))
            y = conv1_gelu(x, w, b)
            runs.append((y, *torch.autograd.grad(y, [w, b], up.to(device, dtype))))
        y, gw, gb = runs[0]
        # fp64 reference with the rounded weights: the kernel's own error, not the inputs' rounding
        wr, br = (t.to(dtype).double().requires_grad_() for t in (w64, b64))
        ref_r = F.gelu(F.conv2d(ref_in, wr, br, stride=2, padding=1))
        rgw, rgb = torch.autograd.grad((ref_r * up).sum(), [wr, br])
        out[f"conv1 {k}x{m}x{length}x{c}"] = (
            max(rel(y, ref_r), rel(gw, rgw), rel(gb, rgb)),
            y.is_contiguous(memory_format=torch.channels_last) and tuple(y.shape) == tuple(ref.shape),
            all(torch.equal(a, b) for a, b in zip(runs[0][1:], runs[1][1:])))
        yy64 = torch.randn(k, c, (m + 1) // 2, (length + 1) // 2, generator=g, dtype=torch.float64)
        yy = yy64.to(device, dtype).contiguous(memory_format=torch.channels_last).requires_grad_()
        b = b64.to(device, dtype).requires_grad_()
        z = bias_gelu(yy, b)
        up2 = torch.randn(z.shape, generator=g, dtype=torch.float64)
        gy, gb2 = torch.autograd.grad(z, [yy, b], up2.to(device, dtype))
        yr, br = yy.detach().double().cpu().requires_grad_(), b.detach().double().cpu().requires_grad_()
        zr = F.gelu(yr + br[:, None, None])
        rgy, rgb2 = torch.autograd.grad((zr * up2).sum(), [yr, br])
        out[f"bias_gelu {k}x{c}x{yy.shape[2]}x{yy.shape[3]}"] = (
            max(rel(z, zr), rel(gy, rgy), rel(gb2, rgb2)),
            z.is_contiguous(memory_format=torch.channels_last) and gy.is_contiguous(memory_format=torch.channels_last),
            True)
    # the whole front-end, fused (x takes no gradient) against three fp64 conv2d
    x64 = torch.randn(3, 1, 128, 100, generator=g, dtype=torch.float64)
    shapes = [(24, 1, 3, 3), (24, 24, 3, 3), (24, 24, 3, 3)]
    p64 = [(torch.randn(s, generator=g, dtype=torch.float64) * (0.3 if s[1] == 1 else 0.1),
            torch.randn(s[0], generator=g, dtype=torch.float64) * 0.1) for s in shapes]
    params = [(w.to(device, dtype).requires_grad_(), b.to(device, dtype).requires_grad_()) for w, b in p64]
    y = conv_front_end(x64.to(device, dtype), params)
    up = torch.randn(y.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(y, [t for p in params for t in p], up.to(device, dtype))
    pr = [(w.detach().double().cpu().requires_grad_(), b.detach().double().cpu().requires_grad_()) for w, b in params]
    ref = x64.to(dtype).double()
    for w, b in pr:
        ref = F.gelu(F.conv2d(ref, w, b, stride=2, padding=1))
    rgrads = torch.autograd.grad((ref * up).sum(), [t for p in pr for t in p])
    out["front_end"] = (max([rel(y, ref)] + [rel(a, r) for a, r in zip(grads, rgrads)]),
                        y.is_contiguous(memory_format=torch.channels_last), True)
    return out


def _check_fused(res: dict, tol: float) -> None:
    for case, (err, layout, deterministic) in res.items():
        assert err < tol and layout and deterministic, (case, err, layout, deterministic)


def test_fused_bias_gelu_interpreted():
    """The Triton passes (``audio_conv_fused.py``) through Triton's interpreter in fp32: the values and
    the weight, bias and input gradients of ``conv1_gelu``, ``bias_gelu`` and the fused front-end
    against fp64 ``F.conv2d`` + ``F.gelu``, to fp32 rounding; channels-last outputs; deterministic."""
    from megatron_grpo.testing.interpreted import run_interpreted
    from model_bridge.modeling.audio_conv_fused import _kernels

    res = run_interpreted(_kernels, _fused_cases, "cpu", torch.float32)
    print(f"\n[fused audio conv, interpreted] {res}")
    _check_fused(res, 2e-6)


def test_fused_path_is_off_on_cpu_and_for_an_input_with_gradient():
    from model_bridge.modeling.audio_conv_fused import fused_conv_available

    x = torch.zeros(1, 1, 8, 8)
    assert not fused_conv_available(x)  # no CUDA, no interpreter: conv_front_end takes the torch path
    if torch.cuda.is_available():
        assert not fused_conv_available(x.cuda().requires_grad_())  # conv1_gelu gives the mel no gradient


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_bias_gelu_on_gpu():
    """The same cases compiled on the GPU in fp32 (to fp32 rounding; cuDNN's convs without TF32) and
    bf16 (one bf16 rounding of each output; gradients summed in fp32 then rounded)."""
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        _check_fused(_fused_cases("cuda", torch.float32), 2e-6)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    _check_fused(_fused_cases("cuda", torch.bfloat16), 2e-2)


def _wide_offsets_equal_narrow() -> bool:
    """conv1_gelu's output and gradients with 64-bit mel offsets equal those with 32-bit ones, bit for bit."""
    import model_bridge.modeling.audio_conv_fused as fused

    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 1, 13, 9, generator=g)
    w = (torch.randn(40, 1, 3, 3, generator=g) * 0.3).requires_grad_()
    b = torch.randn(40, generator=g).requires_grad_()
    up = torch.randn(2, 40, 7, 5, generator=g)
    runs = []
    for wide in (False, True):
        fused._mel_offsets_wide = lambda *a, _w=wide: _w
        y = fused.conv1_gelu(x, w, b)
        runs.append((y, *torch.autograd.grad(y, [w, b], up)))
    return all(torch.equal(a, c) for a, c in zip(*runs))


def test_conv1_wide_mel_offsets_interpreted():
    """Inputs past 2^31 elements take 64-bit mel offsets (``WIDE``): the same values as 32-bit ones."""
    from megatron_grpo.testing.interpreted import run_interpreted
    from model_bridge.modeling.audio_conv_fused import _kernels

    assert run_interpreted(_kernels, _wide_offsets_equal_narrow)


def test_conv1_refuses_positions_past_int32():
    from model_bridge.modeling.audio_conv_fused import _mel_offsets_wide

    x = torch.zeros(1, 1, 4, 4)
    assert not _mel_offsets_wide(x, 10, 128)
    assert _mel_offsets_wide(torch.empty_strided((1, 1, 2, 2), (0, 0, 2**31, 1), device="meta"), 10, 128)
    with pytest.raises(ValueError, match=r"conv1_gelu takes fewer than 2\^31 output positions per call, got "
                                         r"2147483600: split the chunks into several calls"):
        _mel_offsets_wide(x, 2147483600, 128)


def _gelu_errors(device: str) -> tuple[float, float]:
    """``bias_gelu`` (zero bias, fp32) on a grid of pre-activations over [-12, 12]: the largest error
    of GELU and of its slope (the input gradient for an incoming gradient of 1) against fp64's erf
    GELU, per element, relative to ``max(1, |z|)`` and absolute."""
    import math

    from model_bridge.modeling.audio_conv_fused import bias_gelu

    z = torch.linspace(-12, 12, 32 * 50 * 51, dtype=torch.float32).reshape(1, 32, 51, 50)
    zz = z.to(device).contiguous(memory_format=torch.channels_last).requires_grad_()
    out = bias_gelu(zz, torch.zeros(32, device=device))
    (slope,) = torch.autograd.grad(out, [zz], torch.ones_like(out))
    zd = z.double()
    cdf = 0.5 * (1 + torch.erf(zd / math.sqrt(2)))
    want_slope = cdf + zd * torch.exp(-zd * zd / 2) / math.sqrt(2 * math.pi)
    return (float(((out.detach().cpu().double() - zd * cdf).abs() / zd.abs().clamp_min(1)).max()),
            float((slope.cpu().double() - want_slope).abs().max()))


def test_gelu_is_erf_gelu_per_element_interpreted():
    """The fused passes' GELU (erf from Abramowitz & Stegun 7.1.26) and its slope, element by element,
    within a few fp32 roundings of fp64's erf GELU over the whole range (1.5e-7 and 2.7e-7 here;
    torch's own fp32 GELU is within 3.3e-7 of it on this grid)."""
    from megatron_grpo.testing.interpreted import run_interpreted
    from model_bridge.modeling.audio_conv_fused import _kernels

    gelu_err, slope_err = run_interpreted(_kernels, _gelu_errors, "cpu")
    assert gelu_err < 4e-7 and slope_err < 4e-7, (gelu_err, slope_err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gelu_is_erf_gelu_per_element_on_gpu():
    gelu_err, slope_err = _gelu_errors("cuda")
    assert gelu_err < 4e-7 and slope_err < 4e-7, (gelu_err, slope_err)
