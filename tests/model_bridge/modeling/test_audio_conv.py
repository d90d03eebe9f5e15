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
