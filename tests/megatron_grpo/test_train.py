"""`mgrpo train` end to end: the embedded default (tiny Qwen3-Omni, synthetic audio data, a real
vLLM CPU server, 2 Megatron ranks at TP2) learns, writes its run dir, and resumes.

The end-to-end runs roll out on the session's vLLM server (`rollout.server=remote`; it is started
from the very spec `rollout.server=local` would start, tests/conftest.py) instead of a server of
their own each (a minute of start-up per run on 2 cores); `remote_server` pushes the checkpoint's
weights back afterwards. Starting and stopping the local server is tested by
tests/launch/test_slurm_local.py (the rollout job) and tests/megatron_grpo/run/test_sizing.py."""
import json
import os
import subprocess
import sys

import pytest

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("MGRPO_TEST_CACHE", REPO / ".cache" / "tests"))  # as tests/conftest.py

REWARD_STEPS = 4
"""Steps of the embedded-default run. The default is the audio-agent task from the cached tiny
cold start (megatron_grpo/run/embedded.py; built once per test cache, 280 s on 2 busy cores):
its reward rises over 20 steps (docs/sft.md) but moves by about as much from step to step as it
gains in 6, so this run checks that the agent loop runs and that every step has a learning signal;
4 steps hold a checkpoint written and dropped (step 2) and the one kept (step 4)."""
MIN_TURNS = (1.25, 1.7)
"""(every step, the mean of the steps): the cold start calls crop_audio. A model that answers at
once (the raw tiny model, or one that learned to skip the tool) has `turns/mean` 1.0 (docs/sft.md);
the cold start gives about 1.95 on average, 1.47-1.72 on the steps of the hardest prompts."""


def _remote(server) -> list[str]:
    """Overrides for a run on `server` that is otherwise the embedded default."""
    return ["rollout.server=remote", f"rollout.server_urls=[{server.url}]"]


def _mgrpo(*args, env_extra=None, timeout=1500):
    env = dict(os.environ, MGRPO_CACHE=str(CACHE / "embedded"), HF_HUB_OFFLINE="1")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_entry_point_prints_the_error_line_and_exit_code(mgrpo_inproc, tmp_path):
    """`python -m launch.cli` (what `mgrpo` runs) prints what `launch.cli.main` prints in-process,
    with its return value as the exit code: the config-error tests below run in-process through
    `mgrpo_inproc`."""
    args = ("train", "loss.varant=dapo", f"trainer.run_dir={tmp_path}")
    r, inproc = _mgrpo(*args), mgrpo_inproc(*args)
    assert (r.returncode, r.stderr, r.stdout) == (inproc.returncode, inproc.stderr, inproc.stdout) == (
        2, "mgrpo train: config error: unknown config key 'loss.varant' (did you mean 'loss.variant'?); valid "
           "keys here: ['dual_clip_c', 'entropy_coef', 'eps_high', 'eps_low', 'kl_coef', 'kl_estimator', "
           "'max_response_len', 'variant']\n", "")


def test_config_errors_are_one_line_naming_the_key(mgrpo_inproc, tmp_path):
    r = mgrpo_inproc("train", "loss.varant=dapo", f"trainer.run_dir={tmp_path}")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "mgrpo train: config error: unknown config key 'loss.varant' (did you mean 'loss.variant'?); "
        "valid keys here: ['dual_clip_c', 'entropy_coef', 'eps_high', 'eps_low', 'kl_coef', 'kl_estimator', "
        "'max_response_len', 'variant']"]
    r = mgrpo_inproc("train", "parallel.tp=1", "parallel.ep=3", "parallel.nproc=3", f"trainer.run_dir={tmp_path}")
    assert r.returncode == 2  # (building the embedded inputs on first use may log above the error)
    assert r.stderr.strip().splitlines()[-1:] == [
        "mgrpo train: config error: parallel layout does not fit the model: ep=3 does not divide num_experts=8"]
    # --nproc N is parallel.nproc=N before the checks, and overrides may follow an option
    r = mgrpo_inproc("train", "--nproc", "3", "parallel.tp=1", "parallel.ep=3", f"trainer.run_dir={tmp_path}")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1:] == [
        "mgrpo train: config error: parallel layout does not fit the model: ep=3 does not divide num_experts=8"]
    r = mgrpo_inproc("train", "--nproc", "0")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == \
        "mgrpo train: error: argument --nproc: must be a positive integer, got '0'"
    r = mgrpo_inproc("train", "--bogus", "1")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == "mgrpo train: error: unrecognized arguments: --bogus"


