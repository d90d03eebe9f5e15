"""`mgrpo launch slurm` on a real (one-node, localhost) Slurm: the tiny CPU recipe trains to the
end through a preemption (the SIGUSR1'd trainer job checkpoints, requeues itself and resumes), and
the trainer's server wait gives up at once when the rollout job has died.

Both jobs (the rollout job with its vLLM CPU server, the trainer job with 2 gloo ranks) share the
one node, as `slurm_local` lets them. Everything binds to loopback (launch.socket_ifname=lo; the
default would be the first address of `hostname -I`) on ports picked free. The run is the
embedded tiny job cut down: few steps, 2 prompts x 4 samples.
"""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.slurm.node import _ENDED_STATES
from slurm_local import local_slurm

__all__ = ["local_slurm"]  # the session fixture, used by name below

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("MGRPO_TEST_CACHE", REPO / ".cache" / "tests"))  # as tests/conftest.py
JOB_TIMEOUT_S = 600


def _free_port() -> int:
    """A free port below the kernel's ephemeral range (32768+): a port the kernel handed out for
    bind(0) can be taken by some outgoing connection before the job binds it, seconds later."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port in 20000-32000")


def _launch(cluster, tmp_path: Path, *overrides: str) -> tuple[dict, Path]:
    """`mgrpo launch slurm --recipe tiny_cpu` into tmp_path; returns (jobs.json, run_dir)."""
    run, out = tmp_path / "run", tmp_path / "slurm"
    env = dict(cluster.env, MGRPO_CACHE=str(CACHE / "embedded"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    serve_port = _free_port()
    master_port = next(p for p in iter(_free_port, None) if p != serve_port)
    cmd = [sys.executable, "-m", "launch.cli", "launch", "slurm", "--recipe", "tiny_cpu",
           "--out", str(out), f"trainer.run_dir={run}", "trainer.prompts_per_step=2",
           "rollout.num_generations=4", "launch.socket_ifname=lo",
           f"launch.serve_port={serve_port}", f"launch.master_port={master_port}",
           "launch.time=00:30:00", "launch.health_timeout_s=300", *overrides]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    jobs = json.loads((out / "jobs.json").read_text())
    return jobs, run


def _logs(jobs: dict, cluster) -> str:
    parts = []
    logs = Path(jobs["out"]) / "logs"
    for f in sorted(logs.glob("*")) if logs.is_dir() else []:
        lines = f.read_text(errors="replace").splitlines()
        parts.append(f"===== {f.name} (last 60 of {len(lines)} lines)\n" + "\n".join(lines[-60:]))
    for key in ("rollout", "train"):
        parts.append(f"===== scontrol show job {jobs[key]}: {cluster.job(jobs[key])}")
    parts.append(cluster.diagnostics())
    return "\n".join(parts)


def _wait(cond, timeout: float, what: str, jobs: dict, cluster, poll: float = 0.5, unless_ended: str = ""):
    """Poll ``cond`` until it is true; fail after ``timeout``, or at once when the job
    ``jobs[unless_ended]`` has ended (a trainer that crashed at its start is not waited for)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        state = cluster.job(jobs[unless_ended]).get("JobState", "") if unless_ended else ""
        if state in _ENDED_STATES and not cond():  # cond again: the job may have ended right after it came true
            pytest.fail(f"the {unless_ended} job ended ({state}) while waiting for {what}\n{_logs(jobs, cluster)}")
        time.sleep(poll)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{_logs(jobs, cluster)}")


def _metrics(run: Path) -> list[dict]:
    f = run / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []


def _steps(run: Path) -> list[int]:
    return [m["step"] for m in _metrics(run)]


def _checkpoints(run: Path) -> list[int]:
    from megatron_grpo.engine.checkpoint import list_checkpoints

    return [s for s, _ in list_checkpoints(run)]


def _finish(jobs: dict, cluster, timeout: float = JOB_TIMEOUT_S) -> tuple[dict, dict]:
    """Wait until the trainer job ended and then the rollout job; return both records."""
    t_end = time.monotonic() + timeout
    try:
        train = cluster.wait_done(jobs["train"], timeout=timeout)
        rollout = cluster.wait_done(jobs["rollout"], timeout=max(30.0, t_end - time.monotonic()))
    except TimeoutError as e:
        pytest.fail(f"{e}\n{_logs(jobs, cluster)}")
    return train, rollout


