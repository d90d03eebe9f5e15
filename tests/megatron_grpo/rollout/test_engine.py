"""Multi-turn rollouts against the real vLLM CPU server: token-exact trajectories with audio tool
turns, tool errors that do not stop a rollout, roots confinement, plugins, failure handling.

The tiny model writes random text, so tool calls are scripted: `TeacherForcedSampler` sends the
scripted turn's ids to the server, which scores them (prompt logprobs), or a scripted policy
answers every sampled turn with a crop.  Either way every id of the trajectory went through the
server, and each test re-sends the finished trajectory to the server to check that its prompt
ids equal ours exactly (the trainer's token count is vLLM's) and its logprobs match.
"""
import asyncio
import copy
import logging
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from megatron_grpo.data.features import audio_token_counts
from megatron_grpo.data.reader import PromptRow
from megatron_grpo.data.synth import CROP_AUDIO_TOOL
from megatron_grpo.rollout.client import (AudioItem, RolloutClient, RolloutServerError,
                                          collapse_audio_runs)
from megatron_grpo.rollout.config import RolloutConfig
from megatron_grpo.rollout.engine import (HermesToolPolicy, RolloutConsistencyError, RolloutEngine,
                                          ServerSampler, TeacherForcedSampler, stitch_routed_experts)
from megatron_grpo.rollout.plugins import Registry, builtin_registry, load_registry
from megatron_grpo.rollout.tools import Tool
from megatron_grpo.trajectory import check_alignment

REPO = Path(__file__).resolve().parents[3]
SR = 16000
LOGPROB_ATOL = 2e-5   # decode-time logprobs vs a prefill of the whole trajectory (fp32 CPU: measured 0)


# ---------------------------------------------------------------------------------------- setup
@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_ckpt)


@pytest.fixture(scope="module")
def audio_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("audio")
    (d / "data").mkdir()
    (d / "outside").mkdir()
    t = np.arange(int(7.3 * SR)) / SR
    rec = (0.01 * np.sin(2 * np.pi * 50 * t) + 0.3 * np.sin(2 * np.pi * 440 * t) * ((t > 2) & (t < 4))).astype(np.float32)
    sf.write(d / "data" / "rec.wav", rec, SR, subtype="FLOAT")
    sf.write(d / "data" / "rec2.wav", rec[: 4 * SR][::-1].copy(), SR, subtype="FLOAT")
    sf.write(d / "outside" / "secret.wav", rec, SR, subtype="FLOAT")
    return d


def make_row(audio_dir, i=0, name="rec.wav", gt="[00:02 - 00:04]"):
    return PromptRow(prompt_index=i, messages=[{"role": "user", "content": [
        {"type": "audio", "audio_index": 0},
        {"type": "text", "text": "\nWhen does the beep occur? Answer [MM:SS - MM:SS]."}]}],
        tools=[CROP_AUDIO_TOOL], audio_paths=(str(audio_dir / "data" / name),),
        columns={"ground_truth": gt, "id": f"row{i}"})


def cfg_for(url, **kw):
    base = dict(server_urls=[url], num_generations=2, max_turns=5, max_new_tokens=16,
                max_tool_calls=10, seed=1234, max_retries=0, backoff_s=0.05)
    base.update(kw)
    return RolloutConfig(**base)


def call(name, **args):
    import json
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def explode(x=None, *, ctx):
    raise RuntimeError("tool exploded")


def registry_with(*tools, plugin=None):
    reg = load_registry(plugin) if plugin else builtin_registry()
    for t in tools:
        reg.add_tool(t)
    return reg


async def rescore(url, traj, pad_id):
    """Send the finished trajectory back (all clips, one pad per clip) and score every token."""
    audios = [AudioItem.from_waveform(a) for a in traj.audios]
    async with RolloutClient(RolloutConfig(server_urls=[url], max_retries=0)) as c:
        return await c.generate(collapse_audio_runs(traj.input_ids_T, pad_id), audios, max_tokens=1,
                                prompt_logprobs=True)


