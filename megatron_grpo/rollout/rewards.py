"""Built-in reward functions and the code that applies reward functions to trajectories.

Signature (ms-swift / TRL): ``fn(completions: list[str], **columns) -> list[float]``, sync or
async.  ``completions[i]`` is the text of sample i's LAST generated turn (the answer); the keyword
arguments are the dataset's extra columns as lists aligned with ``completions`` (``ground_truth``,
``id``, ...; None where a row lacks the column), plus ``completion_texts`` (every generated turn of
each sample), ``finish_reasons``, ``num_turns`` and ``trajectories`` (the `Trajectory` objects).
A function takes what it needs and must accept ``**kwargs`` for the rest.  A returned None counts
as 0 (TRL's "not applicable").

Built-ins (see each docstring for the exact rule):

* ``format``: 1.0 when the answer is ``<think>...</think>`` (non-empty) followed by text that holds
  a ``[MM:SS - MM:SS]`` span and no further ``<think>`` or ``<tool_call>``; else 0.0.
* ``iou``: tiered time-span IoU against ``ground_truth``: 2.0 if IoU > 0.8, 1.0 if > 0.4, 0.5 if
  > 0.1, else 0.0 (`make_iou_reward` builds other tiers).
* ``iou_raw``: the IoU itself, in [0, 1].
* ``think_length``: length and repetition of the think block (`think_length_reward`).
* ``tool_call``: 1.0 when a turn before the answer made a well-formed ``crop_audio`` call
  (`tool_call_reward`); keeps an agent calling its tool while the other rewards score the answer.
"""
from __future__ import annotations

import asyncio
import inspect
import math
import re
from typing import Callable, Optional, Sequence

from megatron_grpo.data.schema import SPAN_PATTERN
from megatron_grpo.rollout.tools import parse_tool_calls

__all__ = ["span_iou", "extract_answer", "extract_think", "find_spans", "format_reward",
           "make_iou_reward", "iou_reward", "iou_raw_reward", "think_length_reward",
           "make_think_length_reward", "repetition_ratio", "tool_call_reward", "BUILTIN_REWARDS", "DEFAULT_IOU_TIERS",
           "compute_rewards", "check_reward_fn", "RewardError"]

DEFAULT_IOU_TIERS = ((0.8, 2.0), (0.4, 1.0), (0.1, 0.5))
"""(threshold, reward): the first tier whose threshold the IoU exceeds (strictly) gives the reward."""

_SPAN_RE = re.compile(SPAN_PATTERN)
_THINK_RE = re.compile(r"^\s*<think>(.*?)</think>(.*)$", re.DOTALL)


class RewardError(ValueError):
    """A reward function is misdefined or returned something unusable; the message names it."""


# ---------------------------------------------------------------------------------------------
# Text helpers
# ---------------------------------------------------------------------------------------------

def find_spans(text: str) -> list[tuple[float, float]]:
    """Every well-formed ``[MM:SS - MM:SS]`` in ``text`` as (start_sec, end_sec), in order (spans
    that end before they start are skipped)."""
    out = []
    for m in _SPAN_RE.finditer(text or ""):
        s = int(m.group(1)) * 60 + float(m.group(2))
        e = int(m.group(3)) * 60 + float(m.group(4))
        if e >= s:
            out.append((s, e))
    return out


def extract_think(text: str) -> Optional[str]:
    """The content of a leading ``<think>...</think>`` block, or None when there is none."""
    m = _THINK_RE.match(text or "")
    return m.group(1) if m else None


def extract_answer(text: str) -> str:
    """The text after a leading think block (the whole text when there is none)."""
    m = _THINK_RE.match(text or "")
    return m.group(2) if m else (text or "")


