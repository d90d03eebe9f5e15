"""Direct weight sending: every trainer rank that exports tensors streams its OWN `export_hf` tensors,
in packed buckets, point-to-point to one receiver, all ranks at once (no gather to rank 0 first).

Under expert parallelism (TP = ETP = 1) `export_hf` yields every HF tensor exactly once across the
job (model_bridge/export.py): EP rank 0 (data-parallel rank 0) the dense tensors and its experts,
EP rank r its experts under their global indices, and it makes no collective at all. So each rank
can push its share straight to the receiver, and the bytes of the job travel over N links at once
instead of N-1 links into rank 0 and then one link out of it (`gather.export_to_rank0` + a push).

1. Plan (no tensor data, no collective): `local_buckets(model, bucket_bytes, **export_kw)` is this
   rank's `export_plan` cut into buckets exactly as `iter_buckets` cuts the stream (a list of the
   per-bucket metadata `{'names', 'dtype_names', 'shapes'}`, the `/update_weights` update_info; empty
   on ranks that yield nothing). It works on a meta model. It refuses a model whose export needs a
   TP/ETP gather (`DirectLayoutError`: use `export_to_rank0` there). The receiver is handed every
   sender's list up front (HTTP / a store in production; `DirectPlan(senders={group rank: buckets},
   receiver=group rank)`), so only bytes travel on the data plane.
2. The one global order (`DirectPlan.order()`): bucket 0 of every sender in group-rank order, then
   bucket 1 of every sender that has one, and so on. Each sender's buckets appear in its own export
   order, so every sender's op list is a subsequence of that order.
3. Sender (`send_direct(weights, buckets, group, dst)`): takes each planned bucket's tensors from its
   `export_hf` stream (checking name, shape, dtype against the plan), packs them (`pack_bucket`: one
   uint8 buffer, on the model's device) and posts one point-to-point send (tag = bucket index), with at
   most `buffers` sends outstanding: the next bucket is exported and packed while the previous one is
   on the wire. The same function pushes any stream with its bucket plan to one receiver (the bench
   uses it for rank 0's `export_to_rank0` stream as well).
4. Receiver (`recv_direct(plan, group, consume)`): posts the receives in the global order (a fresh
   buffer sized by `packed_layout`, tag = bucket index), with at most `buffers` x senders outstanding,
   finishes them oldest first and hands `consume(sender, bucket index, pairs)` the HF-named views of
   each buffer (`unpack_bucket`: what vLLM's `load_weights` takes), in each sender's order.

Why this cannot hang (the anti-hang invariant of docs: every rank issues its collectives and
point-to-point ops in one globally consistent order, so blocking at any op only waits for peers
that are themselves not waiting on us):
* The group carries nothing but these sends and receives: each sender's ops are its buckets in plan
  order, the receiver's ops are the global order, and each sender's list is a subsequence of it; a
  pair's messages match in posting order (gloo: by pair and tag, the tag being the bucket index; NCCL:
  per pair, in stream order).
* A sender blocks only (a) inside its own `export_hf`, which under TP = ETP = 1 makes no collective
  and waits for nobody (`local_buckets` refuses any other layout), and (b) waiting for its own oldest
  outstanding send, which is earlier in the global order than anything it has not posted yet.
  The receiver blocks only waiting for its oldest outstanding receive.
* By induction over the global order: if every op before position p completes, then the receiver
  posts op p (it waits only on earlier ops) and its sender posts the matching send (it too waits
  only on earlier ops of its own and on local work), so op p completes. With NCCL the receiver's
  receives may run one at a time on one stream, in posting order = global order, which is the same
  induction on the device; a sender's stream holds its earlier sends (complete) and local kernels.
* Nothing else may run in the group while a transfer is in flight, and every process must run the
  same sequence of transfers (callers separate them with a barrier outside the group, e.g. a store).
  A sender that fails mid-stream leaves the receiver waiting: the process-group timeout (and the
  caller's watchdog) turns that into an error, as for every collective of the job.

Memory: a sender holds at most `buffers` packed buckets (<= bucket_bytes each, or one larger tensor)
on top of what `export_hf` holds (one full parameter); the receiver holds `buffers` x senders
received buckets plus what `consume` keeps.

The group is any torch `ProcessGroup` with `send` / `recv` (NCCL on GPUs, gloo on CPU); `p2p_group`
builds a stateless one over a store (the construction of vLLM's stateless groups), so the trainers'
own torch.distributed world stays untouched. Checked on gloo processes against a single-rank
`export_hf` by `mgrpo bench sync --ep N` (tests/launch/test_bench_sync.py) and by
tests/megatron_grpo/weight_sync/test_direct.py.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable, Iterator, Sequence

import torch

from megatron_grpo.weight_sync.buckets import (dtype_from_name, dtype_name, iter_buckets, pack_bucket,
                                               packed_layout, unpack_bucket)

__all__ = ["DirectLayoutError", "DirectPlan", "local_buckets", "bucket_plan", "p2p_group", "send_direct",
           "recv_direct", "warm_up"]


class DirectLayoutError(RuntimeError):
    """The model's export needs collectives (TP/ETP gathers): direct sending could hang; gather instead."""


