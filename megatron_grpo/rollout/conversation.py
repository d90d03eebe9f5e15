"""One multi-turn conversation, token-exact, with tools and audio: the loop of `RolloutEngine`
(which hands it a `RolloutContext`, not itself).

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
"""
from __future__ import annotations

import hashlib
import inspect
import logging
import math
import numpy as np

from megatron_grpo.rollout.assemble import build_trajectory
from megatron_grpo.rollout.client import AudioItem, GenerateResult, RolloutServerError, collapse_audio_runs
from megatron_grpo.rollout.context import RolloutContext
from megatron_grpo.rollout.render import template_messages
from megatron_grpo.rollout.state import NextTurn, RolloutConsistencyError, RolloutState, TurnResponse
from megatron_grpo.rollout.tools import ToolContext
from megatron_grpo.trajectory import Trajectory

log = logging.getLogger("megatron_grpo.rollout")


async def run_conversation(ctx: RolloutContext, row, group_id: int, k: int,
                           prompt_audio: list) -> Trajectory:
    """Sample ``k`` of ``row`` (group ``group_id``, prompt clips ``prompt_audio``) from its prompt to
    its trajectory: generate, check and append turns until the policy, ``max_turns`` or the context
    length ends it."""
    cfg = ctx.cfg
    pidx = getattr(row, "prompt_index", 0)
    state = RolloutState(row=row, group_id=group_id, sample_index=k, messages=list(row.messages),
                         audios=list(prompt_audio))
    state.tool_ctx = ToolContext(audios=[a.waveform for a in prompt_audio],
                                 audio_paths=tuple(getattr(row, "audio_paths", ()) or ()),
                                 audio_roots=ctx.audio_roots, columns=state.columns, config=cfg,
                                 state=state)
    if not cfg.return_routed_experts:
        state.routed_rows = None
    policy = ctx.policy_cls(ctx)
    tools = list(getattr(row, "tools", None) or []) or None

    prompt_text = ctx.renderer.render(template_messages(row.messages), tools, True)
    pending = ctx.tokenizer.encode(prompt_text, add_special_tokens=False)
    n_pad = sum(1 for t in pending if t == ctx.audio_token_id)
    if n_pad != len(prompt_audio) or collapse_audio_runs(pending, ctx.audio_token_id) != pending:
        raise RolloutConsistencyError(
            f"prompt {pidx}: the rendered prompt has {n_pad} <|audio_pad|> placeholders for "
            f"{len(prompt_audio)} clips (or adjacent ones); check the row's messages")
    pending_new_audio = list(range(len(prompt_audio)))
    max_total = ctx.max_total_tokens
    turn = 0
    while True:
        predicted = len(state.input_ids) + len(pending) + sum(
            predicted_audio_tokens(state.audios[j]) - 1 for j in pending_new_audio)
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
        sent = collapse_audio_runs(state.input_ids, ctx.audio_token_id) + pending
        res = await ctx.sampler.generate(ctx, state, sent, max_tokens=max_tokens, seed=seed,
                                       routed_experts_prompt_start=routed_start)
        _commit_prompt(ctx, state, res, sent, pending_new_audio, pidx, k)
        pending, pending_new_audio = [], []
        resp = _commit_turn(ctx, state, res)
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
            ctx.stats["tool_calls"] += nxt.tool_calls
        pending, pending_new_audio = _tool_turn(ctx, state, nxt, tools)
    traj = build_trajectory(state, pidx, ctx.audio_token_id)
    ctx.stats["tool_errors"] += sum(1 for _, _, r in state.tool_results if r.error)
    return traj


def predicted_audio_tokens(item: AudioItem) -> int:
    """Audio tokens of a clip by the trainer's rule (``data.features``), which the server must match."""
    from megatron_grpo.data.features import audio_token_counts

    return audio_token_counts([item.waveform])[0]


