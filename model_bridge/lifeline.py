"""Nothing outlives the run: what a process starts dies with it, also when it is killed with SIGKILL.

Two mechanisms, for two kinds of child:

- `die_with_parent()`, called early in a child started with `child_env()` / `PARENT_ENV` set (the
  ranks of `model_bridge.spawn.run_ranks`, so `mgrpo train`'s trainer ranks): the kernel sends the
  child SIGKILL when its parent exits (Linux ``PR_SET_PDEATHSIG``). The signal fires when the
  parent *thread* that started the child exits, so start it on a thread that lives as long as the
  parent (the main thread, as `mgrpo train` does).
- `guard_group(pgid)` for a child in its own process group (the vLLM server and its engine-core
  processes; test daemons): a tiny watcher process polls its own parent pid; when the parent is
  gone (reparented watcher) it sends the whole group SIGTERM, then SIGKILL after a grace period.
  The watcher exits by itself once the group is gone.

Without these, a ``kill -9`` of ``mgrpo train`` (the OOM killer, a scheduler's hard kill) leaves its
ranks training on and the vLLM server holding the GPUs.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

PARENT_ENV = "MGRPO_PARENT_PID"
"""Set by `child_env` in a spawned child's environment: the pid it must not outlive."""

_PR_SET_PDEATHSIG = 1

_WATCHER = r"""
import os, signal, sys, time
parent, pgid, grace = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
def alive():
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
while os.getppid() == parent and alive():
    time.sleep(0.2)
if alive():
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        sys.exit(0)
    end = time.monotonic() + grace
    while alive() and time.monotonic() < end:
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
"""


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) plus the marker `die_with_parent` reads."""
    return dict(os.environ if env is None else env, **{PARENT_ENV: str(os.getpid())})


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a child started with `child_env`: receive `sig` when the parent exits. The marker is
    removed from the environment so this process's own children do not inherit it. No-op
    elsewhere (no marker, or not Linux)."""
    expected = os.environ.pop(PARENT_ENV, None)
    if expected is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(expected):  # the parent died before the prctl: nobody would signal us
        os.kill(os.getpid(), sig)


def guard_group(pgid: int, grace_s: float = 3.0) -> subprocess.Popen:
    """Start a watcher that ends process group `pgid` (SIGTERM, SIGKILL after `grace_s`) when this
    process exits, however it exits. Returns the watcher; `release` stops it once the group is
    stopped the ordinary way."""
    return subprocess.Popen([sys.executable, "-S", "-c", _WATCHER, str(os.getpid()), str(pgid), str(grace_s)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


def release(watcher: subprocess.Popen | None) -> None:
    """Stop a `guard_group` watcher (its group has been stopped) and reap it."""
    if watcher is None:
        return
    if watcher.poll() is None:
        watcher.kill()
    watcher.wait()
