"""Interleaved MRoPE == transformers' Qwen3-Omni thinker rotary embedding; positions == get_rope_index."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from model_bridge.modeling.mrope import InterleavedMRoPE, mrope_position_ids


def _hf_rope(head_dim, theta, section):
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextRotaryEmbedding

    cfg = Qwen3OmniMoeTextConfig(hidden_size=256, num_attention_heads=2, head_dim=head_dim,
                                 rope_parameters={"rope_type": "default", "rope_theta": theta,
                                                  "mrope_section": list(section), "interleaved": True,
                                                  "mrope_interleaved": True})
    return Qwen3OmniMoeThinkerTextRotaryEmbedding(cfg)


@pytest.mark.parametrize("head_dim,theta,section", [(128, 1_000_000.0, (24, 20, 20)), (32, 1_000_000.0, (8, 4, 4)),
                                                    (64, 10_000.0, (16, 8, 8))])
def test_cos_sin_equal_hf_exactly(head_dim, theta, section):
    hf = _hf_rope(head_dim, theta, section)
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 5000, (3, 2, 50), generator=g)  # distinct t/h/w positions
    cos_hf, sin_hf = hf(torch.zeros(1, dtype=torch.float32), pos)  # [b, T, d]
    emb = InterleavedMRoPE(kv_channels=head_dim, rotary_base=theta, device="cpu")(pos, list(section))  # [T, b, 1, d]
    assert emb.shape == (50, 2, 1, head_dim)
    e = emb[:, :, 0].transpose(0, 1)
    assert torch.equal(e.cos(), cos_hf) and torch.equal(e.sin(), sin_hf)
    m = InterleavedMRoPE(kv_channels=head_dim, rotary_base=theta, device="cpu").bfloat16()
    assert m.inv_freq.dtype == torch.float32, "Float16Module-style casts must not touch the rotary frequencies"


def test_megatron_chunked_mrope_differs(monkeypatch):
    """Why we replace it: megatron's MultimodalRotaryEmbedding uses the chunked Qwen2-VL layout."""
    pytest.importorskip("megatron.core")
    if not torch.cuda.is_available():  # it allocates on torch.cuda.current_device()
        monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    hf = _hf_rope(128, 1e6, (24, 20, 20))
    pos = torch.randint(0, 500, (3, 1, 40), generator=torch.Generator().manual_seed(1))
    cos_hf, _ = hf(torch.zeros(1), pos)
    stock = MultimodalRotaryEmbedding(kv_channels=128, rotary_percent=1.0, rotary_base=1e6)(pos, [24, 20, 20]).cpu()
    assert (stock[:, :, 0].transpose(0, 1).cos() - cos_hf).abs().max() > 0.5
    # with equal axes (text/audio) both layouts give plain RoPE
    p1 = torch.arange(40).expand(3, 1, 40)
    a = InterleavedMRoPE(128, 1e6, device="cpu")(p1, [24, 20, 20])
    b = MultimodalRotaryEmbedding(kv_channels=128, rotary_percent=1.0, rotary_base=1e6)(p1, [24, 20, 20]).cpu()
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)  # megatron computes with a matmul (GPU: not bit-equal)


def _spec(audio_token_id=151675):
    return SimpleNamespace(audio_token_id=audio_token_id, image_token_id=151655, video_token_id=151656)


def test_positions_sequential_and_packed():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    pos = mrope_position_ids(ids, _spec())
    assert pos.shape == (3, 7) and torch.equal(pos, torch.arange(7).expand(3, 7))
    packed = mrope_position_ids(ids[0], _spec(), cu_seqlens=torch.tensor([0, 3, 5]))
    assert packed[0].tolist() == [0, 1, 2, 0, 1, 0, 1]  # trailing padding counts on from 0
    assert torch.equal(packed[0], packed[2])
    with pytest.raises(NotImplementedError, match="vision"):
        mrope_position_ids(torch.tensor([1, 151655, 2]), _spec())