def test_yaml_syntax_error_and_config_with_resume_are_one_line(mgrpo_inproc, tmp_path):
    bad = tmp_path / "run.yaml"
    bad.write_text("trainer: [1,2\n")
    r = mgrpo_inproc("train", "--config", str(bad))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"mgrpo train: config error: config file {bad} is not valid YAML at line 2, column 1: "
        "expected ',' or ']', but got '<stream end>'"]
    r = mgrpo_inproc("train", "--config", str(bad), "--resume", str(tmp_path))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"mgrpo train: config error: --config {bad} with --resume {tmp_path}: a resumed run keeps its saved "
        f"config ({tmp_path / 'config.json'}); pass changes as KEY=VALUE overrides instead"]
    fix = ("pass the trainer.run_dir of an earlier `mgrpo train` (it holds config.json and checkpoints/), or start "
           "a new run with --config")
    for where, what in ((tmp_path / "missing", "does not exist"), (tmp_path, "has no config.json (not a run dir)")):
        r = mgrpo_inproc("train", "--resume", str(where))
        assert r.returncode == 2
        assert r.stderr.strip().splitlines() == [f"mgrpo train: config error: --resume {where} {what}: {fix}"]
    saved = tmp_path / "config.json"
    for text, what in (("", "is not valid JSON (Expecting value: line 1 column 1 (char 0))"),
                       ("[]", "does not hold a JSON object")):
        saved.write_text(text)
        r = mgrpo_inproc("train", "--resume", str(tmp_path))
        assert r.returncode == 2
        assert r.stderr.strip().splitlines() == [
            f"mgrpo train: config error: {saved} {what}; it is written by `mgrpo train` at the start of a run: "
            "restore it or start a new run"]


def test_a_new_run_never_writes_over_checkpoints_and_resume_needs_one(mgrpo_inproc, tmp_path):
    from megatron_grpo.engine.checkpoint import CHECKPOINT_FORMAT, META_FILE

    run = tmp_path / "run"
    run.mkdir()  # a run dir with a config but no checkpoint
    (run / "config.json").write_text(json.dumps({"trainer": {"run_dir": str(run)}}))
    r = mgrpo_inproc("train", "--resume", str(run))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        f"mgrpo train: config error: --resume {run}: no complete checkpoint under {run / 'checkpoints'} yet, "
        "so there is nothing to resume: start the run over without --resume (same trainer.run_dir; its "
        "metrics.jsonl starts afresh)")
    step = run / "checkpoints" / "step_00000010"
    step.mkdir(parents=True)
    (step / META_FILE).write_text(json.dumps({"format": CHECKPOINT_FORMAT, "step": 10}))
    r = mgrpo_inproc("train", f"trainer.run_dir={run}")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        f"mgrpo train: config error: trainer.run_dir={run} already holds a run with checkpoints (newest: "
        f"step_00000010): continue it with `mgrpo train --resume {run}`, or start a new run in another "
        "trainer.run_dir (or remove that directory)")
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.json"]  # nothing touched


def test_resume_without_steps_left_fails_before_anything_starts_or_is_written(mgrpo_inproc, tmp_path):
    from launch.train_cli import _check_run_dir
    from megatron_grpo.engine.checkpoint import CHECKPOINT_FORMAT, META_FILE

    run = tmp_path / "run"
    step = run / "checkpoints" / "step_00000020"
    step.mkdir(parents=True)
    (step / META_FILE).write_text(json.dumps({"format": CHECKPOINT_FORMAT, "step": 20}))
    saved = json.dumps({"trainer": {"run_dir": str(run), "steps": 20}, "model": {"hf_dir": str(tmp_path / "model")}})
    (run / "config.json").write_text(saved)
    for steps in (2, 20):
        r = mgrpo_inproc("train", "--resume", str(run), f"trainer.steps={steps}")
        assert r.returncode == 2
        assert r.stderr.strip().splitlines() == [
            f"mgrpo train: config error: {run} is at step 20 (its newest checkpoint); trainer.steps={steps} leaves "
            "nothing to train: pass trainer.steps greater than 20"]
    assert (run / "config.json").read_text() == saved  # nothing written, no server started
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.json"]
    _check_run_dir(str(run), True, 21)  # one step left: fine


