"""Packed (THD) core attention == per-sample attention: causal and not, GQA, padding, grads."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from model_bridge.modeling.attention import (PackedCoreAttention, dense_attention, packed_attention,
                                             packed_segments)


def _eager(q, k, v, causal):
    """Reference: q [s, nq, d], k/v [s, nk, d] -> [s, nq, d], plain softmax attention in fp64."""
    q, k, v = (x.double() for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        s = q.shape[0]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _qkv(T, nq, nk, d, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(T, n, d, generator=g) for n in (nq, nk, nk)]
    for x in out:
        x.requires_grad_(requires_grad)
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("nq,nk", [(4, 4), (4, 2), (6, 1)])
def test_packed_equals_per_sample(causal, nq, nk):
    lens, pad = [5, 9, 1, 4], 3
    T = sum(lens) + pad
    q, k, v = _qkv(T, nq, nk, 16, requires_grad=True)
    cu = torch.tensor([0, 5, 14, 15, 19], dtype=torch.int32)
    out = packed_attention(q, k, v, cu, causal=causal)
    assert out.shape == (T, nq, 16)
    s = 0
    for n in lens:
        ref = _eager(q[s:s + n], k[s:s + n], v[s:s + n], causal)
        torch.testing.assert_close(out[s:s + n].double(), ref, atol=1e-5, rtol=1e-5)
        s += n
    assert torch.equal(out[s:], torch.zeros_like(out[s:])), "trailing padding must be zero"
    # gradients: per-sample independent, padding rows get none
    (out * torch.arange(T).view(T, 1, 1)).sum().backward()
    assert torch.equal(q.grad[s:], torch.zeros_like(q.grad[s:]))
    assert torch.equal(k.grad[s:], torch.zeros_like(k.grad[s:]))
    gq = q.grad.clone()
    q2, k2, v2 = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    s = 0
    for n in lens:
        o = packed_attention(q2[s:s + n], k2[s:s + n], v2[s:s + n], [0, n], causal=causal)
        (o * torch.arange(s, s + n).view(n, 1, 1)).sum().backward()
        s += n
    torch.testing.assert_close(gq, q2.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_padded_slots(causal):
    """cu_seqlens_padded (TE convention): sample i starts at cu_padded[i], keeps its real length."""
    cu, cu_pad = [0, 3, 8, 10], [0, 4, 12, 14]
    T = 16
    q, k, v = _qkv(T, 4, 2, 8, seed=1)
    out = packed_attention(q, k, v, torch.tensor(cu), causal=causal, cu_seqlens_padded=torch.tensor(cu_pad))
    assert packed_segments(cu, cu_pad) == [(0, 3), (4, 5), (12, 2)]
    real = torch.zeros(T, dtype=torch.bool)
    for start, n in packed_segments(cu, cu_pad):
        torch.testing.assert_close(out[start:start + n].double(),
                                   _eager(q[start:start + n], k[start:start + n], v[start:start + n], causal),
                                   atol=1e-5, rtol=1e-5)
        real[start:start + n] = True
    assert torch.equal(out[~real], torch.zeros_like(out[~real]))
    with pytest.raises(ValueError, match="does not fit"):
        packed_segments([0, 5], [0, 4])


def test_dense_sbhd_matches_eager():
    s, b, nq, nk, d = 7, 2, 4, 2, 8
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(s, b, n, d, generator=g) for n in (nq, nk, nk))
    for causal in (True, False):
        out = dense_attention(q, k, v, causal=causal)
        for i in range(b):
            torch.testing.assert_close(out[:, i].double(), _eager(q[:, i], k[:, i], v[:, i], causal),
                                       atol=1e-5, rtol=1e-5)
    # megatron mask convention: True = masked out; mask the last 2 keys of batch 1
    mask = torch.zeros(b, 1, s, s, dtype=torch.bool)
    mask[1, :, :, -2:] = True
    out = dense_attention(q, k, v, causal=False, attention_mask=mask)
    torch.testing.assert_close(out[:, 1].double(), _eager(q[:, 1], k[:-2, 1], v[:-2, 1], False), atol=1e-5, rtol=1e-5)


def _module(causal: bool, nq=4, nk=2, d=8, cls=None):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=nq * d, num_attention_heads=nq, num_query_groups=nk,
                            kv_channels=d, use_cpu_initialization=True, attention_dropout=0.0)
    pg = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    mask_type = AttnMaskType.causal if causal else AttnMaskType.no_mask
    return (cls or PackedCoreAttention)(cfg, layer_number=1, attn_mask_type=mask_type, attention_type="self",
                                        pg_collection=pg)


@pytest.mark.parametrize("causal", [True, False])
def test_core_attention_module_thd_and_sbhd(causal):
    from megatron.core.packed_seq_params import PackedSeqParams

    mod = _module(causal)
    lens = [3, 6, 2]
    T = sum(lens) + 1  # one trailing padding token
    q, k, v = _qkv(T, 4, 2, 8, seed=3)
    cu = torch.tensor([0, 3, 9, 11], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6, max_seqlen_kv=6)
    out = mod(q, k, v, None, packed_seq_params=psp)
    assert out.shape == (T, 4 * 8)
    s = 0
    for n in lens:  # the same sample through the SBHD path
        o = mod(q[s:s + n, None], k[s:s + n, None], v[s:s + n, None], None)
        assert o.shape == (n, 1, 32)
        torch.testing.assert_close(out[s:s + n], o[:, 0], atol=1e-6, rtol=1e-6)
        s += n
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("plan", ["exact", "one_segment"])
def test_core_attention_plans_from_the_packers_host_offsets_without_a_sync(plan):
    """With ``thd_params``' host copy attached the module plans on the host and the kernel reads
    the device offsets: no host sync (a read per layer call otherwise). ``one_segment``: the host
    copy only plans (one segment over the buffer, as a CUDA graph's stack attaches it) while the
    device tensor holds the real offsets; the result is still the real segments' attention."""
    from model_bridge.modeling.thd import attach_host_offsets, thd_params

    mod = _module(True)
    q, k, v = (x.cuda().bfloat16() for x in _qkv(12, 4, 2, 8, seed=5))
    host = [0, 3, 9, 12]
    want = mod(q, k, v, None, packed_seq_params=thd_params(host, "cuda", 6))
    psp = thd_params(host, "cuda", 12 if plan == "one_segment" else 6)
    if plan == "one_segment":
        attach_host_offsets(psp, [0, 12, 12, 12])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = mod(q, k, v, None, packed_seq_params=psp)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_cuda_matches_sdpa(causal):
    lens, pad = [37, 128, 5, 300], 7
    T = sum(lens) + pad
    q, k, v = (x.cuda().bfloat16() for x in _qkv(T, 8, 2, 64, seed=4))
    cu = torch.tensor([0, 37, 165, 170, 470], dtype=torch.int32, device="cuda")
    fast = packed_attention(q, k, v, cu, causal=causal, backend="varlen")
    ref = packed_attention(q.float(), k.float(), v.float(), cu, causal=causal, backend="sdpa")
    assert (fast.float() - ref).abs().max().item() < 2e-2
    assert torch.equal(fast[-pad:], torch.zeros_like(fast[-pad:]))
    # padded slots (gaps) through the compacting path
    cu_pad = torch.tensor([0, 40, 170, 176, T], dtype=torch.int32, device="cuda")
    fast = packed_attention(q, k, v, cu, causal=causal, cu_seqlens_padded=cu_pad, backend="varlen")
    ref = packed_attention(q.float(), k.float(), v.float(), cu, causal=causal, cu_seqlens_padded=cu_pad,
                           backend="sdpa")
    assert (fast.float() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("args,reason", [
    (("cuda", torch.bfloat16, 128, 128, 128), None),
    (("cuda", torch.float16, 64, 64, 64), None),
    (("cuda", torch.bfloat16, 10, 10, 10), "head size 10 is not a multiple of 8"),
    (("cuda", torch.bfloat16, 320, 320, 320), "head size 320 exceeds 256"),
    (("cuda", torch.bfloat16, 64, 64, 32), "query/key/value head sizes differ (64/64/32)"),
    (("cuda", torch.float32, 128, 128, 128), "dtype torch.float32 (flash runs bfloat16/float16)"),
    (("cpu", torch.bfloat16, 128, 128, 128), "not on CUDA"),
])
def test_flash_refusal_reasons(args, reason):
    from model_bridge.modeling.attention import flash_refusal_for

    assert flash_refusal_for(*args) == reason


def test_varlen_backend_refuses_with_the_reason():
    q, k, v = _qkv(6, 2, 2, 10)
    with pytest.raises(ValueError, match=r"backend='varlen'\): not on CUDA; use backend='auto'"):
        packed_attention(q, k, v, [0, 6], backend="varlen")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal", [True, False])
def test_odd_head_size_falls_back_to_sdpa_on_cuda(causal, caplog):
    """Head size 10 (an audio tower of d_model 40 with 4 heads): flash refuses it, so the bf16 CUDA
    path runs SDPA per sample (one logged line), for the plain function and for the core attention
    module, forward and backward, matching the fp64 reference."""
    from megatron.core.packed_seq_params import PackedSeqParams

    lens = [7, 30, 3]
    T = sum(lens) + 2
    q, k, v = (x.cuda().bfloat16().requires_grad_() for x in _qkv(T, 4, 4, 10, seed=5))
    cu = torch.tensor([0, 7, 37, 40], dtype=torch.int32)
    with caplog.at_level("WARNING", logger="model_bridge.attention"):
        out = packed_attention(q, k, v, cu, causal=causal)
    out.float().square().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    s = 0
    for n in lens:
        ref = _eager(q[s:s + n].detach().cpu(), k[s:s + n].detach().cpu(), v[s:s + n].detach().cpu(), causal)
        assert (out[s:s + n].detach().cpu().double() - ref).abs().max().item() < 2e-2
        s += n
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))
    mod = _module(causal, nq=4, nk=4, d=10)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu.cuda(), cu_seqlens_kv=cu.cuda(), max_seqlen_q=30,
                          max_seqlen_kv=30)
    out2 = mod(q, k, v, None, packed_seq_params=psp)
    assert torch.equal(out2.view_as(out), out)
