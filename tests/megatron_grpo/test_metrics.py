"""megatron_grpo/metrics.py: the summary `mgrpo train` prints when a run ends."""
from __future__ import annotations

import json

from megatron_grpo.metrics import run_summary


def _write(run, rows):
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_run_summary_reward_step_times_and_outputs(tmp_path):
    run = tmp_path / "run"
    _write(run, [
        {"step": 1, "reward/mean": 0.25, "time/step": 10.0, "time/rollout": 6.0, "time/train": 3.5, "time/push": 0.5},
        {"step": 2, "reward/mean": 0.5, "time/step": 12.0, "time/rollout": 8.0, "time/train": 3.5, "time/push": 0.25},
    ])
    (run / "curves.png").write_bytes(b"")
    (run / "checkpoints").mkdir()
    assert run_summary(run) == [
        "reward: step 1 0.250 -> step 2 0.500",
        "mean step 11.0 s = rollout 7.0 + train 3.5 + push 0.38",
        f"run dir: {run}/ (metrics.jsonl, curves.png, checkpoints/)",
    ]


def test_run_summary_of_a_replayed_run_and_of_no_steps(tmp_path):
    run = tmp_path / "replayed"
    _write(run, [{"step": 3, "reward/mean": 1.0, "time/step": 2.0, "time/train": 1.5}])
    assert run_summary(run)[:2] == ["reward: step 3 1.000 -> step 3 1.000", "mean step 2.0 s = train 1.5"]
    assert run_summary(tmp_path / "nothing") == []
    _write(tmp_path / "empty", [])
    assert run_summary(tmp_path / "empty") == []
