"""Mel features of a sample's audio clips, exactly as the audio tower receives them, and the number
of audio tokens each clip becomes.

Shapes: ``M`` mel bins (128), ``A`` clips, ``F_a`` valid mel frames of clip ``a``,
``F = sum F_a``.

What transformers does (``Qwen3OmniMoeProcessor`` + ``get_audio_features``): the
``WhisperFeatureExtractor`` pads the batch of clips with zeros to the longest
(``padding=True, truncation=False, return_attention_mask=True``), computes a log-mel spectrogram
per padded row ``[A, M, F_max]`` and a frame mask ``[A, F_max]``; the model then keeps the masked
frames of every clip and concatenates them: ``input_features.permute(0, 2, 1)[mask].permute(1, 0)``
-> ``[M, F]``, ``feature_lens = mask.sum(-1)``.

What vLLM does on top (``Qwen3OmniMoeThinkerMultiModalProcessor``), and what the trainer must
match because the rollout's token ids come from vLLM: every clip is first zero-padded to a
multiple of the hop length (160 samples), and its frame count is ``len(padded) // 160``, i.e.
``ceil(N / 160)`` for a clip of N samples.  (Plain transformers gives ``N // 160`` frames to a clip
that is the longest of its batch and not a multiple of 160, ``ceil(N / 160)`` to the others; the
two can differ by one audio token.)  ``pad_to_hop=True`` (default) follows vLLM.

Batching.  The log-mel of a clip's last frame depends on what follows the clip in the padded row:
zeros when a longer clip shares the call, the STFT's reflect padding when the clip is the longest.
vLLM featurises the clips that are new to its multimodal cache in one call; in the multi-turn tool
loop that is one clip per request (the prompt's clip first, then each tool clip, earlier ones being
cache hits), so ``per_clip=True`` (default: each clip featurised on its own) reproduces vLLM there
and makes a clip's features independent of its neighbours.  ``per_clip=False`` featurises all clips
in one call, exactly like ``processor(text, audio=clips)``.  Only the last mel frame of a clip can
differ between the two.

Token counts: ``audio_token_count(F_a)`` is HF's ``_get_feat_extract_output_lengths`` (13 tokens
per full 100-frame chunk plus the three stride-2 convolutions' output length of the remainder),
the same formula as ``model_bridge.modeling.audio.audio_output_lengths``; it is restated here so
the data layer does not import megatron (tests check all three agree).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

__all__ = ["HOP_LENGTH", "MIN_CLIP_SAMPLES", "num_frames", "audio_token_count",
           "audio_token_counts", "audio_features"]

HOP_LENGTH = 160
"""Samples per mel frame of Qwen3-Omni's Whisper feature extractor (10 ms at 16 kHz)."""
N_WINDOW = 50
"""The audio tower's ``n_window``: a chunk is ``2 * n_window`` = 100 frames -> 13 tokens."""
MIN_CLIP_SAMPLES = HOP_LENGTH + 1
"""A clip of <= 160 samples cannot be featurised on its own (the STFT's reflect padding of
n_fft // 2 = 200 samples needs a longer signal); vLLM fails on it too."""


def num_frames(num_samples, hop_length: int = HOP_LENGTH, *, pad_to_hop: bool = True):
    """Mel frames the audio tower gets for a clip of ``num_samples`` featurised on its own:
    ``ceil(N / hop)`` with vLLM's padding to the hop (default), ``N // hop`` without it.
    Works on ints and numpy/torch integer arrays."""
    if pad_to_hop:
        return (num_samples + hop_length - 1) // hop_length
    return num_samples // hop_length