def verify(url, trajs, pad_id, label=""):
    """Alignment, audio counts, server prompt ids == ours, logprobs == server's. Returns max diff."""
    worst = 0.0
    for tr in trajs:
        check_alignment(tr, pad_id)
        assert tr.audio_token_counts == audio_token_counts(tr.audios)
        res = asyncio.run(rescore(url, tr, pad_id))
        assert res.prompt_token_ids == tr.input_ids_T.tolist(), "the server sees other tokens than the trainer"
        m = np.array(tr.loss_mask_T, bool)
        ours = np.array(tr.rollout_logprobs_T)[m]
        theirs = np.array([np.nan] + res.prompt_logprobs[1:])[m]
        diff = float(np.abs(ours - theirs).max()) if m.any() else 0.0
        worst = max(worst, diff)
        assert diff <= LOGPROB_ATOL, (diff, ours, theirs)
    print(f"[{label}] {len(trajs)} trajectories, tokens {[t.num_tokens for t in trajs]}, generated "
          f"{[t.num_generated for t in trajs]}, max |rollout logprob - rescored| = {worst:.2e}")
    return worst


# ------------------------------------------------------------------------- 5-turn tool conversations
SCRIPTS = {
    # sample 0: crop, malformed JSON, crop past the end (clamped), unknown tool, then sampled
    0: [call("crop_audio", start_sec=1.0, end_sec=2.5),
        '<think>\nlisten again\n</think>\n<tool_call>\n{"name": "crop_audio", "arguments": {"start_sec": 2 "end_sec": 3}}\n</tool_call>',
        call("crop_audio", start_sec=2, end_sec=99),
        call("nope", x=1), None],
    # sample 1: crop, a tool that raises, a file outside the audio roots, another file inside, sampled
    1: [call("crop_audio", start_sec=0, end_sec=0.75),
        call("explode", x=1),
        call("crop_audio", start_sec=0, end_sec=1, audio_path="../outside/secret.wav"),
        call("crop_audio", start_sec=0.5, end_sec=3, audio_path="rec2.wav"), None],
}


def run_five_turn(url, tok, audio_dir, n_rows=2):
    cfg = cfg_for(url, num_generations=2, max_new_tokens=128)
    reg = registry_with(Tool("explode", explode, {"type": "object", "properties": {"x": {"type": "integer"}}}))
    eng = RolloutEngine(cfg, tok, registry=reg, audio_roots=[str(audio_dir / "data")])
    sampler = TeacherForcedSampler(eng.client, lambda s: SCRIPTS[s.sample_index][s.num_turns])
    eng.sampler = sampler
    rows = [make_row(audio_dir, i) for i in range(n_rows)]
    t0 = time.monotonic()
    batch = eng.run(rows)
    return eng, batch, sampler, time.monotonic() - t0


