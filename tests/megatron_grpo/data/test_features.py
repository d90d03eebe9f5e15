"""audio_features / audio_token_count against transformers' own Qwen3-Omni processing.

Reference = ``Qwen3OmniMoeProcessor`` of the tiny checkpoint (chat template + feature extractor +
``<|audio_pad|>`` expansion) and the model's ``get_audio_features`` masking, run on the real code
with a recording stand-in for the audio tower.  vLLM's rule (clips zero-padded to a multiple of
160 samples first, ``len // 160`` frames each) is the same reference applied to pre-padded clips.
"""
import json

import numpy as np
import pytest
import torch

from megatron_grpo.data.features import (MIN_CLIP_SAMPLES, audio_features, audio_token_count,
                                         audio_token_counts, num_frames)

SR = 16000
# 3 clips: not a hop multiple / the longest and not a hop multiple / an exact hop multiple.
# 33300 samples: vLLM 209 frames -> 28 tokens, plain transformers (longest clip) 208 -> 27.
LENS_3 = [3 * SR + 37, 33300, 5 * SR]


@pytest.fixture(scope="module")
def processor(tiny_ckpt):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(tiny_ckpt))


def clips(lens, seed=0):
    rng = np.random.default_rng(seed)
    t = [np.arange(n) / SR for n in lens]
    return [(0.3 * np.sin(2 * np.pi * (300 + 200 * i) * x) + 0.05 * rng.standard_normal(len(x))).astype(np.float32)
            for i, x in enumerate(t)]


def hop_pad(w):
    return np.pad(w, (0, -len(w) % 160))


def hf_reference(processor, waves, tools=None):
    """(features [M, F], feature_lens [A], audio-pad run lengths) the transformers way."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import \
        Qwen3OmniMoeThinkerForConditionalGeneration as Thinker

    content = [{"type": "audio", "audio": w} for w in waves] + [{"type": "text", "text": "When?"}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], tools=tools,
                                         tokenize=False, add_generation_prompt=True)
    out = processor(text=[text], audio=list(waves), return_tensors="pt")

    seen = {}

    class Tower:
        def __call__(self, input_features, feature_lens, **kw):
            seen["features"], seen["lens"] = input_features, feature_lens
            return None

    class FakeThinker:
        audio_tower = Tower()

    Thinker.get_audio_features(FakeThinker(), out["input_features"], out["feature_attention_mask"])
    ids = out["input_ids"][0].tolist()
    pad = processor.tokenizer.convert_tokens_to_ids("<|audio_pad|>")
    runs, t = [], 0
    while t < len(ids):
        if ids[t] == pad:
            s = t
            while t < len(ids) and ids[t] == pad:
                t += 1
            runs.append(t - s)
        else:
            t += 1
    return seen["features"], seen["lens"], runs


@pytest.mark.parametrize("lens", [[2 * SR + 77], LENS_3], ids=["1clip", "3clips"])
def test_equals_transformers(processor, lens):
    fe = processor.feature_extractor
    waves = clips(lens)
    # plain transformers: one batch call, no hop padding
    ref_f, ref_l, ref_runs = hf_reference(processor, waves)
    f, l = audio_features(fe, waves, per_clip=False, pad_to_hop=False)
    assert f.dtype == torch.float32 and l.dtype == torch.long and f.shape[0] == 128
    assert l.tolist() == ref_l.tolist() and f.shape == ref_f.shape
    assert torch.equal(f, ref_f)
    assert [int(audio_token_count(n)) for n in l.tolist()] == ref_runs
    # vLLM: the same processing of hop-padded clips; frames = ceil(N / 160)
    v_f, v_l, v_runs = hf_reference(processor, [hop_pad(w) for w in waves])
    f, l = audio_features(fe, waves, per_clip=False)
    assert l.tolist() == v_l.tolist() == [num_frames(n) for n in lens] == [-(-n // 160) for n in lens]
    assert torch.equal(f, v_f)
    assert [int(audio_token_count(n)) for n in l.tolist()] == v_runs == audio_token_counts(waves)
    # per clip (default): each clip alone == transformers on that clip alone
    f, l = audio_features(fe, waves)
    parts = [hf_reference(processor, [hop_pad(w)])[0] for w in waves]
    assert torch.equal(f, torch.cat(parts, dim=1))
    assert l.tolist() == v_l.tolist()


def test_vllm_and_transformers_frame_rules_differ_by_a_token(processor):
    """Why pad_to_hop defaults to True: for the 33300-sample clip, alone, the two rules disagree."""
    w = clips([33300])
    _, l_hf, runs_hf = hf_reference(processor, w)
    _, l_v, runs_v = hf_reference(processor, [hop_pad(w[0])])
    assert (l_hf.tolist(), runs_hf) == ([208], [27])
    assert (l_v.tolist(), runs_v) == ([209], [28])
    assert audio_features(processor.feature_extractor, w)[1].tolist() == [209]


def test_per_clip_differs_only_in_a_clips_last_frame(processor):
    waves = clips(LENS_3)
    a, la = audio_features(processor.feature_extractor, waves, per_clip=True)
    b, lb = audio_features(processor.feature_extractor, waves, per_clip=False)
    assert la.tolist() == lb.tolist()
    ends = np.cumsum(la.tolist()) - 1
    diff = (a - b).abs().amax(dim=0)
    assert set(torch.nonzero(diff).flatten().tolist()) <= set(ends.tolist())


def test_chat_template_with_tools_expands_as_counted(processor):
    from megatron_grpo.data.synth import CROP_AUDIO_TOOL

    waves = clips([SR + 5, 4 * SR + 333])
    _, lens, runs = hf_reference(processor, [hop_pad(w) for w in waves], tools=[CROP_AUDIO_TOOL])
    assert runs == audio_token_counts(waves) == [int(audio_token_count(n)) for n in lens.tolist()]


def test_token_count_formula_matches_hf_and_model_bridge():
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    from model_bridge.modeling.audio import audio_output_lengths

    frames = torch.arange(1, 3001)
    ours = audio_token_count(frames)
    assert torch.equal(ours, _get_feat_extract_output_lengths(frames))
    assert torch.equal(ours, audio_output_lengths(frames))
    assert [audio_token_count(f) for f in (1, 8, 9, 100, 101, 3000)] == [1, 1, 2, 13, 14, 390]
    assert np.array_equal(audio_token_count(np.arange(1, 300)), ours[:299].numpy())


def test_bad_inputs(processor):
    fe = processor.feature_extractor
    f, l = audio_features(fe, [])
    assert f.shape == (128, 0) and l.tolist() == []
    with pytest.raises(ValueError, match=rf"audio clip 1 has 160 samples; a clip needs at least {MIN_CLIP_SAMPLES}"):
        audio_features(fe, [np.zeros(1000, np.float32), np.zeros(160, np.float32)])
    with pytest.raises(ValueError, match=r"audio clip 0: expected a mono waveform \[N\], got shape \(2, 100\)"):
        audio_features(fe, [np.zeros((2, 100), np.float32)])
    # the shortest accepted clip works alone (1 frame... 2 frames after hop padding)
    f, l = audio_features(fe, [np.full(MIN_CLIP_SAMPLES, 0.1, np.float32)])
    assert l.tolist() == [2] and bool(torch.isfinite(f).all())
    json.dumps(l.tolist())
