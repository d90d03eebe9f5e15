"""Raw bandwidth of :mod:`launch.bench.sync`'s transport (no export, no packing) and the two-sided
timing of a pass."""
from __future__ import annotations

from collections import deque

from launch.bench._sync_common import _Ctrl, _now, _sync
from launch.bench._sync_transport import _GlooProductReceiver, _GlooProductTrainer


def _raw_pass(tr_or_rx, is_trainer: bool, device, sizes: list[int], buf, buffers: int) -> dict:
    """Broadcast ``sizes`` bytes back to back out of / into ``buf`` (one size: the raw ceiling)."""
    t0 = _now()
    if isinstance(tr_or_rx, (_GlooProductTrainer, _GlooProductReceiver)):
        for n in sizes:
            if is_trainer:
                tr_or_rx.send(buf[:n])
            else:
                rx = tr_or_rx
                rx.recv_bucket({"names": ["raw"], "dtype_names": ["uint8"], "shapes": [[n]]})
        return {"start": t0, "end": _now()}
    inflight = deque()
    for n in sizes:
        view = buf[:n]
        inflight.append(tr_or_rx.send(view) if is_trainer else tr_or_rx.recv(view))
        while len(inflight) > max(0, buffers - 1):
            tr_or_rx.wait(inflight.popleft())
    while inflight:
        tr_or_rx.wait(inflight.popleft())
    _sync(device)
    return {"start": t0, "end": _now()}


def _timed(ctrl: _Ctrl, n: int, warmup: int, fn, *args) -> list[float]:
    """``n`` runs of ``fn(*args)`` after a barrier each; both sides' (start, end) pairs are exchanged so
    the trainer times from its start to the later end (seconds of the runs after ``warmup``)."""
    out = []
    for i in range(n):
        ctrl.barrier()
        r = fn(*args)
        key = f"timed/{ctrl._n}"
        if ctrl.rank == 1:
            ctrl.put(key, r)
        else:
            other = ctrl.get(key)
            if i >= warmup:
                out.append(max(r["end"], other["end"]) - r["start"])
    return out