@pytest.mark.slow
def test_five_turn_audio_tool_conversations_token_exact(vllm_server, tok, audio_dir):
    eng, batch, sampler, secs = run_five_turn(vllm_server.url, tok, audio_dir)
    trajs = batch.trajectories
    assert len(trajs) == 4 and not batch.dropped and sampler.forced_turns == 16
    for tr in trajs:
        assert tr.num_turns == 5 and tr.finish_reason in ("stop", "length", "invalid_token")
        assert tr.columns["ground_truth"] == "[00:02 - 00:04]" and tr.weight_version >= 0
        # prompt clip + 2 tool clips, each its own pad run, counts from the server = trainer's rule
        assert len(tr.audios) == 3 and len(tr.audio_token_counts) == 3
        # five generated spans (mask runs), four tool turns between them
        runs = np.flatnonzero(np.diff(np.r_[0, tr.loss_mask_T, 0]) == 1)
        assert len(runs) == 5
    text0 = tok.decode(trajs[0].input_ids_T)
    assert "error: malformed tool call JSON (Expecting ',' delimiter" in text0
    assert "end clamped to 00:07.30, the end of the recording" in text0
    assert "error: unknown tool 'nope'; available tools: crop_audio, explode" in text0
    text1 = tok.decode(trajs[1].input_ids_T)
    assert "error: explode failed: RuntimeError: tool exploded" in text1
    assert "error: crop_audio: refused: '../outside/secret.wav' lies outside the dataset's audio roots" in text1
    assert "Audio from 00:00.50 to 00:03 (2.50 s)" in text1
    # the tool turns follow the chat template right after the sampled <|im_end|> (mask 1)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids, mask = trajs[0].input_ids_T, trajs[0].loss_mask_T
    ends = [i for i in range(len(ids) - 1) if mask[i] == 1 and mask[i + 1] == 0]
    assert len(ends) == 4 and all(ids[i] == im_end for i in ends)
    assert tok.decode(ids[ends[0] + 1: ends[0] + 7]) == "\n<|im_start|>user\n<tool_response>\n"
    # the clipped audio is exactly the crop of the recording
    rec = sf.read(audio_dir / "data" / "rec.wav", dtype="float32")[0]
    assert np.array_equal(trajs[0].audios[1], rec[SR: int(2.5 * SR)])
    assert np.array_equal(trajs[0].audios[2], rec[2 * SR:])
    worst = verify(vllm_server.url, trajs, eng.audio_token_id, "5-turn scripted tool calls")
    print(f"5-turn rollout of {len(trajs)} conversations: {secs:.1f} s, stats {batch.stats}")
    assert batch.stats["tool_errors"] == 8 and worst <= LOGPROB_ATOL


class CropEveryTurn(HermesToolPolicy):
    """Test policy: whatever the model sampled, answer with a crop (never finishes on its own)."""

    name = "crop_every_turn"

    def is_finished(self, state):
        return False

    async def step(self, state, response):
        from megatron_grpo.rollout.engine import NextTurn, tool_message
        from megatron_grpo.rollout.tools import ToolResult

        if state.num_turns == 3:   # the server takes 4 clips per prompt: one text-only tool turn
            res = ToolResult(text="error: no segment selected")
        else:
            s = 0.4 * state.num_turns + 0.1 * state.sample_index
            res = await self.call_tool(state, "crop_audio",
                                       {"start_sec": s, "end_sec": s + 0.5 + 0.25 * state.num_turns})
        return NextTurn(messages=[tool_message("crop_audio", res)], tool_calls=1)


def run_sampled(url, tok, audio_dir, **kw):
    reg = builtin_registry()
    reg.add_policy("crop_every_turn", CropEveryTurn)
    # a logit bias on <|im_end|> makes the random model end some turns itself (EOS path) and run
    # into max_new_tokens in others (length path); vLLM's logprobs are the raw model's either way
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = cfg_for(url, num_generations=3, max_new_tokens=12, policy="crop_every_turn",
                  extra_sampling_params={"logit_bias": {str(im_end): 8.0}}, **kw)
    eng = RolloutEngine(cfg, tok, registry=reg, audio_roots=[str(audio_dir / "data")])
    return eng, eng.run([make_row(audio_dir, 0), make_row(audio_dir, 1, name="rec2.wav")])


