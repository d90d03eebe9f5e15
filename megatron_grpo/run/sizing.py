"""Pre-flight sizing of the local vLLM server from the data, before any rank or server starts.

Every row's prompt length in tokens is computed as the rollout will see it: the tokenizer's chat
template on the row's messages and tools (each clip one ``<|audio_pad|>``), plus each clip's audio
tokens under the processor's rule (`megatron_grpo.data.features`: ceil(samples / hop) mel frames ->
13 tokens per 100 frames) from the clip's length in its header. From these:

- ``serve.max_model_len: auto`` becomes the longest prompt plus ``rollout.max_turns`` full turns of
  ``rollout.max_new_tokens`` (plus ``crop_max_seconds`` of audio per tool turn when set), rounded up
  to 256, at least 4096 (room for tool clips on short data) and capped by the model's positions; a tool turn that does not fit ends its conversation
  (finish_reason "context_length");
- ``serve.max_audio_seconds`` (unset) becomes the longest recording (at least vLLM's 600 s); the
  server's decode and clip-size limits follow it (`megatron_grpo.rollout.server.audio_limits_env`);
- a row whose prompt leaves no room to generate under the limit is refused, one line per row
  (file, line, tokens, the setting to change).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

VLLM_DEFAULT_AUDIO_S = 600
"""vLLM's own decode limit (``VLLM_MAX_AUDIO_DECODE_DURATION_S``)."""
MIN_MODEL_LEN = 4096
MP3_MARGIN_TOKENS = 13
"""A compressed file's header may misstate its length by a fraction of a second (mp3 frame padding,
resampling): one second of audio tokens of margin on each clip."""


class RowsDoNotFit(ValueError):
    """Rows whose prompt leaves no room to generate; the message has one line per row."""


@dataclass
class ServeSizing:
    max_model_len: int
    """The server's context length, tokens."""
    max_audio_seconds: float
    """Longest clip the server must decode."""
    longest_prompt: int
    """Tokens of the data's longest prompt."""


def model_positions(hf_dir: str) -> int:
    """The thinker's ``max_position_embeddings`` (from the checkpoint's config.json)."""
    import json
    from pathlib import Path

    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    text = cfg.get("thinker_config", cfg).get("text_config", cfg)
    return int(text["max_position_embeddings"])


def prompt_tokens(row, tokenizer, renderer, *, sample_rate: int, n_window: int) -> int:
    """Tokens of `row`'s prompt as the server expands it (module doc)."""
    from megatron_grpo.data.features import audio_token_count, num_frames
    from megatron_grpo.rollout.render import template_messages

    text = renderer.render(template_messages(row.messages), list(row.tools or []) or None, True)
    n = len(tokenizer.encode(text, add_special_tokens=False)) - len(row.audio_info)  # one pad per clip
    for info in row.audio_info:
        samples = math.ceil(info.frames * sample_rate / info.sample_rate) if info.sample_rate else 0
        n += int(audio_token_count(num_frames(samples), n_window)) + MP3_MARGIN_TOKENS
    return n


def size_server(cfg, rows) -> ServeSizing:
    """The server's sizes for `rows` (module doc); `RowsDoNotFit` listing every row that cannot
    fit, one line each."""
    from transformers import AutoTokenizer

    from megatron_grpo.rollout.render import ToolTurnRenderer
    from model_bridge.config import read_omni_config

    hf_dir = cfg.model.hf_dir
    spec = read_omni_config(hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(cfg.rollout.tokenizer or hf_dir)
    renderer = ToolTurnRenderer(tokenizer, cfg.rollout.chat_template_kwargs)
    cap = model_positions(hf_dir)
    r = cfg.rollout
    want = cfg.serve.max_model_len
    cut = ("cut the recording into shorter clips (or skip such rows: a lower data.max_audio_seconds with "
           "data.skip_bad_rows=true)")
    limit, setting, fix = (cap, f"the model's {cap} positions", cut) if want == "auto" else (
        int(want), f"serve.max_model_len={want}", f"raise serve.max_model_len (the model allows {cap}) or set it to auto")
    if r.max_total_tokens and r.max_total_tokens < limit:
        limit, setting = r.max_total_tokens, f"rollout.max_total_tokens={r.max_total_tokens}"
        fix = f"raise rollout.max_total_tokens (the model allows {cap}) or unset it"
    lengths, refused = [], []
    for row in rows:
        n = prompt_tokens(row, tokenizer, renderer, sample_rate=cfg.data.sample_rate, n_window=spec.audio.n_window)
        lengths.append(n)
        if n >= limit:
            audio = sum(i.duration for i in row.audio_info)
            refused.append(f"{row.where}: the prompt needs {n} tokens ({audio / 60:.1f} min of audio), no room "
                           f"to generate within {setting}: {fix}")
    if refused:
        raise RowsDoNotFit("\n".join(refused))
    longest = max(lengths, default=0)
    if want == "auto":
        room = r.max_turns * r.max_new_tokens
        if r.crop_max_seconds:
            room += (r.max_turns - 1) * math.ceil(r.crop_max_seconds * 13)
        size = min(cap, max(MIN_MODEL_LEN, 256 * math.ceil((longest + room) / 256)))
    else:
        size = int(want)
    seconds = max((i.duration for row in rows for i in row.audio_info), default=0.0)
    audio_s = cfg.serve.max_audio_seconds or max(float(VLLM_DEFAULT_AUDIO_S), float(math.ceil(seconds)))
    return ServeSizing(max_model_len=size, max_audio_seconds=audio_s, longest_prompt=longest)
