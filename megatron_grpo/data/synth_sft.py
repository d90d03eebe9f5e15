"""Synthetic expert trajectories for `mgrpo make-data --sft`: from a row's known event, the
conversation an expert audio agent would have with the ``crop_audio`` tool.

Per row (docs/sft.md shows one)::

    assistant: <think> what is asked, where to look </think> <tool_call> crop_audio(a, b) </tool_call>
    tool:      the tool's own text for that crop, then the clip (``clips: [[a, b]]``)
    assistant: <think> where the event lies in the clip </think> [MM:SS - MM:SS]   (the ground truth)

The crop covers the event with a random margin of 1-4 s on each side and stays inside the
recording (no clamping note in the tool text), so its text is exactly what the rollout's
``crop_audio`` answers for the same call.
"""
from __future__ import annotations

import json
import math

import numpy as np

from megatron_grpo.data.audio_events import SR, Event
from megatron_grpo.data.schema import format_span

__all__ = ["expert_messages"]


def _call(start: float, end: float) -> str:
    args = json.dumps({"name": "crop_audio", "arguments": {"start_sec": start, "end_sec": end}})
    return f"<tool_call>\n{args}\n</tool_call>"


def expert_messages(rng: np.random.Generator, target: Event, audio: np.ndarray) -> list[dict]:
    """The assistant, tool and assistant messages that follow the row's question."""
    from megatron_grpo.rollout.tools import ToolContext, crop_audio

    total = len(audio) / SR
    a = max(0.0, math.floor(target.start_sec - rng.uniform(1.0, 4.0)))
    b = min(math.floor(total * 10) / 10 - 0.1, math.ceil(target.end_sec + rng.uniform(1.0, 4.0)))
    a, b = float(a), round(float(max(b, a + 1.0)), 1)
    res = crop_audio(a, b, ctx=ToolContext(audios=[audio], sample_rate=SR))
    span = format_span(target.start_sec, target.end_sec)
    s0, s1 = math.floor(target.start_sec), math.ceil(target.end_sec)
    think1 = (f"The question asks when {target.label} occurs in a recording of {total:.0f} seconds. "
              f"I will crop the part from {a:g} to {b:g} seconds and listen to it closely.")
    think2 = (f"The clip from {a:g} to {b:g} seconds holds {target.label}. It starts at about {s0} "
              f"seconds and ends at about {s1} seconds of the recording, so the answer is {span}.")
    return [
        {"role": "assistant", "content": f"<think>\n{think1}\n</think>\n\n{_call(a, b)}"},
        {"role": "tool", "name": "crop_audio", "content": res.text + "<audio>", "clips": [[a, b]]},
        {"role": "assistant", "content": f"<think>\n{think2}\n</think>\n\n{span}"},
    ]
