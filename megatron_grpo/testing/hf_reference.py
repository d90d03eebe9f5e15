"""transformers as the numerical reference: teacher-forced per-token logprobs of a Qwen3-Omni thinker.

Shapes: T = tokens of one sequence, V = vocab. Audio is given as 16 kHz float32 waveforms; the
checkpoint's own processor turns them into Whisper features, as vLLM does.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def load_hf_thinker(ckpt_dir: str | Path, dtype=torch.float32):
    """(thinker module, processor) of an HF Qwen3-Omni checkpoint, in eval mode."""
    from transformers import AutoProcessor, Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(ckpt_dir), dtype=dtype).eval()
    return model.thinker, AutoProcessor.from_pretrained(str(ckpt_dir))


@torch.no_grad()
def hf_logprobs_T(thinker, processor, ids: list[int], audios: list[np.ndarray] | None = None,
                  sampling_rate: int = 16000, *, per_clip: bool = False) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t = 1..T-1 under the HF thinker, as float32 [T-1].

    `audios` are the waveforms whose `<|audio_pad|>` runs appear in `ids`, in order. Features:
    one processor call over all clips (``per_clip=False``, what ``processor(text, audio=clips)``
    does), or each clip on its own with the trainer's rule (``per_clip=True``:
    ``megatron_grpo.data.features.audio_features``, which follows vLLM in the tool loop).
    """
    kw = {}
    if audios and per_clip:
        from megatron_grpo.data.features import audio_features

        feats_MF, lens_A = audio_features(processor.feature_extractor, list(audios))
        x_AMF = torch.zeros(len(lens_A), feats_MF.shape[0], int(lens_A.max()))
        mask_AF = torch.zeros(len(lens_A), int(lens_A.max()), dtype=torch.long)
        for a, (o, n) in enumerate(zip((torch.cumsum(lens_A, 0) - lens_A).tolist(), lens_A.tolist())):
            x_AMF[a, :, :n] = feats_MF[:, o:o + n]
            mask_AF[a, :n] = 1
        kw = {"input_features": x_AMF, "feature_attention_mask": mask_AF}
    elif audios:
        feats = processor.feature_extractor(list(audios), sampling_rate=sampling_rate,
                                            return_attention_mask=True, padding=True, return_tensors="pt")
        kw = {"input_features": feats["input_features"], "feature_attention_mask": feats["attention_mask"]}
    ids_1T = torch.tensor([ids])
    logits_TV = thinker(input_ids=ids_1T, attention_mask=torch.ones_like(ids_1T), **kw).logits[0].float()
    logp_TV = torch.log_softmax(logits_TV[:-1], dim=-1)
    return logp_TV.gather(1, ids_1T[0, 1:, None])[:, 0]
