"""Nothing outlives the run: the trainer's ranks and the vLLM server die with the process that
started them, also on `kill -9`; a rollout failure ends every rank with one line."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("MGRPO_TEST_CACHE", REPO / ".cache" / "tests"))  # as tests/conftest.py
DEAD_WITHIN_S = 10.0


def _running(pid: int) -> bool:
    """Alive and not a zombie (orphans are reparented; the container's init may reap them late)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_all_dead(pids, timeout=DEAD_WITHIN_S) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(_running(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if _running(p)]


def _wait_for(ok, timeout, what, proc=None, log=None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if ok():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited ({proc.returncode}) first:\n"
                                 + (log.read_text()[-3000:] if log and log.exists() else ""))
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _is_rank(p: psutil.Process) -> bool:
    """A rank of model_bridge.spawn: a multiprocessing child (spawned, or forked by the fork server,
    whose command line it shares) that leads its own process group, as every rank does."""
    try:
        cmd = " ".join(p.cmdline())
        return ("spawn_main" in cmd or "forkserver" in cmd) and os.getpgid(p.pid) == p.pid
    except (psutil.NoSuchProcess, ProcessLookupError):
        return False


def _kill_tree_now(proc):
    """Test hygiene if an assertion fails: SIGKILL what is left of `proc`'s tree."""
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        kids = []
    for p in [proc, *kids]:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    proc.wait()


PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from model_bridge.lifeline import child_env, guard_group
    group = subprocess.Popen(["bash", "-c", "sleep 600 & sleep 600"], start_new_session=True)
    guard_group(group.pid, grace_s=1.0)
    child = subprocess.Popen([sys.executable, "-c",
        "from model_bridge.lifeline import die_with_parent; import time; die_with_parent(); time.sleep(600)"],
        env=child_env())
    time.sleep(1.5)  # the child has called die_with_parent
    print(group.pid, child.pid, flush=True)
    time.sleep(600)
""")


def test_children_and_process_groups_die_with_a_sigkilled_parent():
    """`die_with_parent` (PDEATHSIG) and `guard_group` (a watcher that ends the whole group, the
    grandchildren too) on a parent killed with SIGKILL."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True)
    try:
        group_pid, child_pid = map(int, parent.stdout.readline().split())
        pids = [group_pid, child_pid] + [c.pid for c in psutil.Process(group_pid).children()]
        assert len(pids) == 4 and all(_running(p) for p in pids)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert _wait_all_dead(pids) == []
    finally:
        _kill_tree_now(parent)


def test_a_rollout_failure_is_one_line_on_every_rank_with_the_trace_in_the_run_dir(tmp_path):
    from megatron_grpo.rollout.client import RolloutServerError
    from megatron_grpo.run.failures import ERROR_LOG, RolloutFailed
    from megatron_grpo.run.rollout_source import TrajectorySource

    class Rows:
        def next_batch(self):
            return ["row"]

    class FailingBackend:
        def rollout(self, rows, group_ids):
            raise RolloutServerError("prompt 0 has 15985 tokens, no room to generate within 4096 "
                                     "(rollout.max_total_tokens / the server's max_model_len)", retryable=False)

    sent = []

    def broadcast(obj):  # rank 0 sends the failure in place of the trajectories
        sent.append(obj)
        return obj

    src = TrajectorySource(FailingBackend(), Rows(), overlap=False, rank=0, run_dir=tmp_path)
    with pytest.raises(RolloutFailed) as e:
        src.advantages(1, src.rollout_and_score(1), broadcast)
    line = (f"RolloutServerError: prompt 0 has 15985 tokens, no room to generate within 4096 "
            f"(rollout.max_total_tokens / the server's max_model_len) (full trace in {tmp_path / ERROR_LOG})")
    assert str(e.value) == line and "\n" not in line
    assert isinstance(sent[0], RolloutFailed) and str(sent[0]) == line
    trace = (tmp_path / ERROR_LOG).read_text()
    assert trace.startswith("Traceback") and "in rollout" in trace and "15985 tokens" in trace
    # another rank receives the same failure through the broadcast and raises it
    src1 = TrajectorySource(None, Rows(), overlap=False, rank=1, run_dir=tmp_path)
    with pytest.raises(RolloutFailed, match="^RolloutServerError: prompt 0 has 15985"):
        src1.advantages(1, src1.rollout_and_score(1), lambda obj: sent[0])


def _guards_of(parent_pid: int, pgid: int) -> list[int]:
    """The `model_bridge.lifeline.guard_group` watchers among `parent_pid`'s children that guard `pgid`."""
    try:
        kids = psutil.Process(parent_pid).children()
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in kids:
        try:
            cmd = p.cmdline()
        except psutil.NoSuchProcess:
            continue
        if cmd[1:3] == ["-S", "-c"] and len(cmd) >= 3 and cmd[-2] == str(pgid):
            out.append(p.pid)
    return out


def _group_gone(pgid) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return all(not _running(p.pid) for p in psutil.process_iter() if _pgid(p.pid) == pgid)


@pytest.mark.slow
@pytest.mark.cold_start
def test_kill_9_of_mgrpo_train_leaves_no_rank_and_no_vllm_process(tmp_path):
    """The embedded tiny job (2 ranks, a local vLLM server), killed with SIGKILL as soon as both
    ranks run and rank 0's vLLM server has started (its API process, guarded by its watcher): the
    ranks are spawned first and rank 0 starts the server, so this is the whole tree a training run
    has. Every pid of that tree and every process of the server's group is gone within 10 s."""
    run = tmp_path / "run"
    log = tmp_path / "train.log"
    env = dict(os.environ, MGRPO_CACHE=str(CACHE / "embedded"), HF_HUB_OFFLINE="1")
    seen = {}

    def started():
        try:
            tree = psutil.Process(proc.pid).children(recursive=True)
            ranks = [p for p in tree if _is_rank(p)]
        except psutil.NoSuchProcess:
            return False
        servers = [(r, _server_group(r.pid)) for r in ranks]
        servers = [(r, pgid, group) for r, (pgid, group) in servers if pgid is not None]
        if len(ranks) != 2 or not servers or not _guards_of(servers[0][0].pid, servers[0][1]):
            return False
        seen.update(tree=[p.pid for p in psutil.Process(proc.pid).children(recursive=True)], pgid=servers[0][1])
        return True

    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "train", "trainer.steps=50",
                                 "checkpoint.every=0", "checkpoint.at_end=false", "logging.progress=false",
                                 f"trainer.run_dir={run}"], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for(started, 900, "2 ranks and rank 0's vLLM server", proc, log)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        left = _wait_all_dead(seen["tree"])
        assert left == [], [(p, psutil.Process(p).cmdline()) for p in left]
        assert _group_gone(seen["pgid"])  # also what the server started after we looked
    finally:
        _kill_tree_now(proc)
        if "pgid" in seen:  # hygiene if an assertion failed: the group is no longer in the tree
            try:
                os.killpg(seen["pgid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


HOLD_SERVER = '''
import time
def test_hold(vllm_server):
    time.sleep(600)
'''


def _server_group(parent_pid: int) -> tuple[int | None, list[int]]:
    """(pgid, pids) of the vLLM server's process group among `parent_pid`'s children (the server
    runs in its own session: pgid = the API process's pid); (None, []) while there is none."""
    try:
        kids = psutil.Process(parent_pid).children()
    except psutil.NoSuchProcess:
        return None, []
    for p in kids:
        try:
            cmd = " ".join(p.cmdline())  # vLLM's API server, or ours when it returns routes (R3 on CPU)
            if ("vllm.entrypoints" in cmd or "megatron_grpo.rollout.vllm_serve" in cmd) and _pgid(p.pid) == p.pid:
                return p.pid, [q.pid for q in psutil.process_iter() if _pgid(q.pid) == p.pid]
        except psutil.NoSuchProcess:
            pass
    return None, []


@pytest.mark.slow
def test_kill_9_of_a_pytest_run_stops_its_vllm_server_fixture(tmp_path):
    """A pytest run whose test needs the session `vllm_server` fixture (started in the background
    when collection ends), killed with SIGKILL while that server is still starting: as soon as its
    process group holds the API process and the engine core. Every process of the group, and the
    watcher that guards it, is gone within 10 s."""
    inner = REPO / "tests" / f"_hold_vllm_server_{os.getpid()}.py"  # under tests/: tests/conftest.py applies
    inner.write_text(HOLD_SERVER)
    log = tmp_path / "pytest.log"
    pgid = None
    try:
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(inner)],
                                    cwd=REPO, env=dict(os.environ), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            _wait_for(lambda: len(_server_group(proc.pid)[1]) >= 2, 600,
                      "the vllm_server fixture's API process and engine core", proc, log)
            pgid, group = _server_group(proc.pid)
            watchers = _guards_of(proc.pid, pgid)
            assert len(watchers) == 1, [p.cmdline() for p in psutil.Process(proc.pid).children()]
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            left = _wait_all_dead(group + watchers)
            assert left == [], [(p, psutil.Process(p).cmdline()) for p in left]
            assert _group_gone(pgid)  # also what the server started after we looked
        finally:
            _kill_tree_now(proc)
            if pgid is not None:  # hygiene if the assertion failed: the group is no longer in the tree
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    finally:
        inner.unlink()


def _pgid(pid):
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


@pytest.mark.slow
@pytest.mark.cold_start
def test_a_failed_rollout_ends_both_ranks_with_one_line(tmp_path):
    """`mgrpo train` (2 ranks) against a rollout server that is up (/health) but answers every other
    request with an error (the weight push before step 1 is the first): exit 1, one `rollout error` line from rank 0 and no traceback from any
    rank on the terminal; the trace is in the run dir's error.log."""
    import http.server
    import threading

    class Broken(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 500)
            self.end_headers()
            self.wfile.write(b"" if self.path == "/health" else b"engine is dead")

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Broken)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    run = tmp_path / "run"
    try:
        env = dict(os.environ, MGRPO_CACHE=str(CACHE / "embedded"), HF_HUB_OFFLINE="1")
        r = subprocess.run([sys.executable, "-m", "launch.cli", "train", "rollout.server=remote",
                            f"rollout.server_urls=[{url}]", "logging.progress=false", f"trainer.run_dir={run}"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    finally:
        server.shutdown()
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    err = [line for line in r.stderr.splitlines() if "rollout error" in line or "Traceback" in line]
    # a remote server gets the weights before step 1: that push is the first request to fail
    assert len(err) == 1 and err[0].startswith("mgrpo train: rollout error: WeightPushError: "), r.stderr[-3000:]
    assert f"on {url}: " in err[0] and "HTTP 500: engine is dead" in err[0], err[0]
    assert err[0].endswith(f"(full trace in {run / 'error.log'})"), err[0]
    assert "Traceback" not in r.stdout
    assert "WeightPushError" in (run / "error.log").read_text()