def span_iou(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Intersection over union of two time spans; two identical zero-length spans give 1.0."""
    (s1, e1), (s2, e2) = a, b
    inter = max(0.0, min(e1, e2) - max(s1, s2))
    union = max(e1, e2) - min(s1, s2)
    if union <= 0:
        return 1.0 if (s1, e1) == (s2, e2) else 0.0
    return inter / union


def repetition_ratio(text: str, n: int = 3) -> float:
    """Share of repeated word n-grams: ``1 - unique / total`` (0 for fewer than n words)."""
    words = (text or "").split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


# ---------------------------------------------------------------------------------------------
# Built-in rewards
# ---------------------------------------------------------------------------------------------

def format_reward(completions: list[str], **kwargs) -> list[float]:
    """1.0 for ``<think>THINK</think>ANSWER`` with THINK not blank, a ``[MM:SS - MM:SS]`` span in
    ANSWER, and no ``<think>``/``</think>``/``<tool_call>`` in ANSWER; else 0.0."""
    out = []
    for c in completions:
        m = _THINK_RE.match(c or "")
        ok = bool(m) and bool(m.group(1).strip())
        if ok:
            ans = m.group(2)
            ok = bool(find_spans(ans)) and not any(t in ans for t in ("<think>", "</think>", "<tool_call>"))
        out.append(1.0 if ok else 0.0)
    return out


def _predicted_span(completion: str) -> Optional[tuple[float, float]]:
    spans = find_spans(extract_answer(completion))
    return spans[-1] if spans else None


def _gt_span(gt) -> Optional[tuple[float, float]]:
    if gt is None:
        return None
    if isinstance(gt, (list, tuple)) and len(gt) == 2:
        return float(gt[0]), float(gt[1])
    spans = find_spans(str(gt))
    return spans[0] if spans else None


def _ious(completions: Sequence[str], ground_truth) -> list[Optional[float]]:
    if ground_truth is None:
        raise RewardError("the IoU reward needs a 'ground_truth' column ('[MM:SS - MM:SS]') in the data")
    if len(ground_truth) != len(completions):
        raise RewardError(f"ground_truth has {len(ground_truth)} entries for {len(completions)} completions")
    out = []
    for c, gt in zip(completions, ground_truth):
        g = _gt_span(gt)
        p = _predicted_span(c)
        out.append(None if g is None else (0.0 if p is None else span_iou(p, g)))
    return out


def make_iou_reward(tiers: Sequence[tuple[float, float]] = DEFAULT_IOU_TIERS) -> Callable:
    """A reward: the first ``(threshold, value)`` of ``tiers`` (sorted by threshold, highest first)
    whose threshold the IoU of the answer's last span with ``ground_truth`` exceeds gives ``value``;
    no tier, or no span in the answer, gives 0.0; a row without ground truth gives None."""
    tiers = sorted(((float(t), float(v)) for t, v in tiers), key=lambda tv: -tv[0])
    for t, v in tiers:
        if not (0.0 <= t < 1.0) or not math.isfinite(v):
            raise RewardError(f"IoU tier ({t}, {v}): the threshold must be in [0, 1) and the value finite")

    def iou_reward(completions: list[str], ground_truth=None, **kwargs) -> list[Optional[float]]:
        out = []
        for iou in _ious(completions, ground_truth):
            if iou is None:
                out.append(None)
                continue
            out.append(next((v for t, v in tiers if iou > t), 0.0))
        return out

    iou_reward.tiers = tiers
    return iou_reward


iou_reward = make_iou_reward()


def iou_raw_reward(completions: list[str], ground_truth=None, **kwargs) -> list[Optional[float]]:
    """The IoU of the answer's last span with ``ground_truth`` (0.0 without a span)."""
    return _ious(completions, ground_truth)


def make_think_length_reward(min_words: int = 20, max_words: int = 400, ngram: int = 3,
                             max_repeat: float = 0.3) -> Callable:
    """A reward for the think block: ``length_score - repetition_penalty``, clamped to [0, 1].

    * length_score: 1 for ``min_words <= n <= max_words`` words; ``n / min_words`` below;
      ``max(0, 1 - (n - max_words) / max_words)`` above; 0 without a think block.
    * repetition_penalty: ``max(0, r - max_repeat) / (1 - max_repeat)`` with r the share of
      repeated word ``ngram``-grams (`repetition_ratio`).
    """
    if not (0 < min_words <= max_words) or not (0 <= max_repeat < 1) or ngram < 1:
        raise RewardError(f"think_length: need 0 < min_words <= max_words, 0 <= max_repeat < 1, ngram >= 1 "
                          f"(got {min_words}, {max_words}, {max_repeat}, {ngram})")

    def think_length_reward(completions: list[str], **kwargs) -> list[float]:
        out = []
        for c in completions:
            think = extract_think(c)
            if think is None:
                out.append(0.0)
                continue
            n = len(think.split())
            if n < min_words:
                length = n / min_words
            elif n > max_words:
                length = max(0.0, 1.0 - (n - max_words) / max_words)
            else:
                length = 1.0
            rep = repetition_ratio(think, ngram)
            penalty = max(0.0, rep - max_repeat) / (1.0 - max_repeat)
            out.append(min(1.0, max(0.0, length - penalty)))
        return out

    return think_length_reward


think_length_reward = make_think_length_reward()

SPAN_CHARS = frozenset("[]0123456789:- ")
"""The characters an ``[MM:SS - MM:SS]`` answer is written with."""


def answer_chars_reward(completions: list[str], **kwargs) -> list[float]:
    """Dense shaping toward the answer format: the fraction of the completion's non-blank
    characters that can appear in ``[MM:SS - MM:SS]`` (0.0 for an empty completion). A randomly
    initialised model starts near the share of those characters in its vocabulary and can climb
    within a few steps, which makes learning visible on the tiny demo model."""
    out = []
    for c in completions:
        chars = [ch for ch in (c or "") if not ch.isspace()]
        out.append(sum(ch in SPAN_CHARS for ch in chars) / len(chars) if chars else 0.0)
    return out

def tool_call_reward(completions: list[str], completion_texts=None, **kwargs) -> list[float]:
    """1.0 when a turn before the last (a call the rollout executed) holds a ``crop_audio``
    ``<tool_call>`` whose JSON parses with numeric ``0 <= start_sec < end_sec``; else 0.0.

    ``think_length`` and ``format`` score the last turn only, so a policy earns them as well by
    answering at once; this term keeps the tool call worth making."""
    if completion_texts is None:
        raise RewardError("the tool_call reward needs completion_texts (every generated turn)")

    def ok(call) -> bool:
        a = call.arguments
        s, e = a.get("start_sec"), a.get("end_sec")
        return (call.error is None and call.name == "crop_audio"
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (s, e))
                and 0 <= s < e)

    return [1.0 if any(ok(c) for turn in (texts or [])[:-1] for c in parse_tool_calls(turn)) else 0.0
            for texts in completion_texts]


