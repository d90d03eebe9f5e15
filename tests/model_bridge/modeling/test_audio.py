"""AudioTower (megatron) == transformers' Qwen3OmniMoeAudioEncoder, outputs and gradients, fp32.

One spawn of 2 real gloo ranks runs every parallel case (module fixture ``results``):
TP=1 (on rank 0, under a DP=2 layout), TP=2 with 4 audio heads (tensor-parallel encoder) and
TP=2 with 3 audio heads (encoder replicated on both TP ranks). Clip sets: one 3 s clip; 0.5 s +
3 s + 12 s in one packed call (crosses chunk and 800-frame window boundaries); clips all shorter
than one chunk; the 1-frame dummy clip. HF weights are randomised at a scale where a wrong
wiring shows (std 0.2), and copied in with the test-only ``_hf_to_megatron_local`` helper. The
encoder's linears add their bias in the GEMM where they are alone on their TP group (TP=1 and the
replicated encoder) and are megatron's own where TP shards them: both paths are checked here.
"""
from __future__ import annotations

import time

import pytest
import torch

from model_bridge.spawn import run_ranks

TOL = 1e-5
GRAD_ABS_TOL = 3e-5
"""Absolute gradient difference allowed. The first conv's weight gradient sums over every output
position of the clips (~1.8 in magnitude for the 15.5 s set), so fp32 summation-order rounding
between the two implementations reaches ~1.3e-5 there (transformers 5.19.0); each tensor is also
held to ``TOL`` relative to its own scale (``grad_rel``)."""
CLIPS = {
    "one_3s": [300],
    "multi_0.5s_3s_12s": [50, 300, 1200],
    "all_short": [37, 80],
    "dummy_1frame": [1],
}
AUDIO_CFGS = {
    # name: (d_model, heads): 4 heads -> TP=2 shards them; 3 heads -> TP=2 replicates the encoder
    "h4": (64, 4),
    "h3": (48, 3),
}


def _omni_cfg(d_model: int, heads: int, layers: int = 2, ffn: int = 96, downsample: int = 8,
              hidden: int = 32) -> dict:
    """A minimal Qwen3-Omni config.json dict (only what parse_omni_config and the tower read)."""
    audio = dict(model_type="qwen3_omni_moe_audio_encoder", num_mel_bins=128, encoder_layers=layers,
                 encoder_attention_heads=heads, encoder_ffn_dim=ffn, d_model=d_model,
                 activation_function="gelu", downsample_hidden_size=downsample, output_dim=hidden,
                 n_window=50, n_window_infer=800, max_source_positions=1500, scale_embedding=False,
                 conv_chunksize=500, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    text = dict(hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                head_dim=16, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                vocab_size=256, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                 "mrope_section": [2, 3, 3], "mrope_interleaved": True})
    thinker = dict(text_config=text, audio_config=audio, audio_token_id=250, audio_start_token_id=251,
                   audio_end_token_id=252, image_token_id=253, video_token_id=254,
                   vision_start_token_id=255)
    return dict(model_type="qwen3_omni_moe", thinker_config=thinker)


