"""A run directory's checkpoint lookup warns about what it passes over once, as a plain line; callers
that record warnings still get them."""
import os
import subprocess
import sys
import warnings
from pathlib import Path

from model_bridge.dist_ckpt.runs import CheckpointWarning, find_latest_checkpoint

REPO = Path(__file__).resolve().parents[3]


def _run_without_a_complete_checkpoint(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)  # no mgrpo_checkpoint.json
    return run


def test_passed_over_checkpoint_is_said_once_without_a_source_line(tmp_path):
    run = _run_without_a_complete_checkpoint(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run([sys.executable, "-m", "launch.cli", "convert", "mcore-to-hf", "--mcore", str(run),
                        "--out", str(tmp_path / "o")], cwd=REPO, env=env, text=True, capture_output=True,
                       timeout=120)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"ignoring {run}/checkpoints/step_00000001: it has no valid mgrpo_checkpoint.json, so it is not a "
        "complete checkpoint",
        f"mgrpo convert: error: {run} is a training run directory without a complete checkpoint under "
        f"{run}/checkpoints (a complete one is a step_<8-digit step> dir, e.g. step_00000020, with "
        "mgrpo_checkpoint.json)",
    ]
    assert not (tmp_path / "o").exists()


def test_recorded_warnings_still_name_the_checkpoint(tmp_path):
    run = _run_without_a_complete_checkpoint(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert find_latest_checkpoint(run) is None
    assert [(w.category, str(w.message)) for w in caught] == [
        (CheckpointWarning, f"ignoring {run}/checkpoints/step_00000001: it has no valid mgrpo_checkpoint.json, "
                            "so it is not a complete checkpoint")]
