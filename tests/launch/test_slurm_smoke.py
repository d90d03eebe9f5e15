"""The local one-node Slurm works as the launcher needs: batch jobs run, two jobs share the node
at once (rollout job + trainer job), and a requeued job runs again with SLURM_RESTART_COUNT=1."""
from __future__ import annotations

import time

import pytest

from slurm_local import local_slurm

__all__ = ["local_slurm"]  # the session fixture, used by name below

pytestmark = pytest.mark.slow


def test_requeued_job_runs_again(local_slurm, tmp_path):
    out = tmp_path / "job.out"
    script = ("#!/bin/bash\n"
              "echo \"run restart=${SLURM_RESTART_COUNT:-0} job=$SLURM_JOB_ID\"\n"
              "if [ \"${SLURM_RESTART_COUNT:-0}\" = 0 ]; then sleep 60; fi\n"
              "echo done\n")
    t0 = time.monotonic()
    jid = local_slurm.sbatch("--requeue", "--open-mode=append", "-o", str(out), "-J", "smoke",
                             f"--chdir={tmp_path}", script=script)
    local_slurm.wait_state(jid, "RUNNING", timeout=30)
    t_start = time.monotonic() - t0
    deadline = time.monotonic() + 10
    while "restart=0" not in (out.read_text() if out.exists() else ""):
        assert time.monotonic() < deadline, "first run printed nothing"
        time.sleep(0.2)
    local_slurm.run("scontrol", "requeue", str(jid))
    info = local_slurm.wait_state(jid, "PENDING", timeout=30)
    # the requeue BeginTime delay (module doc): short here through cred_expire
    assert info.get("Reason") in ("BeginTime", "None", "Priority", "Resources"), info
    t1 = time.monotonic()
    info = local_slurm.wait_done(jid, timeout=60)
    t_requeue = time.monotonic() - t1
    assert info["JobState"] == "COMPLETED", info
    assert info["Restarts"] == "1", info
    text = out.read_text()
    assert "run restart=0" in text and "run restart=1" in text and text.rstrip().endswith("done"), text
    print(f"job start {t_start:.1f} s; requeued job ran again and finished in {t_requeue:.1f} s; "
          f"cluster timings {local_slurm.timings}")
    assert local_slurm.alive()


def test_two_jobs_share_the_node(local_slurm, tmp_path):
    ids = [local_slurm.sbatch("-n", "1", "-c", "1", "-o", str(tmp_path / f"j{i}.out"), "-J",
                              f"share{i}", f"--chdir={tmp_path}",
                              script="#!/bin/bash\necho up\nsleep 120\n") for i in range(2)]
    try:
        deadline = time.monotonic() + 30
        while True:
            states = [local_slurm.state(j) for j in ids]
            if states == ["RUNNING", "RUNNING"]:
                break
            assert time.monotonic() < deadline, f"not both running at once: {states}"
            time.sleep(0.3)
    finally:
        local_slurm.scancel(*ids)
    for j in ids:
        assert local_slurm.wait_done(j, timeout=30)["JobState"] == "CANCELLED"
    assert local_slurm.alive()