BUILTIN_REWARDS: dict[str, Callable] = {
    "format": format_reward,
    "iou": iou_reward,
    "iou_raw": iou_raw_reward,
    "think_length": think_length_reward,
    "answer_chars": answer_chars_reward,
    "tool_call": tool_call_reward,
}


# ---------------------------------------------------------------------------------------------
# Applying rewards
# ---------------------------------------------------------------------------------------------

def check_reward_fn(name: str, fn: Callable) -> None:
    """Raise `RewardError` unless ``fn`` can be called as ``fn(completions, **columns)``."""
    if not callable(fn):
        raise RewardError(f"reward {name!r} is not callable ({type(fn).__name__})")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    params = list(sig.parameters.values())
    has_kwargs = any(p.kind == p.VAR_KEYWORD for p in params)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional and "completions" not in sig.parameters:
        raise RewardError(f"reward {name!r}: the first parameter must be `completions` "
                          "(signature fn(completions: list[str], **kwargs) -> list[float])")
    if not has_kwargs:
        raise RewardError(f"reward {name!r} must accept **kwargs (it is called with every dataset "
                          "column): def fn(completions, **kwargs)")


async def compute_rewards(trajectories: list, reward_fns: Sequence[tuple[str, Callable]],
                          weights: Optional[Sequence[float]] = None) -> list[float]:
    """Call every reward function once on all trajectories; set each trajectory's ``reward``
    (weighted sum) and ``reward_terms`` (name -> value, None kept as None); return the rewards."""
    n = len(trajectories)
    if n == 0:
        return []
    weights = list(weights) if weights is not None else [1.0] * len(reward_fns)
    if len(weights) != len(reward_fns):
        raise RewardError(f"{len(weights)} reward weights for {len(reward_fns)} reward functions")
    completions = [t.completion_texts[-1] if t.completion_texts else "" for t in trajectories]
    keys: list[str] = []
    for t in trajectories:
        for k in t.columns:
            if k not in keys:
                keys.append(k)
    columns = {k: [t.columns.get(k) for t in trajectories] for k in keys}
    reserved = {"completions", "completion_texts", "finish_reasons", "num_turns", "trajectories"}
    clash = reserved & set(columns)
    if clash:
        raise RewardError(f"dataset columns {sorted(clash)} clash with reward arguments; rename them")
    columns.update(completion_texts=[list(t.completion_texts) for t in trajectories],
                   finish_reasons=[t.finish_reason for t in trajectories],
                   num_turns=[t.num_turns for t in trajectories], trajectories=list(trajectories))
    terms: dict[str, list] = {}
    for name, fn in reward_fns:
        try:
            if inspect.iscoroutinefunction(fn):
                vals = await fn(completions, **columns)
            else:
                vals = fn(completions, **columns)
                if inspect.isawaitable(vals):
                    vals = await vals
        except RewardError:
            raise
        except Exception as e:
            raise RewardError(f"reward {name!r} raised {type(e).__name__}: {e}") from e
        if not isinstance(vals, (list, tuple)) or len(vals) != n:
            raise RewardError(f"reward {name!r} returned {type(vals).__name__}"
                              f"{f' of length {len(vals)}' if hasattr(vals, '__len__') else ''}; "
                              f"expected a list of {n} floats")
        clean = []
        for i, v in enumerate(vals):
            if v is None:
                clean.append(None)
                continue
            try:
                f = float(v)
            except (TypeError, ValueError):
                raise RewardError(f"reward {name!r} returned {v!r} for sample {i}; expected a float") from None
            if not math.isfinite(f):
                raise RewardError(f"reward {name!r} returned {f} for sample {i}")
            clean.append(f)
        terms[name] = clean
    out = []
    for i, t in enumerate(trajectories):
        t.reward_terms = {name: terms[name][i] for name, _ in reward_fns}
        t.reward = float(sum(w * (terms[name][i] or 0.0) for (name, _), w in zip(reward_fns, weights)))
        out.append(t.reward)
    return out


def run_sync(coro):
    """Run a coroutine from sync code (no running loop in this thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    raise RuntimeError("called from a running event loop: await the coroutine instead")
