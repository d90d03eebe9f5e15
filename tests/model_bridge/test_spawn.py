"""run_ranks: values in rank order, a rank's exception re-raised, a hang turned into TimeoutError."""
from __future__ import annotations

import os
import time

import pytest
import torch

from model_bridge.spawn import RankError, run_ranks


def _whoami(scale, offset=0):
    return {
        "rank": int(os.environ["RANK"]) * scale + offset,
        "world": int(os.environ["WORLD_SIZE"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "addr": os.environ["MASTER_ADDR"],
        "port": int(os.environ["MASTER_PORT"]),
        "omp": os.environ["OMP_NUM_THREADS"],
        "pid": os.getpid(),
    }


def _gloo_allreduce():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def _fail_on_rank_1():
    if os.environ["RANK"] == "1":
        raise ValueError("boom on rank one")
    return "fine"


class _Unpicklable(Exception):
    def __init__(self, a, b):  # pickles, but unpickling calls __init__ with one argument
        super().__init__(f"{a}/{b}")


def _fail_unpicklable():
    raise _Unpicklable("x", "y")


def _hang_on_rank_0(seconds):
    if os.environ["RANK"] == "0":
        time.sleep(seconds)
    return "done"


def test_values_in_rank_order_with_env():
    out = run_ranks(_whoami, 3, 10, offset=1)
    assert [o["rank"] for o in out] == [1, 11, 21]
    assert [o["local_rank"] for o in out] == [0, 1, 2]
    assert {o["world"] for o in out} == {3}
    assert {o["addr"] for o in out} == {"127.0.0.1"}
    assert len({o["port"] for o in out}) == 1
    assert {o["omp"] for o in out} == {"1"}
    assert len({o["pid"] for o in out}) == 3 and os.getpid() not in {o["pid"] for o in out}


def test_no_timeout_and_thread_count_from_env():
    """What `mgrpo train` spawns its ranks with: no time limit, its own OMP_NUM_THREADS."""
    out = run_ranks(_whoami, 2, 1, timeout=None, env={"OMP_NUM_THREADS": "3"})
    assert [o["rank"] for o in out] == [0, 1] and {o["omp"] for o in out} == {"3"}


def test_env_rendezvous_works_for_gloo():
    assert run_ranks(_gloo_allreduce, 2) == [3.0, 3.0]


def test_exception_on_rank_1_is_reraised():
    with pytest.raises(ValueError, match="boom on rank one") as info:
        run_ranks(_fail_on_rank_1, 2, timeout=60)
    assert "rank 1" in "".join(getattr(info.value, "__notes__", []))
    assert "_fail_on_rank_1" in str(info.value.__cause__)  # the child's traceback text


def test_exception_that_does_not_unpickle_becomes_rank_error():
    with pytest.raises(RankError, match=r"rank 0 raised _Unpicklable: x/y"):
        run_ranks(_fail_unpicklable, 1, timeout=60)


def test_hang_becomes_timeout_error_naming_the_rank():
    t0 = time.monotonic()
    # rank 1 must finish inside the limit: 15 s leaves room for a new interpreter on a loaded machine
    with pytest.raises(TimeoutError, match=r"ranks \[0\] of 2 did not finish"):
        run_ranks(_hang_on_rank_0, 2, 600, timeout=15)
    assert time.monotonic() - t0 < 40


def _origin():
    import sys

    return {"ppid": os.getppid(), "preloaded": "megatron.core" in sys.modules,
            "late": os.environ.get("MGRPO_TEST_LATE_VAR"), "cwd": os.getcwd()}


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine every rank is spawned (no fork server)")
def test_ranks_fork_from_the_preloading_server_with_the_launchers_current_environment(monkeypatch, tmp_path):
    """Default: a rank is forked from the fork server (not the launcher's child; megatron-core is
    already imported), yet sees the launcher's environment and directory as they are now."""
    run_ranks(_origin, 1)  # the server exists from here on
    monkeypatch.setenv("MGRPO_TEST_LATE_VAR", "set after the server started")
    for key, value in (("KMP_INIT_AT_FORK", "FALSE"), ("TRITON_CACHE_AUTOTUNING", "1")):
        monkeypatch.setenv(key, value)  # as importing vLLM does: the launcher's own business
    monkeypatch.chdir(tmp_path)
    (out,) = run_ranks(_origin, 1)
    assert out["ppid"] != os.getpid() and out["preloaded"]
    assert out["late"] == "set after the server started" and out["cwd"] == str(tmp_path)


def test_a_variable_read_at_import_makes_the_rank_a_fresh_interpreter(monkeypatch):
    (out,) = run_ranks(_origin, 1, env={"TRITON_INTERPRET": "1"})
    assert out["ppid"] == os.getpid() and not out["preloaded"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # set in this process: the ranks need it too
    (out,) = run_ranks(_origin, 1)
    assert out["ppid"] == os.getpid() and not out["preloaded"]


LAUNCHER = """
import sys, time
import torch
from model_bridge.spawn import run_ranks
def sleeper():
    time.sleep(600)
if __name__ == "__main__":
    run_ranks(sleeper, 2, timeout=None)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine every rank is spawned (no fork server)")
def test_sigkill_of_the_launcher_ends_the_fork_server_and_its_ranks(tmp_path):
    import contextlib
    import signal
    import subprocess
    import sys

    import psutil

    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tree = []
    proc = subprocess.Popen([sys.executable, str(script)], cwd=repo,
                            env=dict(os.environ, PYTHONPATH=repo), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the server and both ranks (its children) exist
            tree = psutil.Process(proc.pid).children(recursive=True)
            if sum("forkserver" in " ".join(p.cmdline()) for p in tree) >= 3:
                break
            time.sleep(0.5)
        assert sum("forkserver" in " ".join(p.cmdline()) for p in tree) >= 3, [p.cmdline() for p in tree]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        gone, alive = psutil.wait_procs(tree, timeout=10)
        assert alive == [], [p.cmdline() for p in alive]
    finally:  # hygiene if an assertion failed
        for p in [proc, *tree]:
            with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):
                os.kill(p.pid, signal.SIGKILL)
        proc.wait()