@pytest.mark.slow
def test_five_sampled_turns_with_audio_token_exact(vllm_server, tok, audio_dir):
    eng, batch = run_sampled(vllm_server.url, tok, audio_dir)
    trajs = batch.trajectories
    assert len(trajs) == 6 and [t.group_id for t in trajs] == [0, 0, 0, 1, 1, 1]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    eos_turns = length_turns = 0
    for tr in trajs:
        assert tr.num_turns == 5 and tr.finish_reason in ("max_turns", "invalid_token")
        assert len(tr.audios) == 4 or tr.finish_reason == "invalid_token"
        ids, mask = tr.input_ids_T, tr.loss_mask_T
        for i in range(len(ids) - 1):
            if mask[i] == 1 and mask[i + 1] == 0:   # end of a sampled turn inside the conversation
                if ids[i] == im_end:
                    eos_turns += 1                  # sampled <|im_end|>: template goes on after it
                else:
                    length_turns += 1               # cut by max_tokens: template brings <|im_end|>
                    assert ids[i + 1] == im_end
    assert eos_turns > 0 and length_turns > 0, (eos_turns, length_turns)
    verify(vllm_server.url, trajs, eng.audio_token_id, "5 sampled turns")
    # negative control: the same ids with one tool clip replaced by noise of the same length
    # score differently, so the logprob check above does see the audio tokens were conditioned on
    tr = trajs[0]
    swapped = copy.copy(tr)
    noise = np.random.default_rng(0).uniform(-1, 1, len(tr.audios[0])).astype(np.float32)
    swapped.audios = [noise] + tr.audios[1:]
    res = asyncio.run(rescore(vllm_server.url, swapped, eng.audio_token_id))
    m = np.array(tr.loss_mask_T, bool)
    moved = np.abs(np.array(tr.rollout_logprobs_T)[m] - np.array([np.nan] + res.prompt_logprobs[1:])[m]).max()
    print(f"negative control (prompt clip replaced by noise): max logprob change {moved:.2e}")
    assert res.prompt_token_ids == tr.input_ids_T.tolist() and moved > 10 * LOGPROB_ATOL, moved
    # same seed, same server, same weights -> the same rollout
    _, again = run_sampled(vllm_server.url, tok, audio_dir)
    assert [t.input_ids_T.tolist() for t in again.trajectories] == [t.input_ids_T.tolist() for t in trajs]


# ------------------------------------------------------------------------------- plugin + rewards
@pytest.mark.slow
def test_audio_agent_plugin_rollout_and_rewards(vllm_server, tok, audio_dir):
    plugin = REPO / "examples" / "plugins" / "audio_agent.py"
    answer = "<think>\nThe beep starts at two seconds and stops at four.\n</think>\n\n[00:02 - 00:04]"
    scripts = {0: [call("crop_audio", start_sec=1, end_sec=5), answer],
               1: [call("crop_audio", start_sec=0, end_sec=2), call("crop_audio", start_sec=2, end_sec=4),
                   call("crop_audio", start_sec=4, end_sec=6)],
               2: ["<think>\nno idea\n</think>\nsomewhere [00:03 - 00:06]"]}
    cfg = cfg_for(vllm_server.url, num_generations=3, max_new_tokens=64, plugin=str(plugin),
                  reward_funcs=["audio_format", "audio_iou", "think_quality"], reward_weights=[0.5, 1.0, 0.2])
    eng = RolloutEngine(cfg, tok, audio_roots=[str(audio_dir / "data")])
    eng.sampler = TeacherForcedSampler(eng.client, lambda s: scripts[s.sample_index][s.num_turns])

    async def go():
        async with eng:
            b = await eng.rollout([make_row(audio_dir)])
            await eng.score(b.trajectories)
            return b
    trajs = asyncio.run(go()).trajectories
    assert [(t.finish_reason, t.num_turns, len(t.audios)) for t in trajs] == [
        ("answer", 2, 2), ("tool_limit", 3, 3), ("answer", 1, 1)]   # the 3rd crop is not run
    # think: 10 words of the 15 the plugin asks for
    assert trajs[0].reward_terms == {"audio_format": 1.0, "audio_iou": 2.0, "think_quality": pytest.approx(10 / 15)}
    assert trajs[1].reward_terms["audio_format"] == 0.0 and trajs[1].reward_terms["audio_iou"] == 0.0
    assert trajs[2].reward_terms["audio_iou"] == 0.5          # IoU 1/4
    assert trajs[0].reward == pytest.approx(0.5 + 2.0 + 0.2 * 10 / 15)
    verify(vllm_server.url, trajs, eng.audio_token_id, "audio_agent plugin")


# ------------------------------------------------------------------------------- failures
class FailingSampler(ServerSampler):
    """Raises a server error for the chosen (prompt, sample) at its second turn."""

    def __init__(self, client, fail):
        super().__init__(client)
        self.fail = fail

    async def generate(self, engine, state, prompt_ids, **kw):
        if (state.row.prompt_index, state.sample_index) in self.fail and state.num_turns == 1:
            raise RolloutServerError("rollout server http://fake:1 closed the connection mid-request",
                                     url="http://fake:1")
        return await super().generate(engine, state, prompt_ids, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["raise", "drop_sample", "drop_group"])
