"""Multi-turn policies: after each generated turn, whether the conversation ends and what comes next.

`MultiTurnPolicy` is the base a plugin subclasses (``@policy`` registers it) and ends after one
turn; `HermesToolPolicy` (the default) runs a turn's ``<tool_call>`` calls and ends on a turn
without one. `tool_message` turns a tool's result into the OpenAI-style message of the next turn.
"""
from __future__ import annotations

from typing import Sequence

from megatron_grpo.rollout.context import RolloutContext
from megatron_grpo.rollout.state import NextTurn, RolloutState, TurnResponse
from megatron_grpo.rollout.tools import ToolCall, ToolRegistry, ToolResult, parse_tool_calls


class MultiTurnPolicy:
    """Decides after each generated turn whether the conversation ends, and what comes next.

    Subclass it in a plugin (``@policy`` registers it).  Override:

    * ``is_finished(state) -> bool``: called after every generated turn (``state.last_response``);
      True ends the conversation (set ``state.finish_reason`` to say why).
    * ``step(state, response) -> NextTurn | None`` (sync or async): the next turn's messages, e.g.
      the tool responses; None ends the conversation.

    Helpers: ``await self.run_tool_calls(state, calls)`` executes parsed calls with the registry
    (errors become "error: ..." tool messages) and builds the `NextTurn`; ``await
    self.call_tool(state, name, arguments)`` runs one tool.  ``self.config`` is the RolloutConfig,
    ``self.tools`` the ToolRegistry, ``self.context`` the `RolloutContext` (tokenizer, limits,
    stats).  The engine enforces ``max_turns`` and the context length.
    """

    name = "single_turn"

    def __init__(self, ctx: RolloutContext):
        self.context = ctx
        self.config = ctx.cfg
        self.tools: ToolRegistry = ctx.tools

    def is_finished(self, state: RolloutState) -> bool:
        state.finish_reason = state.finish_reason or "stop"
        return True

    def step(self, state: RolloutState, response: TurnResponse):
        return None

    async def call_tool(self, state: RolloutState, name: str, arguments: dict) -> ToolResult:
        call = ToolCall(name=name, arguments=dict(arguments), raw="")
        res = await self.tools.execute(call, state.tool_ctx, timeout_s=self.config.tool_timeout_s)
        state.tool_results.append((state.num_turns, call, res))
        return res

    async def run_tool_calls(self, state: RolloutState, calls: Sequence[ToolCall]) -> NextTurn:
        """Execute up to ``max_tool_calls_per_turn`` calls; answer the rest with an error."""
        msgs = []
        limit = self.config.max_tool_calls_per_turn
        executed = 0
        for i, call in enumerate(calls):
            if i < limit:
                res = await self.tools.execute(call, state.tool_ctx, timeout_s=self.config.tool_timeout_s)
                executed += 1
            else:
                res = ToolResult(text=f"error: only {limit} tool call{'s' if limit > 1 else ''} per turn "
                                      "are executed; this one was skipped", error=True)
            state.tool_results.append((state.num_turns, call, res))
            msgs.append(tool_message(call.name or "unknown", res))
        return NextTurn(messages=msgs, tool_calls=executed)


def tool_message(name: str, res: ToolResult) -> dict:
    """The OpenAI-style tool message of a result: text part, then one audio part per clip."""
    parts: list = []
    if res.text or not res.audios:
        parts.append({"type": "text", "text": res.text})
    parts.extend({"type": "audio", "audio": a} for a in res.audios)
    return {"role": "tool", "name": name, "content": parts}


class HermesToolPolicy(MultiTurnPolicy):
    """Qwen3's hermes tool calling: a turn with ``<tool_call>`` blocks gets their results; a turn
    without one ends the conversation ("stop"); a turn cut by max_new_tokens ends it ("length");
    a turn whose calls would exceed ``max_tool_calls`` ends it ("tool_limit")."""

    name = "hermes"

    def is_finished(self, state: RolloutState) -> bool:
        r = state.last_response
        if r.finish_reason == "length":
            state.finish_reason = "length"
            return True
        if not parse_tool_calls(r.text):
            state.finish_reason = "stop"
            return True
        return False

    async def step(self, state: RolloutState, response: TurnResponse):
        calls = parse_tool_calls(response.text)
        n = min(len(calls), self.config.max_tool_calls_per_turn)
        if state.num_tool_calls + n > self.config.max_tool_calls:
            state.finish_reason = "tool_limit"
            return None
        return await self.run_tool_calls(state, calls)

