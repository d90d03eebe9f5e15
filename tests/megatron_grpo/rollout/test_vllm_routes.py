"""Routed experts (R3) from the real vLLM CPU server (`megatron_grpo.rollout.vllm_routes`): the rows it
returns in vLLM's own response format are the expert ids its MoE layers used, for every position of a
3-turn conversation with audio and tool turns (prefill and decode), and prefix-cached prompt tokens
keep their rows.

The independent record comes from the server too, by another path than the capture: the worker
extension's diagnostic recorder (``mgrpo_record_routes``) keeps the ``topk_ids`` the CPU expert
kernel itself received in every forward step, with the positions each request computed in it.
"""
from __future__ import annotations

import uuid

import numpy as np
import requests

from megatron_grpo.data.reader import PromptRow
from megatron_grpo.data.synth import CROP_AUDIO_TOOL
from megatron_grpo.rollout.engine import RolloutEngine
from megatron_grpo.rollout.plugins import builtin_registry
from megatron_grpo.rollout.vllm_routes import recorded_rows
from test_engine import CropEveryTurn, audio_dir, cfg_for, tok  # noqa: F401 (fixtures)


def _rpc(url: str, method: str, *args):
    r = requests.post(f"{url}/collective_rpc", json={"method": method, "args": [str(a) for a in args]},
                      timeout=120)
    r.raise_for_status()
    return r.json()["results"][0]


def _row(audio_dir, nonce: str) -> PromptRow:
    # a text no other test sends, so nothing of it is in the prefix cache before the first run
    return PromptRow(prompt_index=0, messages=[{"role": "user", "content": [
        {"type": "audio", "audio_index": 0}, {"type": "text", "text": f"\n{nonce} When does the beep occur?"}]}],
        tools=[CROP_AUDIO_TOOL], audio_paths=(str(audio_dir / "data" / "rec.wav"),), columns={})


def _rollout_recorded(url, tok, audio_dir, nonce):
    """One 3-turn conversation (prompt clip, two crop tool turns) with the server's recorder on:
    (trajectory, [{position: ids}] per request in order)."""
    reg = builtin_registry()
    reg.add_policy("crop_every_turn", CropEveryTurn)
    cfg = cfg_for(url, num_generations=1, max_turns=3, max_new_tokens=6, policy="crop_every_turn",
                  return_routed_experts=True)
    eng = RolloutEngine(cfg, tok, registry=reg, audio_roots=[str(audio_dir / "data")])
    _rpc(url, "mgrpo_record_routes", 1)
    try:
        (tr,) = eng.run([_row(audio_dir, nonce)]).trajectories
    finally:
        steps = _rpc(url, "mgrpo_record_routes", 0)
    by_req = recorded_rows(steps)
    order = list(dict.fromkeys(rid for s in steps if "req_ids" in s for rid in s["req_ids"]))
    return tr, [by_req[r] for r in order]


def test_returned_routes_are_the_ids_the_layers_used(vllm_server, tok, audio_dir):
    # earlier tests sent prompts that share this one's chat-template head and clip, so their blocks
    # may sit in the prefix cache, and positions served from it are not computed (not recorded)
    requests.post(f"{vllm_server.url}/reset_prefix_cache", timeout=60).raise_for_status()
    nonce = uuid.uuid4().hex[:8]
    tr, reqs = _rollout_recorded(vllm_server.url, tok, audio_dir, nonce)
    T = len(tr.input_ids_T)
    assert tr.num_turns == 3 and len(tr.audios) == 3 and len(reqs) == 3, (tr.num_turns, len(tr.audios), len(reqs))
    routed = np.asarray(tr.routed_experts)
    L, k = routed.shape[1:]
    assert routed.shape == (T - 1, L, k) and L >= 2 and k >= 2
    # every returned row: the ids the request that first computed that position fed its experts
    # (turn t's rows start where turn t-1's ended: the tail nobody had computed yet)
    want = np.full_like(routed, -1, dtype=np.int64)
    for rows in reversed(reqs):
        for p, ids in rows.items():
            if p < T - 1:
                want[p] = ids
    assert (want >= 0).all(), f"{int((want < 0).any(axis=(1, 2)).sum())} positions never computed"
    bad = np.flatnonzero((want != routed).any(axis=(1, 2)))
    assert bad.size == 0, f"positions {bad[:10]} of {T - 1}: returned {routed[bad[:3]].tolist()} used {want[bad[:3]].tolist()}"
    prompt_len = next(i for i, m in enumerate(tr.loss_mask_T) if m)
    decoded = [p for p in reqs[0] if p >= prompt_len]
    assert decoded, "the first turn decoded nothing"

    # the same conversation again: its prompts are prefix-cached now, so the server computes far
    # fewer positions, and the cached ones come back from vLLM's routed-experts store unchanged
    tr2, reqs2 = _rollout_recorded(vllm_server.url, tok, audio_dir, nonce)
    assert np.array_equal(tr2.input_ids_T, tr.input_ids_T)
    computed = sum(len(r) for r in reqs2)
    assert computed < (T - 1) // 2, f"no prefix cache hit: {computed} positions computed of {T}"
    assert np.array_equal(np.asarray(tr2.routed_experts), routed)
    print(f"\n[R3 capture] {T} tokens, {L} layers x top-{k}; rerun computed {computed} positions, "
          f"the other {T - 1 - computed} rows came from the prefix cache's store")
