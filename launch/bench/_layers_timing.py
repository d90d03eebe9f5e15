"""Timing, memory, profiling and environment helpers of :mod:`launch.bench.layers`."""
from __future__ import annotations

import datetime
import gc
import platform
import statistics
import time
from pathlib import Path


class _Timer:
    """Device time of the block (CUDA events, or wall time on CPU) in ``s``, and in ``host_s`` the
    wall time until the block returned on the host (all its kernels issued): ``host_s`` close to
    ``s`` means the host, not the GPU, sets the pace."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        import torch

        self.h0 = time.perf_counter()
        if self.cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import torch

        self.host_s = time.perf_counter() - self.h0
        if self.cuda:
            self.b.record()
            torch.cuda.synchronize()
            self.s = self.a.elapsed_time(self.b) / 1e3
        else:
            self.s = time.perf_counter() - self.t0


def _time_steps(step, device, warmup: int, iters: int, host_s: list | None = None,
                pipelined_s: list | None = None) -> list[float]:
    """Step times (s), each step timed alone (the GPU idles while the host runs the step's
    prologue); ``host_s`` (a list) also gets each step's host issue time (:class:`_Timer`);
    ``pipelined_s`` the mean time of ``iters`` steps run back to back with no host wait between
    them (the next step's prologue overlaps this one's tail, as a trainer's micro-batches do)."""
    for _ in range(warmup):
        step()
    out = []
    for _ in range(iters):
        with _Timer(device) as t:
            step()
        out.append(t.s)
        if host_s is not None:
            host_s.append(t.host_s)
    if pipelined_s is not None:
        with _Timer(device) as t:
            for _ in range(iters):
                step()
        pipelined_s.append(t.s / iters)
    return out


def time_alternating(fns: list, device, warmup: int, iters: int) -> list[list[float]]:
    """Each of ``fns`` timed alone (:class:`_Timer`), taking turns: every round times ``fns[0]``,
    ``fns[1]``, ... once, after ``warmup`` such rounds untimed. Things compared this way run in
    the same GPU state: under back-to-back work an H200 at its power limit lowers its clocks
    (measured 1.71-1.79 GHz during our steps, 1.97 GHz after 0.3 s idle), so two things timed one
    after the other, or one of them in short bursts, are not on the same footing."""
    for _ in range(warmup):
        for f in fns:
            f()
    out = [[] for _ in fns]
    for _ in range(iters):
        for i, f in enumerate(fns):
            with _Timer(device) as t:
                f()
            out[i].append(t.s)
    return out


GPU_IDLE_S = 0.05
"""GPU idle before each step of ``step_s_after_idle`` (an H200 back at full clocks after ~0.3 s
idle measured 1.97 GHz against 1.71-1.79 under back-to-back steps; 50 ms already recovers most)."""
_SLEEP_CYCLES_PER_S = 2.0e9
"""GPU clock cycles per second assumed to size the sleep kernel (H200: up to 1.98 GHz); the
sleep's length is checked, not trusted (:func:`step_diagnostics`)."""


def step_diagnostics(step, device, iters: int, host_issue_s: float) -> dict:
    """Two more timings of ``step`` on CUDA, ``iters`` steps each (lists of seconds; the bench
    reports their medians), that split a timed step's time (``step_s``) into the GPU's own work
    and what surrounds it:

    * ``step_s_gpu_bound``: each step issued while a sleep kernel holds the GPU, long enough that
      the host has queued the whole step before the GPU starts it (checked: the event behind the
      sleep must still be pending when the step returns; the sleep doubles up to 3 times, else
      None: the host had to wait for the GPU somewhere, at a host sync, or because the step has
      more kernels than the GPU's launch queue holds: ``ours_mb``'s six micro-batches on an H200).
      The GPU never waits for the host here: its kernels and their launch gaps only. ``step_s``
      minus this is the GPU's idle start while the host runs the step's prologue, plus the clocks
      (next).
    * ``step_s_after_idle``: each step timed alone after :data:`GPU_IDLE_S` of GPU idle, as
      ``step_s`` but with the GPU's clocks recovered from the previous step's sustained work.
      ``step_s`` minus this is what back-to-back work costs in clocks.
    """
    import torch

    out = {"step_s_gpu_bound": None, "step_s_after_idle": None}
    if device.type != "cuda":
        return out
    sleep = getattr(torch.cuda, "_sleep", None)
    bound, seconds = [], max(0.02, 2 * host_issue_s)
    while sleep is not None and len(bound) < iters:
        torch.cuda.synchronize()
        sleep(int(seconds * _SLEEP_CYCLES_PER_S))
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        started = a.query()  # the GPU got past the sleep before the host had queued the step
        b.record()
        torch.cuda.synchronize()
        if not started:
            bound.append(a.elapsed_time(b) / 1e3)
        elif seconds < 8 * max(0.02, 2 * host_issue_s):
            seconds *= 2
        else:
            break
    if len(bound) == iters:
        out["step_s_gpu_bound"] = bound
    idle = []
    for _ in range(iters):
        torch.cuda.synchronize()
        time.sleep(GPU_IDLE_S)
        with _Timer(device) as t:
            step()
        idle.append(t.s)
    out["step_s_after_idle"] = idle
    return out


def bench_loss(out, probe_lo):
    """The bench's loss ``sum(out * R)``: ``R`` already in ``out``'s dtype, the product in that dtype,
    summed in fp32 (one pass each way: the cheapest stand-in for an LM head, the same for every
    system; an fp32 copy of ``out`` cost ~0.3 ms of a 2-layer step on an H200)."""
    import torch

    return (out * probe_lo).sum(dtype=torch.float32)


def _mem_reset(device):
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def _alloc_gib(device) -> float | None:
    import torch

    return torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else None


def _backward(loss, device, trace: list | None, tokens: int, before_gib: float | None) -> None:
    """``loss.backward()``; with a ``trace`` list (CUDA) also record this micro-batch's memory:
    allocated before its forward (``before_gib``), its activations (allocated now minus that) and
    the backward's peak above the activations (resets the peak counter)."""
    import torch

    if trace is None:
        loss.backward()
        return
    b = _alloc_gib(device)
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    trace.append({"tokens": tokens, "before_gib": before_gib, "activations_gib": b - before_gib,
                  "backward_peak_over_activations_gib": _peak_gib(device) - b})


def _bench_fn(fn, device, warmup=3, iters=10) -> float:
    return statistics.median(_time_steps(fn, device, warmup, iters))


def _count_syncs(step) -> dict:
    """Synchronizing CUDA calls in one step (torch's sync debug mode), by the Python line that made them."""
    import warnings

    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return _tally_syncs(caught)


def _tally_syncs(caught: list) -> dict:
    """``{"total", "by_line"}`` of the sync warnings among ``caught`` (``warnings.WarningMessage``).

    A warning attributed to torch's own ``set_sync_debug_mode`` is the mode switch, not the step:
    on an H200 the first count after the profiler gave one there, while the same step under
    ``set_sync_debug_mode("error")`` raised nothing and a second count gave none."""
    import collections

    import torch

    code = torch.cuda.set_sync_debug_mode.__code__
    switch_lines = range(code.co_firstlineno, max((ln for *_, ln in code.co_lines() if ln), default=0) + 1)
    where = collections.Counter(
        f"{Path(w.filename).name}:{w.lineno}" for w in caught
        if "synchroniz" in str(w.message)
        and not (Path(w.filename) == Path(code.co_filename) and w.lineno in switch_lines))
    return {"total": sum(where.values()), "by_line": dict(where.most_common(12))}


def _profile(step, path) -> str:
    """Profile tables of one step to ``path``; with ``MGRPO_BENCH_TRACE=1`` also its timeline with
    Python stacks (``<path stem>_trace.json.gz``, for chrome://tracing or Perfetto)."""
    import os

    import torch
    from torch.profiler import ProfilerActivity, profile

    trace = os.environ.get("MGRPO_BENCH_TRACE", "0") == "1"
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True,
                 with_stack=trace) as prof:
        step()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(str(Path(path).with_name(Path(path).stem + "_trace.json.gz")))
    ka = prof.key_averages()
    try:
        table = ka.table(sort_by="device_time_total", row_limit=45, max_name_column_width=70)
    except Exception:  # noqa: BLE001 - older torch: the CUDA column's old name
        table = ka.table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=70)
    try:  # where the host's time goes (what bounds small micro-batches)
        cpu = ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
    except Exception:  # noqa: BLE001
        cpu = ""
    try:  # which tensors the small ops (copies, multiplies, gathers) run on
        shapes = prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_device_time_total", row_limit=60, max_name_column_width=40, max_shapes_column_width=90)
    except Exception:  # noqa: BLE001
        shapes = ""
    try:
        gaps = _idle_gaps(prof)
    except Exception as e:  # noqa: BLE001 - a torch whose events lack time ranges
        gaps = f"(not available: {e})"
    Path(path).write_text(table + "\n\nBy host (self CPU) time:\n" + cpu
                          + "\n\nBy operator and input shapes (self device time):\n" + shapes
                          + "\n\nWhere the GPU waits (idle gaps between kernels):\n" + gaps + "\n")
    return table


