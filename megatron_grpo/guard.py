"""Hang guards: every rank checks the step's schedule before it starts, and a watchdog turns a stalled
step into a stack dump and a non-zero exit (design.md, hang invariant 3).

Two tools, both cheap enough to run on every step:

* :func:`check_schedule` -- collective. Before each step every rank describes what it is about to
  run (:class:`StepSchedule`: step, micro-batch count, tokens and audio clips per micro-batch) and
  the ranks all-gather a fixed-size encoding of it. Every rank of the group must agree on the step
  and the micro-batch count (invariant 1: a rank with one micro-batch more waits forever in the
  expert all-to-all or the pipeline send). Ranks that share their micro-batches (TP/PP/CP peers,
  i.e. the same data-parallel rank) must agree on everything. A disagreement raises
  :class:`ScheduleMismatchError` *on every rank* with the ranks and their values, e.g.::

      step 12: ranks disagree on the micro-batch count: rank 0 has 3, rank 1 has 2 -- the packer
      must equalise counts (invariant 1)

  The first round is one ``all_gather`` of ``_HEADER`` int64s per rank (a digest of the per-micro-
  batch lists); only when peers' digests differ does a second fixed-size round gather the lists to
  name the first differing micro-batch. Every rank sees the same gathered data and so takes the
  same path: the check itself can never leave a rank waiting. CPU tensors on gloo, CUDA on NCCL.

* :class:`Watchdog` -- a daemon thread per rank. ``with watchdog.step(n):`` arms it for one step;
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
import dataclasses
import faulthandler
import hashlib
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch

__all__ = ["StepSchedule", "ScheduleMismatchError", "check_schedule", "Watchdog", "HANG_EXIT_CODE",
           "note_collective", "collective", "active_watchdog", "iter_hang_files"]

HANG_EXIT_CODE = 75
"""Exit status of a process the watchdog ended (EX_TEMPFAIL: the job may be retried from the last
checkpoint). A preempted run that checkpointed exits 0 instead (``engine.signals``)."""

_MAGIC = 0x6D67_7270_6F67  # "mgrpog": a rank that sends anything else is out of step
_VERSION = 1
_HEADER = 9  # magic, version, step, count, peer key, token digest, audio digest, tokens, clips
_NO_KEY = -1


# ------------------------------------------------------------------------------------------------
# schedule check
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepSchedule:
    """What one rank is about to run in one step; what :func:`check_schedule` compares."""

    step: int
    num_microbatches: int
    tokens_per_microbatch: tuple[int, ...]
    """T of each micro-batch (padding included)."""
    audio_per_microbatch: tuple[int, ...] = ()
    """Audio clips of each micro-batch (0: the tower runs on the dummy clip); () = all 0."""

    def __post_init__(self):
        toks = tuple(int(t) for t in self.tokens_per_microbatch)
        audio = tuple(int(a) for a in self.audio_per_microbatch) or (0,) * len(toks)
        object.__setattr__(self, "tokens_per_microbatch", toks)
        object.__setattr__(self, "audio_per_microbatch", audio)
        if int(self.num_microbatches) != self.num_microbatches or self.num_microbatches < 0:
            raise ValueError(f"num_microbatches must be a non-negative int, got {self.num_microbatches!r}")
        if len(toks) != self.num_microbatches or len(audio) != self.num_microbatches:
            raise ValueError(f"StepSchedule of step {self.step}: {self.num_microbatches} micro-batches but "
                             f"{len(toks)} token counts and {len(audio)} audio counts")
        if any(t < 0 for t in toks) or any(a < 0 for a in audio):
            raise ValueError(f"StepSchedule of step {self.step}: negative token or audio counts")

    @property
    def audio_flags(self) -> tuple[bool, ...]:
        """True where a micro-batch carries real audio."""
        return tuple(a > 0 for a in self.audio_per_microbatch)

    @classmethod
    def from_microbatches(cls, step: int, microbatches: Sequence[Any]) -> "StepSchedule":
        """From micro-batch objects: T from ``num_tokens`` (or ``input_ids_T``/``input_ids``), clips from
        ``num_clips`` / ``num_audio_clips``, ``audio_feature_lens`` (its length) or ``has_audio`` when present, else 0."""
        toks, audio = [], []
        for mb in microbatches:
            if hasattr(mb, "num_tokens"):
                toks.append(int(mb.num_tokens))
            else:
                ids = getattr(mb, "input_ids_T", None)
                ids = getattr(mb, "input_ids", None) if ids is None else ids
                if ids is None:
                    raise TypeError(f"cannot tell the token count of {type(mb).__name__}")
                toks.append(int(ids.shape[-1]))
            audio.append(_clip_count(mb))
        return cls(step=int(step), num_microbatches=len(toks), tokens_per_microbatch=tuple(toks),
                   audio_per_microbatch=tuple(audio))


def _clip_count(mb: Any) -> int:
    for name in ("num_clips", "num_audio_clips"):
        n = getattr(mb, name, None)
        if n is not None:
            return int(n)
    lens = getattr(mb, "audio_feature_lens", None)
    if lens is not None:
        return int(torch.as_tensor(lens).numel())
    flag = getattr(mb, "has_audio", None)
    return int(bool(flag)) if flag is not None else 0


class ScheduleMismatchError(RuntimeError):
    """The ranks disagree on the step's schedule; raised on every rank with the same message."""

    def __init__(self, message: str, step: Optional[int] = None, field: Optional[str] = None,
                 values: Optional[dict] = None):
        super().__init__(message)
        self.step = step
        self.field = field
        self.values = dict(values or {})

    def __reduce__(self):  # keeps the fields through pickling (spawned ranks send it to the parent)
        return (type(self), (str(self), self.step, self.field, self.values))