def _hf_encoder(cfg: dict, seed: int = 0):
    """HF reference encoder with all weights re-drawn at a scale where a wrong wiring shows."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeAudioEncoderConfig)
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

    ac = {k: v for k, v in cfg["thinker_config"]["audio_config"].items() if k != "model_type"}
    hf_cfg = Qwen3OmniMoeAudioEncoderConfig(**ac)
    hf_cfg._attn_implementation = "eager"
    enc = Qwen3OmniMoeAudioEncoder(hf_cfg).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in enc.named_parameters():
            if "layer_norm" in name or "ln_post" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_((0.2 if name.endswith("weight") else 0.1) * torch.randn(p.shape, generator=g))
    return enc


def _hf_to_megatron_local(hf: dict, heads: int, tp_rank: int, tp_size: int, sharded: bool) -> dict:
    """TEST-ONLY weight (or gradient) mapping: HF Qwen3OmniMoeAudioEncoder state -> this rank's
    AudioTower tensors. q/k/v are fused per head as [q_h; k_h; v_h] (megatron, one query group per
    head); with ``sharded`` the heads / FFN rows are split over ``tp_size`` ranks (column:
    qkv, fc1; row: out_proj, fc2 inputs; row biases replicated)."""
    out = {}
    for n in ("conv2d1.weight", "conv2d1.bias", "conv2d2.weight", "conv2d2.bias", "conv2d3.weight",
              "conv2d3.bias", "conv_out.weight", "ln_post.weight", "ln_post.bias", "proj1.weight",
              "proj1.bias", "proj2.weight", "proj2.bias"):
        out[n] = hf[n]
    n_layers = 1 + max(int(k.split(".")[1]) for k in hf if k.startswith("layers."))
    r, t = (tp_rank, tp_size) if sharded else (0, 1)
    for i in range(n_layers):
        p, m = f"layers.{i}.", f"encoder.layers.{i}."
        D = hf[p + "self_attn.q_proj.weight"].shape[1]
        d = D // heads
        hs = slice(r * heads // t, (r + 1) * heads // t)
        w = torch.stack([hf[p + f"self_attn.{x}_proj.weight"].reshape(heads, d, D) for x in "qkv"], 1)
        b = torch.stack([hf[p + f"self_attn.{x}_proj.bias"].reshape(heads, d) for x in "qkv"], 1)
        out[m + "self_attention.linear_qkv.weight"] = w[hs].reshape(-1, D)
        out[m + "self_attention.linear_qkv.bias"] = b[hs].reshape(-1)
        out[m + "self_attention.linear_proj.weight"] = (
            hf[p + "self_attn.out_proj.weight"].reshape(D, heads, d)[:, hs].reshape(D, -1))
        out[m + "self_attention.linear_proj.bias"] = hf[p + "self_attn.out_proj.bias"]
        ffn = hf[p + "fc1.weight"].shape[0]
        fs = slice(r * ffn // t, (r + 1) * ffn // t)
        out[m + "mlp.linear_fc1.weight"] = hf[p + "fc1.weight"][fs]
        out[m + "mlp.linear_fc1.bias"] = hf[p + "fc1.bias"][fs]
        out[m + "mlp.linear_fc2.weight"] = hf[p + "fc2.weight"][:, fs]
        out[m + "mlp.linear_fc2.bias"] = hf[p + "fc2.bias"]
        for src, dst in (("self_attn_layer_norm", "input_layernorm"), ("final_layer_norm", "pre_mlp_layernorm")):
            out[m + f"{dst}.weight"] = hf[p + f"{src}.weight"]
            out[m + f"{dst}.bias"] = hf[p + f"{src}.bias"]
    return out


def _features(lens: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(128, sum(lens), generator=g), torch.tensor(lens, dtype=torch.long)


def _compare(cfg_name: str, clips: str, tp: int) -> dict:
    """Build HF + AudioTower at the current megatron layout, run fwd+bwd on both, return diffs."""
    from model_bridge.config import ParallelLayout, audio_is_tensor_parallel, parse_omni_config
    from model_bridge.modeling.audio import AudioTower, audio_output_lengths, dummy_audio_input
    from megatron.core import parallel_state as ps

    d_model, heads = AUDIO_CFGS[cfg_name]
    cfg = _omni_cfg(d_model, heads)
    spec = parse_omni_config(cfg)
    layout = ParallelLayout(tp=tp)
    sharded = audio_is_tensor_parallel(spec, layout)
    tp_rank = ps.get_tensor_model_parallel_rank()

    hf = _hf_encoder(cfg)
    tower = AudioTower(spec, layout)
    local = _hf_to_megatron_local(dict(hf.state_dict()), heads, tp_rank, tp, sharded)
    own = dict(tower.named_parameters())
    assert set(own) == set(local), (sorted(set(own) ^ set(local)))
    with torch.no_grad():
        for n, p in own.items():
            assert p.shape == local[n].shape, (n, p.shape, local[n].shape)
            p.copy_(local[n])

    if clips == "dummy_1frame":
        feats, lens = dummy_audio_input(spec)
        feats = feats + torch.randn(feats.shape, generator=torch.Generator().manual_seed(3))
    else:
        feats, lens = _features(CLIPS[clips])
    t0 = time.perf_counter()
    out = tower(feats, lens)
    # a random unit-norm weighting of the outputs: every element matters, gradients stay O(1)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)) / out.numel() ** 0.5
    (out * w).sum().backward()
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = hf(input_features=feats, feature_lens=lens).last_hidden_state
    (ref * w).sum().backward()
    t_hf = time.perf_counter() - t0

    hf_grads = _hf_to_megatron_local({n: p.grad for n, p in hf.named_parameters()}, heads, tp_rank, tp, sharded)
    grad_diff = {n: (p.grad - hf_grads[n]).abs().max().item() for n, p in own.items()}
    grad_rel = {n: grad_diff[n] / max(hf_grads[n].abs().max().item(), 1e-30) for n in own}
    pos_diff = (tower.positional_embedding - hf.positional_embedding.positional_embedding).abs().max().item()
    return dict(
        cfg=cfg_name, clips=clips, tp=tp, sharded=sharded, tp_rank=tp_rank,
        n_tokens=out.shape[0], expected_tokens=int(audio_output_lengths(lens).sum()),
        out_diff=(out - ref).abs().max().item(), out_scale=ref.abs().max().item(),
        grad_diff=max(grad_diff.values()), worst_grad=max(grad_diff, key=grad_diff.get),
        grad_rel=max(grad_rel.values()), worst_rel=max(grad_rel, key=grad_rel.get),
        grad_scale=max(p.grad.abs().max().item() for p in own.values()),
        pos_diff=pos_diff, t_ours=t_ours, t_hf=t_hf,
        names=sorted(own),
        tp_tagged=sorted(n for n, p in own.items() if getattr(p, "tensor_model_parallel", False)),
        sp_tagged=sorted(n for n, p in own.items() if getattr(p, "sequence_parallel", False)),
        # which encoder linears add their bias in the GEMM (bias_linear.py: alone on their TP group)
        bias_in_gemm=sorted({getattr(m, "_bias_in_gemm", None) for m in tower.encoder.modules()
                             if type(m).__name__.startswith("BiasInGemm")}, key=str),
        grads={n: p.grad.clone() for n, p in own.items()} if not sharded and tp > 1 else None,
        replica_ids=_replica_ids(tower) if tp > 1 else None,
    )


def _replica_ids(tower) -> dict:
    sd = tower.sharded_state_dict(prefix="audio_tower.")
    return {k: (tuple(v.replica_id), tuple(getattr(v, "global_shape", ()) or ()))
            for k, v in sd.items() if hasattr(v, "replica_id")}


GEOMETRY_LENS = ([1], [37, 80], [100], [99, 101], [800], [801, 5], [50, 300, 1200], [3000, 7, 1600],
                 [1200])


def _geometry() -> dict:
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        _get_feat_extract_output_lengths, chunk_and_pad_features, get_audio_cu_seqlens)

    from model_bridge.modeling.audio import (audio_chunk_lengths, audio_output_lengths,
                                             audio_window_cu_seqlens)

    rows = []
    for lens in GEOMETRY_LENS:
        lt = torch.tensor(lens)
        _, chunk_lens = chunk_and_pad_features(torch.zeros(1, sum(lens)), lt, 50)
        cu, max_len = audio_window_cu_seqlens(lt)
        rows.append(dict(lens=lens, chunks=audio_chunk_lengths(lt).tolist(), chunks_hf=chunk_lens.tolist(),
                         cu=cu.tolist(), cu_hf=get_audio_cu_seqlens(chunk_lens, lt, 800, 50).tolist(),
                         max_len=max_len, tokens=audio_output_lengths(lt).tolist(),
                         tokens_hf=_get_feat_extract_output_lengths(lt).tolist()))
    refusals = {}
    for name, lens in (("zero_length_clip", [10, 0]), ("no_clip", [])):
        try:
            audio_window_cu_seqlens(torch.tensor(lens, dtype=torch.long))
            refusals[name] = "accepted"
        except ValueError as e:
            refusals[name] = str(e)
    return dict(geometry=rows, refusals=refusals)


def _all_cases() -> list[dict]:
    """Rank body: TP=1 cases on rank 0 (DP=2 layout, no collective in the tower), then TP=2."""
    from model_bridge.parallel import destroy_parallel, init_parallel

    res = []
    t0 = time.perf_counter()
    lay = init_parallel(tp=1)
    if lay.rank == 0:
        for clips in CLIPS:
            res.append(_compare("h4", clips, tp=1))
        res.append(_compare("h3", "multi_0.5s_3s_12s", tp=1))
    else:
        res.append(_geometry())
    init_parallel(tp=2)
    for cfg_name in ("h4", "h3"):
        for clips in ("one_3s", "multi_0.5s_3s_12s"):
            res.append(_compare(cfg_name, clips, tp=2))
    destroy_parallel()
    res.append(dict(total_s=time.perf_counter() - t0))
    return res


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_cases, 2, timeout=600)


def _cases(results, **want):
    found = [r for rank in results for r in rank
             if "cfg" in r and all(r[k] == v for k, v in want.items())]
    assert found, f"no case {want}"
    return found


def _check_close(r):
    assert r["n_tokens"] == r["expected_tokens"]
    assert r["pos_diff"] == 0.0
    assert r["out_diff"] < TOL, r
    assert r["grad_diff"] < GRAD_ABS_TOL, (r["worst_grad"], r["grad_diff"])
    assert r["grad_rel"] < TOL, (r["worst_rel"], r["grad_rel"])  # each tensor against its own scale
    assert not r["sp_tagged"], r["sp_tagged"]


@pytest.mark.parametrize("clips", list(CLIPS))
def test_tp1_matches_hf(results, clips):
    for r in _cases(results, cfg="h4", clips=clips, tp=1):
        _check_close(r)
        assert r["bias_in_gemm"] == [True]  # all four linears of every layer: F.linear, the bias in the GEMM


def test_tp1_three_heads_matches_hf(results):
    for r in _cases(results, cfg="h3", tp=1):
        _check_close(r)


@pytest.mark.parametrize("clips", ["one_3s", "multi_0.5s_3s_12s"])
def test_tp2_sharded_matches_hf(results, clips):
    rs = _cases(results, cfg="h4", clips=clips, tp=2)
    assert sorted(r["tp_rank"] for r in rs) == [0, 1]
    for r in rs:
        assert r["sharded"]
        _check_close(r)
        assert r["bias_in_gemm"] == [False]  # TP shards: megatron's own linears
        # column-parallel weights are TP shards; dist-ckpt tensors are the global shapes
        assert "encoder.layers.0.self_attention.linear_qkv.weight" in r["tp_tagged"]


@pytest.mark.parametrize("clips", ["one_3s", "multi_0.5s_3s_12s"])
def test_tp2_replicated_matches_hf_with_identical_grads(results, clips):
    rs = sorted(_cases(results, cfg="h3", clips=clips, tp=2), key=lambda r: r["tp_rank"])
    assert [r["tp_rank"] for r in rs] == [0, 1]
    for r in rs:
        assert not r["sharded"]
        _check_close(r)
        assert r["bias_in_gemm"] == [True]  # replicated over a single-rank group: alone on it
        assert not r["tp_tagged"], f"replicated weights tagged tensor_model_parallel: {r['tp_tagged']}"
    g0, g1 = rs[0]["grads"], rs[1]["grads"]
    for n in g0:  # no TP all-reduce is needed because the two ranks' grads are bit-identical
        assert torch.equal(g0[n], g1[n]), n
    # dist-ckpt: each replicated tensor has exactly one main copy across the TP ranks
    ids0, ids1 = rs[0]["replica_ids"], rs[1]["replica_ids"]
    assert ids0.keys() == ids1.keys()
    for k in ids0:
        assert ids0[k][1] == ids1[k][1], k  # same global shape
        assert ids0[k][0] != ids1[k][0], (k, ids0[k], ids1[k])


def test_parameter_names_follow_contract(results):
    names = _cases(results, cfg="h4", clips="one_3s", tp=1)[0]["names"]
    expected = {f"conv2d{i}.{w}" for i in (1, 2, 3) for w in ("weight", "bias")}
    expected |= {"conv_out.weight", "ln_post.weight", "ln_post.bias", "proj1.weight", "proj1.bias",
                 "proj2.weight", "proj2.bias"}
    for i in range(2):
        for sub in ("input_layernorm", "pre_mlp_layernorm", "self_attention.linear_qkv",
                    "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"):
            expected |= {f"encoder.layers.{i}.{sub}.weight", f"encoder.layers.{i}.{sub}.bias"}
    assert set(names) == expected, sorted(set(names) ^ expected)


def test_report(results, capsys):
    """Not a check: prints the measured differences and timings (visible with -s)."""
    rows = [r for rank in results for r in rank if "cfg" in r]
    with capsys.disabled():
        print()
        for r in rows:
            print(f"  {r['cfg']} tp={r['tp']} rank={r['tp_rank']} {'shard' if r['sharded'] else 'repl '} "
                  f"{r['clips']:<18} T={r['n_tokens']:<4} out {r['out_diff']:.2e} (|ref| {r['out_scale']:.1f}) "
                  f"grad {r['grad_diff']:.2e} (|g| {r['grad_scale']:.1f}, rel {r['grad_rel']:.1e}) ours {r['t_ours']*1e3:.0f} ms "
                  f"hf {r['t_hf']*1e3:.0f} ms")
        print("  rank totals:", [round(r["total_s"], 1) for rank in results for r in rank if "total_s" in r])


# ---- host-side geometry, no megatron needed ------------------------------------------------


def test_window_geometry_matches_hf(results):
    """chunk lengths, window cu_seqlens and token counts equal HF's helpers (computed on rank 1
    while rank 0 runs the TP=1 cases)."""
    rows = [r for rank in results for r in rank if "geometry" in r]
    assert len(rows) == 1 and len(rows[0]["geometry"]) == len(GEOMETRY_LENS)
    for g in rows[0]["geometry"]:
        assert g["chunks"] == g["chunks_hf"], g
        assert g["cu"] == g["cu_hf"], g
        assert g["max_len"] == max(b - a for a, b in zip(g["cu"], g["cu"][1:])), g
        assert g["tokens"] == g["tokens_hf"], g
    by_lens = {tuple(g["lens"]): g for g in rows[0]["geometry"]}
    assert by_lens[(1200,)]["cu"] == [0, 104, 156]  # 104-token (800-frame) windows, then the rest
    assert by_lens[(37, 80)]["cu"] == [0, 5, 15]  # all clips shorter than a chunk: one window each


def test_bad_lengths_are_refused(results):
    refusals = [r for rank in results for r in rank if "refusals" in r][0]["refusals"]
    assert "at least one mel frame" in refusals["zero_length_clip"]
    assert "at least one clip" in refusals["no_clip"]
