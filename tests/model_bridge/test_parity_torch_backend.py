"""GPU: the thinker on the ``"torch"`` layer-spec backend == transformers' Qwen3-Omni thinker (CUDA).

The tiny checkpoint is loaded with ``load_hf`` into ``build_thinker(..., backend="torch")``; the
samples (text, text + two audio clips, text) of ``test_parity`` are run

* in fp32, one sample at a time: per-segment SDPA and the exact-fp32 expert path (``grouped_mm``
  where it is exact in fp32, else the per-expert loop; TF32 off): max |logit - HF| < 1e-4;
* in bf16, unpacked and packed into one THD micro-batch (``varlen_attn`` with a plan computed once
  per micro-batch, ``grouped_mm`` experts, sort-based dispatch): max |logit - HF fp32| < 5% of
  max |logit| (bf16 weights and activations through 2 layers), packed vs unpacked likewise;
* bf16 backward, torch backend vs the ``"local"`` backend (SequentialMLP, scatter-add dispatch) on
  the same packed batch: every parameter gradient within 3% of that tensor's largest gradient
  (bf16 rounding at different points), logits within 2%.

It also checks that the packed forward reads ``cu_seqlens`` to the host once (one varlen plan for
all thinker layers) and that ``"auto"`` resolves to ``"torch"`` here (no Transformer Engine).
"""
from __future__ import annotations

import pytest
import torch

from model_bridge.spawn import run_ranks
from test_parity import reference  # noqa: F401 - its module fixture: HF fp32 logits on CPU

FP32_TOL = 1e-4
BF16_REL_LOGITS = 0.05
BF16_GRAD_REL = 0.03


