"""Samplers: where a turn's tokens come from. `ServerSampler` samples on the rollout server;
`TeacherForcedSampler` scripts turns and has the server score them (tests, evaluation, replays).
"""
from __future__ import annotations

from typing import Callable, Optional

from megatron_grpo.rollout.client import GenerateResult, RolloutClient
from megatron_grpo.rollout.context import RolloutContext
from megatron_grpo.rollout.state import RolloutConsistencyError, RolloutState


class ServerSampler:
    """Sample the turn on the rollout server (the normal case)."""

    def __init__(self, client: RolloutClient):
        self.client = client

    async def generate(self, ctx: RolloutContext, state: RolloutState, prompt_ids: list,
                       *, max_tokens: int, seed: Optional[int],
                       routed_experts_prompt_start: Optional[int]) -> GenerateResult:
        cfg = ctx.cfg
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

    async def generate(self, ctx, state, prompt_ids, *, max_tokens, seed,
                       routed_experts_prompt_start):
        text = self.script(state)
        if text is None:
            return await super().generate(ctx, state, prompt_ids, max_tokens=max_tokens, seed=seed,
                                          routed_experts_prompt_start=routed_experts_prompt_start)
        forced = ctx.tokenizer.encode(text, add_special_tokens=False)
        if not forced or forced[-1] not in ctx.eos_ids:
            forced = forced + [ctx.end_of_turn_id]
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
            finish_reason="stop" if forced[-1] in ctx.eos_ids else "length",
            stop_reason=None, weight_version=res.weight_version, routed_experts=None,
            seconds=res.seconds, forced=True)