def bucket_plan(tensors: Iterable[tuple[str, Sequence[int], torch.dtype | str]], bucket_bytes: int) -> list[dict]:
    """The bucket metadata `iter_buckets` gives for a stream of (name, shape, dtype): the same cuts, no data."""
    fake = ((n, torch.empty(tuple(s), dtype=dtype_from_name(d) if isinstance(d, str) else d, device="meta"))
            for n, s, d in tensors)
    return [b.metadata() for b in iter_buckets(fake, bucket_bytes)]


def local_buckets(model, bucket_bytes: int, **export_kw) -> list[dict]:
    """This rank's `export_hf` stream as bucket metadata (see the module doc); no collective, works on a
    meta model. `export_kw` go to `export_hf` (spec, bridge, dtype). Raises `DirectLayoutError` when some
    parameter this rank exports is sharded over TP/ETP (its export would gather)."""
    from model_bridge.export import export_plan, export_tasks

    tasks = export_tasks(model, export_kw.get("spec"), **{k: v for k, v in export_kw.items() if k == "bridge"})
    gathered = [t.name for t in tasks if t.shard.replica_rank == 0 and t.shard.size > 1]
    if gathered:
        raise DirectLayoutError(f"direct sending needs an export without TP/ETP gathers; {len(gathered)} parameters "
                                f"here are sharded (first: {gathered[0]!r}): use gather.export_to_rank0")
    return bucket_plan(export_plan(model, **export_kw), bucket_bytes)


@dataclass
class DirectPlan:
    """Every sender's buckets (group rank -> bucket metadata in send order) and the receiver's group rank."""

    senders: dict[int, list[dict]]
    receiver: int

    def __post_init__(self):
        self.senders = {int(s): list(b) for s, b in sorted(self.senders.items())}
        if self.receiver in self.senders and self.senders[self.receiver]:
            raise ValueError(f"group rank {self.receiver} is the receiver and has buckets to send")
        self.senders = {s: b for s, b in self.senders.items() if b and s != self.receiver}
        seen: dict[str, int] = {}
        for s, buckets in self.senders.items():
            for meta in buckets:
                if not (len(meta["names"]) == len(meta["dtype_names"]) == len(meta["shapes"])):
                    raise ValueError(f"sender {s}: a bucket's names, dtype_names and shapes differ in length")
                for n in meta["names"]:
                    if n in seen:
                        raise ValueError(f"{n!r} is sent by both group ranks {seen[n]} and {s}")
                    seen[n] = s

    def order(self) -> list[tuple[int, int]]:
        """(sender, bucket index) in the one global order: round robin over the senders by bucket index."""
        out = []
        for k in range(max((len(b) for b in self.senders.values()), default=0)):
            out.extend((s, k) for s, b in self.senders.items() if k < len(b))
        return out

    def tensors(self) -> int:
        return sum(len(m["names"]) for b in self.senders.values() for m in b)

    def payload_bytes(self, sender: int | None = None) -> int:
        """Sum of the tensors' bytes (of one sender, or all)."""
        return sum(_packed(m)[1] for s, b in self.senders.items() if sender in (None, s) for m in b)

    def packed_bytes(self, sender: int | None = None) -> int:
        """Sum of the packed buffers' bytes (alignment included)."""
        return sum(_packed(m)[2] for s, b in self.senders.items() if sender in (None, s) for m in b)


