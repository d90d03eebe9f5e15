"""The data the rollout engine, its samplers and its policies pass around: a conversation in
progress (`RolloutState`), one generated turn (`TurnResponse`), a policy's next turn (`NextTurn`),
a batch's result (`RolloutBatch`), and the error raised when the server's tokens and ours differ.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_grpo.rollout.tools import ToolContext


class RolloutConsistencyError(RuntimeError):
    """The server's view of a conversation's tokens differs from ours (a bug, never trained on)."""


@dataclass
class TurnResponse:
    """One generated turn."""

    token_ids: list
    """Sampled ids (the stop token included when the turn ended on one)."""
    logprobs: list
    text: str
    """Decoded ``token_ids`` without special tokens (for policies and rewards only)."""
    finish_reason: str
    """"stop" (EOS/stop token), "length" (max tokens), "invalid_token" (cut before a sampled
    multimodal placeholder)."""
    stop_reason: Any = None
    url: str = ""
    weight_version: Optional[str] = None
    forced: bool = False
    """True when the text was scripted (`TeacherForcedSampler`) rather than sampled."""


@dataclass
class NextTurn:
    """What a policy's ``step`` returns: the messages of the next non-assistant turn.

    ``messages``: OpenAI-style dicts, role "tool" (or "user"); ``content`` a string or a list of
    parts ``{"type": "text", "text": ...}`` / ``{"type": "audio", "audio": float32 waveform}``.
    ``tool_calls``: tool calls this turn answers (counted against ``max_tool_calls``).
    """

    messages: list
    tool_calls: int = 0


@dataclass
class RolloutState:
    """A conversation in progress (what policies and tools see; the engine owns the token lists)."""

    row: Any
    group_id: int
    sample_index: int
    messages: list
    """Text-level record: the prompt messages, then assistant texts and tool messages; audio parts
    are ``{"type": "audio", "audio_index": k}`` into ``audios``."""
    input_ids: list = field(default_factory=list)
    loss_mask: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    audios: list = field(default_factory=list)
    """`AudioItem` of every clip so far (prompt clips first)."""
    audio_token_counts: list = field(default_factory=list)
    completion_texts: list = field(default_factory=list)
    turn_finish_reasons: list = field(default_factory=list)
    tool_results: list = field(default_factory=list)
    """(turn, ToolCall, ToolResult) of every executed call."""
    num_turns: int = 0
    num_tool_calls: int = 0
    finish_reason: Optional[str] = None
    """Set by a policy to say why it ended the conversation."""
    last_response: Optional[TurnResponse] = None
    weight_versions: list = field(default_factory=list)
    routed_rows: Optional[list] = field(default_factory=list)
    server_url: Optional[str] = None
    prompt_len: int = 0
    tool_ctx: Optional[ToolContext] = None

    @property
    def columns(self) -> dict:
        return dict(getattr(self.row, "columns", {}) or {})

    @property
    def prompt_audios(self) -> list:
        return [a.waveform for a in self.audios[:_num_prompt_audios(self.row)]]


def _num_prompt_audios(row) -> int:
    return len(getattr(row, "audio_paths", ()) or ())


@dataclass
class RolloutBatch:
    """The result of `RolloutEngine.rollout`: complete trajectories only."""

    trajectories: list
    dropped: list = field(default_factory=list)
    """(prompt_index, sample_index or None for a whole group, reason) of dropped samples."""
    stats: dict = field(default_factory=dict)