def test_failed_sample_never_half_written(vllm_server, tok, audio_dir, mode):
    reg = builtin_registry()
    reg.add_policy("crop_every_turn", CropEveryTurn)
    cfg = cfg_for(vllm_server.url, num_generations=2, max_turns=2, max_new_tokens=4, on_error=mode,
                  policy="crop_every_turn")
    eng = RolloutEngine(cfg, tok, registry=reg, audio_roots=[str(audio_dir / "data")])
    eng.sampler = FailingSampler(eng.client, fail={(1, 0)})
    rows = [make_row(audio_dir, 0), make_row(audio_dir, 1)]
    if mode == "raise":
        with pytest.raises(RolloutServerError, match="http://fake:1 closed the connection"):
            eng.run(rows)
        return
    batch = eng.run(rows)
    got = [(t.prompt_index, t.num_turns) for t in batch.trajectories]
    if mode == "drop_sample":
        assert got == [(0, 2), (0, 2), (1, 2)] and batch.dropped[0][:2] == (1, 0)
    else:
        assert got == [(0, 2), (0, 2)] and batch.dropped[-1][:2] == (1, None)
    for t in batch.trajectories:
        check_alignment(t, eng.audio_token_id)


@pytest.mark.slow
def test_divergent_server_prompt_is_caught(vllm_server, tok, audio_dir):
    class Tamper(ServerSampler):
        async def generate(self, engine, state, prompt_ids, **kw):
            res = await super().generate(engine, state, prompt_ids, **kw)
            if state.num_turns == 1:
                res.prompt_token_ids[3] += 1
            return res

    reg = builtin_registry()
    reg.add_policy("crop_every_turn", CropEveryTurn)
    eng = RolloutEngine(cfg_for(vllm_server.url, num_generations=1, max_turns=2, max_new_tokens=4,
                                policy="crop_every_turn"), tok, registry=reg)
    eng.sampler = Tamper(eng.client)
    with pytest.raises(RolloutConsistencyError, match="differs from the trajectory at token 3"):
        eng.run([make_row(audio_dir)])


def test_stitch_routed_experts():
    # turn 1: prompt 5 + 3 sampled -> rows for positions 0..6; turn 2 prompt 11 (+3) + 2 sampled
    t1 = np.arange(7 * 2 * 2).reshape(7, 2, 2)
    t2 = 100 + np.arange(5 * 2 * 2).reshape(5, 2, 2)       # positions 7..11 (T = 13)
    out = stitch_routed_experts([t1, t2], total_tokens=13)
    assert out.shape == (12, 2, 2) and (out[7] == t2[0]).all()
    with pytest.raises(RolloutConsistencyError, match="cover 12 positions, expected 13"):
        stitch_routed_experts([t1, t2], total_tokens=14)


def test_routing_replay_and_config_checks():
    assert RolloutConfig(routing_replay=True, return_routed_experts=True).routing_replay == "r3"
    assert RolloutConfig(routing_replay="r2").routing_replay == "r2"
    with pytest.raises(ValueError, match="set rollout.return_routed_experts=true too"):
        RolloutConfig(routing_replay="r3")
    with pytest.raises(ValueError, match="must be false, true \\(= r3\\), r3 or r2, got 'r1'"):
        RolloutConfig(routing_replay="r1")
    with pytest.raises(ValueError, match="rollout.on_error must be one of"):
        RolloutConfig(on_error="ignore")
    with pytest.raises(ValueError, match="unknown key rollout.max_turn; did you mean rollout.max_turns"):
        RolloutConfig.from_dict({"max_turn": 3})
    with pytest.raises(ValueError, match="reward_weights has 1 entries for 2"):
        RolloutConfig(reward_weights=[1.0])
    with pytest.raises(ValueError, match="may not set \\['max_tokens'\\]"):
        RolloutConfig(extra_sampling_params={"max_tokens": 3})
    c = RolloutConfig(server_urls="http://h:1/", api_key="k")
    assert c.server_urls == ["http://h:1"] and c.to_dict()["api_key"] == "***" and "k'" not in repr(c)