def _packed(meta: dict) -> tuple[list[torch.dtype], int, int]:
    """(dtypes, payload bytes, packed bytes) of one bucket's metadata."""
    dtypes = [dtype_from_name(d) for d in meta["dtype_names"]]
    _, sizes, total = packed_layout(dtypes, meta["shapes"])
    return dtypes, sum(sizes), total


# ------------------------------------------------------------------------------------------------
# the group
# ------------------------------------------------------------------------------------------------


def p2p_group(store, rank: int, world_size: int, device: torch.device, timeout_s: float,
              prefix: str = "mgrpo_direct"):
    """A stateless `ProcessGroup` of `world_size` ranks over `store` (NCCL when `device` is CUDA, else
    gloo), not registered with torch.distributed: use its `send` / `recv` methods. Every member must call
    this with the same `prefix` (a fresh one per group on one store)."""
    import torch.distributed as dist
    from torch.distributed import ProcessGroup

    device = torch.device(device)
    store = dist.PrefixStore(prefix, store)
    timeout = timedelta(seconds=timeout_s)
    pg = ProcessGroup(store, rank, world_size)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        backend = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        kind = ProcessGroup.BackendType.NCCL
    else:
        backend = dist.ProcessGroupGloo(store, rank, world_size, timeout=timeout)
        kind = ProcessGroup.BackendType.GLOO
    pg._set_default_backend(kind)
    backend._set_sequence_number_for_group()
    pg._register_backend(torch.device(device.type), kind, backend)
    return pg


def _is_cuda(buf: torch.Tensor) -> bool:
    return buf.device.type == "cuda"


def _finish(work, buf: torch.Tensor) -> None:
    """Block the host until `work` is done (gloo: `wait` blocks; NCCL: `wait` only orders the current
    stream after it, so poll its completion as well: that bounds the buffers in flight)."""
    work.wait()
    if _is_cuda(buf):
        while not work.is_completed():
            time.sleep(0)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(plan: DirectPlan, group, rank: int, device) -> None:
    """One 64-byte message from every sender to the receiver, in the global order (on NCCL this creates
    the pairs' communicators, which would otherwise be timed in the first transfer). Every sender and
    the receiver call it; other members of the group return at once."""
    buf = torch.zeros(64, dtype=torch.uint8, device=device)
    if rank == plan.receiver:
        for s in plan.senders:
            _finish(group.recv([buf], s, 0), buf)
    elif rank in plan.senders:
        _finish(group.send([buf], plan.receiver, 0), buf)
    _sync(device)