def _packed(samples, spec, pad: int = 5, device="cuda"):
    """``samples`` (``test_parity._make_samples`` tuples) packed into one THD micro-batch with ``pad``
    trailing padding tokens on ``device``: (ids [1, T], positions, PackedSeqParams, audio features
    or None, feature lengths or None, cu_seqlens as a list)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from model_bridge.modeling.thinker import mrope_position_ids

    lens = [len(s[1]) for s in samples]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    ids = torch.tensor([sum((s[1] for s in samples), []) + [0] * pad], device=device)
    pos = mrope_position_ids(ids, spec, cu_seqlens=cu).unsqueeze(1)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                          max_seqlen_kv=max(lens))
    clips = [s for s in samples if s[2] is not None]
    feats = torch.cat([s[2] for s in clips], 1).to(device) if clips else None
    flens = torch.cat([s[3] for s in clips]).to(device) if clips else None
    return ids, pos, psp, feats, flens, cu.tolist()


def _rank_cuda_torch_backend(hf_dir: str, samples):
    import megatron.core

    from model_bridge.config import ParallelLayout, read_omni_config
    from model_bridge.export import export_tasks
    from model_bridge.load import load_hf
    from model_bridge.modeling.experts import grouped_mm_available
    from model_bridge.modeling.specs import resolve_backend
    from model_bridge.modeling.thinker import build_thinker, gather_logits, mrope_position_ids
    from model_bridge.parallel import destroy_parallel, init_parallel

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import model_bridge.modeling.attention as attn

    plans = [0]
    orig_segments = attn.packed_segments

    def counting_segments(*a, **k):
        plans[0] += 1
        return orig_segments(*a, **k)

    attn.packed_segments = counting_segments
    import model_bridge.modeling.rope as rp

    fused = [0]
    orig_norm_rope = rp._norm_rope_fwd

    def counting_norm_rope(*a, **k):
        fused[0] += 1
        return orig_norm_rope(*a, **k)

    rp._norm_rope_fwd = counting_norm_rope
    init_parallel(seed=1234)
    spec = read_omni_config(hf_dir)
    V = spec.text.vocab_size
    out = {"megatron_core": megatron.core.__version__, "auto": resolve_backend("auto"),
           "grouped_mm": {"bf16": grouped_mm_available("cuda", torch.bfloat16),
                          "fp32": grouped_mm_available("cuda", torch.float32)},
           "fp32": {}, "bf16": {}, "bf16_packed": {}}
    ids, pos, psp, feats, flens, cu = _packed(samples, spec)
    g = torch.Generator().manual_seed(4)
    w = torch.randn(ids.shape[1], V, generator=g).cuda()
    w[cu[-1]:] = 0
    grads = {}
    for dtype, key in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        model = build_thinker(spec, ParallelLayout(), dtype, backend="torch")
        load_hf(model, hf_dir)
        model = model.cuda().eval()
        with torch.no_grad():
            for name, sid, f, fl in samples:
                x = torch.tensor([sid], device="cuda")
                logits = model(x, mrope_position_ids(x, spec).unsqueeze(1),
                               audio_features=None if f is None else f.to("cuda", dtype),
                               audio_feature_lens=None if fl is None else fl.cuda())
                out[key][name] = gather_logits(logits, V).float().cpu()
        if dtype == torch.bfloat16:
            for backend in ("torch", "local"):
                m = model if backend == "torch" else build_thinker(spec, ParallelLayout(), dtype, backend="local")
                if backend == "local":
                    load_hf(m, hf_dir)
                    m = m.cuda()
                m.train()
                before = plans[0]
                full = gather_logits(m(ids, pos, psp, audio_features=feats.to(dtype), audio_feature_lens=flens), V)
                if backend == "torch":
                    out["varlen_plans_per_packed_forward"] = plans[0] - before
                    for (name, *_), a, b in zip(samples, cu[:-1], cu[1:]):
                        out["bf16_packed"][name] = full[a:b].detach().float().cpu()
                (full.float() * w).sum().backward()
                out[f"packed_logits_{backend}"] = full[:cu[-1]].detach().float().cpu()
                gr = {}
                for t in export_tasks(m, spec):
                    p = t.param.grad if t.param.grad is not None else torch.zeros_like(t.param)
                    for role, tensor in t.mapping.merge([p.detach().float()]).items():
                        gr[t.hf[role]] = tensor.cpu()
                grads[backend] = gr
                del m
        del model
    gt, gl = grads["torch"], grads["local"]
    gmax = max(v.abs().max().item() for v in gl.values())
    errs = {k: (gt[k] - gl[k]).abs().max().item() / max(gl[k].abs().max().item(), 1e-2 * gmax) for k in gl}
    out["grad_keys_equal"] = sorted(gt) == sorted(gl)
    out["grad_worst"] = sorted(errs.items(), key=lambda kv: kv[1])[-3:]
    lt, ll = out.pop("packed_logits_torch"), out.pop("packed_logits_local")
    out["packed_logits_torch_vs_local"] = (lt - ll).abs().max().item() / ll.abs().max().item()
    out["fused_norm_rope_calls"] = fused[0]
    destroy_parallel()
    attn.packed_segments = orig_segments
    rp._norm_rope_fwd = orig_norm_rope
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("qk_norm_rope", [False, True], ids=["rope", "qk_norm_rope"])
def test_torch_backend_cuda_parity(tiny_ckpt, reference, qk_norm_rope):  # noqa: F811
    """``qk_norm_rope``: the q/k RMSNorms fused into the RoPE kernel (``MGRPO_TRITON_QK_NORM_ROPE=1``):
    the packed bf16 pass uses it (the unpacked passes do not: no THD), so "packed vs unpacked" and
    the gradients against the local backend check it."""
    samples, ref = reference
    res = run_ranks(_rank_cuda_torch_backend, 1, str(tiny_ckpt), samples, timeout=900,
                    env={"MGRPO_TRITON_QK_NORM_ROPE": "1" if qk_norm_rope else "0"})[0]
    lines = [f"megatron-core {res['megatron_core']}, auto -> {res['auto']}, grouped_mm usable {res['grouped_mm']}, "
             f"varlen plans per packed forward {res['varlen_plans_per_packed_forward']}, packed logits torch vs local "
             f"{res['packed_logits_torch_vs_local']:.2e}, worst grads {res['grad_worst']}"]
    ok = True
    for name, *_ in samples:
        scale = ref[name].abs().max().item()
        d32 = (res["fp32"][name] - ref[name]).abs().max().item()
        d16 = (res["bf16"][name] - ref[name]).abs().max().item()
        dpk = (res["bf16_packed"][name] - res["bf16"][name]).abs().max().item()
        lines.append(f"{name}: fp32 vs HF {d32:.2e}, bf16 vs HF {d16:.2e}, bf16 packed vs unpacked {dpk:.2e} "
                     f"(max|logit| {scale:.1f})")
        ok &= d32 < FP32_TOL and d16 < BF16_REL_LOGITS * scale and dpk < BF16_REL_LOGITS * scale
    print("\n[cuda parity, torch backend] " + "; ".join(lines))
    assert ok, lines
    assert res["auto"] == "torch"
    assert res["grouped_mm"]["bf16"]
    assert res["varlen_plans_per_packed_forward"] == 2  # one per PackedSeqParams: the thinker's, the audio windows'
    assert res["grad_keys_equal"]
    assert res["grad_worst"][-1][1] < BF16_GRAD_REL, res["grad_worst"]
    assert res["packed_logits_torch_vs_local"] < 0.02
    assert (res["fused_norm_rope_calls"] > 0) == qk_norm_rope, res["fused_norm_rope_calls"]
