"""Where a profiled step leaves the device idle: each idle stretch between device activities is
charged to the innermost host range open at that time (``megatron_grpo.host_ranges``: ``mgrpo/...``)."""
from __future__ import annotations

import numpy as np

__all__ = ["device_timeline", "idle_intervals", "idle_by_owner", "busy_host_ops"]

BIN_US = 5.0
"""Resolution of the attribution (us): an idle stretch is split over the ranges open in each bin."""

NO_RANGE = "(no range)"

GAPS_TOP = 10
"""Longest device idle gaps listed per profiled step."""

GAPS_EXPLAINED = 3
"""Of those, how many list the host ops that ran during them (:func:`busy_host_ops`)."""

OPS_PER_GAP = 6
"""Host ops listed per explained gap."""


def idle_intervals(spans_us: list[tuple[float, float]], start_us: float, end_us: float) -> list[tuple[float, float]]:
    """The stretches of ``[start_us, end_us]`` no device activity (``spans_us``) covers."""
    out, last = [], start_us
    for a, b in sorted(spans_us):
        if a > last:
            out.append((last, min(a, end_us)))
        last = max(last, b)
        if last >= end_us:
            break
    if last < end_us:
        out.append((last, end_us))
    return [(a, b) for a, b in out if b > a]


def idle_by_owner(idle_us: list[tuple[float, float]], ranges: list[tuple[str, float, float]], start_us: float,
                  end_us: float, top: int = 12) -> list[dict]:
    """``ranges``: ``(name, start, end)`` host ranges, nested or not. Each idle microsecond goes to
    the shortest range open at that time (the innermost), or to :data:`NO_RANGE`; returns the
    ``top`` owners as ``{"name", "idle_ms"}``, most idle first (their sum is the idle time)."""
    n = max(1, int(np.ceil((end_us - start_us) / BIN_US)))
    owner = np.full(n, -1, dtype=np.int64)
    names = sorted({r[0] for r in ranges})
    index = {nm: k for k, nm in enumerate(names)}
    # longest first, so a nested (shorter) range paints over the one around it
    for name, a, b in sorted(ranges, key=lambda r: -(r[2] - r[1])):
        i, j = int((a - start_us) // BIN_US), int(np.ceil((b - start_us) / BIN_US))
        owner[max(i, 0):min(j, n)] = index[name]
    totals = np.zeros(len(names) + 1)
    for a, b in idle_us:
        i, j = max(int((a - start_us) // BIN_US), 0), min(max(int(np.ceil((b - start_us) / BIN_US)), 1), n)
        if j <= i:
            continue
        counts = np.bincount(owner[i:j] + 1, minlength=len(names) + 1)
        totals += counts * ((b - a) / (j - i))  # the stretch's exact length, shared by its bins
    rows = [{"name": NO_RANGE if k == 0 else names[k - 1], "idle_ms": float(t) / 1e3}
            for k, t in enumerate(totals) if t > 0]
    return sorted(rows, key=lambda r: -r["idle_ms"])[:top]


def busy_host_ops(gap_us: tuple[float, float], ops: list[tuple[str, float, float]],
                  top: int = OPS_PER_GAP) -> list[dict]:
    """The host ops (``(name, start, end)``, nested or not) that overlap the idle stretch ``gap_us``
    most, as ``{"name", "overlap_ms", "ms"}`` (the op's whole length): what kept the host from
    launching device work then (an allocator's ``cudaMalloc``, a pageable copy, Python packing)."""
    a, b = gap_us
    rows = [(min(e, b) - max(s, a), name, e - s) for name, s, e in ops if s < b and e > a]
    rows.sort(key=lambda r: (-r[0], r[2]))
    return [{"name": name[:120], "overlap_ms": o / 1e3, "ms": d / 1e3} for o, name, d in rows[:top]]


def device_timeline(spans_us: list[tuple[float, float]], start_us: float, end_us: float,
                    ranges: list[tuple[str, float, float]] | None = None,
                    host_ops: list[tuple[str, float, float]] | None = None) -> dict:
    """Where the device was idle in a profiled step: ``spans_us`` are its activities (kernels,
    copies, memsets) as ``(start, end)`` in microseconds, ``[start_us, end_us]`` the step on the
    host's clock. Returns ms: the step, the device busy (the activities' union), idle in all, idle
    before its first activity and after its last, and the :data:`GAPS_TOP` longest gaps between
    activities (``at_ms``: where each begins, from the step's start); with host ``ranges``, also
    ``idle_by_range`` (:func:`idle_by_owner`); with ``host_ops``, the :data:`GAPS_EXPLAINED`
    longest gaps name the host ops that ran during them (``host``, :func:`busy_host_ops`)."""
    if not spans_us:
        out = {"step_ms": (end_us - start_us) / 1e3, "busy_ms": 0.0, "idle_ms": (end_us - start_us) / 1e3}
        if ranges is not None:
            out["idle_by_range"] = idle_by_owner([(start_us, end_us)], ranges, start_us, end_us)
        return out
    first, last = min(a for a, _ in spans_us), max(b for _, b in spans_us)
    t0, t1 = min(start_us, first), max(end_us, last)
    idle = idle_intervals(spans_us, t0, t1)
    idle_us = sum(b - a for a, b in idle)
    gaps = sorted(((b - a, a) for a, b in idle if a >= first and b <= last), reverse=True)[:GAPS_TOP]
    out = {"step_ms": (t1 - t0) / 1e3, "busy_ms": (t1 - t0 - idle_us) / 1e3, "idle_ms": idle_us / 1e3,
           "idle_before_first_ms": max(first - start_us, 0.0) / 1e3, "idle_after_last_ms": max(end_us - last, 0.0) / 1e3,
           "longest_gaps": [{"ms": g / 1e3, "at_ms": (at - t0) / 1e3} for g, at in gaps]}
    if host_ops is not None:
        for row, (g, at) in zip(out["longest_gaps"][:GAPS_EXPLAINED], gaps):
            row["host"] = busy_host_ops((at, at + g), host_ops)
    if ranges is not None:
        out["idle_by_range"] = idle_by_owner(idle, ranges, t0, t1)
    return out