@pytest.mark.cold_start
def test_preempted_trainer_checkpoints_requeues_and_resumes(local_slurm, tmp_path):
    """The tiny CPU run trains to the end through one preemption: the trainer job checkpoints at
    USR1, is requeued once, resumes, finishes (DONE, no second requeue) and cancels the rollout
    job. (One run for both: a run without preemption takes the same path minus the requeue, and a
    launcher run costs minutes here: a vLLM server and 2 ranks.)"""
    steps = 3
    t0 = time.monotonic()
    jobs, run = _launch(local_slurm, tmp_path, f"trainer.steps={steps}", "checkpoint.every=0",
                        "checkpoint.keep_last=2")
    tid = jobs["train"]
    _wait(lambda: len(_steps(run)) >= 1, JOB_TIMEOUT_S, "the first step's metrics", jobs,
          local_slurm, unless_ended="train")
    t_signal = time.monotonic()
    local_slurm.scancel("--signal=USR1", tid)  # what slurm does at --signal=USR1@120
    # PREEMPTED lives from the preemption checkpoint until the requeued job starts (>= the
    # requeue BeginTime delay, slurm_local.CRED_EXPIRE_S), so poll for it
    marker = _wait(lambda: (run / "PREEMPTED").exists() and (run / "PREEMPTED").read_text(),
                   300, "the PREEMPTED marker", jobs, local_slurm, poll=0.2)
    k = json.loads(marker)["step"]
    assert 1 <= k < steps, marker
    assert k in _checkpoints(run), (k, _checkpoints(run))
    requeued = _wait(lambda: int(local_slurm.job(tid).get("Restarts", 0)) >= 1 and
                     local_slurm.job(tid), 120, "the trainer job to be requeued", jobs, local_slurm)
    t_requeue = time.monotonic() - t_signal
    train, rollout = _finish(jobs, local_slurm)
    elapsed = time.monotonic() - t0
    why = _logs(jobs, local_slurm)
    assert train["JobState"] == "COMPLETED", why
    assert train["Restarts"] == "1", why
    assert rollout["JobState"] == "CANCELLED" and rollout["Restarts"] == "0", why
    assert _steps(run) == list(range(1, steps + 1)), why  # k+1..N after 1..k, nothing repeated
    assert _checkpoints(run) == [k, steps], why  # the preemption's and the end's (checkpoint.every=0)
    done = json.loads((run / "DONE").read_text())
    assert str(done["job"]) == str(jobs["train"]), done
    assert not (run / "PREEMPTED").exists(), why
    log = Path(jobs["logs"]["train"]).read_text()  # --open-mode=append: both runs of the job
    assert "[train] finished" in log and "cancelling the rollout job" in log, why
    assert "(restart 0)" in log and "(restart 1)" in log, why
    assert f"[train] preempted: checkpoint of step {k} saved" in log, why
    assert f"--resume {run}" in log.split("(restart 1)", 1)[1], why
    assert f"resuming from the checkpoint of step {k}" in log, why
    assert local_slurm.alive(), local_slurm.diagnostics()
    print(f"preempted at step {k} (requeued state {requeued.get('JobState')} "
          f"{t_requeue:.1f} s after USR1); submit -> both jobs ended {elapsed:.1f} s")


def test_wait_servers_fails_at_once_when_the_rollout_job_ended(local_slurm, tmp_path):
    """A rollout job whose server crashed: the trainer job's wait-servers gives up at once instead of
    after launch.health_timeout_s."""
    from launch.slurm.node import ServersNotReady, wait_servers

    ended = local_slurm.sbatch("-o", str(tmp_path / "dead.out"), "-J", "dead-rollout",
                               script="#!/bin/bash\nexit 1\n")
    assert local_slurm.wait_done(ended, timeout=30)["JobState"] == "FAILED"
    alive = local_slurm.sbatch("-o", str(tmp_path / "alive.out"), "-J", "slow-rollout",
                               script="#!/bin/bash\nsleep 120\n")
    local_slurm.wait_state(alive, "RUNNING", timeout=30)
    quiet = lambda *a, **k: None  # noqa: E731
    with local_slurm.activated():
        t0 = time.monotonic()
        with pytest.raises(ServersNotReady, match=f"the rollout job {ended} has ended \\(FAILED\\)"):
            wait_servers(tmp_path / "servers", 1, timeout=60, rollout_log="LOG", poll_s=0.2, log=quiet,
                         rollout_job=str(ended))
        assert time.monotonic() - t0 < 10
        with pytest.raises(ServersNotReady, match="0 of 1 rollout servers ready after 2 s"):
            wait_servers(tmp_path / "servers", 1, timeout=2, poll_s=0.2, log=quiet,
                         rollout_job=str(alive))
    local_slurm.scancel(alive)
