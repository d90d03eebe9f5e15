"""Chat-template rendering: messages as the template sees them (`template_messages`), and the
template ids of a turn that follows an assistant message (`ToolTurnRenderer`).
"""
from __future__ import annotations

from typing import Optional

from megatron_grpo.rollout.state import RolloutConsistencyError

_SENTINEL_USER = "MGRPO_SENTINEL_USER"
_SENTINEL_ASSISTANT = "MGRPO_SENTINEL_ASSISTANT"


class ToolTurnRenderer:
    """Template text/ids of the turn after an assistant message, from the tokenizer's own chat
    template: render ``[user, assistant]`` and ``[user, assistant, *messages]`` (+ generation
    prompt), take the second's extra suffix, and prepend what the template puts after the
    assistant's content (``<|im_end|>\\n``) minus the stop token the policy already sampled.
    Rendering fixed sentinel messages keeps the earlier turns out of it: nothing already in the
    trajectory is re-rendered."""

    def __init__(self, tokenizer, chat_template_kwargs: Optional[dict] = None):
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})

    def render(self, messages: list, tools: Optional[list], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **self.kwargs)

    def text(self, messages: list, tools: Optional[list], last_token_text: Optional[str]) -> str:
        base = [{"role": "user", "content": _SENTINEL_USER},
                {"role": "assistant", "content": _SENTINEL_ASSISTANT}]
        t1 = self.render(base, tools, False)
        t2 = self.render(base + list(messages), tools, True)
        if not t2.startswith(t1) or _SENTINEL_ASSISTANT not in t1:
            raise RolloutConsistencyError(
                "the chat template renders an assistant turn differently once further messages "
                "follow it; tool-turn ids cannot be cut out of it (render with "
                f"add_generation_prompt=False:\n{t1[-300:]!r}\nwith the tool turn:\n{t2[:len(t1) + 50][-350:]!r})")
        close = t1[t1.rindex(_SENTINEL_ASSISTANT) + len(_SENTINEL_ASSISTANT):]
        if last_token_text and close.startswith(last_token_text):
            close = close[len(last_token_text):]
        return close + t2[len(t1):]


def template_messages(messages: list) -> list:
    """Messages for the chat template: audio parts of any form become ``{"type": "audio", ...}``
    (rendered as one ``<|audio_start|><|audio_pad|><|audio_end|>``); waveforms are not passed."""
    out = []
    for m in messages:
        m = dict(m)
        c = m.get("content")
        if isinstance(c, list):
            m["content"] = [{"type": "audio", "audio_index": p.get("audio_index", 0)}
                            if isinstance(p, dict) and p.get("type") in ("audio", "audio_url", "input_audio")
                            else p for p in c]
        out.append(m)
    return out