def test_bad_data_row_fails_before_any_rank_or_server_starts(mgrpo_inproc, tmp_path):
    """A malformed JSONL row is reported in one line naming the file and line, with exit 2, before
    the ranks spawn and the vLLM server starts (which takes minutes on a 30B model)."""
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "<audio>hi"}]}\n')
    r = mgrpo_inproc("train", f"data.train_jsonl={bad}", f"trainer.run_dir={tmp_path / 'run'}")
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"mgrpo train: data error: {bad} line 1: missing 'audios'"), last
    assert "vllm" not in (r.stdout + r.stderr).lower()
    assert "cold start" not in r.stdout + r.stderr  # the data is checked before the cold start's minutes
    assert not (tmp_path / "run" / "vllm-server.log").exists()


@pytest.mark.slow
@pytest.mark.cold_start
def test_embedded_default_learns_checkpoints_and_resumes(remote_server, tmp_path):
    run = tmp_path / "run"
    # the checkpoints written in the background (checkpoint.async_save; "auto" is off on CPU): the
    # loop finishes each one at a later step or at the end, and the resume below reads the last
    r = _mgrpo("train", f"trainer.steps={REWARD_STEPS}", "checkpoint.every=2", "checkpoint.keep_last=1",
               "checkpoint.async_save=true", *_remote(remote_server), f"trainer.run_dir={run}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "rows; the embedded synthetic audio-agent data, as data.train_jsonl is unset)\n" in r.stdout
    assert "turns per conversation (a turn past the first follows a tool call): step 1 " in r.stdout
    m = _metrics(run)
    assert [x["step"] for x in m] == list(range(1, REWARD_STEPS + 1))
    assert all(x["mismatch_kl_k3"] >= 0 for x in m), [x["mismatch_kl_k3"] for x in m]  # k3 >= 0 (algo/kl.py)
    print(f"turns/mean {[x['turns/mean'] for x in m]}, reward/mean {[round(x['reward/mean'], 3) for x in m]}; "
          f"step time {sum(x['time/step'] for x in m) / len(m):.1f} s")
    turns = [x["turns/mean"] for x in m]
    assert min(turns) >= MIN_TURNS[0] and sum(turns) / len(turns) >= MIN_TURNS[1], turns
    assert all(x["reward/tool_call"] > 0 for x in m), [x["reward/tool_call"] for x in m]  # executed, well-formed
    assert all(x["reward/frac_zero_std"] < 1 for x in m), [x["reward/frac_zero_std"] for x in m]
    assert all(x["reward/std"] > 0 and x["grad_norm"] > 0 for x in m)  # every step had advantages to learn from
    assert (run / "curves.png").stat().st_size > 1000
    assert any((run / "tensorboard").iterdir())
    # step 2's checkpoint was written and then dropped (keep_last=1)
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")) == ["step_00000004"]
    assert json.loads((run / "checkpoints" / "step_00000004" / "mgrpo_checkpoint.json").read_text())["async_write"]
    for key in ("loss", "grad_norm", "mismatch_kl_k3", "time/rollout", "time/train", "time/push", "tokens_per_s"):
        assert key in m[0], key

    r = _mgrpo("train", "--resume", str(run), f"trainer.steps={REWARD_STEPS + 1}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m2 = _metrics(run)
    assert [x["step"] for x in m2] == list(range(1, REWARD_STEPS + 2))
    assert m2[:REWARD_STEPS] == m
    assert (run / "checkpoints" / "step_00000005").is_dir()


@pytest.mark.slow
@pytest.mark.cold_start
def test_one_step_off_policy_overlap(remote_server, tmp_path):
    """rollout.overlap: step k+1 rolls out while step k trains, one policy version behind."""
    run = tmp_path / "overlap"
    r = _mgrpo("train", "trainer.steps=3", "rollout.overlap=true", "checkpoint.every=0", "checkpoint.at_end=false",
               *_remote(remote_server), f"trainer.run_dir={run}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = _metrics(run)
    assert [x["rollout/weight_lag"] for x in m] == [0.0, 1.0, 1.0]
    # the summary at the end, once (rank 0); no notice about what is fine (transformers on
    # Qwen3-Omni's MRoPE keys, megatron's CUDA stream advice on a CPU machine)
    assert r.stdout.count("mgrpo train: done (3 steps)") == 1, r.stdout[-3000:]
    for notice in ("Unrecognized keys in `rope_parameters`", "CUDA_DEVICE_MAX_CONNECTIONS"):
        assert notice not in r.stdout + r.stderr, notice
    assert f"reward: step 1 {m[0]['reward/mean']:.3f} -> step 3 {m[-1]['reward/mean']:.3f}" in r.stdout
    assert all(x["time/rollout"] < 1.0 for x in m[1:]), [x["time/rollout"] for x in m]


def test_zero_std_groups_are_counted_and_a_streak_is_announced_once(capsys):
    """`reward/frac_zero_std` is the share of groups whose samples all scored the same (their
    advantages are 0); the first step of a streak where that share is 1 prints one line."""
    from types import SimpleNamespace

    from megatron_grpo.train import _step_metrics, _warn_no_signal

    def traj(group, reward):
        return SimpleNamespace(group_id=group, reward=reward, num_generated=4, num_turns=1, weight_version=0,
                               reward_terms={"answer_chars": reward})

    mixed = [traj(0, 0.5), traj(0, 0.5), traj(1, 0.0), traj(1, 0.25), traj(2, 1.0)]
    m = _step_metrics(1, mixed, {}, 0.0, {"rollout": 1.0})
    assert m["reward/frac_zero_std"] == pytest.approx(2 / 3)  # groups 0 and 2 (a group of one) are flat
    flat = _step_metrics(2, [traj(0, 0.0), traj(0, 0.0), traj(1, 0.0), traj(1, 0.0)], {}, 0.0, {})
    assert flat["reward/frac_zero_std"] == 1.0

    streak = _warn_no_signal(1, m, False)
    assert not streak and capsys.readouterr().out == ""
    streak = _warn_no_signal(2, flat, streak)
    assert streak
    assert capsys.readouterr().out.startswith(
        "[train] step 2: no learning signal: every group's samples scored the same (mean reward 0.000), so every "
        "advantage is 0")
    assert _warn_no_signal(3, flat, streak) and capsys.readouterr().out == ""  # announced once per streak
    assert not _warn_no_signal(4, m, True)


def test_unknown_reward_or_plugin_fails_before_any_rank_or_server_starts(mgrpo_inproc, tmp_path):
    r = mgrpo_inproc("train", "rollout.reward_funcs=[iuo]", "rollout.reward_weights=null", f"trainer.run_dir={tmp_path / 'a'}")
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("mgrpo train: config error: unknown reward function 'iuo' (did you mean 'iou'?); "
                           "registered: ['answer_chars', 'format', 'iou'"), last
    r = mgrpo_inproc("train", f"rollout.plugin={tmp_path / 'nope.py'}", f"trainer.run_dir={tmp_path / 'b'}")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == \
        f"mgrpo train: config error: plugin file not found: {tmp_path / 'nope.py'} (rollout.plugin)"
    assert not (tmp_path / "a" / "vllm-server.log").exists() and not (tmp_path / "b" / "vllm-server.log").exists()


def test_unreachable_remote_server_fails_before_any_rank_starts(mgrpo_inproc, tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    r = mgrpo_inproc("train", "rollout.server=remote", f"rollout.server_urls=[{url}]", f"trainer.run_dir={tmp_path}")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        f"mgrpo train: config error: rollout server {url} is unreachable (ConnectionError); is `mgrpo serve` "
        "running there? (rollout.server_urls)")
