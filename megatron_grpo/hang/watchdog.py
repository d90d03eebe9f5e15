"""The hang watchdog (hang invariant 3: a hang becomes an error message).

A daemon thread per rank. ``with watchdog.step(n):`` arms it for one step;
``with watchdog.collective("forward_backward"):`` (or :func:`note_collective`) records the last
collective the rank entered. When an armed step runs past its timeout the watchdog writes

    run_dir/hang-rank{R}-step{S}.txt

(a header naming the step, the elapsed time, the timeout and the last collective entered, then the
Python stack of every thread with source lines, then ``faulthandler``'s dump of all threads),
copies it to stderr, and ends the process with ``os._exit(HANG_EXIT_CODE)``. Every rank runs its
own watchdog, so all ranks of a stuck collective dump and exit; comparing their "last collective"
lines shows which rank diverged. The first armed step gets its own (longer) timeout for
compilation and warm-up. A C-level ``faulthandler.dump_traceback_later`` backstop (stack to stderr,
exit code 1) fires ``backstop_s`` later still, for the case where a stuck C call holds the GIL and
the watchdog thread cannot run.

The watchdog's timeout must be shorter than the process group's collective timeout (30 min by
default in :func:`model_bridge.parallel.init_parallel`), or the collective raises first.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Iterable, Iterator, Optional

__all__ = ["Watchdog", "HANG_EXIT_CODE", "note_collective", "collective", "active_watchdog", "iter_hang_files"]

HANG_EXIT_CODE = 75
"""Exit status of a process the watchdog ended (EX_TEMPFAIL: the job may be retried from the last
checkpoint). A preempted run that checkpointed exits 0 instead (``engine.signals``)."""

_ACTIVE: Optional["Watchdog"] = None


def active_watchdog() -> Optional["Watchdog"]:
    """The watchdog this process started last (None when none runs)."""
    return _ACTIVE


def note_collective(name: str) -> None:
    """Record that this rank enters collective ``name`` (no-op without a running watchdog)."""
    wd = _ACTIVE
    if wd is not None:
        wd.note_collective(name)


@contextlib.contextmanager
def collective(name: str) -> Iterator[None]:
    """``with collective("optimizer.step"):`` records entry and exit on the running watchdog, if any."""
    wd = _ACTIVE
    if wd is None:
        yield
        return
    with wd.collective(name):
        yield


class Watchdog:
    """Per-rank daemon thread that dumps every thread's stack and exits when a step stalls.

    ``timeout_s``: limit of an armed step; ``first_step_timeout_s`` (default 3x ``timeout_s``): limit of
    the first armed step (compilation, warm-up). ``run_dir``: where ``hang-rank{R}-step{S}.txt`` goes
    (stderr only when None). ``rank``: default torch.distributed's rank, else $RANK, else 0.
    ``exit_code``: status passed to ``os._exit`` (None: dump and call ``on_hang`` but keep running -- for
    tests). ``backstop_s``: extra seconds after which faulthandler's C-level timer dumps to stderr and
    exits even if this thread cannot run (None: off).

    Use::

        with Watchdog(cfg.step_timeout_s, run_dir, first_step_timeout_s=cfg.first_step_timeout_s) as wd:
            for step in steps:
                with wd.step(step):
                    with wd.collective("forward_backward"):
                        ...
    """

    def __init__(self, timeout_s: float, run_dir: Optional[os.PathLike | str] = None, rank: Optional[int] = None,
                 *, first_step_timeout_s: Optional[float] = None, exit_code: Optional[int] = HANG_EXIT_CODE,
                 backstop_s: Optional[float] = 120.0, poll_s: Optional[float] = None, on_hang=None):
        if not timeout_s or timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.first_step_timeout_s = float(first_step_timeout_s) if first_step_timeout_s else 3.0 * self.timeout_s
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.rank = _default_rank() if rank is None else int(rank)
        self.exit_code = exit_code
        self.backstop_s = backstop_s
        self.poll_s = float(poll_s) if poll_s else max(0.05, min(1.0, self.timeout_s / 20))
        self.on_hang = on_hang
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._armed: Optional[tuple] = None  # (step, what, t0, timeout)
        self._steps_armed = 0
        self._last: Optional[tuple] = None  # (name, t_enter, t_exit or None)
        self._previous: Optional[tuple] = None
        self._inside = 0
        self.fired: Optional[Path | str] = None  # the dump's path ("<stderr>" without run_dir)

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> "Watchdog":
        global _ACTIVE
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"mgrpo-watchdog-rank{self.rank}", daemon=True)
            self._thread.start()
        _ACTIVE = self
        return self

    def stop(self) -> None:
        global _ACTIVE
        self._stop.set()
        self._wake.set()
        self._cancel_backstop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None
        if _ACTIVE is self:
            _ACTIVE = None

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- arming ----------------------------------------------------------------------------------

    def arm(self, step: int, timeout_s: Optional[float] = None, what: str = "step") -> float:
        """Start the clock for ``step``; returns the timeout that applies."""
        if self._thread is None:
            self.start()
        if timeout_s is None:
            timeout_s = self.first_step_timeout_s if self._steps_armed == 0 else self.timeout_s
        with self._lock:
            self._armed = (int(step), what, time.monotonic(), float(timeout_s))
            self._steps_armed += 1
        self._arm_backstop(float(timeout_s))
        self._wake.set()
        return float(timeout_s)

    def disarm(self) -> None:
        with self._lock:
            self._armed = None
        self._cancel_backstop()

    def heartbeat(self) -> None:
        """Restart the clock of the armed step (a long phase that is making progress)."""
        with self._lock:
            if self._armed is not None:
                s, what, _, timeout = self._armed
                self._armed = (s, what, time.monotonic(), timeout)
                t = timeout
            else:
                t = None
        if t is not None:
            self._arm_backstop(t)

    @contextlib.contextmanager
    def step(self, step: int, timeout_s: Optional[float] = None, what: str = "step") -> Iterator["Watchdog"]:
        """Arm for the duration of the block (``what`` names the phase in the dump, e.g. "checkpoint")."""
        self.arm(step, timeout_s, what)
        try:
            yield self
        finally:
            self.disarm()

    # ---- collectives -----------------------------------------------------------------------

    def note_collective(self, name: str) -> None:
        """Record entry into collective ``name`` (no exit is recorded)."""
        with self._lock:
            if self._last is not None:
                self._previous = self._last
            self._last = (str(name), time.monotonic(), None)

    @contextlib.contextmanager
    def collective(self, name: str) -> Iterator[None]:
        self.note_collective(name)
        token = self._last
        try:
            yield
        finally:
            with self._lock:
                if self._last is token:  # nothing nested was entered since
                    self._last = (token[0], token[1], time.monotonic())

    @property
    def last_collective(self) -> Optional[str]:
        return None if self._last is None else self._last[0]

    # ---- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.poll_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            with self._lock:
                armed = self._armed
            if armed is None:
                continue
            step, what, t0, timeout = armed
            elapsed = time.monotonic() - t0
            if elapsed <= timeout:
                continue
            with self._lock:
                if self._armed is not armed:  # disarmed or re-armed meanwhile
                    continue
            self._fire(step, what, elapsed, timeout)
            if self.exit_code is None:
                with self._lock:
                    if self._armed is armed:
                        self._armed = None
                continue

    def _describe_last(self, now: float) -> str:
        with self._lock:
            last, prev = self._last, self._previous
        if last is None:
            return "last collective entered: none recorded on this rank"
        name, t_in, t_out = last
        state = "still inside" if t_out is None else f"left {now - t_out:.1f} s ago"
        text = f'last collective entered: "{name}" ({now - t_in:.1f} s ago, {state})'
        if prev is not None:
            p_name, p_in, p_out = prev
            left = "never left" if p_out is None else f"left {now - p_out:.1f} s ago"
            text += f'\nthe one before: "{p_name}" (entered {now - p_in:.1f} s ago, {left})'
        return text

    def report_header(self, step: int, what: str, elapsed: float, timeout: float) -> str:
        now = time.monotonic()
        return (
            f"=== megatron-grpo watchdog: rank {self.rank} is stuck ===\n"
            f"{what} {step} has run {elapsed:.1f} s, over its {timeout:g} s timeout\n"
            f"{self._describe_last(now)}\n"
            f"host {socket.gethostname()}, pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
            "Every rank runs a watchdog: compare the ranks' hang-rank*-step*.txt files; a rank whose last "
            "collective differs from the others' is the one that diverged.\n")

    def _fire(self, step: int, what: str, elapsed: float, timeout: float) -> None:
        try:
            header = self.report_header(step, what, elapsed, timeout)
            stacks = _format_all_stacks()
            exiting = (f"exiting with code {self.exit_code} (HANG_EXIT_CODE)\n" if self.exit_code is not None
                       else "exit disabled (exit_code=None)\n")
            path = None
            if self.run_dir is not None:
                try:
                    self.run_dir.mkdir(parents=True, exist_ok=True)
                    path = self.run_dir / f"hang-rank{self.rank}-step{step}.txt"
                    with open(path, "w") as f:
                        f.write(header + "\n--- Python stacks, all threads (most recent call last) ---\n" + stacks)
                        f.write("\n--- faulthandler.dump_traceback(all_threads=True) ---\n")
                        f.flush()
                        faulthandler.dump_traceback(file=f, all_threads=True)
                        f.write("\n" + exiting)
                        f.flush()
                        os.fsync(f.fileno())
                    text = path.read_text()
                except OSError as exc:
                    path = None
                    text = header + f"(could not write the hang file: {exc})\n" + stacks + exiting
            else:
                text = header + "\n--- Python stacks, all threads (most recent call last) ---\n" + stacks + exiting
            where = f" (also in {path})" if path is not None else ""
            _write_stderr(f"\n{text.rstrip()}\n=== end of watchdog dump of rank {self.rank}{where} ===\n")
            self.fired = path if path is not None else "<stderr>"
            if self.on_hang is not None:
                self.on_hang(self, path)
        except BaseException as exc:  # noqa: BLE001 - the exit below must happen whatever went wrong
            try:
                _write_stderr(f"megatron-grpo watchdog: rank {self.rank}, step {step} timed out; the dump failed: "
                              f"{exc!r}\n")
                faulthandler.dump_traceback(all_threads=True)
            except BaseException:  # noqa: BLE001
                pass
        if self.exit_code is not None:
            os._exit(self.exit_code)

    # ---- C-level backstop ----------------------------------------------------------------------

    def _arm_backstop(self, timeout: float) -> None:
        if self.backstop_s is None or self.exit_code is None:
            return
        try:
            faulthandler.dump_traceback_later(timeout + float(self.backstop_s), repeat=False, exit=True)
        except (RuntimeError, ValueError, OSError):
            pass

    def _cancel_backstop(self) -> None:
        if self.backstop_s is None or self.exit_code is None:
            return
        try:
            faulthandler.cancel_dump_traceback_later()
        except (RuntimeError, ValueError):
            pass


def _default_rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001
        pass
    return int(os.environ.get("RANK", "0"))


def _format_all_stacks() -> str:
    """Every thread's Python stack with source lines, named by thread."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    parts = []
    main = threading.main_thread().ident
    frames = sorted(sys._current_frames().items(), key=lambda kv: (kv[0] != main, kv[0] == me))
    for ident, frame in frames:  # the main thread first, the watchdog itself last
        label = f'Thread "{names.get(ident, "?")}" (id {ident})' + (" [the watchdog]" if ident == me else "")
        parts.append(label + ":\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def _write_stderr(text: str) -> None:
    data = text.encode("utf-8", "replace")
    try:
        while data:
            n = os.write(2, data)
            data = data[n:]
    except OSError:
        pass


def iter_hang_files(run_dir: os.PathLike | str) -> Iterable[Path]:
    """The watchdog dumps under ``run_dir`` (for a launcher that reports them)."""
    return sorted(Path(run_dir).glob("hang-rank*-step*.txt"))
