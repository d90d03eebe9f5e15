"""``mgrpo convert check``: build the Megatron model from an HF checkpoint at a layout (spawning its
ranks: gloo on CPU, NCCL on GPU), run one chat sample (text + audio; a built-in one unless
``sample``), compare the logits with transformers' and report the max abs difference. With
``dump_logits`` the Megatron logits are saved as float32 ``[T, V]`` (vocab padding removed):
``.npy`` -> ``numpy.save``, anything else -> ``torch.save`` of a CPU tensor.

It lives beside the CLI rather than in ``model_bridge`` because it reads the chat data format
(``megatron_grpo.data``) and runs transformers as the reference.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from model_bridge.convert import DTYPES, ConvertError, _hf_input, _layout, _run

__all__ = ["check", "build_sample", "BUILTIN_SAMPLE"]

BUILTIN_SAMPLE = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant that listens to audio recordings."},
        {"role": "user", "content": "<audio>\nWhen does the beep occur? Answer as [MM:SS - MM:SS]."},
    ],
    "audios": ["<built-in: 2.3 s of noise with a 1 kHz beep>"],
}


def _builtin_waveform(sr: int = 16000):
    import numpy as np

    rng = np.random.RandomState(0)
    n = int(2.3 * sr)
    w = 0.05 * rng.randn(n).astype(np.float32)
    t = np.arange(int(0.4 * sr)) / sr
    start = int(1.2 * sr)
    w[start:start + len(t)] += 0.5 * np.sin(2 * np.pi * 1000 * t).astype(np.float32)
    return w


def _hf_messages(messages: list[dict], n_audios: int, where: str) -> list[dict]:
    """Data-format messages (string contents, ``<audio>`` tags in user turns) -> HF content parts."""
    from megatron_grpo.data.schema import AUDIO_TAG

    out, used = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content", ""), str):
            raise ConvertError(f"{where}: messages[{i}] must be an object with a 'role' and a string 'content'")
        text = m.get("content") or ""
        parts = []
        pieces = text.split(AUDIO_TAG)
        if len(pieces) > 1 and m["role"] != "user":
            raise ConvertError(f"{where}: messages[{i}] ({m['role']}) holds {AUDIO_TAG}; only user turns may")
        for j, piece in enumerate(pieces):
            if j:
                parts.append({"type": "audio"})
                used += 1
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({"role": m["role"], "content": parts or [{"type": "text", "text": ""}]})
    if used != n_audios:
        raise ConvertError(f"{where}: the messages hold {used} {AUDIO_TAG} tag(s) but 'audios' lists {n_audios} file(s)")
    return out


def build_sample(hf_dir, sample: Optional[str] = None) -> dict:
    """Tokenise one chat sample with the checkpoint's processor.

    Returns ``{"ids": [T], "features": [mel, F] or None, "feature_lens": [n] or None,
    "hf_inputs": {...transformers thinker kwargs...}, "text": str, "audios": [names]}``.
    """
    import torch
    from transformers import AutoProcessor

    if sample is None:
        spec_sample, where, base = BUILTIN_SAMPLE, "built-in sample", None
        waves = [_builtin_waveform()]
    else:
        p = Path(sample)
        if not p.is_file():
            raise ConvertError(f"--sample {p} does not exist")
        try:
            spec_sample = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConvertError(f"--sample {p} is not valid JSON ({e})") from e
        if not isinstance(spec_sample, dict) or not isinstance(spec_sample.get("messages"), list):
            raise ConvertError(f"--sample {p}: expected {{\"messages\": [...], \"audios\": [paths]}}")
        where, base = str(p), p.parent
        from megatron_grpo.data.audio import load_audio

        audios = spec_sample.get("audios") or []
        if not isinstance(audios, list):
            raise ConvertError(f"--sample {p}: 'audios' must be a list of paths")
        waves = [load_audio(a if Path(a).is_absolute() else base / a) for a in audios]
    conv = _hf_messages(spec_sample["messages"], len(waves), where)
    tools = spec_sample.get("tools")
    if isinstance(tools, str):
        tools = json.loads(tools)
    processor = AutoProcessor.from_pretrained(str(hf_dir))
    kw = {"tools": tools} if tools else {}
    text = processor.apply_chat_template(conv, add_generation_prompt=True, tokenize=False, **kw)
    inputs = processor(text=[text], audio=waves or None, return_tensors="pt", padding=True)
    ids = inputs["input_ids"][0].tolist()
    out = {"ids": ids, "features": None, "feature_lens": None, "text": text,
           "audios": list(spec_sample.get("audios") or []),
           "hf_inputs": {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}}
    if waves:
        feats, mask = inputs["input_features"], inputs["feature_attention_mask"]
        lens = mask.sum(-1).to(torch.long)
        out["features"] = torch.cat([feats[i, :, :int(n)] for i, n in enumerate(lens.tolist())], dim=1).float()
        out["feature_lens"] = lens
        out["hf_inputs"].update(input_features=feats, feature_attention_mask=mask)
    return out


def rank_check(hf_dir: str, tp: int, ep: int, etp: Optional[int], pp: int, dtype: str, ids, features,
               feature_lens):
    """One rank of ``convert check``: build at the layout, load_hf, forward; logits on one rank."""
    import torch

    from megatron_grpo.notices import quiet_known_notices
    from model_bridge.checkpoint import forward_logits
    from model_bridge.config import ParallelLayout, read_omni_config
    from model_bridge.load import load_hf
    from model_bridge.modeling import build_thinker
    from model_bridge.parallel import destroy_parallel, init_parallel

    quiet_known_notices()  # a spawned rank does not inherit the CLI's warning filters
    init_parallel(tp=tp, ep=ep, etp=etp, pp=pp)
    try:
        spec = read_omni_config(hf_dir)
        t0 = time.perf_counter()
        model = build_thinker(spec, ParallelLayout(tp=tp, ep=ep, etp=etp, pp=pp), getattr(torch, dtype)).eval()
        if torch.cuda.is_available():
            model.cuda()
        load_hf(model, hf_dir)
        t1 = time.perf_counter()
        logits = forward_logits(model, spec, ids, features, feature_lens)
        return {"logits": logits, "load_s": t1 - t0, "forward_s": time.perf_counter() - t1}
    finally:
        destroy_parallel()


def hf_reference_logits(hf_dir, hf_inputs: dict, dtype: str = "float32"):
    """transformers' thinker logits [T, V] (float32, CPU) for the processor's inputs."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(hf_dir), dtype=getattr(torch, dtype))
    thinker = model.thinker.to(dev).eval()
    with torch.no_grad():
        kw = {k: v.to(dev) for k, v in hf_inputs.items()}
        if "input_features" in kw:
            kw["input_features"] = kw["input_features"].to(getattr(torch, dtype))
        logits = thinker(**kw).logits[0].float().cpu()
    del model, thinker
    return logits


