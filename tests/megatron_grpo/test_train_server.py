"""The vLLM server `mgrpo train` starts computes like the trainer: same dtype, and its token-API
rollout logprobs equal the trainer's numerics.

Regression: the embedded tiny job's server was started with ``--dtype auto``, which vLLM resolves
by downcasting a float32 checkpoint to bfloat16, on CPU too, while the trainer computes in float32;
step 1 logged mismatch_kl_k3 ~4e-4 (per-token |diff| up to ~0.3) where identical numerics give
~1e-12 (per-token |diff| ~5e-6).  The existing vLLM parity tests start their server with an
explicit ``dtype="float32"``, so they never saw the server the trainer actually starts.
"""
import numpy as np
import pytest
import soundfile as sf
import torch

from megatron_grpo.config import ModelConfig, ServeConfig, TrainConfig, serve_dtype, train_dtype
from megatron_grpo.rollout.server import build_command
from megatron_grpo.run.rollout_source import local_server_spec

SR = 16000
LOGPROB_ATOL = 1e-4  # fp32 on both sides (measured ~5e-6); bfloat16 on the server gives ~1e-1


def _cfg(hf_dir, **kw) -> TrainConfig:
    model = ModelConfig(hf_dir=str(hf_dir), dtype=kw.pop("model_dtype", "auto"))
    kw.setdefault("serve", ServeConfig(max_model_len=4096))  # `mgrpo train` sizes "auto" from the data
    return TrainConfig(model=model, **kw)


def test_local_server_runs_in_the_trainers_dtype(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    trainer = "bfloat16" if torch.cuda.is_available() else "float32"
    cfg = _cfg(tmp_path)
    assert str(train_dtype(cfg)) == f"torch.{trainer}"
    spec = local_server_spec(cfg)
    assert spec.dtype == trainer, "serve.dtype 'auto' must mean the trainer's dtype, not vLLM's 'auto'"
    cmd = build_command(spec)
    assert cmd[cmd.index("--dtype") + 1] == trainer
    # an explicit training dtype is followed; an explicit server dtype wins
    assert local_server_spec(_cfg(tmp_path, model_dtype="bfloat16")).dtype == "bfloat16"
    assert local_server_spec(_cfg(tmp_path, model_dtype="float32")).dtype == "float32"
    assert serve_dtype(_cfg(tmp_path, serve=ServeConfig(dtype="float16"))) == "float16"


@pytest.fixture(scope="module")
def train_server(vllm_server, tiny_ckpt):
    """The server exactly as `mgrpo train` starts it for the tiny checkpoint (rollout.server local):
    the session server is started from that very spec (tests/conftest.py), checked here; it is the
    server of a run with rollout.return_routed_experts (R3), which returns routes besides."""
    from dataclasses import replace

    from megatron_grpo.rollout.config import RolloutConfig

    cfg = _cfg(tiny_ckpt, rollout=RolloutConfig(return_routed_experts=True))
    spec = replace(local_server_spec(cfg), port=vllm_server.spec.port)
    assert vllm_server.spec == spec and build_command(vllm_server.spec) == build_command(spec)
    return vllm_server


@pytest.mark.slow
def test_train_server_token_api_logprobs_match_trainer_numerics(train_server, tiny_ckpt, tmp_path):
    """A 2-turn audio conversation through the rollout engine (/inference/v1/generate): a scripted
    crop_audio call (a second clip, featurised by the server on its own) then a sampled turn; every
    generated token's rollout logprob == transformers fp32 teacher-forced with the trainer's
    per-clip features (Megatron == transformers is tests/model_bridge/test_parity.py)."""
    import json

    from transformers import AutoTokenizer

    from megatron_grpo.data.reader import PromptRow
    from megatron_grpo.data.synth import CROP_AUDIO_TOOL
    from megatron_grpo.rollout.config import RolloutConfig
    from megatron_grpo.rollout.engine import RolloutEngine, TeacherForcedSampler
    from megatron_grpo.testing.hf_reference import hf_logprobs_T, load_hf_thinker

    n = int(6.4 * SR) + 37  # not a multiple of the hop length: the server pads the clip to it
    t = np.arange(n) / SR
    rec = (0.01 * np.sin(2 * np.pi * 50 * t) + 0.3 * np.sin(2 * np.pi * 440 * t) * ((t > 2) & (t < 4)))
    sf.write(tmp_path / "rec.wav", rec.astype(np.float32), SR, subtype="FLOAT")
    row = PromptRow(prompt_index=0, messages=[{"role": "user", "content": [
        {"type": "audio", "audio_index": 0},
        {"type": "text", "text": "\nWhen does the beep occur? Answer [MM:SS - MM:SS]."}]}],
        tools=[CROP_AUDIO_TOOL], audio_paths=(str(tmp_path / "rec.wav"),), columns={"id": "r0"})
    crop = '<tool_call>\n' + json.dumps({"name": "crop_audio", "arguments": {"start_sec": 1.5,
                                                                            "end_sec": 3.25}}) + '\n</tool_call>'
    rcfg = TrainConfig().rollout   # the trainer's sampling settings
    rcfg.server_urls, rcfg.model = [train_server.url], train_server.spec.served_model_name
    rcfg.num_generations, rcfg.max_turns, rcfg.max_new_tokens, rcfg.seed = 2, 2, 48, 1234
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    eng = RolloutEngine(rcfg, tok, audio_roots=[str(tmp_path)])
    eng.sampler = TeacherForcedSampler(eng.client, lambda s: crop if s.num_turns == 0 else None)
    trajs = eng.run([row]).trajectories
    assert len(trajs) == 2

    thinker, processor = load_hf_thinker(tiny_ckpt)
    pad = eng.audio_token_id
    for tr in trajs:
        assert len(tr.audios) == 2 and tr.num_turns == 2, (tr.num_turns, tr.finish_reason)
        ids = np.array(tr.input_ids_T)
        mask = np.array(tr.loss_mask_T, bool)
        ours = np.array(tr.rollout_logprobs_T)
        ref = np.r_[0.0, hf_logprobs_T(thinker, processor, tr.input_ids_T, tr.audios, per_clip=True).numpy()]
        diff = np.abs(ours - ref)
        after_clip2 = np.arange(len(ids)) > np.flatnonzero(ids == pad).max()
        sampled = mask & after_clip2          # the second, sampled turn (after the tool clip)
        assert sampled.any() and (mask & ~after_clip2).any()
        print(f"max |rollout logprob - trainer numerics|: scripted turn {diff[mask & ~after_clip2].max():.2e}, "
              f"sampled turn after the tool clip {diff[sampled].max():.2e}; "
              f"mismatch k3 {np.mean(np.expm1(ref - ours)[mask] - (ref - ours)[mask]):.1e}")
        assert diff[mask].max() <= LOGPROB_ATOL, (diff[mask].max(), ours[mask], ref[mask])