def _digest(values: Sequence[int]) -> int:
    """A 63-bit digest of an int sequence, the same in every process (unlike ``hash``)."""
    h = hashlib.blake2b(",".join(str(int(v)) for v in values).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def _default_peer_key() -> int:
    """Ranks with the same key share micro-batches: megatron's data-parallel rank (TP, PP and CP peers
    hold the same samples); without megatron's parallel state every rank has its own data."""
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return int(ps.get_data_parallel_rank())
    except Exception:  # noqa: BLE001 - no megatron, or not initialised
        pass
    return _NO_KEY


def _collective_device(group) -> torch.device:
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _global_ranks(group, n: int) -> list[int]:
    import torch.distributed as dist

    if group is None:
        return list(range(n))
    try:
        return [dist.get_global_rank(group, i) for i in range(n)]
    except Exception:  # noqa: BLE001 - older torch
        return list(range(n))


def _by_value(values: dict[int, Any], fmt=str, limit: int = 16) -> str:
    """'rank 0 has 3, rank 1 has 2' (few ranks) or 'ranks 0, 2 have 3; rank 1 has 2' (grouped)."""
    groups: dict[str, list[int]] = {}
    for r, v in sorted(values.items()):
        groups.setdefault(fmt(v), []).append(r)
    parts = []
    for text, ranks in sorted(groups.items(), key=lambda kv: kv[1][0]):
        if len(ranks) == 1:
            parts.append(f"rank {ranks[0]} has {text}")
        else:
            shown = ", ".join(map(str, ranks[:limit])) + (f", ... ({len(ranks)} ranks)" if len(ranks) > limit else "")
            parts.append(f"ranks {shown} have {text}")
    sep = ", " if all(len(r) == 1 for r in groups.values()) else "; "
    return sep.join(parts)


def _encode(schedule: StepSchedule, peer_key: int) -> list[int]:
    return [_MAGIC, _VERSION, int(schedule.step), schedule.num_microbatches, int(peer_key),
            _digest(schedule.tokens_per_microbatch), _digest(schedule.audio_per_microbatch),
            sum(schedule.tokens_per_microbatch), sum(schedule.audio_per_microbatch)]


def check_schedule(schedule: StepSchedule, group=None, *, peer_key: Optional[int] = None) -> None:
    """Collective over ``group`` (default: the world): raise :class:`ScheduleMismatchError` on every
    rank unless all ranks agree on the step and the micro-batch count, and ranks with the same
    ``peer_key`` (default: megatron's data-parallel rank, i.e. TP/PP/CP peers) also agree on the
    tokens and audio clips of every micro-batch. Returns None when they agree. Without an initialised
    process group (one process) it only validates ``schedule``.
    """
    import torch.distributed as dist

    if not isinstance(schedule, StepSchedule):
        raise TypeError(f"check_schedule needs a StepSchedule, got {type(schedule).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        return
    key = _default_peer_key() if peer_key is None else int(peer_key)
    with collective(f"check_schedule(step {schedule.step})"):
        device = _collective_device(group)
        n = dist.get_world_size(group)
        mine = torch.tensor(_encode(schedule, key), dtype=torch.int64, device=device)
        rows = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(rows, mine, group=group)
        headers = [r.cpu().tolist() for r in rows]
        ranks = _global_ranks(group, n)
        problem = _compare_headers(headers, ranks, schedule.step)  # the step of the error is rank 0's
        if problem is not None:
            raise problem
        # peers whose digests differ: gather the per-micro-batch lists to say where (same path on
        # every rank, since every rank holds the same headers)
        if not _peer_digests_differ(headers):
            return
        count = headers[0][3]
        detail = torch.tensor(list(schedule.tokens_per_microbatch) + list(schedule.audio_per_microbatch),
                              dtype=torch.int64, device=device)
        if detail.numel() != 2 * count:  # cannot happen after the count check; keep the sizes equal
            detail = torch.zeros(2 * count, dtype=torch.int64, device=device)
        out = [torch.empty_like(detail) for _ in range(n)]
        dist.all_gather(out, detail, group=group)
        lists = [o.cpu().tolist() for o in out]
    raise _compare_details(headers, lists, ranks, schedule.step)


def _compare_headers(headers: list[list[int]], ranks: list[int], step: int) -> Optional[ScheduleMismatchError]:
    step = headers[0][2]  # rank 0's, so that every rank words the error the same way
    bad = {ranks[i]: h[:2] for i, h in enumerate(headers) if h[0] != _MAGIC or h[1] != _VERSION}
    if bad:
        return ScheduleMismatchError(
            f"step {step}: ranks {sorted(bad)} sent something that is not a schedule to the schedule check "
            "(a different collective, or a different megatron-grpo version, is running there); the ranks are "
            "out of step", step, "protocol", bad)
    steps = {ranks[i]: h[2] for i, h in enumerate(headers)}
    if len(set(steps.values())) > 1:
        return ScheduleMismatchError(
            f"step {step}: ranks disagree on the step number: {_by_value(steps)} -- a rank skipped or repeated "
            "a step (check the data iterator / resume state)", step, "step", steps)
    counts = {ranks[i]: h[3] for i, h in enumerate(headers)}
    if len(set(counts.values())) > 1:
        return ScheduleMismatchError(
            f"step {step}: ranks disagree on the micro-batch count: {_by_value(counts)} -- the packer must "
            "equalise counts (invariant 1: MAX all-reduce, then pad with empty micro-batches)",
            step, "num_microbatches", counts)
    return None


def _peer_digests_differ(headers: list[list[int]]) -> bool:
    seen: dict[int, tuple] = {}
    for h in headers:
        if h[4] == _NO_KEY:
            continue
        sig = (h[5], h[6], h[7], h[8])
        if seen.setdefault(h[4], sig) != sig:
            return True
    return False


def _compare_details(headers, lists, ranks, step) -> ScheduleMismatchError:
    count = headers[0][3]
    peers: dict[int, list[int]] = {}
    for i, h in enumerate(headers):
        if h[4] != _NO_KEY:
            peers.setdefault(h[4], []).append(i)
    for key, members in sorted(peers.items()):
        for field, sl, why in (
                ("tokens_per_microbatch", slice(0, count),
                 "peers must build the same micro-batches from the same samples (same plan, same pad multiple)"),
                ("audio_per_microbatch", slice(count, 2 * count),
                 "peers must agree which micro-batches carry real audio (invariant 2: the tower runs on "
                 "every micro-batch, a dummy clip where there is none)")):
            vals = {ranks[i]: lists[i][sl] for i in members}
            if len({tuple(v) for v in vals.values()}) > 1:
                first = min(k for k in range(count) if len({tuple(v)[k] for v in vals.values()}) > 1)
                what = "tokens per micro-batch" if field.startswith("tokens") else "audio clips per micro-batch"
                return ScheduleMismatchError(
                    f"step {step}: ranks {sorted(vals)} hold the same micro-batches (data-parallel rank {key}: "
                    f"TP/PP peers) but disagree on the {what}: {_by_value(vals, _short_list)} (first difference at "
                    f"micro-batch {first}) -- {why}", step, field, vals)
    return ScheduleMismatchError(f"step {step}: ranks' schedule digests differ but no per-micro-batch difference "
                                 "was found (hash collision?)", step, "digest", {})


def _short_list(v: list[int], limit: int = 12) -> str:
    return "[" + ", ".join(map(str, v[:limit])) + (f", ... ({len(v)})" if len(v) > limit else "") + "]"


# ------------------------------------------------------------------------------------------------
# watchdog
# ------------------------------------------------------------------------------------------------

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