def test_positions_equal_hf_get_rope_index(tiny_ckpt):
    """Text+audio sequence: HF's audio branch of get_rope_index (forced with an empty image grid)
    and its text-only branch both give sequential positions, equal on all three axes."""
    from transformers import AutoConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeThinkerForConditionalGeneration, _get_feat_extract_output_lengths)

    from model_bridge.config import read_omni_config

    spec = read_omni_config(tiny_ckpt)
    th = AutoConfig.from_pretrained(tiny_ckpt).thinker_config
    fake = SimpleNamespace(spatial_merge_size=2, config=th)
    frames = [230, 100]
    n_audio = [int(_get_feat_extract_output_lengths(torch.tensor(f))) for f in frames]
    ids = [11, 12]
    for n in n_audio:
        ids += [13, spec.audio_start_token_id] + [spec.audio_token_id] * n + [spec.audio_end_token_id]
    ids += [14, 15, 16]
    input_ids = torch.tensor([ids])
    ours = mrope_position_ids(input_ids, spec)
    hf_audio, _ = Qwen3OmniMoeThinkerForConditionalGeneration.get_rope_index(
        fake, input_ids, image_grid_thw=torch.zeros(0, 3, dtype=torch.long), attention_mask=torch.ones_like(input_ids),
        audio_seqlens=torch.tensor(frames))
    hf_text, _ = Qwen3OmniMoeThinkerForConditionalGeneration.get_rope_index(
        fake, input_ids, attention_mask=torch.ones_like(input_ids))
    assert torch.equal(hf_audio[:, 0].long(), ours)
    assert torch.equal(hf_text[:, 0].long(), ours)


# ------------------------------------------------------------------------------------------------
# the one-launch angle kernel (CUDA; Triton's interpreter on CPU here)
# ------------------------------------------------------------------------------------------------

def _kernel_vs_eager(device: str) -> dict:
    """The kernel's angles (bit-equal to the eager path's) and the cos/sin it hands to the fused
    RoPE (within 2 fp32 ulps of torch's), per (head_dim, section, T); T = 0 included. Deferred
    (``defer_launch``, rope.py's wrapper installed): nothing launched until the first read, then
    the same angles and cos/sin."""
    import model_bridge.modeling.mrope as m
    from model_bridge.modeling.rope import _cos_sin, install_fast_rope

    install_fast_rope()
    g = torch.Generator().manual_seed(0)
    out = {}
    for d, section, T in ((128, (24, 20, 20), 77), (32, (8, 4, 4), 5), (128, (24, 20, 20), 0)):
        mod = m.InterleavedMRoPE(kv_channels=d, rotary_base=1e6, device=device)
        pos = torch.randint(0, 5000, (3, 1, T), generator=g).to(device)
        assert mod._kernel_ok(pos, section)
        got = mod(pos, list(section))
        want = m.interleaved_mrope_freqs(pos, mod.inv_freq, section)[:, :, None, :].transpose(0, 1)
        cos, sin = _cos_sin(got, 1.0)  # from the kernel, through the cache
        f = want.reshape(T, d)
        mod.defer_launch = True
        lazy = mod(pos, list(section))
        pending = hasattr(lazy, "_mgrpo_pending_angles")
        lcos, lsin = _cos_sin(lazy, 1.0)  # the first read launches the kernel, once
        mod.defer_launch = False
        out[f"{d}-{T}"] = {"shape": tuple(got.shape), "angles_equal": torch.equal(got, want),
                           "cached": cos is got._mgrpo_cos_sin[2],
                           "deferred": (pending and not hasattr(lazy, "_mgrpo_pending_angles")
                                        and torch.equal(lazy, want) and torch.equal(lcos, cos)
                                        and torch.equal(lsin, sin)),
                           "cos_sin_err": 0.0 if T == 0 else max(float((cos - f.cos()).abs().max()),
                                                                 float((sin - f.sin()).abs().max()))}
    return out


def _check_kernel(res: dict) -> None:
    for key, r in res.items():
        d, T = (int(x) for x in key.split("-"))
        assert r["shape"] == (T, 1, 1, d) and r["angles_equal"] and r["cached"] and r["deferred"], (key, r)
        assert r["cos_sin_err"] <= 2.4e-7, (key, r)  # |cos| <= 1: two fp32 ulps at 1.0


def test_mrope_kernel_interpreted():
    import model_bridge.modeling.mrope as m
    from megatron_grpo.testing.interpreted import run_interpreted

    res = run_interpreted(m._mrope_kernel, _kernel_vs_eager, "cpu")
    print(f"\n[MRoPE kernel, interpreted] {res}")
    _check_kernel(res)


@pytest.mark.gpu
def test_mrope_kernel_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    res = _kernel_vs_eager("cuda")
    print(f"\n[MRoPE kernel, GPU] {res}")
    _check_kernel(res)
