"""The audio-agent plugin: listen, crop (at most twice), answer ``[MM:SS - MM:SS]``.

Use it with ``rollout.plugin: examples/plugins/audio_agent.py`` (or ``--plugin``) and

    rollout:
      policy: audio_agent
      reward_funcs: [audio_format, audio_iou, think_quality]
      reward_weights: [0.5, 1.0, 0.2]
      max_turns: 3            # two crops + the answer

What it registers (docs/rollout.md, "Plugin API"):

* tool ``crop_audio(start_sec, end_sec)``: the built-in crop (seconds validated and clamped to the
  recording, file access confined to the dataset's audio roots, the clip kept in memory) with the
  exact schema the data's ``tools`` column shows the model;
* policy ``audio_agent``: hermes tool calls, at most 2 per conversation; the conversation ends
  as soon as a turn answers with a ``[MM:SS - MM:SS]`` span (outside any tool call);
* rewards ``audio_format`` (think block + span: 1/0), ``audio_iou`` (tiered IoU: 2.0 > 0.8,
  1.0 > 0.4, 0.5 > 0.1, else 0) and ``think_quality`` (think length and repetition, in [0, 1]).
"""
from __future__ import annotations

from megatron_grpo.data.synth import CROP_AUDIO_TOOL
from megatron_grpo.rollout import rewards as R
from megatron_grpo.rollout import tools as T
from megatron_grpo.rollout.plugins import HermesToolPolicy, policy, reward, tool

MAX_TOOL_CALLS = 2


@tool(name="crop_audio", description=CROP_AUDIO_TOOL["function"]["description"],
      parameters=CROP_AUDIO_TOOL["function"]["parameters"], timeout_s=30)
def crop_audio(start_sec: float, end_sec: float, *, ctx):
    """Cut [start_sec, end_sec) out of the conversation's recording; returns text + the clip."""
    return T.crop_audio(start_sec, end_sec, ctx=ctx)


def _answer_span(text: str):
    """The last span of the turn's answer part (after </think>, tool calls removed), or None."""
    answer = T.TOOL_CALL_RE.sub("", R.extract_answer(text))
    spans = R.find_spans(answer)
    return spans[-1] if spans else None


@policy
class AudioAgentPolicy(HermesToolPolicy):
    """Tool calls until an answer span appears; at most MAX_TOOL_CALLS calls per conversation."""

    name = "audio_agent"

    def is_finished(self, state) -> bool:
        r = state.last_response
        calls = T.parse_tool_calls(r.text)
        if not calls and _answer_span(r.text) is not None:
            state.finish_reason = "answer"
            return True
        if r.finish_reason == "length":
            state.finish_reason = "length"
            return True
        if not calls:
            state.finish_reason = "no_answer"
            return True
        if state.num_tool_calls >= MAX_TOOL_CALLS:
            state.finish_reason = "tool_limit"
            return True
        return False

    async def step(self, state, response):
        calls = T.parse_tool_calls(response.text)[:MAX_TOOL_CALLS - state.num_tool_calls]
        return await self.run_tool_calls(state, calls)


@reward("audio_format")
def audio_format(completions, **kwargs):
    """1.0 for <think>...</think> followed by an answer holding [MM:SS - MM:SS]; else 0.0."""
    return R.format_reward(completions)


_iou = R.make_iou_reward(tiers=((0.8, 2.0), (0.4, 1.0), (0.1, 0.5)))


@reward("audio_iou")
def audio_iou(completions, ground_truth=None, **kwargs):
    """Tiered IoU of the answer's span with ground_truth: 2.0 / 1.0 / 0.5 / 0.0."""
    return _iou(completions, ground_truth=ground_truth)


_think = R.make_think_length_reward(min_words=15, max_words=300, ngram=3, max_repeat=0.3)


@reward("think_quality")
def think_quality(completions, **kwargs):
    """Think block of 15-300 words without heavy n-gram repetition: up to 1.0."""
    return _think(completions)
