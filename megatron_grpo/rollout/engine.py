"""Multi-turn rollout engine: n conversations per prompt, token-exact, with tools and audio.

Per conversation::

    prompt ids  = tokenizer(chat_template(messages, tools, add_generation_prompt))   one pad per clip
    loop:
        answer = server.generate(ids so far, every clip so far)     /inference/v1/generate
        check   server's prompt_token_ids == our ids (placeholders expanded by the server)
        append  answer.token_ids   (mask 1, answer.logprobs)         <|im_end|> included
        policy.is_finished(state)?  -> done
        next  = policy.step(state, answer)     e.g. run the <tool_call>s -> tool messages (+ clips)
        append template ids of the tool turn (mask 0), rendered with the chat template and cut
        out by diffing two renders (see `ToolTurnRenderer`); the new clips' pads are expanded by
        the server in the next request and checked there

The trajectory is built only from token ids the server saw or sampled; text is decoded for the
policy and the rewards but never tokenised back into the trajectory.  Every request's
``prompt_token_ids`` is compared with the ids accumulated so far, so the trainer's token count is
the server's by construction, and any divergence raises `RolloutConsistencyError` instead of
silently training on misaligned tokens.

How vLLM ends a turn (measured on vLLM 0.32): a sampled EOS / stop token (``<|im_end|>``,
``<|endoftext|>``) IS in ``token_ids`` (finish_reason "stop") and has a logprob, so it is part of
the generated span (mask 1: the model learns to stop).  The tool turn's template then starts after
it (``\\n<|im_start|>user\\n<tool_response>...``); a turn cut by max_tokens gets the template's
``<|im_end|>`` from the tool turn (mask 0).

Policies decide the conversation's shape (`MultiTurnPolicy`; a plugin may bring its own):
`HermesToolPolicy` (default) runs a turn's ``<tool_call>`` calls and ends on a turn without one.
"""
from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from megatron_grpo.rollout.client import (AudioItem, GenerateResult, RolloutClient,
                                          RolloutServerError, collapse_audio_runs)
from megatron_grpo.rollout.tools import (ToolCall, ToolContext, ToolRegistry, ToolResult,
                                         parse_tool_calls)
from megatron_grpo.trajectory import Trajectory

log = logging.getLogger("megatron_grpo.rollout")

__all__ = ["RolloutEngine", "RolloutState", "RolloutBatch", "NextTurn", "TurnResponse",
           "MultiTurnPolicy", "HermesToolPolicy", "ServerSampler", "TeacherForcedSampler",
           "ToolTurnRenderer", "RolloutConsistencyError", "stitch_routed_experts"]


class RolloutConsistencyError(RuntimeError):
    """The server's view of a conversation's tokens differs from ours (a bug, never trained on)."""


