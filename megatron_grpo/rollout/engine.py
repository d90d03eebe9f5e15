"""Multi-turn rollout engine: n conversations per prompt, token-exact, with tools and audio.

`RolloutEngine` runs a batch: every prompt's ``num_generations`` conversations concurrently against
the servers, failures handled per ``cfg.on_error``, complete trajectories returned in (row, sample)
order, rewards on request. The parts it is made of, each in its own module of this package:

* ``conversation``: one conversation, turn by turn (the token accounting is described there);
* ``policies``: whether a conversation ends after a turn and what comes next (`MultiTurnPolicy`;
  `HermesToolPolicy`, the default, runs a turn's ``<tool_call>`` calls; a plugin may bring its own);
* ``samplers``: where a turn's tokens come from (`ServerSampler`, `TeacherForcedSampler`);
* ``render``: the chat template's text of the prompt and of tool turns (`ToolTurnRenderer`);
* ``assemble``: the finished conversation as a `Trajectory` (`stitch_routed_experts` for R3);
* ``state``: the data passed between them (`RolloutState`, `TurnResponse`, `NextTurn`,
  `RolloutBatch`, `RolloutConsistencyError`);
* ``context``: what a conversation, its policy and its sampler get from the engine
  (`RolloutContext`: tokenizer, renderer, sampler, limits, the batch's counters).

Their public names are importable from here too.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Optional, Sequence

from megatron_grpo.rollout.assemble import stitch_routed_experts
from megatron_grpo.rollout.client import AudioItem, RolloutClient, RolloutServerError
from megatron_grpo.rollout.context import RolloutContext
from megatron_grpo.rollout.conversation import run_conversation
from megatron_grpo.rollout.policies import HermesToolPolicy, MultiTurnPolicy
from megatron_grpo.rollout.policies import tool_message  # noqa: F401 - re-exported (tests)
from megatron_grpo.rollout.render import ToolTurnRenderer
from megatron_grpo.rollout.samplers import ServerSampler, TeacherForcedSampler
from megatron_grpo.rollout.state import (NextTurn, RolloutBatch, RolloutConsistencyError, RolloutState,
                                         TurnResponse)
from megatron_grpo.rollout.tools import ToolRegistry

__all__ = ["RolloutEngine", "RolloutState", "RolloutBatch", "NextTurn", "TurnResponse",
           "MultiTurnPolicy", "HermesToolPolicy", "ServerSampler", "TeacherForcedSampler",
           "ToolTurnRenderer", "RolloutConsistencyError", "stitch_routed_experts"]

log = logging.getLogger("megatron_grpo.rollout")


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
        from megatron_grpo.rollout.plugins import load_registry, resolve_rollout_names

        self.cfg = cfg
        self.tokenizer = tokenizer
        self.registry = registry if registry is not None else load_registry(cfg.plugin)
        # every name now (an unknown reward fails here, not after the first rollout)
        tools, self.policy_cls = resolve_rollout_names(self.registry, cfg, policy)
        self.tools: ToolRegistry = tools
        self.data_config = data_config
        if audio_roots is None and data_config is not None:
            audio_roots = data_config.allowed_audio_roots
        self.audio_roots = tuple(audio_roots) if audio_roots else None
        self.client = client or RolloutClient(cfg)
        self.sampler = sampler or ServerSampler(self.client)
        self.renderer = ToolTurnRenderer(tokenizer, cfg.chat_template_kwargs)
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
        self._warned: set = set()  # once-per-engine warnings, shared by every batch's context

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
        ctx = self._context()
        results: list[Optional[list]] = [None] * len(rows)
        dropped: list = []
        try:
            async with asyncio.TaskGroup() as tg:
                for i, (row, gid) in enumerate(zip(rows, group_ids)):
                    tg.create_task(self._group(ctx, i, row, gid, results, dropped))
        except BaseExceptionGroup as eg:
            first = _first_error(eg)
            raise first from None
        trajs = [t for g in results if g for t in g]
        reasons = Counter(t.finish_reason for t in trajs)
        stats = dict(ctx.stats)
        stats.update(seconds=time.monotonic() - t0, trajectories=len(trajs), dropped=len(dropped),
                     tokens=sum(t.num_tokens for t in trajs), generated=sum(t.num_generated for t in trajs),
                     turns=sum(t.num_turns for t in trajs),
                     finish_reasons=dict(reasons), client=dict(self.client.stats))
        return RolloutBatch(trajectories=trajs, dropped=dropped, stats=stats)

    def _context(self) -> RolloutContext:
        """A batch's `RolloutContext`: the engine's current parts (a test may swap the sampler) and
        fresh counters."""
        return RolloutContext(cfg=self.cfg, tokenizer=self.tokenizer, renderer=self.renderer, sampler=self.sampler,
                              tools=self.tools, policy_cls=self.policy_cls, audio_roots=self.audio_roots,
                              audio_token_id=self.audio_token_id, placeholder_ids=frozenset(self.placeholder_ids),
                              end_of_turn_id=self.end_of_turn_id, eos_ids=frozenset(self.eos_ids),
                              max_total_tokens=self.max_total_tokens, warned=self._warned)

    async def _group(self, ctx: RolloutContext, i: int, row, group_id: int, results: list, dropped: list) -> None:
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
        samples = [run_conversation(ctx, row, group_id, k, items) for k in range(n)]
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

    # ------------------------------------------------------------------ rewards
    async def score(self, trajectories: list) -> list[float]:
        """Apply ``cfg.reward_funcs`` (weighted by ``cfg.reward_weights``) to the trajectories."""
        from megatron_grpo.rollout.rewards import compute_rewards

        fns = [(n, self.registry.reward(n)) for n in self.cfg.reward_funcs]
        return await compute_rewards(trajectories, fns, self.cfg.reward_weights)


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
