"""model_bridge/modeling/rope.py: the fused q/k RMSNorm + RoPE kernels (Triton's interpreter on
CPU tensors, and the GPU) against float64 eager math, and the wrapper's deferred-norm bookkeeping."""
from __future__ import annotations

import pytest
import torch

from megatron_grpo.testing.interpreted import run_interpreted

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _reference(x, w, freqs, eps: float, go):
    """float64: torch's RMSNorm over d, then megatron's unfused BSHD RoPE; (y, dx, dw)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    xr = x.double().requires_grad_()
    wr = w.double().requires_grad_()
    n = torch.nn.functional.rms_norm(xr, (x.shape[-1],), wr, eps)
    y = _apply_rotary_pos_emb_bshd(n.unsqueeze(1), freqs.double()).squeeze(1)
    y.backward(go.double())
    return y.detach(), xr.grad, wr.grad


def _norm_rope_errors(device: str) -> dict:
    """Relative errors of ``_FusedNormRope`` (y, dx, dw) against :func:`_reference`, per case."""
    import model_bridge.modeling.rope as rp

    g = torch.Generator().manual_seed(0)
    out = {}
    # (T, heads, d): q-like and k-like head counts, T not a multiple of the backward's token block,
    # a strided input (a view of a wider qkv buffer, as megatron's key is), and no tokens at all
    for dtype in (torch.float32, torch.bfloat16):
        for T, n, d, strided in ((37, 5, 16, False), (20, 32, 128, True), (3, 4, 128, True), (0, 4, 16, False)):
            wide = (torch.randn(T, n + 3, d, generator=g) * 3).to(dtype)
            x = wide[:, 1:n + 1] if strided else wide[:, :n].contiguous()
            w = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
            freqs = torch.randn(T, 1, 1, d, generator=g) * 4
            go = torch.randn(T, n, d, generator=g).to(dtype)
            leaf = (wide if strided else x).to(device).clone().requires_grad_()
            xx = leaf[:, 1:n + 1] if strided else leaf  # the kernel reads the view's strides
            ww = w.to(device).clone().requires_grad_()
            cos, sin = rp._cos_sin(freqs.to(device), 1.0)
            y = rp._FusedNormRope.apply(xx, ww, cos, sin, 1e-6)
            y.backward(go.to(device))
            dx = leaf.grad[:, 1:n + 1] if strided else leaf.grad
            ry, rdx, rdw = _reference(x, w, freqs, 1e-6, go)
            key = f"{str(dtype).split('.')[-1]}-{T}x{n}x{d}{'-strided' if strided else ''}"
            out[key] = 0.0 if T == 0 else max(_rel(y.cpu(), ry), _rel(dx.cpu(), rdx), _rel(ww.grad.cpu(), rdw))
            if T == 0:
                out[key] = float(ww.grad.abs().max())  # no tokens: a zero weight gradient
        # megatron's grouped query, read in place: [T, groups, (hpg + 2) * d] qkv buffer, q = its
        # first hpg * d columns per group (the split's view), heads g * hpg + i
        for T, groups, hpg, d in ((37, 4, 8, 16), (5, 2, 3, 128)):
            qkv = (torch.randn(T, groups, (hpg + 2) * d, generator=g) * 3).to(dtype)
            w = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
            freqs = torch.randn(T, 1, 1, d, generator=g) * 4
            go = torch.randn(T, groups * hpg, d, generator=g).to(dtype)
            leaf = qkv.to(device).clone().requires_grad_()
            ww = w.to(device).clone().requires_grad_()
            cos, sin = rp._cos_sin(freqs.to(device), 1.0)
            y = rp._FusedNormRope.apply(leaf[..., :hpg * d], ww, cos, sin, 1e-6)
            y.backward(go.to(device))
            x = qkv[..., :hpg * d].reshape(T, groups * hpg, d)
            ry, rdx, rdw = _reference(x, w, freqs, 1e-6, go)
            dx = leaf.grad[..., :hpg * d].reshape(T, groups * hpg, d).cpu()
            assert float(leaf.grad[..., hpg * d:].abs().max()) == 0.0  # nothing reaches k and v
            key = f"{str(dtype).split('.')[-1]}-{T}x{groups}x{hpg}x{d}-grouped"
            out[key] = max(_rel(y.cpu(), ry), _rel(dx, rdx), _rel(ww.grad.cpu(), rdw))
    return out


def _check(errs: dict) -> None:
    for k, v in errs.items():  # fp32: rounding only; bf16: the output's and the norm's roundings
        assert v < (1e-5 if k.startswith("float32") else 2e-2), f"{k}: {v:.2e}"


def test_fused_norm_rope_kernels_interpreted():
    import model_bridge.modeling.rope as rp

    res = run_interpreted(rp._triton_kernels, _norm_rope_errors, "cpu")
    print(f"\n[q/k norm + rope, interpreted] {res}")
    _check(res)


@pytest.mark.gpu
def test_fused_norm_rope_kernels_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    res = _norm_rope_errors("cuda")
    print(f"\n[q/k norm + rope, GPU] {res}")
    _check(res)


# ------------------------------------------------------------------------------------------------
# the wrapper: a deferred norm is applied exactly once, never skipped
# ------------------------------------------------------------------------------------------------

def _wrapper_and_inputs():
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.transformer.transformer_config import TransformerConfig

    import model_bridge.modeling.rope as rp

    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, kv_channels=16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 2, 16, generator=g)
    freqs = torch.randn(9, 1, 1, 16, generator=g)
    norm = torch.nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(16, generator=g))
    return rp, rp._make_fast_rope(apply_rotary_pos_emb), apply_rotary_pos_emb, cfg, x, freqs, norm


class _OneRankCP:
    """A context-parallel group of one rank (what megatron passes from ``pg_collection.cp``)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def test_deferred_norm_applied_before_unfused_rope():
    """On CPU (no Triton): the wrapper applies the deferred norm, then megatron's RoPE; bit-equal
    to doing the two in sequence, and the queue is emptied in order (q's norm, then k's)."""
    rp, wrapped, orig, cfg, x, freqs, norm = _wrapper_and_inputs()
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    cp = _OneRankCP()
    want = orig(norm(x).unsqueeze(1), freqs, cfg, None, cp_group=cp).squeeze(1)
    other = torch.nn.RMSNorm(16, eps=1e-6)
    pending = [norm, other]
    with torch.no_grad(), rp.fast_rope_scope(pending):
        got = wrapped(x, freqs, cfg, cu_seqlens=cu, cp_group=cp)
        assert pending == [other]
        wrapped(x, freqs, cfg, cu_seqlens=cu, cp_group=cp)
    assert pending == []
    assert torch.equal(got, want)


