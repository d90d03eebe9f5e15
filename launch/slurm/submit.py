"""Write a rendered slurm run to disk and submit it: rollout job first, trainer job after it.

Files in ``<out>`` (default ``<trainer.run_dir>/slurm``): ``rollout.sbatch``, ``train.sbatch``,
``config.yaml``, ``api_key`` (a fresh token, mode 0600, never printed and never inside a script),
``servers/`` (one ``<hostname>.url`` per live rollout server), ``logs/`` and, once submitted,
``jobs.json`` (both job ids).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

from launch.slurm.render import LaunchError, SlurmPlan

__all__ = ["write_files", "write_api_key", "submit", "check_sbatch", "SubmitError"]


class SubmitError(RuntimeError):
    """sbatch refused a job; the message carries its output."""


def write_api_key(path: Path) -> None:
    """A new random token in `path`, created with mode 0600 (no window with wider permissions)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")


def write_files(plan: SlurmPlan, files: dict[str, str]) -> list[Path]:
    """Write the rendered files (scripts executable), a fresh api_key, and the servers/ and logs/
    dirs into ``plan.out``; return the paths written."""
    out = plan.out
    for d in (out, out / "servers", out / "logs"):
        d.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        p = out / name
        p.write_text(text)
        if name.endswith(".sbatch"):
            p.chmod(0o755)
        written.append(p)
    write_api_key(out / "api_key")
    written.append(out / "api_key")
    (out / "jobs.json").unlink(missing_ok=True)  # belongs to an earlier submission
    return written


def check_sbatch() -> None:
    if shutil.which("sbatch") is None:
        raise LaunchError("sbatch is not on PATH: run `mgrpo launch slurm` on the cluster's login node (or "
                          "`module load slurm` first), or add --dry-run to only write the scripts")


def _sbatch(args: list[str]) -> str:
    r = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SubmitError(f"`sbatch --parsable {' '.join(args)}` failed (exit {r.returncode}): "
                          f"{(r.stderr or r.stdout).strip()}")
    job = r.stdout.strip().splitlines()[-1].split(";")[0].strip()  # "<id>" or "<id>;<cluster>"
    if not job:
        raise SubmitError(f"`sbatch --parsable {' '.join(args)}` printed no job id: {r.stdout!r}")
    return job


def sbatch_commands(plan: SlurmPlan, rollout_job: str = "<rollout job id>") -> list[list[str]]:
    """The two sbatch invocations (the second depends on the first's id)."""
    return [["sbatch", "--parsable", str(plan.out / "rollout.sbatch")],
            ["sbatch", "--parsable", f"--dependency=after:{rollout_job}",
             f"--export=ALL,MGRPO_ROLLOUT_JOB_ID={rollout_job}", str(plan.out / "train.sbatch")]]


def submit(plan: SlurmPlan) -> dict:
    """Submit rollout.sbatch, then train.sbatch after it; write and return ``jobs.json``'s content.
    When the trainer job is refused, the rollout job is cancelled again."""
    check_sbatch()
    rollout = _sbatch(sbatch_commands(plan)[0][2:])
    try:
        train = _sbatch(sbatch_commands(plan, rollout)[1][2:])
    except SubmitError:
        subprocess.run(["scancel", rollout], capture_output=True)
        raise
    jobs = {"rollout": rollout, "train": train, "out": str(plan.out), "run_dir": str(plan.run_dir),
            "submitted": time.time(),
            "logs": {"rollout": str(plan.log_dir / f"rollout-{rollout}.out"),
                     "train": str(plan.log_dir / f"train-{train}.out")}}
    tmp = plan.out / ".jobs.json.tmp"
    tmp.write_text(json.dumps(jobs, indent=2) + "\n")
    tmp.replace(plan.out / "jobs.json")
    return jobs