# ---------------------------------------------------------------------------------------------
# Data passed between the engine, the sampler and the policy
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------------------------

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
    ``self.tools`` the ToolRegistry.  The engine enforces ``max_turns`` and the context length.
    """

    name = "single_turn"

    def __init__(self, engine: "RolloutEngine"):
        self.engine = engine
        self.config = engine.cfg
        self.tools: ToolRegistry = engine.tools

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


# ---------------------------------------------------------------------------------------------
# Samplers: where a turn's tokens come from
# ---------------------------------------------------------------------------------------------

class ServerSampler:
    """Sample the turn on the rollout server (the normal case)."""

    def __init__(self, client: RolloutClient):
        self.client = client

    async def generate(self, engine: "RolloutEngine", state: RolloutState, prompt_ids: list,
                       *, max_tokens: int, seed: Optional[int],
                       routed_experts_prompt_start: Optional[int]) -> GenerateResult:
        cfg = engine.cfg
        return await self.client.generate(
            prompt_ids, state.audios, max_tokens=max_tokens, temperature=cfg.temperature,
            top_p=cfg.top_p, top_k=cfg.top_k, seed=seed, stop_token_ids=cfg.stop_token_ids,
            extra_sampling_params=cfg.extra_sampling_params,
            routed_experts_prompt_start=routed_experts_prompt_start, prefer=state.server_url)


class TeacherForcedSampler(ServerSampler):
    """Scripted turns, scored by the real server: for tests, evaluation and replays.

    ``script(state) -> str | None``: the text of the turn (e.g. a hermes tool call), or None to
    sample it on the server as usual.  A scripted turn is ``tokenizer(text) + [<|im_end|>]``; the
    server receives the prompt ids followed by them (with every clip) and returns the logprob of
    each (vLLM's ``prompt_logprobs``), so the token accounting still goes through the server: it
    sees and checks exactly these ids.  Routed experts are not recorded for scripted turns.
    """

    def __init__(self, client: RolloutClient, script: Callable[[RolloutState], Optional[str]]):
        super().__init__(client)
        self.script = script
        self.forced_turns = 0

    async def generate(self, engine, state, prompt_ids, *, max_tokens, seed,
                       routed_experts_prompt_start):
        text = self.script(state)
        if text is None:
            return await super().generate(engine, state, prompt_ids, max_tokens=max_tokens, seed=seed,
                                          routed_experts_prompt_start=routed_experts_prompt_start)
        forced = engine.tokenizer.encode(text, add_special_tokens=False)
        if not forced or forced[-1] not in engine.eos_ids:
            forced = forced + [engine.end_of_turn_id]
        forced = forced[:max_tokens]
        res = await self.client.generate(list(prompt_ids) + forced, state.audios, max_tokens=1,
                                         temperature=1.0, prompt_logprobs=True, prefer=state.server_url)
        tail = res.prompt_token_ids[-len(forced):]
        if tail != forced:
            raise RolloutConsistencyError(f"teacher-forced ids came back as {tail}, sent {forced}")
        self.forced_turns += 1
        return GenerateResult(
            url=res.url, prompt_token_ids=res.prompt_token_ids[:-len(forced)],
            audio_placeholders=res.audio_placeholders, token_ids=forced,
            logprobs=res.prompt_logprobs[-len(forced):],
            finish_reason="stop" if forced[-1] in engine.eos_ids else "length",
            stop_reason=None, weight_version=res.weight_version, routed_experts=None,
            seconds=res.seconds, forced=True)


# ---------------------------------------------------------------------------------------------
# Tool-turn template ids
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# R3 stitching
# ---------------------------------------------------------------------------------------------

def stitch_routed_experts(parts: Sequence[np.ndarray], total_tokens: int) -> np.ndarray:
    """Concatenate per-turn routed-expert rows ([rows_i, layers, top_k], turn i covering positions
    [end of turn i-1's rows, P_i + O_i - 1)) into ``[total_tokens - 1, layers, top_k]``: the
    experts that routed every input position whose output the policy's logprobs came from (the
    last sampled token is never fed, so it has none)."""
    if not parts:
        raise ValueError("no routed-expert rows")
    out = np.concatenate([np.asarray(p) for p in parts], axis=0)
    if out.shape[0] != total_tokens - 1:
        raise RolloutConsistencyError(f"routed experts cover {out.shape[0]} positions, expected "
                                      f"{total_tokens - 1} (tokens - 1)")
    return out


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------

def _stable_seed(*parts) -> int:
    h = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def _version_int(v: Optional[str]) -> int:
    try:
        return int(str(v))
    except (TypeError, ValueError):
        return 0


class RolloutEngine:
    """Runs the rollouts of a batch of prompts against the servers.

    ``tokenizer``: the served checkpoint's tokenizer (chat template included).  ``registry``: a
    `plugins.Registry` (tools, rewards, policies); default: the built-ins plus ``cfg.plugin``.
    ``audio_roots``: directories tools may read files from (default ``data_config.allowed_audio_roots``).
    ``sampler``: where turns come from (default the servers; tests pass a `TeacherForcedSampler`).

    Use ``async with engine: batch = await engine.rollout(rows)``, or ``engine.run(rows)`` from
    sync code.
    """

    def __init__(self, cfg, tokenizer, *, registry=None, client: Optional[RolloutClient] = None,
                 sampler: Optional[ServerSampler] = None, data_config=None,
                 audio_roots: Optional[Sequence[str]] = None, policy: Optional[str] = None):
        from megatron_grpo.rollout.plugins import load_registry

        self.cfg = cfg
        self.tokenizer = tokenizer
        self.registry = registry if registry is not None else load_registry(cfg.plugin)
        self.tools: ToolRegistry = self.registry.tools.select(cfg.tools)
        self.data_config = data_config
        if audio_roots is None and data_config is not None:
            audio_roots = data_config.allowed_audio_roots
        self.audio_roots = tuple(audio_roots) if audio_roots else None
        self.client = client or RolloutClient(cfg)
        self.sampler = sampler or ServerSampler(self.client)
        self.renderer = ToolTurnRenderer(tokenizer, cfg.chat_template_kwargs)
        self.policy_cls = self.registry.policy_class(policy or cfg.policy)
        for name in cfg.reward_funcs:   # fail now, not after the first rollout
            self.registry.reward(name)
        vocab = tokenizer.get_vocab()
        self.audio_token_id = vocab.get("<|audio_pad|>")
        if self.audio_token_id is None:
            raise ValueError("the tokenizer has no <|audio_pad|> token: not a Qwen3-Omni tokenizer")
        self.placeholder_ids = {vocab[t] for t in ("<|audio_pad|>", "<|image_pad|>", "<|video_pad|>")
                                if t in vocab}
        self.end_of_turn_id = vocab.get("<|im_end|>", tokenizer.eos_token_id)
        eos = {self.end_of_turn_id, tokenizer.eos_token_id}
        for t in ("<|endoftext|>",):
            if t in vocab:
                eos.add(vocab[t])
        eos |= set(cfg.stop_token_ids or [])
        self.eos_ids = {int(t) for t in eos if t is not None}
        self.max_total_tokens: Optional[int] = cfg.max_total_tokens
        self._opened = False
        self._stats: Counter = Counter()

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> "RolloutEngine":
        await self.open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def open(self) -> None:
        await self.client.open()
        if not self._opened:
            try:
                await self.client.model_info()
            except BaseException:
                await self.client.close()
                raise
            server_len = self.client.max_model_len
            if server_len is not None:
                self.max_total_tokens = min(self.cfg.max_total_tokens or server_len, server_len)
            self._opened = True

    async def close(self) -> None:
        await self.client.close()

    def run(self, rows: Sequence, group_ids: Optional[Sequence[int]] = None) -> RolloutBatch:
        """Sync entry point: open the client, roll out ``rows``, close."""
        async def go():
            async with self:
                return await self.rollout(rows, group_ids=group_ids)
        return asyncio.run(go())

    # ------------------------------------------------------------------ batch
    async def rollout(self, rows: Sequence, group_ids: Optional[Sequence[int]] = None) -> RolloutBatch:
        """``cfg.num_generations`` conversations for every row; complete trajectories only, in
        (row, sample) order.  Failures follow ``cfg.on_error``."""
        if not self._opened:
            await self.open()
        t0 = time.monotonic()
        group_ids = list(group_ids) if group_ids is not None else list(range(len(rows)))
        if len(group_ids) != len(rows):
            raise ValueError(f"{len(group_ids)} group ids for {len(rows)} rows")
        self._stats = Counter()
        results: list[Optional[list]] = [None] * len(rows)
        dropped: list = []
        try:
            async with asyncio.TaskGroup() as tg:
                for i, (row, gid) in enumerate(zip(rows, group_ids)):
                    tg.create_task(self._group(i, row, gid, results, dropped))
        except BaseExceptionGroup as eg:
            first = _first_error(eg)
            raise first from None
        trajs = [t for g in results if g for t in g]
        reasons = Counter(t.finish_reason for t in trajs)
        stats = dict(self._stats)
        stats.update(seconds=time.monotonic() - t0, trajectories=len(trajs), dropped=len(dropped),
                     tokens=sum(t.num_tokens for t in trajs), generated=sum(t.num_generated for t in trajs),
                     turns=sum(t.num_turns for t in trajs),
                     finish_reasons=dict(reasons), client=dict(self.client.stats))
        return RolloutBatch(trajectories=trajs, dropped=dropped, stats=stats)

    async def _group(self, i: int, row, group_id: int, results: list, dropped: list) -> None:
        mode = self.cfg.on_error
        try:
            waves = await asyncio.to_thread(self._load_prompt_audio, row)
            items = [AudioItem.from_waveform(w) for w in waves]
        except Exception as e:
            if mode == "raise" or not _is_sample_error(e):
                raise
            dropped.append((getattr(row, "prompt_index", i), None, f"{type(e).__name__}: {e}"))
            return
        n = self.cfg.num_generations
        samples = [self._sample(row, group_id, k, items) for k in range(n)]
        if mode == "raise":   # the first failure cancels the rest (gather cancels its children)
            results[i] = list(await asyncio.gather(*samples))
            return
        outs = await asyncio.gather(*samples, return_exceptions=True)
        errors = [(k, o) for k, o in enumerate(outs) if isinstance(o, BaseException)]
        for k, e in errors:
            if mode == "raise" or not _is_sample_error(e):
                raise e
        if errors:
            pidx = getattr(row, "prompt_index", i)
            for k, e in errors:
                log.warning("rollout: dropping prompt %s sample %d: %s", pidx, k, e)
                dropped.append((pidx, k, f"{type(e).__name__}: {e}"))
            if mode == "drop_group":
                dropped.append((pidx, None, f"group dropped: {len(errors)} of {n} samples failed"))
                return
        results[i] = [o for o in outs if not isinstance(o, BaseException)]

    def _load_prompt_audio(self, row) -> list:
        if hasattr(row, "load_audios"):
            return row.load_audios(self.data_config)
        return list(getattr(row, "audios", []) or [])

    # ------------------------------------------------------------------ one conversation
    async def _sample(self, row, group_id: int, k: int, prompt_audio: list) -> Trajectory:
        cfg = self.cfg
        pidx = getattr(row, "prompt_index", 0)
        state = RolloutState(row=row, group_id=group_id, sample_index=k, messages=list(row.messages),
                             audios=list(prompt_audio))
        state.tool_ctx = ToolContext(audios=[a.waveform for a in prompt_audio],
                                     audio_paths=tuple(getattr(row, "audio_paths", ()) or ()),
                                     audio_roots=self.audio_roots, columns=state.columns, config=cfg,
                                     state=state)
        if not cfg.return_routed_experts:
            state.routed_rows = None
        policy = self.policy_cls(self)
        tools = list(getattr(row, "tools", None) or []) or None

        prompt_text = self.renderer.render(_render_messages(row.messages), tools, True)
        pending = self.tokenizer.encode(prompt_text, add_special_tokens=False)
        n_pad = sum(1 for t in pending if t == self.audio_token_id)
        if n_pad != len(prompt_audio) or collapse_audio_runs(pending, self.audio_token_id) != pending:
            raise RolloutConsistencyError(
                f"prompt {pidx}: the rendered prompt has {n_pad} <|audio_pad|> placeholders for "
                f"{len(prompt_audio)} clips (or adjacent ones); check the row's messages")
        pending_new_audio = list(range(len(prompt_audio)))
        max_total = self.max_total_tokens
        turn = 0
        while True:
            predicted = len(state.input_ids) + len(pending) + sum(
                self._predicted_audio_tokens(state.audios[j]) - 1 for j in pending_new_audio)
            budget = (max_total - predicted) if max_total else cfg.max_new_tokens
            if budget < 1:
                if not state.input_ids:
                    raise RolloutServerError(
                        f"prompt {pidx} has {predicted} tokens, no room to generate within "
                        f"{max_total} (rollout.max_total_tokens / the server's max_model_len)",
                        retryable=False)
                state.finish_reason = "context_length"
                del state.audios[len(state.audio_token_counts):]
                break
            max_tokens = min(cfg.max_new_tokens, budget)
            seed = None if cfg.seed is None else _stable_seed(cfg.seed, pidx, k, turn)
            # R3: rows already recorded cover positions [0, routed_start); ask for the rest
            routed_start = (sum(r.shape[0] for r in state.routed_rows)
                            if state.routed_rows is not None else None)
            sent = collapse_audio_runs(state.input_ids, self.audio_token_id) + pending
            res = await self.sampler.generate(self, state, sent, max_tokens=max_tokens, seed=seed,
                                              routed_experts_prompt_start=routed_start)
            self._commit_prompt(state, res, sent, pending_new_audio, pidx, k)
            pending, pending_new_audio = [], []
            resp = self._commit_turn(state, res)
            turn += 1
            if resp.finish_reason == "invalid_token":
                state.finish_reason = "invalid_token"
                break
            finished = policy.is_finished(state)
            if inspect.isawaitable(finished):
                finished = await finished
            if finished:
                state.finish_reason = state.finish_reason or "stop"
                break
            if state.num_turns >= cfg.max_turns:
                state.finish_reason = "max_turns"
                break
            nxt = policy.step(state, resp)
            if inspect.isawaitable(nxt):
                nxt = await nxt
            if nxt is None:
                state.finish_reason = state.finish_reason or "stop"
                break
            if nxt.tool_calls:
                self._stats["tool_calls"] += nxt.tool_calls
            pending, pending_new_audio = self._tool_turn(state, nxt, tools)
        return self._finish(state, pidx)

    def _predicted_audio_tokens(self, item: AudioItem) -> int:
        from megatron_grpo.data.features import audio_token_counts

        return audio_token_counts([item.waveform])[0]

    def _commit_prompt(self, state: RolloutState, res: GenerateResult, sent: list,
                       new_audio: list, pidx, k) -> None:
        """Check the server's prompt ids against ours and append the pending (tool/prompt) ids
        with the server's placeholder expansion (mask 0)."""
        P = list(res.prompt_token_ids)
        n_old = len(state.input_ids)
        where = f"prompt {pidx} sample {k} turn {state.num_turns + 1} ({res.url})"
        if P[:n_old] != state.input_ids:
            bad = next((i for i, (a, b) in enumerate(zip(P, state.input_ids)) if a != b), len(P))
            raise RolloutConsistencyError(f"{where}: the server's prompt differs from the trajectory "
                                          f"at token {bad} of {n_old}")
        if collapse_audio_runs(P, self.audio_token_id) != sent:
            raise RolloutConsistencyError(f"{where}: the server's prompt ({len(P)} ids) is not our "
                                          f"prompt ({len(sent)} ids, one pad per clip) expanded")
        runs = [(o, n) for o, n in res.audio_placeholders]
        if len(runs) != len(state.audios):
            raise RolloutConsistencyError(f"{where}: the server placed {len(runs)} clips, we sent "
                                          f"{len(state.audios)}")
        for j in new_audio:
            n = runs[j][1]
            want = self._predicted_audio_tokens(state.audios[j])
            if n != want:
                raise RolloutConsistencyError(
                    f"{where}: clip {j} ({len(state.audios[j].waveform)} samples) became {n} audio "
                    f"tokens on the server, the trainer's rule (data.features) says {want}")
            state.audio_token_counts.append(n)
        seg = P[n_old:]
        state.input_ids.extend(seg)
        state.loss_mask.extend([0] * len(seg))
        state.logprobs.extend([0.0] * len(seg))
        if n_old == 0:
            state.prompt_len = len(P)
        state.server_url = res.url

    def _commit_turn(self, state: RolloutState, res: GenerateResult) -> TurnResponse:
        ids, lps = list(res.token_ids), list(res.logprobs)
        finish = res.finish_reason
        cut = next((i for i, t in enumerate(ids) if t in self.placeholder_ids), None)
        if cut is not None:   # a sampled placeholder would be expanded as audio by the next prompt
            ids, lps, finish = ids[:cut], lps[:cut], "invalid_token"
            self._stats["invalid_token"] += 1
        for lp in lps:
            if not (lp <= 0.0) or math.isnan(lp):
                raise RolloutConsistencyError(f"the server returned logprob {lp} for a sampled token")
        if state.routed_rows is not None:
            if res.routed_experts is None:
                if not res.forced and not getattr(self, "_warned_r3", False):
                    log.warning("rollout.return_routed_experts is on but the server returned no routed "
                                "experts (start it with --enable-return-routed-experts and the V2 "
                                "model runner); trajectories get routed_experts=None")
                    self._warned_r3 = True
                state.routed_rows = None
            else:
                state.routed_rows.append(np.asarray(res.routed_experts))
        state.input_ids.extend(ids)
        state.loss_mask.extend([1] * len(ids))
        state.logprobs.extend(lps)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        resp = TurnResponse(token_ids=ids, logprobs=lps, text=text, finish_reason=finish,
                            stop_reason=res.stop_reason, url=res.url, weight_version=res.weight_version,
                            forced=res.forced)
        state.last_response = resp
        state.completion_texts.append(text)
        state.turn_finish_reasons.append(finish)
        state.messages.append({"role": "assistant", "content": text})
        state.weight_versions.append(res.weight_version)
        state.num_turns += 1
        self._stats["turns"] += 1
        return resp

    def _tool_turn(self, state: RolloutState, nxt: NextTurn, tools) -> tuple[list, list]:
        """Template ids of the next turn (one pad per new clip) and the indices of its clips."""
        state.num_tool_calls += nxt.tool_calls
        msgs, new_audio = [], []
        for m in nxt.messages:
            m = dict(m)
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for p in content:
                    if isinstance(p, dict) and p.get("type") == "audio" and "audio" in p:
                        j = len(state.audios)
                        state.audios.append(AudioItem.from_waveform(np.asarray(p["audio"], dtype=np.float32)))
                        new_audio.append(j)
                        parts.append({"type": "audio", "audio_index": j})
                    else:
                        parts.append(p)
                m["content"] = parts
            msgs.append(m)
        state.messages.extend(msgs)
        last = state.input_ids[-1] if state.input_ids and state.loss_mask[-1] == 1 else None
        last_text = self.tokenizer.decode([last], skip_special_tokens=False) \
            if last is not None and last in self.eos_ids else None
        text = self.renderer.text(_render_messages(msgs), tools, last_text)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        n_pad = sum(1 for t in ids if t == self.audio_token_id)
        if n_pad != len(new_audio):
            raise RolloutConsistencyError(f"the tool turn renders {n_pad} audio placeholders for "
                                          f"{len(new_audio)} clips: {text[:300]!r}")
        return ids, new_audio

    def _finish(self, state: RolloutState, pidx) -> Trajectory:
        T = len(state.input_ids)
        if not (len(state.loss_mask) == len(state.logprobs) == T):
            raise RolloutConsistencyError("token, mask and logprob lists differ in length")
        routed = None
        if state.routed_rows:
            routed = stitch_routed_experts(state.routed_rows, T)
        versions = [v for v in state.weight_versions if v is not None]
        traj = Trajectory(
            prompt_index=pidx, group_id=state.group_id, input_ids_T=list(state.input_ids),
            loss_mask_T=list(state.loss_mask), rollout_logprobs_T=list(state.logprobs),
            audios=[a.waveform for a in state.audios],
            audio_token_counts=list(state.audio_token_counts),
            completion_texts=list(state.completion_texts), num_turns=state.num_turns,
            finish_reason=state.finish_reason or "stop",
            weight_version=min((_version_int(v) for v in versions), default=0),
            routed_experts=routed, columns=dict(state.columns))
        from megatron_grpo.trajectory import check_alignment

        check_alignment(traj, self.audio_token_id)
        self._stats["tool_errors"] += sum(1 for _, _, r in state.tool_results if r.error)
        return traj

    # ------------------------------------------------------------------ rewards
    async def score(self, trajectories: list) -> list[float]:
        """Apply ``cfg.reward_funcs`` (weighted by ``cfg.reward_weights``) to the trajectories."""
        from megatron_grpo.rollout.rewards import compute_rewards

        fns = [(n, self.registry.reward(n)) for n in self.cfg.reward_funcs]
        return await compute_rewards(trajectories, fns, self.cfg.reward_weights)


def _render_messages(messages: list) -> list:
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


def _is_sample_error(e: BaseException) -> bool:
    from megatron_grpo.data.schema import DataError

    try:
        from megatron_grpo.data.audio import AudioError
    except ImportError:  # pragma: no cover
        AudioError = DataError
    return isinstance(e, (RolloutServerError, RolloutConsistencyError, DataError, AudioError))


def _first_error(eg: BaseException) -> BaseException:
    while isinstance(eg, BaseExceptionGroup):
        eg = eg.exceptions[0]
    return eg
