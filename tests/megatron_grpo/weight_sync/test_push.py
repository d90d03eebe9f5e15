"""Weight pushes into the real vLLM CPU server (the session `vllm_server`, gloo backend).

After a push of perturbed weights (attention, router, experts, lm_head, audio projection) the served
logprobs equal a transformers fp32 forward of the new weights (text and text+audio) and /weight_info
reports the version; a push that fails midway (trainer side or server side) raises a clear error and
leaves the server resumed on its previous weights; the CPU MoE re-prepack fix is what makes expert
updates land. The checkpoint's own weights are pushed back at the end (version "default").
"""
from __future__ import annotations

import base64
import copy
import io

import numpy as np
import pytest
import requests
import soundfile as sf
import torch

from megatron_grpo.testing.hf_reference import hf_logprobs_T, load_hf_thinker
from megatron_grpo.weight_sync import WeightPushError, WeightReceiver, push

pytestmark = pytest.mark.slow

LOGPROB_ATOL = 1e-4  # fp32 on both sides
CHANGED = 1e-2  # a push must move the served logprobs by more than this


# ----------------------------------------------------------------------------- helpers
def hf_checkpoint_weights(thinker, prefix: str = "thinker."):
    """(on-disk name, tensor) of an HF thinker's trained parts, experts split per expert (the
    files' layout; transformers 5 fuses them in memory). The vision tower is left out, as in
    `model_bridge.export.export_hf`."""
    inter = thinker.config.text_config.moe_intermediate_size
    for name, p in thinker.named_parameters():
        if name.startswith("visual."):
            continue
        p = p.detach()
        full = prefix + name
        if name.endswith("mlp.experts.gate_up_proj"):
            base = full.removesuffix("gate_up_proj")
            for e in range(p.shape[0]):
                yield f"{base}{e}.gate_proj.weight", p[e, :inter]
                yield f"{base}{e}.up_proj.weight", p[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            base = full.removesuffix("down_proj")
            for e in range(p.shape[0]):
                yield f"{base}{e}.down_proj.weight", p[e]
        else:
            yield full, p


_PERTURBED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate.weight", "mlp.experts.", "lm_head.", "audio_tower.proj")


@torch.no_grad()
def perturbed(thinker, seed: int, only: tuple[str, ...] = _PERTURBED):
    """A copy of `thinker` with the parameters matching `only` moved by 0.5 std of noise."""
    new = copy.deepcopy(thinker)
    g = torch.Generator().manual_seed(seed)
    hit = set()
    for name, p in new.named_parameters():
        if any(k in name for k in only):
            p.add_(0.5 * p.float().std() * torch.randn(p.shape, generator=g))
            hit.add(next(k for k in only if k in name))
    assert hit == set(only), set(only) - hit
    return new


def _wav_bytes(seconds=3.0, sr=16000):
    t = np.arange(int(seconds * sr)) / sr
    x = 0.3 * np.sin(2 * np.pi * 440.0 * t) * (t > 1.0) + 0.01 * np.sin(2 * np.pi * 50 * t)
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), sr, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def served_vs_hf(server, processor, models: dict, with_audio: bool) -> dict[str, float]:
    """max |served logprob - transformers logprob| of one sampled completion, per reference model."""
    wav = _wav_bytes()
    if with_audio:
        content = [{"type": "input_audio",
                    "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
                   {"type": "text", "text": "When does the beep start?"}]
        audios = [sf.read(io.BytesIO(wav), dtype="float32")[0]]
    else:
        content, audios = "Hello, what is the answer?", None
    body = dict(model=server.spec.served_model_name, messages=[{"role": "user", "content": content}],
                max_tokens=12, temperature=1.0, seed=1234, logprobs=True, return_token_ids=True)
    r = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text[:2000]
    resp = r.json()
    choice = resp["choices"][0]
    prompt_ids, out_ids = resp["prompt_token_ids"], choice["token_ids"]
    served = np.array([c["logprob"] for c in choice["logprobs"]["content"]])
    assert len(out_ids) == len(served) > 0
    return {tag: float(np.abs(hf_logprobs_T(m, processor, prompt_ids + out_ids, audios)
                              [len(prompt_ids) - 1:].numpy() - served).max())
            for tag, m in models.items()}


def _rpc(server, method, *args):
    r = requests.post(f"{server.url}/collective_rpc", json={"method": method, "args": list(args)}, timeout=60)
    assert r.status_code == 200, r.text[:2000]
    return r.json()["results"]


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def hf(tiny_ckpt):
    return load_hf_thinker(tiny_ckpt)


@pytest.fixture(scope="module")
def v1(hf):
    return perturbed(hf[0], seed=1)


@pytest.fixture(scope="module")
def receiver(vllm_server, hf):
    rx = WeightReceiver(vllm_server.url, backend="gloo", transfer_timeout_s=120)
    yield rx
    try:  # give the other tests of the session their checkpoint back
        stats = push(hf_checkpoint_weights(hf[0]), "default", [rx])
        print(f"\n[restore] {stats.summary()}")
        assert rx.weight_version() == "default" and not rx.is_paused()
    finally:
        rx.close()


def _ensure(rx, model, version):
    if rx.weight_version() != version:
        push(hf_checkpoint_weights(model), version, [rx])


# ----------------------------------------------------------------------------- tests
def test_push_then_served_logprobs_equal_transformers(vllm_server, hf, v1, receiver):
    orig, processor = hf
    assert receiver.weight_version() == "default"
    stats = push(hf_checkpoint_weights(v1), 1, [receiver])
    print(f"\n{stats.summary()}")
    n_experts = v1.config.text_config.num_experts
    n_layers = v1.config.text_config.num_hidden_layers
    assert stats.tensors == sum(1 for _ in hf_checkpoint_weights(v1))
    assert stats.tensors > 3 * n_experts * n_layers  # per-expert keys
    assert stats.bytes == sum(t.numel() * t.element_size() for _, t in hf_checkpoint_weights(v1))
    assert receiver.weight_version() == "1" and not receiver.is_paused()
    for with_audio in (False, True):
        d = served_vs_hf(vllm_server, processor, {"new": v1, "old": orig}, with_audio)
        print(f"[{'text+audio' if with_audio else 'text'}] max |dlogp| served vs transformers: "
              f"new weights {d['new']:.2e}, old weights {d['old']:.2e}")
        assert d["new"] <= LOGPROB_ATOL, d
        assert d["old"] > CHANGED, d  # the push did change what is served


def test_failed_push_keeps_previous_version_and_server_serving(vllm_server, hf, v1, receiver):
    _, processor = hf
    _ensure(receiver, v1, "1")
    v2 = perturbed(v1, seed=2)
    url = vllm_server.url

    # 1. the trainer's weight stream dies after several buckets went out
    def dying_stream():
        for i, item in enumerate(hf_checkpoint_weights(v2)):
            if i == 60:
                raise RuntimeError("export died")
            yield item

    with pytest.raises(WeightPushError) as ei:
        push(dying_stream(), 2, [receiver], bucket_bytes=64 * 1024)
    e = ei.value
    print(f"\n[trainer failure] {e}")
    assert "version '2'" in str(e) and "export died" in str(e) and "update_weights" in str(e)
    assert e.stage == "update_weights" and e.states[url] == "previous version, resumed"
    assert receiver.weight_version() == "1" and not receiver.is_paused()
    d = served_vs_hf(vllm_server, processor, {"v1": v1}, with_audio=False)
    print(f"[after trainer failure] max |dlogp| vs v1 = {d['v1']:.2e}")
    assert d["v1"] <= LOGPROB_ATOL

    # 2. the server refuses a weight while loading (an unknown name): fails in finish_weight_update
    def bad_stream():
        yield "thinker.no_such_module.weight", torch.zeros(4)
        yield from hf_checkpoint_weights(v2)

    with pytest.raises(WeightPushError) as ei:
        push(bad_stream(), 2, [receiver])
    e = ei.value
    print(f"[server failure] {str(e)[:600]}")
    assert url in str(e) and e.stage == "finish_weight_update" and "no_such_module" in str(e)
    assert e.states[url] == "previous version, resumed"
    assert receiver.weight_version() == "1" and not receiver.is_paused()
    d = served_vs_hf(vllm_server, processor, {"v1": v1}, with_audio=False)
    print(f"[after server failure] max |dlogp| vs v1 = {d['v1']:.2e}")
    assert d["v1"] <= LOGPROB_ATOL

    # 3. the next push reconnects and lands
    stats = push(hf_checkpoint_weights(v2), 2, [receiver], bucket_bytes=64 * 1024)
    print(f"[retry] {stats.summary()}")
    assert receiver.weight_version() == "2" and stats.buckets > 1
    d = served_vs_hf(vllm_server, processor, {"v2": v2}, with_audio=True)
    print(f"[after retry, text+audio] max |dlogp| vs v2 = {d['v2']:.2e}")
    assert d["v2"] <= LOGPROB_ATOL


def test_cpu_moe_reprepack_fix_is_needed(vllm_server, hf, v1, receiver):
    """Expert-only update with the fix switched off in the worker: served logprobs go wrong."""
    _, processor = hf
    _ensure(receiver, v1, "1")
    experts = perturbed(v1, seed=3, only=("mlp.experts.",))
    assert _rpc(vllm_server, "mgrpo_set_cpu_moe_fix", "0") == [{"previous": True, "enabled": False}]
    try:
        push(hf_checkpoint_weights(experts), "experts-nofix", [receiver])
        broken = served_vs_hf(vllm_server, processor, {"new": experts, "old": v1}, with_audio=False)
    finally:
        assert _rpc(vllm_server, "mgrpo_set_cpu_moe_fix", "1") == [{"previous": False, "enabled": True}]
    push(hf_checkpoint_weights(experts), "experts", [receiver])
    fixed = served_vs_hf(vllm_server, processor, {"new": experts, "old": v1}, with_audio=False)
    print(f"\n[cpu moe fix] expert-only push, max |dlogp| vs transformers(new): without fix "
          f"{broken['new']:.2e} (vs old weights {broken['old']:.2e}); with fix {fixed['new']:.2e}")
    assert broken["new"] > CHANGED
    assert fixed["new"] <= LOGPROB_ATOL
