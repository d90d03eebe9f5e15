"""model_bridge/modeling/norm.py: the one-pass RMSNorm kernels (Triton's interpreter on CPU
tensors, and the GPU) against float64 eager math, and the switch of megatron's hidden norms."""
from __future__ import annotations

import pytest
import torch

from model_bridge.spawn import run_ranks
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


def _alias_errors(device: str) -> dict:
    """The residual alias (a norm's input handed to the bias-dropout-add, its gradient added in
    the norm's backward kernel): relative errors of the input's gradient against float64 math,
    and what the alias is and when it is made."""
    from model_bridge.modeling.norm import FastRMSNorm, take_residual_alias

    g = torch.Generator().manual_seed(1)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        T, H = 45, 64
        x = (torch.randn(T, 1, H, generator=g) * 2).to(dtype)
        w = (1 + 0.3 * torch.randn(H, generator=g)).to(dtype)
        gy, gr = torch.randn(T, 1, H, generator=g).to(dtype), torch.randn(T, 1, H, generator=g).to(dtype)
        norm = FastRMSNorm(H, eps=1e-6).to(device=device, dtype=dtype)
        norm.residual_alias = True
        with torch.no_grad():
            norm.weight.copy_(w)
        leaf = x.to(device).clone().requires_grad_()
        h = leaf * 1  # the layer's input: a non-leaf, as the previous layer's output is
        y = norm(h)
        r = take_residual_alias(h)
        key = str(dtype).split(".")[-1]
        out[f"{key}-alias"] = (r is not h, r._base is h, take_residual_alias(h) is h, y.grad_fn.name())
        (y.float() * gy.to(device).float()).sum().add((r.float() * gr.to(device).float()).sum()).backward()
        xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
        yr = torch.nn.functional.rms_norm(xr, (H,), wr, 1e-6)
        ((yr * gy.double()).sum() + (xr * gr.double()).sum()).backward()
        out[f"{key}-err"] = max(_rel(leaf.grad.cpu(), xr.grad), _rel(norm.weight.grad.cpu(), wr.grad))
        # no alias: under no_grad (megatron's recompute-without-output), or for a norm without the flag
        with torch.no_grad():
            norm(h)
        norm2 = FastRMSNorm(H, eps=1e-6).to(device=device, dtype=dtype)
        norm2(h)
        out[f"{key}-none"] = take_residual_alias(h) is h
    return out


def _check_alias(res: dict) -> None:
    for k, v in res.items():
        if k.endswith("-alias"):
            assert v == (True, True, True, "_RMSNormFnBackward"), (k, v)
        elif k.endswith("-none"):
            assert v is True, k
        else:  # fp32: rounding only; bf16: dx rounded once (the unfused add rounds twice)
            assert v < (1e-5 if k.startswith("float32") else 1e-2), f"{k}: {v:.2e}"


def test_residual_alias_gradient_interpreted():
    from model_bridge.modeling.norm import _kernels

    res = run_interpreted(_kernels, _alias_errors, "cpu")
    print(f"\n[residual alias, interpreted] {res}")
    _check_alias(res)


@pytest.mark.gpu
def test_residual_alias_gradient_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    res = _alias_errors("cuda")
    print(f"\n[residual alias, GPU] {res}")
    _check_alias(res)


def test_residual_bda_is_megatrons_with_the_alias():
    """``residual_bda`` is megatron's bias-dropout-add given the alias; on CPU tensors (torch's
    norm, no alias) the residual stays itself."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    from model_bridge.modeling.norm import FastRMSNorm, residual_bda

    x, h = torch.randn(5, 1, 8), torch.randn(5, 1, 8, requires_grad=True)
    norm = FastRMSNorm(8)
    norm.residual_alias = True
    norm(h)  # CPU: torch's forward, nothing pending
    assert torch.equal(residual_bda(True, False)((x, None), h, 0.0), get_bias_dropout_add(True, False)((x, None), h, 0.0))


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
    # the residual alias: the layer norms' inputs have a skip connection, the final norm's has none
    assert (layer.input_layernorm.residual_alias, layer.pre_mlp_layernorm.residual_alias,
            model.final_layernorm.residual_alias) == (True, True, False)
    assert torch.equal(model.final_layernorm(x), torch.nn.functional.rms_norm(x, (8,), model.final_layernorm.weight))


@pytest.mark.gpu
def test_fast_rms_norm_kernels_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    res = _norm_errors("cuda")
    print(f"\n[fast RMSNorm, GPU] {res}")
    _check(res)


def _rank_bdas(hf_dir: str) -> tuple:
    from model_bridge.config import ParallelLayout, read_omni_config, thinker_transformer_config
    from model_bridge.modeling.norm import residual_bda
    from model_bridge.modeling.specs import thinker_layer_spec
    from model_bridge.parallel import destroy_parallel, init_parallel

    init_parallel(seed=1)
    config = thinker_transformer_config(read_omni_config(hf_dir), ParallelLayout(), torch.bfloat16)
    ours = [(ls.submodules.self_attn_bda, ls.submodules.mlp_bda) == (residual_bda, residual_bda)
            for ls in thinker_layer_spec(config, "torch").layer_specs]
    local = [ls.submodules.self_attn_bda is residual_bda for ls in thinker_layer_spec(config, "local").layer_specs]
    # megatron builds a layer from the spec (``build_module`` takes only plain functions as bdas)
    # and asks its bda for the add at every forward: the same wrapper each time
    from megatron.core.transformer.spec_utils import build_module

    layer = build_module(thinker_layer_spec(config, "torch").layer_specs[0], config=config, layer_number=1)
    built = (layer.self_attn_bda is residual_bda and layer.mlp_bda is residual_bda
             and layer.self_attn_bda(True, False) is layer.mlp_bda(True, False)
             and residual_bda(False, True) is residual_bda(False, True))
    destroy_parallel()
    return ours, local, built


def test_torch_spec_uses_the_residual_bda(tiny_ckpt):
    """The torch backend's layers take their residual through ``residual_bda`` (both adds); the
    local spec keeps megatron's; a layer built from the torch spec holds it and gets one cached
    wrapper per ``(training, fused)``."""
    ours, local, built = run_ranks(_rank_bdas, 1, str(tiny_ckpt), timeout=300)[0]
    assert ours and all(ours) and not any(local), (ours, local)
    assert built
