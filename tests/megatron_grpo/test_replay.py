"""Record and replay rollouts (rollout.record_dir, rollout.server: replay): the training phase of
`mgrpo train` without a vLLM server.

Measured (tiny embedded job, 2 prompts x 4 samples, 2 steps, CPU): replaying the recording at the
recording's layout (nproc 2, TP2) gives bit-identical step metrics (loss, grad_norm, entropy, ...),
also across `--resume`; at nproc 1 / TP1, step 1 differs only by TP reduction order: grad_norm
9.139180074 vs 9.139179239 (rel 9e-8), entropy rel 1e-7, loss 6.26e-7 vs 6.11e-7 (abs 1.5e-8; the
on-policy loss is ~0, the mean of normalised advantages).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_grpo.run.replay import (MANIFEST, check_compatible, load_step, read_manifest,
                                      trajectory_from_record, trajectory_to_record)
from megatron_grpo.trajectory import Trajectory

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("MGRPO_TEST_CACHE", REPO / ".cache" / "tests"))  # as tests/conftest.py
DEAD_URL = "http://127.0.0.1:9"  # the discard port: nothing listens there
QUIET = ["checkpoint.every=0", "logging.progress=false", "logging.tensorboard=false", "logging.plot=false"]
COMPARED = ("loss", "pg_loss", "grad_norm", "entropy", "moe_load_balancing_loss", "global_num_tokens",
            "reward/mean", "samples")


def _mgrpo(*args, timeout=900):
    env = dict(os.environ, MGRPO_CACHE=str(CACHE / "embedded"), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _manifest_dir(path: Path, steps, **kw) -> Path:
    path.mkdir(parents=True)
    m = {"format": 1, "model_dir": "m", "vocab_size": 576, "audio": {"num_mel_bins": 128}, "steps": steps,
         "max_token_id": 10, "config": {}}
    m.update(kw)
    (path / MANIFEST).write_text(json.dumps(m))
    return path


def _traj(gid, audio):
    return Trajectory(prompt_index=3, group_id=gid, input_ids_T=[1, 2, 7, 7, 5], loss_mask_T=[0, 0, 0, 0, 1],
                      rollout_logprobs_T=[0.0, 0.0, 0.0, 0.0, -0.1234567890123], audios=[audio],
                      audio_token_counts=[2], completion_texts=["hi"], num_turns=1, finish_reason="answer",
                      weight_version=4, columns={"ground_truth": [1.5, 2.0]}, reward=0.25,
                      reward_terms={"format": 1.0, "iou": None}, advantage=-0.7071067811865476)


def test_record_round_trip_is_exact_and_stores_a_shared_clip_once(tmp_path):
    a = np.random.default_rng(0).standard_normal(1600).astype(np.float32)
    trajs = [_traj(7, a), _traj(7, a), _traj(7, a.copy()), _traj(8, a[:800].copy())]
    clips, index = [], {}
    recs = [trajectory_to_record(t, clips, index) for t in trajs]
    # one clip object, stored once; an equal copy is another object, as the trainer sees it
    assert len(clips) == 3 and [r["audios"] for r in recs] == [[0], [0], [1], [2]]
    torch.save({"clips": clips, "trajectories": recs}, tmp_path / "s.pt")
    back = torch.load(tmp_path / "s.pt", weights_only=True)  # plain tensors/dicts only
    waves = [c.numpy() for c in back["clips"]]
    got = [trajectory_from_record(d, waves) for d in back["trajectories"]]
    assert got[0].audios[0] is got[1].audios[0] and got[2].audios[0] is not got[0].audios[0]
    for t, u in zip(trajs, got):
        assert np.array_equal(u.audios[0], t.audios[0]) and u.audios[0].dtype == np.float32
        u.audios, t.audios = [], []
        assert u == t  # every other field exactly (floats through float64)


def test_replay_config_errors(mgrpo_inproc, tmp_path):
    r = mgrpo_inproc("train", "rollout.server=replay", f"rollout.replay_dir={tmp_path / 'none'}",
               f"trainer.run_dir={tmp_path / 'run'}")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1:] == [
        f"mgrpo train: config error: rollout: rollout.replay_dir {tmp_path / 'none'} does not exist: record one "
        "first with rollout.record_dir=<dir> (docs/training.md, 'Record and replay rollouts')"]
    rec = _manifest_dir(tmp_path / "rec", [1, 2])
    r = mgrpo_inproc("train", "rollout.server=replay", f"rollout.replay_dir={rec}", "trainer.steps=5",
               f"trainer.run_dir={tmp_path / 'run'}")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1:] == [
        f"mgrpo train: config error: config: rollout.replay_dir {rec} holds 2 recorded steps but "
        "trainer.steps=5 (no steps 3..5): set trainer.steps<=2 or record 5 steps (rollout.record_dir with "
        "trainer.steps=5)"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no manifest.json: not a recording"):
        read_manifest(tmp_path / "empty")


def test_recording_must_fit_the_checkpoint(tmp_path, tiny_ckpt):
    check_compatible(read_manifest(_manifest_dir(tmp_path / "ok", [1])), tiny_ckpt)
    bad = _manifest_dir(tmp_path / "mels", [1], audio={"num_mel_bins": 80})
    with pytest.raises(ValueError, match=r"recorded with 80 audio mel bins .* has audio_config.num_mel_bins=128"):
        check_compatible(read_manifest(bad), tiny_ckpt, bad)
    bad = _manifest_dir(tmp_path / "vocab", [1], max_token_id=600, vocab_size=151936)
    with pytest.raises(ValueError, match=r"recorded token id 600 >= vocab_size 576 of model.hf_dir"):
        check_compatible(read_manifest(bad), tiny_ckpt, bad)
    # the audio special token ids (a tiny recording replayed on a checkpoint with the release's ids)
    ok = {"audio_token_id": 512, "audio_start_token_id": 506, "audio_end_token_id": 507}  # the tiny preset's
    check_compatible(read_manifest(_manifest_dir(tmp_path / "ids_ok", [1], special_token_ids=ok)), tiny_ckpt)
    bad = _manifest_dir(tmp_path / "ids", [1], special_token_ids={**ok, "audio_token_id": 151675})
    with pytest.raises(ValueError) as e:
        check_compatible(read_manifest(bad), tiny_ckpt, bad)
    assert str(e.value) == (
        f"rollout.replay_dir {bad}: recorded with other audio token ids than model.hf_dir {tiny_ckpt} has "
        "(audio_token_id 151675 vs 512; recording vs checkpoint): the thinker would find no audio positions; "
        "replay on a checkpoint with the recording's thinker token ids")


def _check_trainer_logprobs(rec: Path, run: Path, live: list) -> None:
    """The trainer logprobs kept beside the recording (nproc 2, TP2: gathered to rank 0) are each
    sample's own: within fp32 noise of vLLM's on every generated token, 0 elsewhere, and they give
    the step's logged mismatch_kl_k1; logging.trajectories kept step 1's first group with the same
    values; `mgrpo report` shows them."""
    for k in (1, 2):
        trajs, _ = load_step(rec, k)
        lps = torch.load(rec / f"step_{k:06d}.trainer.pt", weights_only=True)["trainer_logprobs"]
        assert len(lps) == len(trajs)
        d_sum, n = 0.0, 0
        for t, lp in zip(trajs, lps):
            mask = torch.tensor(t.loss_mask_T, dtype=torch.bool)
            ro = torch.tensor(t.rollout_logprobs_T, dtype=torch.float32)
            assert lp.shape == ro.shape and not lp[~mask].any()
            assert (ro - lp)[mask].abs().max() < 1e-3, (ro - lp)[mask].abs().max()  # fp32 server and trainer
            d_sum += float((ro - lp)[mask].double().sum())
            n += int(mask.sum())
        assert d_sum / n == pytest.approx(live[k - 1]["mismatch_kl_k1"], rel=1e-3, abs=1e-7)
    light = torch.load(run / "trajectories" / "step_000001.pt", weights_only=True)
    idx = light["sample_index"]
    assert len(idx) == 4 and sorted(p.name for p in (run / "trajectories").iterdir()) == [MANIFEST, "step_000001.pt"]
    full = torch.load(rec / "step_000001.trainer.pt", weights_only=True)["trainer_logprobs"]
    assert all(torch.equal(a, full[i]) for a, i in zip(light["trainer_logprobs"], idx))
    r = _mgrpo("report", str(run))
    assert r.returncode == 0 and "2 step pages (1..2)" in r.stdout, r.stdout + r.stderr
    page = (run / "report" / "step_000001.html").read_text()
    assert f'<tr data-key="reward/mean"><th>reward/mean</th><td data-v="{live[0]["reward/mean"]!r}">' in page


@pytest.mark.slow
@pytest.mark.cold_start
def test_record_then_replay_without_a_server(remote_server, tmp_path):
    """Record 2 steps of the embedded job (real vLLM CPU server, nproc 2, TP2, returning routed
    experts); replay them with no server (server_urls at a dead port) at nproc 1/TP1 and, with a
    resume, at the recording's layout; then with MoE routing replay of the server's routes (r3)
    and of the trainer's own old-pass routes (r2).

    The recording rolls out on the session server (`rollout.server=remote`: the very server
    `rollout.server=local` would start, tests/conftest.py) rather than on a server of its own, a
    minute of start-up on 2 cores; starting and stopping a run's own local server is covered by
    tests/megatron_grpo/run/test_sizing.py and tests/launch/test_slurm_local.py."""
    rec = tmp_path / "rec"
    # long answers (up to 3 turns x 1024 tokens): the random tiny model must score in some of 8
    # samples for step 1 to have non-zero advantages (24-token turns scored 0 in all 8)
    small = ["trainer.steps=2", "trainer.prompts_per_step=2", "rollout.num_generations=4", *QUIET,
             "rollout.max_turns=3", "rollout.max_new_tokens=1024",
             "rollout.reward_funcs=[answer_chars,format]", "rollout.reward_weights=[1.0,1.0]",
             "rollout.return_routed_experts=true"]
    r = _mgrpo("train", *small, f"rollout.record_dir={rec}", f"trainer.run_dir={tmp_path / 'live'}",
               "logging.trajectories.every=2", "logging.trajectories.max_samples=4",
               "rollout.server=remote", f"rollout.server_urls=[{remote_server.url}]")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    live = _metrics(tmp_path / "live")
    assert sorted(p.name for p in rec.iterdir()) == [MANIFEST, "step_000001.pt", "step_000001.trainer.pt",
                                                     "step_000002.pt", "step_000002.trainer.pt"]
    _check_trainer_logprobs(rec, tmp_path / "live", live)
    assert f"trajectories: `mgrpo report {tmp_path / 'live'}` writes them as web pages" in r.stdout
    manifest = read_manifest(rec)
    assert manifest["steps"] == [1, 2] and manifest["audio"]["num_mel_bins"] == 128
    assert manifest["vocab_size"] == 576 and manifest["config"]["parallel"]["tp"] == 2
    trajs, _ = load_step(rec, 1)
    assert len(trajs) == live[0]["samples"] and sum(t.num_generated for t in trajs) == live[0]["tokens/generated"]
    assert [t.reward for t in trajs] and any(t.advantage != 0.0 for t in trajs)
    assert all(np.asarray(t.routed_experts).shape == (t.num_tokens - 1, 2, 2) for t in trajs)

    replay = ["rollout.server=replay", f"rollout.replay_dir={rec}", f"rollout.server_urls=[{DEAD_URL}]", *QUIET]
    run = tmp_path / "tp1"
    r = _mgrpo("train", "trainer.steps=2", "parallel.nproc=1", "parallel.tp=1", *replay, f"trainer.run_dir={run}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("no vLLM server is started or contacted, no weights are pushed") == 1
    assert "[serve]" not in r.stdout + r.stderr and not (run / "vllm-server.log").exists()
    tp1 = _metrics(run)
    assert [x["step"] for x in tp1] == [1, 2] and {x["rollout_source"] for x in tp1} == {"replay"}
    for k in ("samples", "global_num_tokens", "reward/mean", "reward/std"):
        assert tp1[0][k] == live[0][k], k  # the same data
    # the step-1 loss is O(1) per-token terms that cancel to ~1e-7 (each group's advantages sum to
    # 0 and the ratio is 1), so TP1's and TP2's fp32 reduction orders alone move it by a few fp32
    # eps: measured 1.5e-8 and 1.04e-7 apart in two runs; grad_norm below carries the parity
    assert tp1[0]["loss"] == pytest.approx(live[0]["loss"], abs=5e-7)
    for k in ("grad_norm", "entropy"):
        assert tp1[0][k] == pytest.approx(live[0][k], rel=1e-5), k  # measured <= 1e-7 (TP1 vs TP2)
    # the recording's samples differ from run to run (vLLM's CPU sampling is not seeded), and a
    # token whose top-k experts are near-tied can route differently under TP1's and TP2's reduction
    # orders, which moves the load-balancing loss by a step: 1.4e-5 relative in one CI run
    assert tp1[0]["moe_load_balancing_loss"] == pytest.approx(live[0]["moe_load_balancing_loss"], rel=1e-4)

    run = tmp_path / "tp2"  # the recording's layout: bit-identical, and across --resume
    r = _mgrpo("train", "trainer.steps=1", *replay, "checkpoint.at_end=true", f"trainer.run_dir={run}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = _mgrpo("train", "--resume", str(run), "trainer.steps=2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    tp2 = _metrics(run)
    assert [x["step"] for x in tp2] == [1, 2]
    for a, b in zip(tp2, live):
        assert {k: a[k] for k in COMPARED} == {k: b[k] for k in COMPARED}
    _replay_routes(tmp_path, replay, live)


def _replay_routes(tmp_path, replay, live):
    """The recording trained with routing replay (TP1): r3 replays the server's routes, r2 the
    trainer's own from the step's old-policy pass; both log router/* and the mismatch KL."""
    got = {}
    for mode in ("r3", "r2"):
        run = tmp_path / mode
        r = _mgrpo("train", "trainer.steps=2", "parallel.nproc=1", "parallel.tp=1", *replay,
                   "rollout.return_routed_experts=true", f"rollout.routing_replay={mode}", f"trainer.run_dir={run}")
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        got[mode] = _metrics(run)
        print(f"[routing replay {mode}] " + "; ".join(
            f"step {x['step']}: agreement {x['router/agreement']:.4f}, replayed {x['router/replayed_fraction']:.4f}, "
            f"mismatch_kl_k3 {x['mismatch_kl_k3']:.2e} (live {y['mismatch_kl_k3']:.2e})" for x, y in zip(got[mode], live)))
    for x in got["r3"]:  # every position but each sample's last token (and padding) has a server row
        assert 0.9 < x["router/replayed_fraction"] < 1.0 and 0.9 <= x["router/agreement"] <= 1.0, x
    for x in got["r2"]:  # the same weights route the same way in the old pass and in training
        assert x["router/replayed_fraction"] == 1.0 and x["router/agreement"] == 1.0, x
    assert got["r3"][0]["samples"] == live[0]["samples"] and got["r2"][0]["global_num_tokens"] == live[0]["global_num_tokens"]
