"""Run a function on N real processes, torchrun-style, and get every rank's return value back.

The one rank spawner of the project: `mgrpo train` (without torchrun/srun), `mgrpo convert`, the
benchmarks and the multi-rank tests all start their ranks here, and :func:`free_port` is the one
place a free TCP port is picked.

    from model_bridge.spawn import run_ranks

    def step(scale):                      # top level of an importable module (pickled by name)
        import torch.distributed as dist
        dist.init_process_group("gloo")   # env:// from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
        ...
        return value                      # anything picklable

    values = run_ranks(step, 2, 0.5)      # [value of rank 0, value of rank 1]

Each rank is a new process with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``, ``OMP_NUM_THREADS=1`` (unless
``env=`` sets it) and any ``env=`` extras set. The first rank to raise makes ``run_ranks`` kill the others and re-raise
that exception in the parent (same type when it pickles, with the rank's traceback text chained
as the cause).

Ranks are forked from a fork server that imported torch, megatron-core and transformers once (see
:data:`PRELOAD`), so a rank starts in a fraction of a second instead of the ~7 s those imports take
(each multi-rank test and ``mgrpo convert`` pays it per rank). The rank gets the launcher's current
environment, working directory, ``sys.path``, stdout and stderr, as a ``spawn`` process would. A
fresh ``spawn`` interpreter is used instead on a machine with a CUDA device (CUDA cannot run in a
process forked from one that may have touched it), when ``env=`` (or the launcher's ``TRITON_INTERPRET``)
gives a variable that the preloaded modules read at import (``TRITON_INTERPRET``, ``TORCH_*``, ...)
another value than the fork server started with, or when ``MGRPO_START_METHOD=spawn``. A run still going after ``timeout`` seconds gets the Python stacks of the
unfinished ranks dumped to stderr, is killed, and raises ``TimeoutError`` naming those ranks.
Children are always reaped.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from multiprocessing import reduction
from multiprocessing.connection import wait
from typing import Any, Callable

from model_bridge.lifeline import PARENT_ENV, die_with_parent

__all__ = ["run_ranks", "RankError", "free_port", "environ_set", "PRELOAD", "START_METHOD_ENV"]

log = logging.getLogger("model_bridge.spawn")

_GRACE_S = 1.0  # after a first failure, how long to wait for the other ranks' own reports
START_METHOD_ENV = "MGRPO_START_METHOD"  # "forkserver" (default) or "spawn"
# What every rank imports and what costs most of a rank's start-up: imported once by the fork server.
PRELOAD = ("torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "transformers",
           "safetensors.torch")
# Variables the preloaded modules (or the native libraries they load: OpenMP, MKL) read when they are
# imported. A rank that needs another value than the fork server started with is spawned afresh.
_IMPORT_TIME_PREFIXES = ("TRITON_", "TORCH", "PYTORCH_", "MKL_", "KMP_", "GOMP_", "OMP_", "CUDA_",
                         "NVIDIA_", "LD_", "PYTHON", "HF_", "TRANSFORMERS_", "MEGATRON", "NVTE_")
# Read later than import: OMP_NUM_THREADS is applied with torch.set_num_threads in the rank, and CUDA
# reads CUDA_VISIBLE_DEVICES when it initialises (never in the fork server).
_PER_RANK_OK = frozenset({"OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"})
# Import-time variables also compared in the launcher's own environment: tests set it in-process.
_LAUNCHER_CHECKED = ("TRITON_INTERPRET",)
_server: dict[str, Any] = {}  # the fork server this process started: its pid and environment


class RankError(RuntimeError):
    """A rank failed in a way that cannot be re-raised as its own exception."""


class _RemoteTraceback(Exception):
    """Carries a child's formatted traceback as the ``__cause__`` of the re-raised exception."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` (an IPv4 or IPv6 address) that was free a moment ago."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _detach() -> None:
    """Own process group (so the parent can kill this rank together with anything it starts, e.g.
    dist_checkpointing's manager process) and, on Linux, die with the parent."""
    try:
        os.setpgid(0, 0)
    except (AttributeError, OSError):
        pass
    try:
        die_with_parent()  # PR_SET_PDEATHSIG, and exits at once if the parent is already gone
    except OSError:
        pass


