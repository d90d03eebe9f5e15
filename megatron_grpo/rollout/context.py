"""What one conversation needs from the engine, in one small object instead of the engine itself.

`RolloutEngine` builds a `RolloutContext` for every batch; ``conversation``, the policies and the
samplers read it and count into its ``stats``, which the engine reports with the batch. Nothing
here imports the modules that use it, so none of them imports the engine back.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from megatron_grpo.rollout.client import GenerateResult
from megatron_grpo.rollout.config import RolloutConfig
from megatron_grpo.rollout.render import ToolTurnRenderer
from megatron_grpo.rollout.state import RolloutState
from megatron_grpo.rollout.tools import ToolRegistry

__all__ = ["RolloutContext", "Sampler"]


class Sampler(Protocol):
    """Where a turn's tokens come from (``samplers.ServerSampler`` and its subclasses)."""

    async def generate(self, ctx: "RolloutContext", state: RolloutState, prompt_ids: list, *, max_tokens: int,
                       seed: Optional[int], routed_experts_prompt_start: Optional[int]) -> GenerateResult: ...


@dataclass
class RolloutContext:
    """The engine's settings and helpers a conversation uses, and the counters it fills."""

    cfg: RolloutConfig
    """The rollout section of the config (``cfg.rollout``)."""
    tokenizer: Any
    """The served checkpoint's tokenizer (chat template included)."""
    renderer: ToolTurnRenderer
    """The chat template's text of the prompt and of tool turns."""
    sampler: Sampler
    """Where each turn's tokens come from."""
    tools: ToolRegistry
    """The tools a policy may call."""
    policy_cls: type
    """The multi-turn policy class; one instance per conversation, built with this context."""
    audio_roots: Optional[tuple]
    """Directories tools may read files from (None: no restriction beyond the tool's own)."""
    audio_token_id: int
    """``<|audio_pad|>``: one per clip in what we send, expanded by the server."""
    placeholder_ids: frozenset
    """Audio/image/video pads: a sampled one ends the turn ("invalid_token")."""
    end_of_turn_id: int
    """``<|im_end|>`` (the tokenizer's EOS without it)."""
    eos_ids: frozenset
    """Every id that ends a turn."""
    max_total_tokens: Optional[int]
    """Longest trajectory (prompt + all turns), the server's max_model_len at most."""
    stats: Counter = field(default_factory=Counter)
    """Counters of the batch (turns, tool_calls, tool_errors, invalid_token), filled by the conversations."""
    warned: set = field(default_factory=set)
    """Once-per-engine warnings already given (shared by the engine's contexts)."""