def test_deferred_norm_left_unapplied_raises():
    rp, _, _, _, _, _, norm = _wrapper_and_inputs()
    with pytest.raises(RuntimeError, match=r"1 q/k norm\(s\) were deferred to the RoPE but no RoPE ran: "
                                           r"set MGRPO_TRITON_QK_NORM_ROPE=0"):
        with rp.fast_rope_scope([norm]):
            pass


def test_no_deferral_when_switched_off_or_for_other_norms(monkeypatch):
    rp, _, _, cfg, _, _, norm = _wrapper_and_inputs()
    monkeypatch.delenv("MGRPO_TRITON_QK_NORM_ROPE", raising=False)
    assert rp.qk_norm_rope_wanted()  # on by default
    monkeypatch.setenv("MGRPO_TRITON_QK_NORM_ROPE", "0")
    assert not rp.qk_norm_rope_wanted()
    assert not rp.defer_qk_norms(norm, norm, 16, cfg, on_device=True)
    monkeypatch.setenv("MGRPO_TRITON_QK_NORM_ROPE", "1")
    assert not rp.defer_qk_norms(norm, norm, 16, cfg, on_device=False)  # CPU tensors, no interpreter
    assert not rp.defer_qk_norms(torch.nn.LayerNorm(16), norm, 16, cfg, on_device=True)
    assert not rp.defer_qk_norms(norm, norm, 32, cfg, on_device=True)  # norm over another width


def test_deferring_qk_norms_shadows_and_restores():
    """Inside the block the attention's q/k norms hand back their input and queue the real norms
    (in call order); the registered submodules never change, and the block restores the attributes."""
    rp, _, _, _, x, _, norm = _wrapper_and_inputs()
    att = torch.nn.Module()
    att.q_layernorm, att.k_layernorm = norm, torch.nn.RMSNorm(16)
    keys = sorted(att.state_dict())
    queue: list = []
    with rp.deferring_qk_norms(att, queue):
        assert att.q_layernorm(x) is x and att.k_layernorm(x) is x
        # megatron >= 0.19 calls them through typed_torch.apply_module, which insists on modules
        assert isinstance(att.q_layernorm, torch.nn.Module) and not list(att.q_layernorm.children())
        assert queue == [att._modules["q_layernorm"], att._modules["k_layernorm"]]
        assert sorted(att.state_dict()) == keys and att._modules["q_layernorm"] is norm
    assert att.q_layernorm is norm and isinstance(att.k_layernorm, torch.nn.RMSNorm)


def test_grouped_query_without_the_kernel_is_reshaped_first():
    """On CPU (no Triton): a grouped query ``[T, groups, hpg * d]`` (as TorchSelfAttention hands it
    over inside a ``grouped_query`` scope) gets megatron's reshape, then the deferred norm and the
    RoPE: bit-equal to the ungrouped call. Outside such a scope the wrapper leaves shapes alone."""
    rp, wrapped, orig, cfg, x, freqs, norm = _wrapper_and_inputs()
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    cp = _OneRankCP()
    want = orig(norm(x).unsqueeze(1), freqs, cfg, None, cp_group=cp).squeeze(1)
    grouped = x.reshape(9, 1, 2 * 16)  # one group of two heads
    pending = [norm]
    with torch.no_grad(), rp.fast_rope_scope(pending, grouped_query=True):
        assert rp.grouped_query_wanted()
        got = wrapped(grouped, freqs, cfg, cu_seqlens=cu, cp_group=cp)
    assert pending == [] and got.shape == (9, 2, 16) and torch.equal(got, want)
    with rp.fast_rope_scope([]):
        assert not rp.grouped_query_wanted() and not rp._is_grouped_query(grouped, freqs)
