"""model_bridge/modeling/norm.py: the one-pass RMSNorm kernels (Triton's interpreter on CPU
tensors, and the GPU) against float64 eager math, and the switch of megatron's hidden norms."""
from __future__ import annotations

import pytest
import torch

from megatron_grpo.testing.interpreted import run_interpreted

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _norm_errors(device: str) -> dict:
    """Relative errors of :class:`FastRMSNorm` (y, dx, dw) against float64 ``F.rms_norm``, per case."""
    from model_bridge.modeling.norm import FastRMSNorm

    g = torch.Generator().manual_seed(0)
    out = {}
    # [s, b, h] as megatron feeds it; rows not a multiple of a backward program's 32; a width that
    # is not a power of two; a strided (non-contiguous) input; no rows
    for dtype in (torch.float32, torch.bfloat16):
        for shape, strided in (((37, 1, 64), False), ((70, 2, 48), True), ((5, 1, 2048), False), ((0, 1, 64), False)):
            H = shape[-1]
            wide = (torch.randn(*shape[:-1], H + 5, generator=g) * 3).to(dtype)
            x = wide[..., 2:H + 2] if strided else wide[..., :H].contiguous()
            w = (1 + 0.3 * torch.randn(H, generator=g)).to(dtype)
            go = torch.randn(*shape, generator=g).to(dtype)
            norm = FastRMSNorm(H, eps=1e-6).to(device=device, dtype=dtype)
            with torch.no_grad():
                norm.weight.copy_(w)
            xx = x.to(device).clone().requires_grad_()
            y = norm(xx)
            y.backward(go.to(device))
            xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
            yr = torch.nn.functional.rms_norm(xr, (H,), wr, 1e-6)
            yr.backward(go.double())
            key = f"{str(dtype).split('.')[-1]}-{'x'.join(map(str, shape))}{'-strided' if strided else ''}"
            if x.numel() == 0:
                out[key] = float(norm.weight.grad.abs().max())  # no rows: a zero weight gradient
            else:
                out[key] = max(_rel(y.cpu(), yr), _rel(xx.grad.cpu(), xr.grad), _rel(norm.weight.grad.cpu(), wr.grad))
            out[key + "-fn"] = y.grad_fn.name()
    return out


def _check(errs: dict) -> None:
    for k, v in errs.items():
        if k.endswith("-fn"):
            assert v == "_RMSNormFnBackward", (k, v)
        else:  # fp32: rounding only; bf16: one rounding of y, dx and dw each
            assert v < (1e-5 if k.startswith("float32") else 1e-2), f"{k}: {v:.2e}"


def test_fast_rms_norm_kernels_interpreted():
    from model_bridge.modeling.norm import _kernels

    res = run_interpreted(_kernels, _norm_errors, "cpu")
    print(f"\n[fast RMSNorm, interpreted] {res}")
    _check(res)


def test_switch_takes_the_hidden_norms_only():
    """Only megatron's input/pre-MLP/final norms switch (the q/k norms stay for the RoPE fusion);
    state dicts unchanged; on CPU tensors the forward is torch's."""
    from model_bridge.modeling.norm import FastRMSNorm, use_fast_rms_norms

    layer = torch.nn.Module()
    layer.input_layernorm, layer.pre_mlp_layernorm = torch.nn.RMSNorm(8), torch.nn.RMSNorm(8)
    layer.self_attention = torch.nn.Module()
    layer.self_attention.q_layernorm, layer.self_attention.k_layernorm = torch.nn.RMSNorm(4), torch.nn.RMSNorm(4)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([layer])
    model.final_layernorm = torch.nn.RMSNorm(8)
    keys = sorted(model.state_dict())
    assert use_fast_rms_norms(model) == 3
    assert [type(m).__name__ for m in (layer.input_layernorm, layer.pre_mlp_layernorm, model.final_layernorm,
                                       layer.self_attention.q_layernorm)] == ["FastRMSNorm"] * 3 + ["RMSNorm"]
    assert sorted(model.state_dict()) == keys and use_fast_rms_norms(model) == 0
    x = torch.randn(3, 8)
    assert isinstance(model.final_layernorm, FastRMSNorm)
    assert torch.equal(model.final_layernorm(x), torch.nn.functional.rms_norm(x, (8,), model.final_layernorm.weight))


@pytest.mark.gpu
def test_fast_rms_norm_kernels_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    res = _norm_errors("cuda")
    print(f"\n[fast RMSNorm, GPU] {res}")
    _check(res)
