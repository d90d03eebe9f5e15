"""Megatron thinker logits == transformers' Qwen3-Omni thinker logits (fp32, CPU, gloo ranks).

For each layout the HF checkpoint is loaded with ``load_hf`` into ``build_thinker``'s model; the
TP-gathered logits (vocab padding removed) of a text sample and a text+audio sample (two clips)
must equal ``Qwen3OmniMoeForConditionalGeneration.thinker``'s within 1e-4 max abs, and the same
samples packed into one THD micro-batch (with trailing padding) must give the same logits as
unpacked. Pipeline stages hand hidden states over with plain send/recv (the schedule is tested
elsewhere).
"""
from __future__ import annotations

import time

import pytest
import torch

from model_bridge.spawn import run_ranks

TOL = 1e-4


def _sample_ids(spec, n_audio: list[int], n_text: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(0, 400, (n,), generator=g).tolist()  # noqa: E731 - BPE range of the tiny tokenizer
    ids = text(n_text)
    for n in n_audio:
        ids += [spec.audio_start_token_id] + [spec.audio_token_id] * n + [spec.audio_end_token_id] + text(3)
    return ids


def _make_samples(spec):
    """[(name, ids, features [mel, F] or None, feature_lens or None)]"""
    from model_bridge.modeling.audio import audio_output_lengths

    frames = [230, 70]  # 2 full 100-frame chunks + a 30-frame tail; one short clip
    n_audio = [int(audio_output_lengths(torch.tensor(f), spec.audio.n_window)) for f in frames]
    g = torch.Generator().manual_seed(5)
    feats = torch.randn(spec.audio.num_mel_bins, sum(frames), generator=g)
    return [
        ("text", _sample_ids(spec, [], 23, seed=1), None, None),
        ("audio", _sample_ids(spec, n_audio, 6, seed=2), feats, torch.tensor(frames)),
        ("text2", _sample_ids(spec, [], 9, seed=3), None, None),
    ]


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    """(samples, {name: HF thinker logits [T, V]}) computed once in this process."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from model_bridge.config import read_omni_config

    spec = read_omni_config(tiny_ckpt)
    samples = _make_samples(spec)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for name, ids, feats, lens in samples:
            ids_t = torch.tensor([ids])
            kw = {}
            if feats is not None:
                clips = feats.split(lens.tolist(), dim=1)
                fmax = max(c.shape[1] for c in clips)
                batch = torch.zeros(len(clips), feats.shape[0], fmax)
                mask = torch.zeros(len(clips), fmax, dtype=torch.long)
                for i, c in enumerate(clips):
                    batch[i, :, :c.shape[1]] = c
                    mask[i, :c.shape[1]] = 1
                kw = dict(input_features=batch, feature_attention_mask=mask)
            out[name] = model.thinker(input_ids=ids_t, attention_mask=torch.ones_like(ids_t), **kw).logits[0].float()
    return samples, out


def _forward_stage(model, ids, pos, psp, feats, lens, hidden_shape):
    """One micro-batch through this rank's pipeline stage; logits on the last stage, else None."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not model.pre_process:
        buf = torch.empty(hidden_shape)
        dist.recv(buf, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(buf)
    out = model(ids, pos, packed_seq_params=psp, audio_features=feats, audio_feature_lens=lens)
    if not model.post_process:
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    return out


def _rank_main(hf_dir: str, tp: int, ep: int, pp: int, samples):
    """Per rank: load, run every sample alone and all of them packed; return gathered logits."""
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams

    from model_bridge.config import ParallelLayout, read_omni_config
    from model_bridge.load import load_hf
    from model_bridge.modeling.thinker import build_thinker, gather_logits, mrope_position_ids
    from model_bridge.parallel import destroy_parallel, init_parallel

    torch.set_num_threads(1)
    init_parallel(tp=tp, ep=ep, pp=pp, seed=1234)
    spec = read_omni_config(hf_dir)
    model = build_thinker(spec, ParallelLayout(tp=tp, ep=ep, pp=pp), torch.float32).eval()
    t0 = time.time()
    load_hf(model, hf_dir)
    H = spec.text.hidden_size
    results, timings = {}, {"load": time.time() - t0}

    def pad_to(n):  # sequence parallel needs T % tp == 0; trailing tokens never affect earlier ones
        return (n + tp - 1) // tp * tp

    with torch.no_grad():
        t0 = time.time()
        for name, ids, feats, lens in samples:
            T = pad_to(len(ids))
            ids_t = torch.tensor([ids + [0] * (T - len(ids))])
            pos = mrope_position_ids(ids_t, spec).unsqueeze(1)
            out = _forward_stage(model, ids_t, pos, None, feats, lens, (T // tp if tp > 1 else T, 1, H))
            if out is not None:
                results[name] = gather_logits(out, spec.text.vocab_size)[:len(ids)]
        timings["unpacked"] = time.time() - t0

        # all samples in one THD micro-batch, plus trailing padding
        t0 = time.time()
        lens_tok = [len(s[1]) for s in samples]
        cu = torch.tensor([0] + torch.tensor(lens_tok).cumsum(0).tolist(), dtype=torch.int32)
        T = pad_to(int(cu[-1]) + 3)
        ids = sum((s[1] for s in samples), [])
        ids_t = torch.tensor([ids + [0] * (T - len(ids))])
        pos = mrope_position_ids(ids_t, spec, cu_seqlens=cu).unsqueeze(1)
        clips = [s for s in samples if s[2] is not None]
        feats = torch.cat([s[2] for s in clips], dim=1) if clips else None
        flens = torch.cat([s[3] for s in clips]) if clips else None
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                              max_seqlen_q=max(lens_tok), max_seqlen_kv=max(lens_tok))
        out = _forward_stage(model, ids_t, pos, psp, feats, flens, (T // tp if tp > 1 else T, 1, H))
        if out is not None:
            full = gather_logits(out, spec.text.vocab_size)
            for (name, *_), a, b in zip(samples, cu[:-1].tolist(), cu[1:].tolist()):
                results[f"packed/{name}"] = full[a:b]
            # padded vocab columns are masked: a softmax over the padded vocab is the real one's
            allcols = gather_logits(out, model.padded_vocab_size)
            real = allcols[:, :spec.text.vocab_size]
            results["pad_logprob_gap"] = (torch.log_softmax(allcols, -1)[:, :spec.text.vocab_size]
                                          - torch.log_softmax(real, -1)).abs().max().item()
        timings["packed"] = time.time() - t0
    keep = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    destroy_parallel()
    return {"rank_results": results if keep else None, "timings": timings}


def _check(values, reference, layout_name):
    samples, ref = reference
    got = [v["rank_results"] for v in values if v["rank_results"]]
    assert got, "no rank returned logits"
    report = {}
    for res in got:
        for name, *_ in samples:
            diff = (res[name] - ref[name]).abs().max().item()
            pdiff = (res[f"packed/{name}"] - ref[name]).abs().max().item()
            pu = (res[f"packed/{name}"] - res[name]).abs().max().item()
            report[name] = (diff, pdiff, pu)
            assert diff < TOL, f"{layout_name} {name}: max|megatron - HF| = {diff:.3e}"
            assert pdiff < TOL, f"{layout_name} {name} packed: max|megatron - HF| = {pdiff:.3e}"
            assert pu < TOL, f"{layout_name} {name}: max|packed - unpacked| = {pu:.3e}"
        assert res["pad_logprob_gap"] == 0.0, "padded vocab columns leak into the softmax"
    print(f"\n[parity {layout_name}] max|diff| (unpacked vs HF, packed vs HF, packed vs unpacked): "
          + ", ".join(f"{k}: {a:.2e}/{b:.2e}/{c:.2e}" for k, (a, b, c) in report.items())
          + f"; rank timings {values[0]['timings']}")


LAYOUTS = [
    pytest.param(1, 1, 1, id="tp1-ep1-pp1"),
    pytest.param(2, 1, 1, id="tp2sp-ep1-pp1"),  # world 2: 12-16 s each on 2 idle cores
    pytest.param(1, 2, 1, id="tp1-ep2-pp1"),
    pytest.param(1, 1, 2, id="tp1-ep1-pp2"),
    pytest.param(2, 2, 1, id="tp2sp-ep2-pp1", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("tp,ep,pp", LAYOUTS)
def test_thinker_logits_match_hf(tiny_ckpt, reference, tp, ep, pp):
    world = _world(tp, ep, pp)
    values = run_ranks(_rank_main, world, str(tiny_ckpt), tp, ep, pp, reference[0], timeout=900)
    _check(values, reference, f"tp{tp}{'+sp' if tp > 1 else ''} ep{ep} pp{pp} (world {world})")


def _world(tp: int, ep: int, pp: int) -> int:
    """Smallest world size that holds the layout: tp*pp dense ranks, ep*etp (etp = tp) expert ranks."""
    import math

    return pp * math.lcm(tp, ep * tp)


def _rank_backward(hf_dir: str, samples):
    """World 1, training mode: packed grads == unpacked grads; dummy audio gives zero (not None)
    audio grads; a token/feature count mismatch names both counts."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from model_bridge.config import ParallelLayout, read_omni_config
    from model_bridge.load import load_hf
    from model_bridge.modeling.thinker import build_thinker, gather_logits, mrope_position_ids
    from model_bridge.parallel import destroy_parallel, init_parallel

    torch.set_num_threads(1)
    init_parallel(seed=1234)
    spec = read_omni_config(hf_dir)
    # aux loss off: the load-balancing loss depends on which tokens share a micro-batch
    model = build_thinker(spec, ParallelLayout(), torch.float32, moe_aux_loss_coeff=0.0)
    load_hf(model, hf_dir)
    model.train()
    V = spec.text.vocab_size
    g = torch.Generator().manual_seed(9)
    weights = {name: torch.randn(len(ids), V, generator=g) for name, ids, *_ in samples}
    out = {}

    def grads():
        res = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return res

    # text only: the audio tower still runs (dummy clip) and every audio weight gets a zero grad
    name, ids, _, _ = samples[0]
    ids_t = torch.tensor([ids])
    logits = gather_logits(model(ids_t, mrope_position_ids(ids_t, spec).unsqueeze(1)), V)
    (logits * weights[name]).sum().backward()
    audio = {n: p.grad for n, p in model.audio_tower.named_parameters()}
    out["audio_grads_none"] = sorted(n for n, gr in audio.items() if gr is None)
    out["audio_grads_max"] = max(gr.abs().max().item() for gr in audio.values() if gr is not None)
    model.zero_grad(set_to_none=True)

    for name, ids, feats, lens in samples:  # unpacked, grads accumulate
        ids_t = torch.tensor([ids])
        logits = gather_logits(model(ids_t, mrope_position_ids(ids_t, spec).unsqueeze(1), audio_features=feats,
                                     audio_feature_lens=lens), V)
        (logits * weights[name]).sum().backward()
    unpacked = grads()
    out["audio_grad_with_audio"] = max(unpacked[n].abs().max().item() for n in unpacked if n.startswith("audio_tower."))

    lens_tok = [len(s[1]) for s in samples]
    cu = torch.tensor([0] + torch.tensor(lens_tok).cumsum(0).tolist(), dtype=torch.int32)
    ids_t = torch.tensor([sum((s[1] for s in samples), []) + [0, 0]])  # 2 trailing padding tokens
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens_tok),
                          max_seqlen_kv=max(lens_tok))
    clips = [s for s in samples if s[2] is not None]
    logits = gather_logits(model(ids_t, mrope_position_ids(ids_t, spec, cu_seqlens=cu).unsqueeze(1), psp,
                                 audio_features=torch.cat([s[2] for s in clips], 1),
                                 audio_feature_lens=torch.cat([s[3] for s in clips])), V)
    w = torch.cat([weights[s[0]] for s in samples] + [torch.zeros(2, V)])
    (logits * w).sum().backward()
    packed = grads()
    out["grad_keys_equal"] = sorted(packed) == sorted(unpacked)
    out["max_grad_diff"] = max((packed[n] - unpacked[n]).abs().max().item() for n in unpacked)
    out["max_grad"] = max(gr.abs().max().item() for gr in unpacked.values())

    name, ids, feats, lens = samples[1]  # features of the first clip only
    ids_t = torch.tensor([ids])
    try:
        model(ids_t, mrope_position_ids(ids_t, spec).unsqueeze(1), audio_features=feats[:, :int(lens[0])],
              audio_feature_lens=lens[:1])
        out["mismatch_error"] = None
    except ValueError as e:
        out["mismatch_error"] = str(e)
    destroy_parallel()
    return out


def test_backward_packed_equals_unpacked_and_dummy_audio(tiny_ckpt, reference):
    samples = reference[0]
    t0 = time.time()
    res = run_ranks(_rank_backward, 1, str(tiny_ckpt), samples, timeout=600)[0]
    print(f"\n[backward] {res} ({time.time() - t0:.1f} s)")
    assert res["audio_grads_none"] == [], "audio weights without a grad after a text-only step"
    assert res["audio_grads_max"] == 0.0
    assert res["audio_grad_with_audio"] > 0.0
    assert res["grad_keys_equal"]
    assert res["max_grad_diff"] < 1e-4 * max(1.0, res["max_grad"]), res
    n_audio = samples[1][1].count(_audio_token(tiny_ckpt))
    msg = res["mismatch_error"]
    assert msg and "mismatch" in msg and str(n_audio) in msg, msg


def _audio_token(hf_dir) -> int:
    from model_bridge.config import read_omni_config

    return read_omni_config(hf_dir).audio_token_id


def _rank_cuda(hf_dir: str, samples):
    """World 1 on CUDA: fp32 logits (SDPA path) and bf16 packed logits (flash varlen path)."""
    import functools
    import sys

    import megatron.core
    from megatron.core.packed_seq_params import PackedSeqParams

    from model_bridge.config import ParallelLayout, read_omni_config
    from model_bridge.load import load_hf
    from model_bridge.modeling.thinker import build_thinker, gather_logits, mrope_position_ids
    from model_bridge.parallel import destroy_parallel, init_parallel

    import torch.nn.attention.varlen as tv

    import model_bridge.modeling.attention as attn

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    varlen_calls = [0]
    callers: dict = {}  # "file:function" of every flash varlen call (the message when counts differ)
    orig_varlen, orig_dense = tv.varlen_attn, attn.dense_attention

    @functools.wraps(orig_varlen)  # keeps its signature: attention.varlen_kwargs inspects it
    def counting_varlen(*args, **kwargs):
        varlen_calls[0] += 1
        f = sys._getframe(1)
        key = f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_code.co_name} q{tuple(args[0].shape)}"
        callers[key] = callers.get(key, 0) + 1
        return orig_varlen(*args, **kwargs)

    def counting_dense(q, *args, **kwargs):
        key = f"dense_attention q{tuple(q.shape)} {q.dtype}"
        callers[key] = callers.get(key, 0) + 1
        return orig_dense(q, *args, **kwargs)

    tv.varlen_attn = counting_varlen  # both packed paths import it at call time
    attn.dense_attention = counting_dense
    init_parallel(seed=1234)
    spec = read_omni_config(hf_dir)
    V = spec.text.vocab_size
    out = {"megatron_core": megatron.core.__version__, "fp32": {}, "bf16": {}, "bf16_packed": {}}
    lens_tok = [len(s[1]) for s in samples]
    cu = torch.tensor([0] + torch.tensor(lens_tok).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens_tok),
                          max_seqlen_kv=max(lens_tok))
    clips = [s for s in samples if s[2] is not None]
    feats_all = torch.cat([s[2] for s in clips], 1).cuda()
    lens_all = torch.cat([s[3] for s in clips]).cuda()
    for dtype, key in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        model = build_thinker(spec, ParallelLayout(), dtype, backend="local")  # counts local varlen calls
        load_hf(model, hf_dir)
        model = model.cuda().eval()
        with torch.no_grad():
            for name, ids, feats, lens in samples:
                ids_t = torch.tensor([ids], device="cuda")
                f = None if feats is None else feats.to("cuda", dtype)
                logits = model(ids_t, mrope_position_ids(ids_t, spec).unsqueeze(1), audio_features=f,
                               audio_feature_lens=None if lens is None else lens.cuda())
                out[key][name] = gather_logits(logits, V).float().cpu()
            if dtype == torch.bfloat16:
                ids_t = torch.tensor([sum((s[1] for s in samples), []) + [0] * 5], device="cuda")
                pos = mrope_position_ids(ids_t, spec, cu_seqlens=cu).unsqueeze(1)
                before = varlen_calls[0]
                callers.clear()
                full = gather_logits(model(ids_t, pos, psp, audio_features=feats_all.to(dtype),
                                           audio_feature_lens=lens_all), V).float().cpu()
                out["varlen_calls_packed"] = varlen_calls[0] - before
                out["varlen_calls_expected"] = spec.text.num_layers + spec.audio.num_layers
                out["attention_calls_packed"] = dict(callers)
                for (name, *_), a, b in zip(samples, cu[:-1].tolist(), cu[1:].tolist()):
                    out["bf16_packed"][name] = full[a:b]
        del model
    destroy_parallel()
    return out


@pytest.mark.gpu
def test_thinker_cuda_fp32_parity_and_bf16_varlen(tiny_ckpt, reference):
    samples, ref = reference
    res = run_ranks(_rank_cuda, 1, str(tiny_ckpt), samples, timeout=600)[0]
    lines = [f"megatron-core {res['megatron_core']}, flash varlen calls in the packed pass "
             f"{res['varlen_calls_packed']} (thinker + audio layers {res['varlen_calls_expected']}); "
             f"attention calls in that pass: {res['attention_calls_packed']}"]
    assert res["varlen_calls_packed"] == res["varlen_calls_expected"], lines[0]
    for name, *_ in samples:
        scale = ref[name].abs().max().item()
        d32 = (res["fp32"][name] - ref[name]).abs().max().item()
        d16 = (res["bf16"][name] - ref[name]).abs().max().item()
        dpk = (res["bf16_packed"][name] - res["bf16"][name]).abs().max().item()
        lines.append(f"{name}: fp32 vs HF {d32:.2e}, bf16 vs HF {d16:.2e}, bf16 packed(varlen) vs unpacked(sdpa) "
                     f"{dpk:.2e} (max|logit| {scale:.1f})")
        assert d32 < TOL, lines[-1]
        assert d16 < 0.05 * scale and dpk < 0.05 * scale, lines[-1]
    print("\n[cuda parity] " + "; ".join(lines))
