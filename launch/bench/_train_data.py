"""``mgrpo bench train``'s inputs: the checkpoint (full width with N layers, or the tiny preset) and
synthetic multi-turn audio-agent trajectories with real 16 kHz waveforms.

A trajectory, as the rollout engine records one (token ids, loss mask, rollout logprobs, clips):

* prompt: 24-64 text tokens, ``<audio_start>``, the recording's audio tokens, ``<audio_end>``,
  8-16 text tokens;
* 1-3 tool turns: the assistant's ``crop_audio`` call (16-48 generated tokens, loss mask 1), then
  the tool's reply (8-16 template tokens around ``<audio_start>``, the clip's audio tokens,
  ``<audio_end>``);
* the answer: 12-32 generated tokens.

Recordings last ``record_s`` (default 10 s to 5 min, uniform), tool clips ``crop_s`` (5-30 s), as the
issue's audio agent sees them. The ``group_size`` samples of a prompt share its recording (one array
object, as the rollout hands a prompt's generations the same clip); each has its own crops. A group
whose samples would exceed the micro-batch budget gets a shorter recording (the packer refuses
samples over the budget, as ``mgrpo train`` does by default).
Audio-token counts follow vLLM's rule (``data.features``: frames ``ceil(N / 160)``, 13 tokens per
100 frames). Waveforms are band-limited noise (float32, 16 kHz) featurised by the checkpoint's real
Whisper feature extractor in the bench. Token ids are random below the first special id; rewards
random per sample, advantages normalised per group of ``group_size`` samples (GRPO).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

__all__ = ["synth_trajectories", "prepare_checkpoint", "FULL_RANGES", "TINY_RANGES"]

SR = 16000
FULL_RANGES = {"record_s": (10.0, 300.0), "crop_s": (5.0, 30.0)}
"""Clip lengths in seconds (uniform) of the full-width run: a 10 s - 5 min recording, 5-30 s crops."""
TINY_RANGES = {"record_s": (1.0, 4.0), "crop_s": (0.5, 1.5)}
"""Short clips for the tiny CPU run (seconds, not minutes)."""


def _noise(rng: np.random.Generator, seconds: float) -> np.ndarray:
    n = max(int(seconds * SR), 2 * 160 + 1)
    x = rng.standard_normal(n).astype(np.float32)
    return (0.05 * np.convolve(x, np.ones(8, np.float32) / 8, mode="same")).astype(np.float32)  # low-passed


def _text(rng, lo: int, hi: int, vocab_hi: int) -> list[int]:
    return rng.integers(0, vocab_hi, size=int(rng.integers(lo, hi + 1))).tolist()


def synth_trajectories(n: int, spec, *, max_tokens: int, seed: int = 0, group_size: int = 8,
                       ranges: dict | None = None, n_window: int = 50) -> list:
    """``n`` :class:`~megatron_grpo.trajectory.Trajectory` objects (module doc) for the checkpoint's
    ``spec`` (``OmniSpec``: token ids, vocab), each at most ``max_tokens`` tokens."""
    from megatron_grpo.data.features import audio_token_count, num_frames
    from megatron_grpo.trajectory import Trajectory, token_arrays

    ranges = ranges or FULL_RANGES
    rng = np.random.default_rng(seed)
    a_id, a_start, a_end = spec.audio_token_id, spec.audio_start_token_id, spec.audio_end_token_id
    vocab_hi = min(a_id, a_start, a_end, spec.image_token_id, spec.video_token_id, spec.vision_start_token_id,
                   spec.text.vocab_size) - 8

    def n_audio(wave) -> int:
        return int(audio_token_count(num_frames(len(wave)), n_window))

    plans = []  # per sample: its tool turns, crops and text; the recording is its group's
    for i in range(n):
        crops = [_noise(rng, rng.uniform(*ranges["crop_s"])) for _ in range(int(rng.integers(1, 4)))]
        turns = [(_text(rng, 16, 48, vocab_hi), _text(rng, 4, 8, vocab_hi), _text(rng, 4, 8, vocab_hi))
                 for _ in crops]
        pre, post, answer = _text(rng, 24, 64, vocab_hi), _text(rng, 8, 16, vocab_hi), _text(rng, 12, 32, vocab_hi)
        fixed = len(pre) + len(post) + len(answer) + 2 + sum(len(a) + len(b) + len(c) + 2 + n_audio(w)
                                                            for (a, b, c), w in zip(turns, crops))
        room_s = (max_tokens - fixed) / 13.0 - 0.2  # 13 audio tokens per second of audio
        if room_s < ranges["crop_s"][0]:
            raise ValueError(f"--mb-tokens {max_tokens} leaves no room for a recording (the turns take {fixed} "
                             "tokens); raise it")
        plans.append((crops, turns, pre, post, answer, room_s))
    records = []  # one recording object per group, as the rollout gives a prompt's generations
    for g in range(0, n, group_size):
        room_s = min(p[-1] for p in plans[g:g + group_size])
        records += [_noise(rng, min(rng.uniform(*ranges["record_s"]), room_s))] * len(plans[g:g + group_size])
    out = []
    for i, ((crops, turns, pre, post, answer, _), record) in enumerate(zip(plans, records)):
        ids, mask, lp = [], [], []

        def add(tokens, generated=False):
            ids.extend(tokens)
            mask.extend([int(generated)] * len(tokens))
            lp.extend((-np.abs(rng.normal(0.0, 1.0, len(tokens)))).tolist() if generated else [0.0] * len(tokens))

        counts = [n_audio(record)]
        add(pre)
        add([a_start] + [a_id] * counts[0] + [a_end])
        add(post)
        for (call, head, tail), clip in zip(turns, crops):
            add(call, generated=True)
            counts.append(n_audio(clip))
            add(head)
            add([a_start] + [a_id] * counts[-1] + [a_end])
            add(tail)
        add(answer, generated=True)
        if len(ids) > max_tokens:  # pragma: no cover - the recording was sized to fit
            raise AssertionError(f"sample {i}: {len(ids)} tokens > {max_tokens}")
        ids, mask, lp = token_arrays(ids, mask, lp)  # as the rollout hands them
        out.append(Trajectory(prompt_index=i // group_size, group_id=i // group_size, input_ids_T=ids,
                              loss_mask_T=mask, rollout_logprobs_T=lp, audios=[record, *crops],
                              audio_token_counts=counts, num_turns=len(crops) + 1, finish_reason="answer",
                              reward=float(rng.uniform())))
    for g in range(0, n, group_size):  # GRPO advantages: rewards normalised within each group
        grp = out[g:g + group_size]
        r = np.array([t.reward for t in grp])
        for t in grp:
            t.advantage = float((t.reward - r.mean()) / (r.std() + 1e-6))
    return out


def prepare_checkpoint(work: Path, *, tiny: bool, layers: int, audio_layers: int, seed: int = 0) -> Path:
    """The checkpoint the bench trains: ``make_tiny`` (``tiny``) or ``bench convert``'s full-width
    generator with ``layers`` decoder and ``audio_layers`` audio-tower layers (random bf16 weights),
    plus the release's ``preprocessor_config.json`` (Whisper features: 128 mel, hop 160). Reused
    when ``work`` already holds one with the same geometry."""
    from model_bridge.tiny.tokenizer import processor_files

    key = f"tiny-s{seed}" if tiny else f"l{layers}-a{audio_layers}-s{seed}"
    ckpt = work / f"ckpt-{key}"
    if (ckpt / ".complete").exists():
        return ckpt
    if tiny:
        from model_bridge.tiny import make_tiny

        make_tiny(ckpt, seed=seed)
    else:
        from launch.bench.convert import write_checkpoint

        write_checkpoint(ckpt, layers=layers, audio_layers=audio_layers, seed=seed, progress=False)
        for name, obj in processor_files().items():
            if name == "preprocessor_config.json":
                (ckpt / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    (ckpt / ".complete").write_text("ok\n")
    return ckpt
