"""The real vLLM CPU server serves the tiny checkpoint, and its logprobs equal transformers fp32."""
import base64
import io

import numpy as np
import pytest
import requests
import soundfile as sf

from megatron_grpo.testing.hf_reference import hf_logprobs_T, load_hf_thinker

pytestmark = pytest.mark.slow

LOGPROB_ATOL = 1e-4  # fp32 on both sides; differences come from kernel summation order only


def _wav_bytes(seconds=3.0, sr=16000):
    t = np.arange(int(seconds * sr)) / sr
    x = 0.3 * np.sin(2 * np.pi * 440.0 * t) * (t > 1.0) + 0.01 * np.sin(2 * np.pi * 50 * t)
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), sr, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _chat(server, content, **kw):
    body = dict(model=server.spec.served_model_name, messages=[{"role": "user", "content": content}],
                max_tokens=12, temperature=1.0, seed=1234, logprobs=True, return_token_ids=True)
    body.update(kw)
    r = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text[:2000]
    return r.json()


@pytest.fixture(scope="module")
def hf(tiny_ckpt):
    return load_hf_thinker(tiny_ckpt)


@pytest.mark.parametrize("with_audio", [False, True], ids=["text", "text+audio"])
def test_vllm_logprobs_match_transformers(vllm_server, hf, with_audio):
    thinker, processor = hf
    wav = _wav_bytes()
    if with_audio:
        content = [{"type": "input_audio",
                    "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
                   {"type": "text", "text": "When does the beep start?"}]
        audios = [sf.read(io.BytesIO(wav), dtype="float32")[0]]
    else:
        content, audios = "Hello, what is the answer?", None
    resp = _chat(vllm_server, content)
    choice = resp["choices"][0]
    prompt_ids, out_ids = resp["prompt_token_ids"], choice["token_ids"]
    vllm_lp = np.array([c["logprob"] for c in choice["logprobs"]["content"]])
    assert len(out_ids) == len(vllm_lp) > 0
    n_audio_pad = sum(i == thinker.config.audio_token_id for i in prompt_ids)
    if with_audio:  # 3 s of audio -> 300 mel frames -> 39 tokens (13 per 100 frames)
        assert n_audio_pad == 39, n_audio_pad
    else:
        assert n_audio_pad == 0

    hf_lp = hf_logprobs_T(thinker, processor, prompt_ids + out_ids, audios)[len(prompt_ids) - 1:].numpy()
    diff = np.abs(hf_lp - vllm_lp).max()
    print(f"max |logprob vLLM - transformers| ({'audio' if with_audio else 'text'}) = {diff:.2e}")
    assert diff <= LOGPROB_ATOL, (diff, vllm_lp, hf_lp)
    if with_audio:  # the server reads the WAV with soundfile (build_command), not trying torchcodec per request
        assert "torchcodec unavailable" not in vllm_server.log_path.read_text(errors="replace")