def test_unreachable_server_is_named(tok):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    eng = RolloutEngine(cfg_for(url), tok)
    with pytest.raises(RolloutServerError, match=f"rollout server {url} is unreachable"):
        eng.run([])


# ------------------------------------------------------------------------------- a server dies
@pytest.mark.slow
def test_server_killed_mid_rollout(vllm_server, tiny_ckpt, tok, audio_dir, tmp_path):
    """A second, small server dies (SIGKILL) while it has requests in flight: those requests are
    retried on the session server and every trajectory comes back complete and token-exact; then a
    rollout against the dead server alone fails with an error naming it."""
    from megatron_grpo.rollout.server import ServerSpec, VLLMServer

    spec = ServerSpec(model=str(tiny_ckpt), served_model_name=vllm_server.spec.served_model_name,
                      dtype="float32", max_model_len=2048, max_num_seqs=2, weight_transfer_backend=None,
                      worker_extension=None)
    import re
    import tempfile

    tmp_root = Path(tempfile.gettempdir())
    before = {q.name for q in tmp_root.iterdir()}
    doomed = VLLMServer(spec, tmp_path / "doomed.log").start(timeout=900)
    own_tmp = Path(doomed._tmp)
    # vLLM's ZMQ sockets and rendezvous files go to the server's own temp folder, not the shared one
    assert any(own_tmp.iterdir()), "vLLM wrote nothing to the server's own temp folder"
    try:
        reg = builtin_registry()
        reg.add_policy("crop_every_turn", CropEveryTurn)
        cfg = cfg_for(vllm_server.url, num_generations=2, max_turns=2, max_new_tokens=300,
                      extra_sampling_params={"ignore_eos": True}, max_retries=2, backoff_s=0.2)
        cfg.server_urls = [vllm_server.url, doomed.url]
        eng = RolloutEngine(cfg, tok, registry=reg, audio_roots=[str(audio_dir / "data")])
        killed = {}

        async def killer():
            b = next(s for s in eng.client.servers if s.url == doomed.url)
            while not (b.served >= 1 and b.inflight >= 1):
                await asyncio.sleep(0.02)
            killed["inflight"] = b.inflight
            os.killpg(os.getpgid(doomed.proc.pid), signal.SIGKILL)

        async def go():
            async with eng:
                k = asyncio.create_task(killer())
                batch = await eng.rollout([make_row(audio_dir, i) for i in range(3)])
                await asyncio.wait_for(k, 1)
                return batch
        batch = asyncio.run(go())
        assert killed["inflight"] >= 1
        assert len(batch.trajectories) == 6 and not batch.dropped
        assert batch.stats["client"]["retries"] >= 1 and batch.stats["client"]["failures"] >= 1
        for t in batch.trajectories:   # 300 random tokens may hit an <|audio_pad|> (cut there)
            assert (t.num_turns, t.finish_reason) == (2, "max_turns") or t.finish_reason == "invalid_token"
        verify(vllm_server.url, batch.trajectories, eng.audio_token_id, "after a server died")
        print(f"killed the second server with {killed['inflight']} request(s) in flight; "
              f"client stats {batch.stats['client']}")

        dead = RolloutEngine(cfg_for(doomed.url, max_retries=1), tok, registry=reg)
        with pytest.raises(RolloutServerError, match=f"rollout server {doomed.url} is unreachable"):
            dead.run([make_row(audio_dir)])
    finally:
        doomed.stop()
    assert not own_tmp.exists()  # stop() removed it, sockets of the killed server included
    uuid = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
    left = [n for n in {q.name for q in tmp_root.iterdir()} - before if uuid.match(n) or n.startswith("vllm_dist_")]
    assert left == [], left
