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
        {"step": 1, "reward/mean": 0.25, "turns/mean": 1.5, "reward/tool_call": 0.34,
         "time/step": 10.0, "time/rollout": 6.0, "time/train": 3.5, "time/push": 0.5},
        {"step": 2, "reward/mean": 0.5, "turns/mean": 2.125, "reward/tool_call": 0.59,
         "time/step": 12.0, "time/rollout": 8.0, "time/train": 3.5, "time/push": 0.25},
    ])
    (run / "curves.png").write_bytes(b"")
    (run / "checkpoints").mkdir()
    assert run_summary(run) == [
        "reward: step 1 0.250 -> step 2 0.500",
        "turns per conversation (a turn past the first follows a tool call): step 1 1.50 -> step 2 2.12; "
        "reward/tool_call 0.34 -> 0.59",
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


def test_a_cut_short_last_line_is_dropped_and_the_log_goes_on(tmp_path):
    """A run killed while writing metrics.jsonl: the partial last line is dropped with a warning,
    and the resumed logger's next row starts on a line of its own."""
    import pytest

    from megatron_grpo.metrics import MetricsLogger, read_metrics

    run = tmp_path / "killed"
    _write(run, [{"step": 1, "reward/mean": 0.5}])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "rew')
    with pytest.warns(UserWarning, match=r"metrics.jsonl: line 2 is cut short .*dropped \(its step is replayed on resume\)"):
        assert read_metrics(run / "metrics.jsonl") == [{"step": 1, "reward/mean": 0.5}]
    with pytest.warns(UserWarning):
        log = MetricsLogger(run, tensorboard=False, plot=False)
    log.log(2, {"reward/mean": 0.75})
    log.close()
    assert read_metrics(run / "metrics.jsonl")[1]["reward/mean"] == 0.75 and len(read_metrics(run / "metrics.jsonl")) == 2


def test_a_bad_line_before_the_last_names_the_file_and_line(tmp_path):
    import pytest

    from megatron_grpo.metrics import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not JSON \(Expecting value\): 'not json'; "
                                         r"delete or fix that line \(each line is one step's metrics\)"):
        read_metrics(path)