def check(hf, *, tp: int = 1, ep: int = 1, etp: Optional[int] = None, pp: int = 1, nproc: Optional[int] = None,
          sample: Optional[str] = None, dump_logits: Optional[str] = None, dtype: str = "float32") -> dict:
    """Megatron (at a layout) vs transformers logits on one chat sample. Returns
    {max_abs_diff, tokens, vocab, argmax_agreement, ...}; saves the Megatron logits when asked."""
    import torch

    spec, reader = _hf_input(hf)
    del reader
    if dtype not in DTYPES:
        raise ConvertError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    layout, world = _layout(spec, tp, ep, etp, pp, nproc)
    cuda = torch.cuda.is_available()
    if cuda and torch.cuda.device_count() < world:
        raise ConvertError(f"the layout needs {world} ranks (one GPU each) but {torch.cuda.device_count()} GPU(s) "
                           "are visible")
    if dump_logits:
        dp = Path(dump_logits)
        if not dp.parent.exists():
            raise ConvertError(f"--dump-logits {dp}: directory {dp.parent} does not exist")
    s = build_sample(hf, sample)
    t0 = time.perf_counter()
    results = _run(rank_check, world, str(Path(hf).resolve()), tp, ep, etp, pp, dtype, s["ids"], s["features"],
                   s["feature_lens"], cpu_only=False)
    mcore_s = time.perf_counter() - t0
    ours = next(r["logits"] for r in results if r["logits"] is not None)
    t1 = time.perf_counter()
    theirs = hf_reference_logits(hf, s["hf_inputs"], dtype)
    if tuple(ours.shape) != tuple(theirs.shape):
        raise ConvertError(f"logits shapes differ: megatron {list(ours.shape)}, transformers {list(theirs.shape)}")
    diff = (ours - theirs).abs()
    out = {"max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(),
           "argmax_agreement": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
           "tokens": ours.shape[0], "vocab": ours.shape[1], "audio_clips": len(s["audios"]),
           "audio_tokens": int(sum(1 for i in s["ids"] if i == spec.audio_token_id)),
           "layout": {"tp": tp, "ep": ep, "etp": layout.expert_tp, "pp": pp, "sp": layout.sequence_parallel},
           "world_size": world, "backend": "nccl" if cuda else "gloo", "dtype": dtype,
           "megatron_s": mcore_s, "transformers_s": time.perf_counter() - t1}
    if dump_logits:
        path = Path(dump_logits)
        if path.suffix == ".npy":
            import numpy as np

            np.save(path, ours.numpy().astype(np.float32))
        else:
            torch.save(ours.contiguous(), path)
        out["dumped"] = str(path)
    return out