def audio_token_count(num_frames, n_window: int = N_WINDOW):
    """Audio tokens (``<|audio_pad|>`` placeholders) a clip of ``num_frames`` mel frames becomes:
    13 per full ``2 * n_window``-frame chunk plus ``conv3(conv2(conv1(rest)))`` for the rest, each
    conv ``(L - 1) // 2 + 1``.  Works on ints and numpy/torch integer arrays."""
    chunk = 2 * n_window
    rest = num_frames % chunk
    feat = (rest - 1) // 2 + 1
    return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (num_frames // chunk) * 13


def audio_token_counts(waveforms: Sequence[np.ndarray], hop_length: int = HOP_LENGTH,
                       n_window: int = N_WINDOW, *, pad_to_hop: bool = True) -> list[int]:
    """Audio tokens of each waveform (vLLM's rule by default); no features are computed."""
    return [int(audio_token_count(num_frames(len(w), hop_length, pad_to_hop=pad_to_hop), n_window))
            for w in waveforms]


def _prepare(waveforms: Sequence[np.ndarray], hop: int, pad_to_hop: bool) -> list[np.ndarray]:
    out = []
    for i, w in enumerate(waveforms):
        w = np.asarray(w, dtype=np.float32)
        if w.ndim != 1:
            raise ValueError(f"audio clip {i}: expected a mono waveform [N], got shape {tuple(w.shape)}")
        if len(w) < MIN_CLIP_SAMPLES:
            raise ValueError(f"audio clip {i} has {len(w)} samples; a clip needs at least "
                             f"{MIN_CLIP_SAMPLES} ({MIN_CLIP_SAMPLES / 16000 * 1000:.0f} ms at 16 kHz) "
                             "to be featurised")
        if pad_to_hop and len(w) % hop:
            w = np.pad(w, (0, hop - len(w) % hop))
        out.append(w)
    return out


def _extract(feature_extractor, clips: list[np.ndarray], pad_to_hop: bool, hop: int):
    """One feature-extractor call -> list of [M, F_a] float32 tensors (valid frames only)."""
    fe = feature_extractor(clips, sampling_rate=feature_extractor.sampling_rate, padding=True,
                           truncation=False, return_attention_mask=True, return_tensors="pt")
    feats, mask = fe["input_features"], fe["attention_mask"]             # [A, M, F_max], [A, F_max]
    out = []
    for a, w in enumerate(clips):
        n = len(w) // hop if pad_to_hop else int(mask[a].sum())            # vLLM overrides the mask
        if pad_to_hop and int(mask[a].sum()) < n:
            raise AssertionError(f"clip {a}: feature extractor gave {int(mask[a].sum())} frames, "
                                 f"expected {n}")
        out.append(feats[a, :, :n])
    return out


def audio_features(feature_extractor, waveforms: Sequence[np.ndarray], *, per_clip: bool = True,
                   pad_to_hop: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Features of A clips for the audio tower.

    ``feature_extractor``: the checkpoint's ``WhisperFeatureExtractor``
    (``AutoProcessor.from_pretrained(ckpt).feature_extractor`` or
    ``AutoFeatureExtractor.from_pretrained(ckpt)``).  ``waveforms``: float32 mono clips at its
    sampling rate (16 kHz), in order of appearance in the conversation.

    Returns ``(features [M, F] float32, feature_lens [A] long)``: the valid frames of each clip
    concatenated along time, and each clip's frame count.  ``per_clip`` / ``pad_to_hop``: see the
    module docstring (defaults reproduce vLLM in the tool loop).
    """
    hop = int(getattr(feature_extractor, "hop_length", HOP_LENGTH))
    n_mels = int(getattr(feature_extractor, "feature_size", 128))
    if len(waveforms) == 0:
        return torch.zeros(n_mels, 0, dtype=torch.float32), torch.zeros(0, dtype=torch.long)
    clips = _prepare(waveforms, hop, pad_to_hop)
    if per_clip:
        parts = [p for w in clips for p in _extract(feature_extractor, [w], pad_to_hop, hop)]
    else:
        parts = _extract(feature_extractor, clips, pad_to_hop, hop)
    lens = torch.tensor([p.shape[1] for p in parts], dtype=torch.long)
    return torch.cat(parts, dim=1).to(torch.float32).contiguous(), lens