def _idle_gaps(prof, top: int = 15, min_us: float = 5.0) -> str:
    """The profiled step's device timeline: from the host's first op to the last kernel, the time
    no kernel or copy ran, and the longest gaps with the kernels around them (a gap at the start is
    the host's prologue; gaps in the middle are where the host fell behind or waited)."""
    from torch.autograd import DeviceType

    evs = prof.events()
    kern = sorted((e.time_range.start, e.time_range.end, e.name) for e in evs
                  if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    t0 = min(e.time_range.start for e in evs if e.device_type == DeviceType.CPU)
    gaps, busy_end, prev = [], t0, "(step start)"
    for start, end, name in kern:
        if start - busy_end >= min_us:
            gaps.append((start - busy_end, busy_end - t0, prev, name))
        if end > busy_end:
            busy_end, prev = end, name
    idle = sum(g[0] for g in gaps)
    lines = [f"window {(busy_end - t0) / 1e3:.2f} ms, idle {idle / 1e3:.2f} ms in {len(gaps)} gaps >= {min_us:g} us"]
    for us, at, before, after in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {us:8.1f} us at {at / 1e3:7.2f} ms  after {before[:60]!r}  before {after[:60]!r}")
    return "\n".join(lines)


def _env(device) -> dict:
    import torch

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__, "host": platform.node()}
    for name, mod in (("transformers", "transformers"), ("megatron_core", "megatron.core")):
        try:
            env[name] = __import__(mod, fromlist=["__version__"]).__version__
        except Exception:  # noqa: BLE001
            env[name] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env