def _child(conn, rank: int, fn: Callable, args: tuple, kwargs: dict) -> None:
    """Entry point of one rank: run fn and send ("ok", value) or ("err", ...) to the parent."""
    _detach()
    try:
        import faulthandler

        faulthandler.register(signal.SIGUSR1, all_threads=True)  # parent asks for stacks on hang
    except (ImportError, AttributeError, ValueError):
        pass
    try:
        value = fn(*args, **kwargs)
        payload = pickle.dumps(("ok", value))
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the parent
        tb = traceback.format_exc()
        try:
            exc_bytes = pickle.dumps(exc)
            pickle.loads(exc_bytes)  # some exceptions pickle but do not unpickle
        except Exception:  # noqa: BLE001
            exc_bytes = None
        payload = pickle.dumps(("err", time.time(), type(exc).__name__, str(exc), tb, exc_bytes))
    try:
        conn.send_bytes(payload)
    finally:
        conn.close()
    sys.stdout.flush()
    sys.stderr.flush()


class _LauncherFd:
    """One of the launcher's file descriptors, handed to a forked rank: pickling it while the rank
    starts makes the fork server pass a duplicate, which the rank gets back as an int."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return (_fd_in_rank, (reduction.DupFd(self.fd),))


def _fd_in_rank(dup) -> int:
    return dup.detach()


def _forked_child(setup: tuple, conn, rank: int, fn: Callable, args: tuple, kwargs: dict) -> None:
    """Entry point of a rank forked from the fork server: take on the launcher's stdout, stderr and
    environment, as a spawned rank inherits them, then run as one. (multiprocessing itself gives it
    the launcher's working directory, sys.path and main module.)"""
    env, out_fd, err_fd = setup
    from multiprocessing import forkserver

    # multiprocessing hands every forked child the write end of the pipe whose EOF tells the fork
    # server that its launcher has exited: the server would then outlive a killed launcher for as
    # long as its ranks run, and the ranks (PR_SET_PDEATHSIG on the server) for as long as it runs.
    alive_fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if alive_fd is not None:
        os.close(alive_fd)
        forkserver._forkserver._forkserver_alive_fd = None
    for fd, target in ((out_fd, 1), (err_fd, 2)):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # OpenMP read the variable when the fork server loaded it
    _child(conn, rank, fn, args, kwargs)


def _fork_server() -> int | None:
    """The pid of this process's fork server (started with :data:`PRELOAD` on first use), or None
    when ranks must be spawned: not Linux, ``MGRPO_START_METHOD=spawn``, or a fork server that
    someone else started (its environment is unknown)."""
    if os.environ.get(START_METHOD_ENV, "forkserver") == "spawn" or not sys.platform.startswith("linux"):
        return None
    torch = sys.modules.get("torch")
    if torch is None or torch.cuda.is_available():
        # a preloaded module may touch CUDA, and CUDA cannot be used in a process forked after that
        return None
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if server is None or not hasattr(server, "_forkserver_pid"):
        return None
    if server._forkserver_pid is None:
        forkserver.set_forkserver_preload(list(PRELOAD))
    elif _server.get("pid") != server._forkserver_pid:
        return None
    # started (again, if it died) without TRITON_INTERPRET (it may be set in this process for a while):
    # ranks that need it get a fresh interpreter instead
    triton = {k: os.environ.pop(k) for k in _LAUNCHER_CHECKED if k in os.environ}
    try:
        env = dict(os.environ)
        forkserver.ensure_running()
    finally:
        os.environ.update(triton)
    if _server.get("pid") != server._forkserver_pid:
        _server.update(pid=server._forkserver_pid, env=env)
    return _server["pid"]


def _differs_at_import(server_env: dict[str, str], extra: dict[str, str]) -> list[str]:
    """Variables that the preloaded modules read at import whose value this rank needs changed:
    those ``env=`` sets, and the launcher's ``TRITON_INTERPRET`` (also set in-process). Other changes
    to the launcher's own environment since the server started (importing vLLM sets KMP_*,
    TORCHINDUCTOR_*, TRITON_CACHE_AUTOTUNING, LD_LIBRARY_PATH) are not the rank's to differ in: the
    launcher's own copies of the preloaded modules were imported before them as well."""
    now = {**os.environ, **extra}
    keys = (set(extra) | set(_LAUNCHER_CHECKED)) - _PER_RANK_OK
    return sorted(k for k in keys if k.startswith(_IMPORT_TIME_PREFIXES) and server_env.get(k) != now.get(k))


def _env_for(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    }


def _start(ctx, target, args, env: dict[str, str]):
    """Start a spawn process whose environment is the parent's plus ``env``."""
    # die_with_parent in `_detach` reads PARENT_ENV
    with environ_set({**env, PARENT_ENV: str(os.getpid())}):
        # Not a daemon: a rank may start processes of its own (dist_checkpointing does).
        proc = ctx.Process(target=target, args=args, daemon=False)
        proc.start()
    return proc


@contextlib.contextmanager
def environ_set(env: dict[str, str]):
    """``os.environ`` with ``env`` set inside the block and restored after it (what a child process
    started inside inherits)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _signal(proc, sig) -> None:
    """Send sig to a rank's process group (the rank and whatever it started) and to the rank."""
    if proc.pid is None:
        return
    if hasattr(os, "killpg"):
        try:
            os.killpg(proc.pid, sig)  # the group outlives the rank while anything in it runs
        except (ProcessLookupError, PermissionError, OSError):
            pass
    if proc.is_alive():  # not yet reaped, so the pid is still this rank's
        try:
            os.kill(proc.pid, sig)
        except (ProcessLookupError, PermissionError, OSError):
            pass


def _stop(procs: list, grace_s: float) -> None:
    """Terminate, then (after ``grace_s``) kill, every rank and its process group; join the ranks."""
    for p in procs:
        _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        _signal(p, signal.SIGKILL)
    for p in procs:
        p.join()


def _dump_stacks(procs: list, ranks: list[int]) -> None:
    for r in ranks:
        if procs[r].is_alive():
            try:
                os.kill(procs[r].pid, signal.SIGUSR1)
            except (OSError, AttributeError):
                pass
    time.sleep(0.5)


def _raise_failure(rank: int, info: tuple, others: list[int]) -> None:
    _, _, type_name, message, tb, exc_bytes = info
    also = f" (ranks {others} failed too)" if others else ""
    exc = None
    if exc_bytes is not None:
        try:
            exc = pickle.loads(exc_bytes)
        except Exception:  # noqa: BLE001
            exc = None
    if isinstance(exc, BaseException):
        if hasattr(exc, "add_note"):
            exc.add_note(f"raised on rank {rank}{also}; its traceback is shown above")
        raise exc from _RemoteTraceback(f"\n\nTraceback of rank {rank}:\n{tb}")
    raise RankError(f"rank {rank} raised {type_name}: {message}{also}\n\nTraceback of rank {rank}:\n{tb}")


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float | None = 300,
              env: dict[str, str] | None = None, stop_grace_s: float = 3.0, **kwargs: Any) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` spawned ranks; return their values by rank.

    ``fn`` must be a picklable top-level function, and the arguments and return values picklable.
    ``timeout`` (seconds, whole run; None: no limit) and ``env`` (extra environment variables for every rank, e.g.
    ``{"CUDA_VISIBLE_DEVICES": ""}`` to force the CPU path) are not passed on to ``fn``, nor is
    ``stop_grace_s``: how long the ranks get between SIGTERM and SIGKILL when the run ends (a rank
    that stops a server of its own on SIGTERM needs more than the default).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    port = free_port()
    extra = {"OMP_NUM_THREADS": "1", **(env or {})}
    server_pid = _fork_server()
    if server_pid is not None and (differ := _differs_at_import(_server["env"], extra)):
        log.debug("run_ranks: spawning afresh: %s differ from the fork server's environment", ", ".join(differ))
        server_pid = None
    ctx = mp.get_context("spawn" if server_pid is None else "forkserver")
    procs, readers = [], []
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            rank_env = {**extra, **_env_for(rank, world_size, port)}
            if server_pid is None:
                proc = _start(ctx, _child, (writer, rank, fn, args, kwargs), rank_env)
            else:  # PR_SET_PDEATHSIG then watches the fork server, which exits with this process
                setup = ({**os.environ, **rank_env, PARENT_ENV: str(server_pid)}, _LauncherFd(1), _LauncherFd(2))
                proc = ctx.Process(target=_forked_child, args=(setup, writer, rank, fn, args, kwargs),
                                   daemon=False)
                proc.start()
            writer.close()  # the parent keeps only the read end: EOF when the child is gone
            procs.append(proc)
            readers.append(reader)

        results: dict[int, Any] = {}
        failures: dict[int, tuple] = {}
        pending = {readers[r]: r for r in range(world_size)}
        deadline = time.monotonic() + (float("inf") if timeout is None else timeout)
        first_failure_at = None
        while pending:
            now = time.monotonic()
            if first_failure_at is not None and now - first_failure_at > _GRACE_S:
                break
            if now >= deadline:
                break
            wait_for = deadline - now
            if first_failure_at is not None:
                wait_for = min(wait_for, _GRACE_S - (now - first_failure_at))
            for conn in wait(list(pending), timeout=None if wait_for == float("inf") else max(0.0, wait_for)):
                rank = pending.pop(conn)
                try:
                    msg = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    procs[rank].join(5)
                    msg = ("err", time.time(), "ProcessDied",
                           f"rank {rank} exited with code {procs[rank].exitcode} without a result",
                           "(no Python traceback: the process died, e.g. killed or crashed)", None)
                except Exception as exc:  # noqa: BLE001 - e.g. a return value that won't unpickle
                    msg = ("err", time.time(), type(exc).__name__, str(exc),
                           f"could not unpickle the value rank {rank} returned: {exc!r}", None)
                if msg[0] == "ok":
                    results[rank] = msg[1]
                else:
                    failures[rank] = msg
                    if first_failure_at is None:
                        first_failure_at = time.monotonic()

        if failures:
            first = min(failures, key=lambda r: (failures[r][1], r))
            _raise_failure(first, failures[first], sorted(r for r in failures if r != first))
        if pending:
            stuck = sorted(pending.values())
            _dump_stacks(procs, stuck)
            raise TimeoutError(
                f"ranks {stuck} of {world_size} did not finish within {timeout:g}s "
                f"(finished: {sorted(results)}); their Python stacks were dumped to stderr")
        for proc in procs:  # let finished ranks exit on their own (atexit handlers, flushes)
            proc.join(max(0.0, min(10.0, deadline - time.monotonic())))
        return [results[r] for r in range(world_size)]
    except KeyboardInterrupt:  # the ranks run in process groups of their own: Ctrl-C reached only us
        live = sum(p.is_alive() for p in procs)
        if live:
            print(f"\n[spawn] interrupted: stopping {live} rank(s) (SIGTERM, then SIGKILL after {stop_grace_s:g} s)",
                  file=sys.stderr, flush=True)
        raise
    finally:
        _stop(procs, stop_grace_s)
        for reader in readers:
            reader.close()
