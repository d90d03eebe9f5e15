"""The receiver process of :mod:`launch.bench.sync`: allocate, receive and unpack each bucket."""
from __future__ import annotations

from collections import deque

from launch.bench._sync_common import _bucket_packed_sizes, _Ctrl, _drain, _now, _payload_sizes, _Sink, _sync
from launch.bench._sync_raw import _raw_pass, _timed
from launch.bench._sync_transport import _GlooProductReceiver, _PgTransport


def _receiver_pass(plan, rx, device, serial: bool, buffers: int, sink: _Sink) -> dict:
    import torch

    from megatron_grpo.weight_sync.buckets import dtype_from_name, packed_layout, unpack_bucket

    phases = {"receive": 0.0, "unpack": 0.0}
    t_start = _now()
    if isinstance(rx, _GlooProductReceiver):
        for meta in plan:
            t0 = _now()
            pairs = rx.recv_bucket(meta)
            phases["receive"] += _now() - t0
            sink(pairs)
        phases["unpack"] = None
        return {"start": t_start, "end": _now(), "phases": phases}
    inflight = deque()
    limit = 0 if serial else max(0, buffers - 1)
    for meta in plan:
        t0 = _now()
        dtypes = [dtype_from_name(d) for d in meta["dtype_names"]]
        _, _, total = packed_layout(dtypes, meta["shapes"])
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        work = rx.recv(buf)
        if serial:
            rx.wait(work)
            _sync(device)
        t1 = _now()
        phases["receive"] += t1 - t0
        pairs = unpack_bucket(buf, meta["names"], dtypes, meta["shapes"])
        if serial:
            _sync(device)
        phases["unpack"] += _now() - t1
        sink(pairs)
        del pairs
        inflight.append((work, buf))
        _drain(inflight, rx, limit)
    t0 = _now()
    _drain(inflight, rx)
    _sync(device)
    phases["receive"] += _now() - t0
    return {"start": t_start, "end": _now(), "phases": phases}


def _receiver(opts: dict, ctrl: _Ctrl) -> dict:
    import torch

    device = torch.device("cuda", 1) if opts["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    plan = ctrl.get("plan")
    rx = _GlooProductReceiver(ctrl) if opts["transport"] == "gloo" else _PgTransport(ctrl, 1, device, opts["timeout_s"])
    sizes = _bucket_packed_sizes(plan)
    payload = sum(_payload_sizes(plan))
    n_runs = opts["warmup"] + opts["iters"]
    big = torch.empty(payload, dtype=torch.uint8, device=device)
    _timed(ctrl, n_runs, opts["warmup"], _raw_pass, rx, False, device, [payload], big, opts["buffers"])
    del big
    buf = torch.empty(max(sizes), dtype=torch.uint8, device=device)
    _timed(ctrl, n_runs, opts["warmup"], _raw_pass, rx, False, device, sizes, buf, opts["buffers"])
    del buf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for mode in ("pipelined", "serial"):
        for i in range(n_runs):
            ctrl.barrier()
            _sync(device)
            r = _receiver_pass(plan, rx, device, mode == "serial", opts["buffers"], _Sink())
            ctrl.put(f"rx/{mode}/{i}", r)
    sink = _Sink(check=True, keep=opts["keep_tensors"])
    ctrl.barrier()
    _receiver_pass(plan, rx, device, True, opts["buffers"], sink)
    ctrl.put("rx/check", sink.result())
    out = {"peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}
    rx.close()
    return out