def _commit_prompt(ctx: RolloutContext, state: RolloutState, res: GenerateResult, sent: list,
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
    if collapse_audio_runs(P, ctx.audio_token_id) != sent:
        raise RolloutConsistencyError(f"{where}: the server's prompt ({len(P)} ids) is not our "
                                      f"prompt ({len(sent)} ids, one pad per clip) expanded")
    runs = [(o, n) for o, n in res.audio_placeholders]
    if len(runs) != len(state.audios):
        raise RolloutConsistencyError(f"{where}: the server placed {len(runs)} clips, we sent "
                                      f"{len(state.audios)}")
    for j in new_audio:
        n = runs[j][1]
        want = predicted_audio_tokens(state.audios[j])
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


def _commit_turn(ctx: RolloutContext, state: RolloutState, res: GenerateResult) -> TurnResponse:
    """Append the generated ids (mask 1, the server's logprobs) and record the turn."""
    ids, lps = list(res.token_ids), list(res.logprobs)
    finish = res.finish_reason
    cut = next((i for i, t in enumerate(ids) if t in ctx.placeholder_ids), None)
    if cut is not None:   # a sampled placeholder would be expanded as audio by the next prompt
        ids, lps, finish = ids[:cut], lps[:cut], "invalid_token"
        ctx.stats["invalid_token"] += 1
    for lp in lps:
        if not (lp <= 0.0) or math.isnan(lp):
            raise RolloutConsistencyError(f"the server returned logprob {lp} for a sampled token")
    if state.routed_rows is not None:
        if res.routed_experts is None:
            if not res.forced and not "r3" in ctx.warned:
                log.warning("rollout.return_routed_experts is on but the server returned no routed "
                            "experts (start it with `mgrpo serve --return-routed-experts`); "
                            "trajectories get routed_experts=None")
                ctx.warned.add("r3")
            state.routed_rows = None
        else:
            # rows for the positions [covered so far, prompt + sampled ids - 1); a cut turn (above)
            # drops the rows of the ids it drops
            rows = np.asarray(res.routed_experts)
            covered = sum(r.shape[0] for r in state.routed_rows)
            want = len(state.input_ids) + len(res.token_ids) - 1 - covered
            if rows.shape[0] != want:
                raise RolloutConsistencyError(
                    f"turn {state.num_turns + 1} ({res.url}): the server returned {rows.shape[0]} routed-expert "
                    f"rows from position {covered} (routed_experts_prompt_start) for a prompt of "
                    f"{len(state.input_ids)} and {len(res.token_ids)} sampled tokens: expected {want}")
            state.routed_rows.append(rows[:len(state.input_ids) + len(ids) - 1 - covered])
    state.input_ids.extend(ids)
    state.loss_mask.extend([1] * len(ids))
    state.logprobs.extend(lps)
    text = ctx.tokenizer.decode(ids, skip_special_tokens=True)
    resp = TurnResponse(token_ids=ids, logprobs=lps, text=text, finish_reason=finish,
                        stop_reason=res.stop_reason, url=res.url, weight_version=res.weight_version,
                        forced=res.forced)
    state.last_response = resp
    state.completion_texts.append(text)
    state.turn_finish_reasons.append(finish)
    state.messages.append({"role": "assistant", "content": text})
    state.weight_versions.append(res.weight_version)
    state.num_turns += 1
    ctx.stats["turns"] += 1
    return resp


def _tool_turn(ctx: RolloutContext, state: RolloutState, nxt: NextTurn,
               tools) -> tuple[list, list]:
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
    last_text = ctx.tokenizer.decode([last], skip_special_tokens=False) \
        if last is not None and last in ctx.eos_ids else None
    text = ctx.renderer.text(template_messages(msgs), tools, last_text)
    ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    n_pad = sum(1 for t in ids if t == ctx.audio_token_id)
    if n_pad != len(new_audio):
        raise RolloutConsistencyError(f"the tool turn renders {n_pad} audio placeholders for "
                                      f"{len(new_audio)} clips: {text[:300]!r}")
    return ids, new_audio


def _stable_seed(*parts) -> int:
    """A sampling seed for (seed, prompt, sample, turn), the same in every process and run (unlike
    ``hash``, which is salted per process)."""
    h = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF

