"""Hang guards: the schedule check raises a clear error on every rank; the watchdog turns a stall
into a stack dump naming the collective, and a non-zero exit (real gloo ranks)."""
from __future__ import annotations

import re
import time

import pytest

from megatron_grpo.hang import (HANG_EXIT_CODE, ScheduleMismatchError, StepSchedule, Watchdog, check_schedule,
                                 note_collective)
from model_bridge.spawn import run_ranks


# ------------------------------------------------------------------------------------------------
# rank functions (run in spawned processes)
# ------------------------------------------------------------------------------------------------

def _init():
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    return dist.get_rank()


def _outcome(fn):
    t0 = time.monotonic()
    try:
        fn()
        return ("ok", None, None, time.monotonic() - t0)
    except ScheduleMismatchError as e:
        return ("raised", str(e), e.field, time.monotonic() - t0)


def _mismatch_cases():
    """Every case in the same two processes; each rank returns what it saw per case."""
    import torch.distributed as dist

    rank = _init()
    out = {}
    # 1. rank 1 claims one more micro-batch than rank 0 (different DP ranks: only the count must agree)
    if rank == 0:
        s = StepSchedule(12, 3, (64, 64, 32), (1, 0, 0))
    else:
        s = StepSchedule(12, 4, (64, 48, 32, 8))
    out["count"] = _outcome(lambda: check_schedule(s, peer_key=rank))
    # 2. DP ranks with different token counts per micro-batch but the same count: fine
    s = StepSchedule(13, 2, (64, 32) if rank == 0 else (48, 48), (1, 0) if rank == 0 else (0, 0))
    out["dp_ok"] = _outcome(lambda: check_schedule(s, peer_key=rank))
    # 3. TP peers (same key) that built different micro-batches
    s = StepSchedule(14, 3, (64, 32, 16) if rank == 0 else (64, 40, 16))
    out["tokens"] = _outcome(lambda: check_schedule(s, peer_key=0))
    # 4. TP peers that disagree on which micro-batch carries audio
    s = StepSchedule(15, 2, (64, 32), (2, 0) if rank == 0 else (0, 2))
    out["audio"] = _outcome(lambda: check_schedule(s, peer_key=0))
    # 5. a rank one step ahead
    s = StepSchedule(16 + rank, 1, (8,))
    out["step"] = _outcome(lambda: check_schedule(s, peer_key=rank))
    # 6. identical peers pass; and the group is still usable afterwards (nobody left waiting)
    s = StepSchedule(17, 2, (64, 32), (1, 0))
    out["peers_ok"] = _outcome(lambda: check_schedule(s, peer_key=0))
    import torch

    t = torch.ones(1)
    dist.all_reduce(t)
    out["after"] = float(t.item())
    dist.destroy_process_group()
    return out


def _stall(run_dir: str, timeout_s: float):
    """Step 1 completes; in step 2 rank 1 sleeps while rank 0 waits in an all_reduce."""
    import torch
    import torch.distributed as dist

    rank = _init()
    wd = Watchdog(timeout_s, run_dir, first_step_timeout_s=30, backstop_s=None).start()
    with wd.step(1):
        t = torch.ones(1)
        with wd.collective("grad_all_reduce"):
            dist.all_reduce(t)
    with wd.step(2):
        if rank == 1:
            note_collective("rollout_wait")
            time.sleep(60)  # stuck outside any collective
        t = torch.ones(1)
        with wd.collective("grad_all_reduce"):
            dist.all_reduce(t)  # rank 0 waits here for rank 1
    return "finished"  # never reached


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------

def test_schedule_mismatch_raises_clear_error_on_every_rank():
    t0 = time.monotonic()
    results = run_ranks(_mismatch_cases, 2, timeout=90)
    wall = time.monotonic() - t0
    r0, r1 = results
    for case in ("count", "tokens", "audio", "step"):
        assert r0[case][0] == r1[case][0] == "raised", (case, r0[case], r1[case])
        assert r0[case][1] == r1[case][1], "both ranks must raise the same message"
        assert r0[case][3] < 5.0, f"{case}: the check took {r0[case][3]:.1f}s"
    assert r0["count"][1] == ("step 12: ranks disagree on the micro-batch count: rank 0 has 3, rank 1 has 4 -- the "
                              "packer must equalise counts (invariant 1: MAX all-reduce, then pad with empty "
                              "micro-batches)")
    assert r0["count"][2] == "num_microbatches"
    assert "step 14" in r0["tokens"][1] and "tokens per micro-batch" in r0["tokens"][1]
    assert "rank 0 has [64, 32, 16], rank 1 has [64, 40, 16]" in r0["tokens"][1]
    assert "first difference at micro-batch 1" in r0["tokens"][1]
    assert "audio clips per micro-batch" in r0["audio"][1] and "rank 0 has [2, 0], rank 1 has [0, 2]" in r0["audio"][1]
    assert "invariant 2" in r0["audio"][1]
    assert "step number" in r0["step"][1] and "rank 0 has 16, rank 1 has 17" in r0["step"][1]
    for case in ("dp_ok", "peers_ok"):
        assert r0[case][0] == r1[case][0] == "ok", (case, r0[case], r1[case])
    assert r0["after"] == r1["after"] == 2.0
    print(f"\nschedule checks: 2 ranks, 6 cases in {wall:.1f}s wall; e.g. {r0['count'][1]}")


def _launch(args: list[str], world: int, timeout: float) -> list[tuple[int, str]]:
    """Start ``python test_hang.py *args`` as ``world`` torchrun-style ranks; wait for all of them to
    exit on their own (nobody is killed early, unlike run_ranks); [(exit code, output)] by rank."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from model_bridge.spawn import free_port

    here = Path(__file__).resolve()
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
               "PYTHONPATH": str(here.parents[2])}
        procs.append(subprocess.Popen([sys.executable, str(here), *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    out = []
    try:
        deadline = time.monotonic() + timeout
        for p in procs:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, text))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return out


def test_watchdog_dumps_stacks_and_exits_nonzero_on_stall(tmp_path):
    t0 = time.monotonic()
    results = _launch(["--stall", str(tmp_path), "2.0"], 2, timeout=90)
    wall = time.monotonic() - t0
    codes = [c for c, _ in results]
    assert codes == [HANG_EXIT_CODE, HANG_EXIT_CODE], (codes, results[0][1][-2000:], results[1][-1][-2000:])
    assert wall < 60, f"the watchdogs should end both ranks within seconds, took {wall:.1f}s"
    dumps = {r: tmp_path / f"hang-rank{r}-step2.txt" for r in range(2)}
    assert all(p.exists() for p in dumps.values()), sorted(p.name for p in tmp_path.iterdir())
    text = dumps[0].read_text()
    assert "rank 0 is stuck" in text
    assert re.search(r"step 2 has run \d+\.\d s, over its 2 s timeout", text)
    assert 'last collective entered: "grad_all_reduce"' in text and "still inside" in text
    assert "in all_reduce" in text  # the waiting frame (faulthandler and traceback both name it)
    assert "dist.all_reduce(t)  # rank 0 waits here" in text  # source line of the waiting frame
    assert "_stall" in text
    assert f"exiting with code {HANG_EXIT_CODE}" in text
    assert "=== megatron-grpo watchdog: rank 0 is stuck ===" in results[0][1]  # also on stderr
    t1 = dumps[1].read_text()  # the sleeping rank's own watchdog fired too
    assert 'last collective entered: "rollout_wait"' in t1 and "time.sleep(60)" in t1
    assert f"exiting with code {HANG_EXIT_CODE}" in t1
    print(f"\nwatchdog: both ranks exited {codes} after {wall:.1f}s wall; dumps: "
          f"{sorted(p.name for p in tmp_path.iterdir())}\n" + text[:1500])


# ---- in-process (no torch.distributed) --------------------------------------------------------

def test_watchdog_in_process_dump_without_exit(tmp_path):
    seen = []
    wd = Watchdog(0.3, tmp_path, rank=5, first_step_timeout_s=0.3, exit_code=None,
                  on_hang=lambda w, path: seen.append(path)).start()
    try:
        with wd.step(7, what="train step"):
            with wd.collective("optimizer.step"):
                time.sleep(1.0)
        with wd.step(8):  # a quick step: no dump
            pass
        time.sleep(0.4)
    finally:
        wd.stop()
    assert seen == [tmp_path / "hang-rank5-step7.txt"]
    text = seen[0].read_text()
    assert "train step 7 has run" in text and 'last collective entered: "optimizer.step"' in text
    assert "time.sleep(1.0)" in text and "test_watchdog_in_process_dump_without_exit" in text
    assert "faulthandler.dump_traceback" in text
    assert not (tmp_path / "hang-rank5-step8.txt").exists()


def test_first_step_timeout_and_heartbeat(tmp_path):
    seen = []
    wd = Watchdog(0.3, tmp_path, rank=0, first_step_timeout_s=1.5, exit_code=None,
                  on_hang=lambda w, p: seen.append(p)).start()
    try:
        with wd.step(1):  # first step: 1.5 s allowed
            time.sleep(0.6)
        with wd.step(2):  # later steps: 0.3 s, but a heartbeat restarts the clock
            for _ in range(4):
                time.sleep(0.15)
                wd.heartbeat()
    finally:
        wd.stop()
    assert seen == []


def test_step_schedule_validation_and_from_microbatches():
    from megatron_grpo.packing import PackLimits, build_microbatch, empty_microbatch

    with pytest.raises(ValueError, match="3 micro-batches but 2 token counts"):
        StepSchedule(1, 3, (4, 4))
    cfg = PackLimits(max_tokens_per_microbatch=16, pad_multiple=4)
    mbs = [build_microbatch([0], [[1, 2, 3, 4, 5]], [[0, 0, 1, 1, 1]], cfg), empty_microbatch(cfg)]
    s = StepSchedule.from_microbatches(3, mbs)
    assert s == StepSchedule(3, 2, (8, 4), (0, 0))
    assert s.audio_flags == (False, False)
    check_schedule(s)  # no process group: validates only

    class _TrainMB:  # the engine's TrainMicroBatch exposes num_tokens and num_clips
        def __init__(self, t, c):
            self.num_tokens, self.num_clips = t, c

    assert StepSchedule.from_microbatches(4, [_TrainMB(64, 2), _TrainMB(32, 0)]).audio_per_microbatch == (2, 0)
    with pytest.raises(TypeError):
        check_schedule((3, 2))


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 4 and sys.argv[1] == "--stall":
        _stall(sys.argv[2], float(sys.argv[3]))