def send_direct(weights: Iterable[tuple[str, torch.Tensor]], buckets: Sequence[dict], group, dst: int, *,
                device: torch.device | str | None = None, buffers: int = 2, serial: bool = False,
                phases: dict | None = None) -> dict:
    """Send `weights` (the stream `buckets` was planned from, e.g. `export_hf(model)`) to group rank `dst`,
    one packed bucket per planned bucket (module doc, 3). The stream is consumed to its end; a tensor
    that differs from the plan (name, shape, dtype), or a stream longer or shorter than it, raises.

    `device`: where the buckets are packed (default: each bucket's first tensor's). `serial`: finish
    each send before exporting more and synchronise the device after each phase (for timing the
    phases). `phases`, when given, accumulates seconds of 'export' (waiting for the stream), 'pack' and
    'send' (posting and waiting for sends). Returns {'buckets', 'tensors', 'bytes' (packed)}."""
    ph = phases if phases is not None else {}
    for k in ("export", "pack", "send"):
        ph.setdefault(k, 0.0)
    it: Iterator = iter(weights)
    inflight: deque = deque()
    limit = 0 if serial else max(0, buffers - 1)
    sent = n_tensors = 0
    dev = torch.device(device) if device is not None else None
    for k, meta in enumerate(buckets):
        t0 = time.perf_counter()
        tensors = []
        for name, shape, dname in zip(meta["names"], meta["shapes"], meta["dtype_names"]):
            got = next(it, None)
            if got is None:
                raise RuntimeError(f"send_direct: the stream ended at {name!r} (bucket {k} of {len(buckets)})")
            n, t = got
            if n != name or tuple(t.shape) != tuple(shape) or dtype_name(t.dtype) != dname:
                raise RuntimeError(f"send_direct: the stream yielded {n!r} {tuple(t.shape)} {dtype_name(t.dtype)}, "
                                   f"the plan says {name!r} {tuple(shape)} {dname} (bucket {k})")
            tensors.append(t)
        if serial and tensors:
            _sync(tensors[0].device)
        t1 = time.perf_counter()
        ph["export"] += t1 - t0
        buf = pack_bucket(tensors, device=dev)
        del tensors
        if serial:
            _sync(buf.device)
        t2 = time.perf_counter()
        ph["pack"] += t2 - t1
        inflight.append((group.send([buf], dst, k), buf))
        while len(inflight) > limit:
            _finish(*inflight.popleft())
        ph["send"] += time.perf_counter() - t2
        sent += buf.numel()
        n_tensors += len(meta["names"])
    t0 = time.perf_counter()
    extra = next(it, None)
    ph["export"] += time.perf_counter() - t0
    if extra is not None:
        raise RuntimeError(f"send_direct: the stream yielded {extra[0]!r} beyond the plan's {n_tensors} tensors")
    t0 = time.perf_counter()
    while inflight:
        _finish(*inflight.popleft())
    ph["send"] += time.perf_counter() - t0
    return {"buckets": len(buckets), "tensors": n_tensors, "bytes": sent}


def recv_direct(plan: DirectPlan, group, consume: Callable[[int, int, list], None], *,
                device: torch.device | str = "cpu", buffers: int = 2, serial: bool = False,
                phases: dict | None = None) -> dict:
    """Receive every sender's buckets (module doc, 4) and hand `consume(sender, bucket index, pairs)` the
    (name, tensor) views of each, in each sender's order (senders interleaved in the global order). The
    views live in a fresh buffer per bucket on `device`; keep them (or copy) as needed.

    `buffers`: receives outstanding per sender (`serial`: one at a time, with a device sync after each
    phase). `phases`, when given, accumulates seconds of 'receive' (allocate, post, wait) and 'unpack'
    (`unpack_bucket` + `consume`). Returns {'buckets', 'tensors', 'bytes' (packed)}."""
    ph = phases if phases is not None else {}
    for k in ("receive", "unpack"):
        ph.setdefault(k, 0.0)
    device = torch.device(device)
    limit = 0 if serial else max(1, buffers) * max(1, len(plan.senders)) - 1
    inflight: deque = deque()
    got = n_tensors = 0

    def finish():
        nonlocal got, n_tensors
        s, k, work, buf, dtypes = inflight.popleft()
        t0 = time.perf_counter()
        _finish(work, buf)
        if serial:
            _sync(device)
        t1 = time.perf_counter()
        ph["receive"] += t1 - t0
        meta = plan.senders[s][k]
        consume(s, k, unpack_bucket(buf, meta["names"], dtypes, meta["shapes"]))
        if serial:
            _sync(device)
        ph["unpack"] += time.perf_counter() - t1
        got += buf.numel()
        n_tensors += len(meta["names"])

    for s, k in plan.order():
        t0 = time.perf_counter()
        dtypes, _, total = _packed(plan.senders[s][k])
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        inflight.append((s, k, group.recv([buf], s, k), buf, dtypes))
        ph["receive"] += time.perf_counter() - t0
        while len(inflight) > limit:
            finish()
    while inflight:
        finish()
    return {"buckets": len(plan.order()), "tensors": n_tensors, "bytes": got}
