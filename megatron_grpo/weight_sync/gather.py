"""Bring a multi-rank `export_hf` stream to the one process that pushes to vLLM (global rank 0),
streaming: bounded memory on every rank, packed byte buckets point-to-point (GPU to GPU on NCCL).

`export_hf` yields each HF tensor exactly once across the job, on different ranks under EP/PP
(model_bridge/export.py says which), and its iteration is collective (TP/ETP gathers). Here every
rank iterates its own `export_hf` in lock-step with the others, and the tensors a non-zero rank
yields travel to rank 0 in the same pass, in buckets of at most `bucket_bytes`:

1. Plan (no tensor data): each rank computes, without collectives, what it will yield (the
   `export_plan`: name, shape, dtype) and, per yielded tensor, its *round*: the index of its
   parameter task in `export_tasks` (the loop `export_hf` runs; ranks of one pipeline stage share
   the task list, and a task's TP/ETP gather is the only collective of that task). One
   `all_gather_object` of these small lists (~20k names for the 30B model) gives every rank the
   whole plan, from which every rank computes the same `Schedule`:
   * the output order: the single-rank `export_hf` order (the ranks' streams merged by the
     parameters' places in the unsharded module tree: global layer and expert numbers, the
     modules' registration order), which keeps a layer's tensors together for vLLM's layerwise
     reload; each rank's own order is kept in any case;
   * pieces: each maximal run of that order that one non-zero rank yields, cut into packed buckets
     of at most `bucket_bytes` (`packed_layout` of buckets.py; a larger tensor travels alone).
     A piece is sent when its sender has yielded its last tensor, at that tensor's round.
   The plan is cached per model (`_cached_plan`): the next push of a model whose parameters
   (names, shapes, dtypes), ranks, bucket size and export arguments are unchanged reuses it (one
   small all-reduce makes every rank reuse it, or none).
2. Sender (rank r != 0): copies each yielded tensor into its piece's buffer (views from
   `unpack_bucket`, so both sides use one layout) and, after the piece's last tensor, before asking
   `export_hf` for more (which would run the next task's gather), `dist.send`s it to rank 0 and
   waits for the send to complete. It holds one piece at a time (stats: max_send_buffer_bytes).
3. Rank 0: yields in the planned order; its own tensors straight from `export_hf`, the others from
   views of the received buffers (`dist.recv` into a fresh buffer per piece, never reused).

Why this cannot hang (the anti-hang invariant of docs: every rank issues its collectives and
point-to-point ops in one globally consistent order, so blocking at any op only waits for peers
that are themselves not waiting on us):
* A piece of a sender in rank 0's own pipeline stage completing at round t is received by rank 0
  exactly after rank 0 has taken its own last tensor of round t and before it asks `export_hf` for
  round t+1. The sender does the matching send after its round-t gather and before its round-t+1
  gather. So on both sides the op sits between the same two collectives of the stage. By
  induction over rounds: a round-t gather needs its group's ranks to finish round t-1, which
  needs only the round <= t-1 receives that rank 0 did before reaching round t. This requires rank
  0 to yield something in every task of its stage (it is TP, ETP, DP and EDP rank 0, so it does);
  the schedule checks it.
* Pieces of other stages share no collective with rank 0's stage (export's gathers never cross a
  stage), so rank 0 may receive them at any point between two of its own ops; it receives each
  stage's pieces in round order (a later-round sender may be waiting, through its stage's
  gathers, on an earlier-round sender) when the output order reaches them. Their senders wait
  blocked in `send` meanwhile (that is the memory bound), their stage with them.
* Rank 0 never receives ahead of a forced round, so it may have to hold a few tensors before
  their turn in the output order (e.g. an EP rank's per-expert weights of a layer, which the
  single-rank order puts after rank 0's): stats max_held_bytes. It never holds more than the
  stretch of the order between a piece's arrival and its turn.
* NCCL: the sends/receives use the default group (their own communicator and stream), the gathers
  the TP/ETP groups'. A sender synchronizes its stream after each send, so it never enqueues a
  later gather before rank 0 has the bucket: the op order is consistent on every GPU even if the
  device ran the kernels of different communicators one at a time. gloo (CPU) is blocking anyway.

Memory: a sender holds its current piece (<= bucket_bytes, or one larger tensor) on top of what
`export_hf` holds; rank 0 one received piece plus what is held for order (see above); no rank
keeps a copy of its experts any more, no pickling, nothing staged through the host on GPUs.

On CPU the buckets go through gloo; on GPUs (default group NCCL, model on CUDA) they stay on the
device. Checked on gloo ranks against the single-rank `export_hf` (tests/megatron_grpo/
weight_sync/test_gather_stream.py: EP2, PP2, TP2xEP2, PP2xEP2, TP2xEP2xETP2).
"""
from __future__ import annotations

import heapq
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_grpo.weight_sync.buckets import ALIGN, default_bucket_bytes, unpack_bucket

__all__ = ["export_to_rank0", "build_schedule", "local_meta", "Schedule", "Piece"]


# ------------------------------------------------------------------------------------------------
# plan
# ------------------------------------------------------------------------------------------------


def _task_path(chunk: torch.nn.Module, task, ep_rank: int) -> tuple:
    """The parameter's place in the unsharded model: its module path with ModuleList indices made
    global (a Megatron layer's ``layer_number``, an expert's EP offset) and, for expert tasks, the
    EP rank appended (stacked experts: the same parameter name on every EP rank)."""
    expert = getattr(task.mapping, "group", "tp") == "etp"
    comps = task.name.split(".")
    out: list = []
    mod = chunk
    for c in comps[:-1]:
        child = mod._modules[c]
        if c.isdigit():
            n = int(c)
            if getattr(child, "layer_number", None) is not None:
                n = int(child.layer_number) - 1
            elif expert:
                n = ep_rank * len(mod) + n
            out.append(n)
        else:
            out.append(c)
        mod = child
    out.append(comps[-1])
    if expert:
        out.append(ep_rank)
    return tuple(out)


def local_meta(model, **export_kw) -> dict:
    """This rank's part of the plan, without collectives: {'stage', 'ntasks', 'yields': [(round,
    name, shape, dtype name)], 'paths': {round: path}, 'error': str | None}."""
    try:
        from model_bridge.export import export_plan, export_tasks
        from model_bridge.load import model_chunks
        from model_bridge.mappings import ParallelContext

        stage = 0
        try:
            from megatron.core import parallel_state as ps

            if ps.model_parallel_is_initialized():
                stage = ps.get_pipeline_model_parallel_rank()
        except ImportError:  # pragma: no cover - megatron is a dependency
            pass
        ep_rank = ParallelContext.from_parallel_state().ep_rank
        chunks = model_chunks(model)
        tasks = export_tasks(model, export_kw.get("spec"),
                             **{k: v for k, v in export_kw.items() if k == "bridge"})
        plan = export_plan(model, **export_kw)
        round_of: dict[str, int] = {}
        for i, t in enumerate(tasks):
            for n in t.hf.values():
                round_of[n] = i
        owner = {}
        for c in chunks:
            for p in c.parameters():
                owner.setdefault(id(p), c)
        yields, paths = [], {}
        for name, shape, dtype in plan:
            if name not in round_of:
                raise RuntimeError(f"export_plan names {name!r}, which no export task of this rank has")
            r = round_of[name]
            if yields and r < yields[-1][0]:
                raise RuntimeError(f"export_plan is not in task order at {name!r}")
            yields.append((r, name, tuple(int(s) for s in shape), str(dtype).removeprefix("torch.")))
            if r not in paths:
                paths[r] = _task_path(owner[id(tasks[r].param)], tasks[r], ep_rank)
        return {"stage": int(stage), "ntasks": len(tasks), "yields": yields, "paths": paths, "error": None}
    except Exception as e:  # noqa: BLE001 - every rank raises it together after the gather
        return {"stage": 0, "ntasks": 0, "yields": [], "paths": {}, "error": f"{type(e).__name__}: {e}"}


@dataclass
class Piece:
    """One packed bucket: yields first..last (inclusive) of `rank`, sent at its last one's round."""

    rank: int
    stage: int
    round: int
    first: int
    last: int
    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[list[int]]
    nbytes: int
    position: int
    """Place of its first tensor in the output order."""


@dataclass
class Schedule:
    order: list[tuple[int, int]]
    """(rank, index into that rank's yields) in the order rank 0 yields them."""
    pieces: dict[int, list[Piece]]
    """Per sender, its pieces in send order."""
    forced: dict[int, list[Piece]] = field(default_factory=dict)
    """Rank 0's stage: round -> pieces rank 0 receives right after its own last tensor of that round."""
    queues: dict[int, list[Piece]] = field(default_factory=dict)
    """Other stages: stage -> pieces in receive order (round order)."""
    piece_of: dict[tuple[int, int], Piece] = field(default_factory=dict)


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def _sibling_positions(seqs: Sequence[Sequence[tuple]]) -> dict[tuple, int]:
    """(parent path, child name) -> position among its siblings, from several rank's paths in their
    module order (each a depth-first walk of part of one tree): a topological merge of the sibling
    orders they show, first seen first on ties."""
    first: dict[tuple, int] = {}
    edges: dict[tuple, set] = defaultdict(set)
    for seq in seqs:
        prev = None
        for p in seq:
            for i, c in enumerate(p):
                if isinstance(c, str):
                    first.setdefault((p[:i], c), len(first))
            if prev is not None:
                i = next((k for k, (a, b) in enumerate(zip(prev, p)) if a != b), None)
                if i is not None and isinstance(prev[i], str) and isinstance(p[i], str):
                    edges[p[:i]].add((prev[i], p[i]))
            prev = p
    children: dict[tuple, list] = defaultdict(list)
    for (parent, c) in sorted(first, key=first.get):
        children[parent].append(c)
    pos: dict[tuple, int] = {}
    for parent, kids in children.items():
        succ: dict[Any, set] = defaultdict(set)
        indeg = dict.fromkeys(kids, 0)
        for a, b in edges.get(parent, ()):
            if b not in succ[a]:
                succ[a].add(b)
                indeg[b] += 1
        rank_of = {c: first[(parent, c)] for c in kids}
        ready = [(rank_of[c], c) for c in kids if indeg[c] == 0]
        heapq.heapify(ready)
        done = []
        while ready:
            _, c = heapq.heappop(ready)
            done.append(c)
            for d in succ[c]:
                indeg[d] -= 1
                if indeg[d] == 0:
                    heapq.heappush(ready, (rank_of[d], d))
        if len(done) < len(kids):  # contradictory orders (cannot happen for one tree): first seen
            done += [c for c in kids if c not in set(done)]
        for k, c in enumerate(done):
            pos[(parent, c)] = k
    return pos


def build_schedule(metas: Sequence[dict], bucket_bytes: int) -> Schedule:
    """The same `Schedule` on every rank from every rank's `local_meta` (pure; see the module doc)."""
    errors = [f"rank {r}: {m['error']}" for r, m in enumerate(metas) if m.get("error")]
    if errors:
        raise RuntimeError("export_to_rank0: cannot plan the export: " + "; ".join(errors))
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    ntasks: dict[int, set] = defaultdict(set)
    for m in metas:
        ntasks[m["stage"]].add(m["ntasks"])
    bad = {s: sorted(v) for s, v in ntasks.items() if len(v) > 1}
    if bad:
        raise RuntimeError(f"export_to_rank0: ranks of one pipeline stage have different task counts {bad}")
    stage0 = metas[0]["stage"]
    rounds0 = {y[0] for y in metas[0]["yields"]}
    senders = [r for r, m in enumerate(metas) if r and m["yields"]]
    if any(metas[r]["stage"] == stage0 for r in senders) and rounds0 != set(range(metas[0]["ntasks"])):
        missing = sorted(set(range(metas[0]["ntasks"])) - rounds0)[:5]
        raise RuntimeError(f"export_to_rank0: rank 0 yields nothing in tasks {missing}...; it cannot receive "
                           "at those rounds without risking a hang")

    # units: runs of one rank's yields from one task, merged by their place in the unsharded tree
    units: list[list[tuple]] = []
    for r, m in enumerate(metas):
        us, ys = [], m["yields"]
        for j, y in enumerate(ys):
            if not us or us[-1][1] != y[0]:
                us.append([r, y[0], j, j, m["paths"][y[0]]])
            us[-1][3] = j
        units.append(us)
    pos = _sibling_positions([[u[4] for u in us] for us in units])

    def key(path: tuple) -> tuple:
        return tuple((0, c) if isinstance(c, int) else (1, pos[(path[:i], c)]) for i, c in enumerate(path))

    heads = [(key(us[0][4]), r, 0) for r, us in enumerate(units) if us]
    heapq.heapify(heads)
    order: list[tuple[int, int]] = []
    while heads:
        _, r, k = heapq.heappop(heads)
        _, _, j0, j1, _ = units[r][k]
        order.extend((r, j) for j in range(j0, j1 + 1))
        if k + 1 < len(units[r]):
            heapq.heappush(heads, (key(units[r][k + 1][4]), r, k + 1))

    # pieces: runs of one sender in that order, cut at bucket_bytes (packed, aligned)
    sched = Schedule(order=order, pieces=defaultdict(list))
    cur: list[tuple[int, int, int]] = []  # (position, rank, j) of the open piece

    def close():
        if not cur:
            return
        r = cur[0][1]
        ys = metas[r]["yields"]
        js = [j for _, _, j in cur]
        dts = [_dtype(ys[j][3]) for j in js]
        shapes = [list(ys[j][2]) for j in js]
        total = _packed_total(dts, shapes)
        p = Piece(rank=r, stage=metas[r]["stage"], round=ys[js[-1]][0], first=js[0], last=js[-1],
                  names=[ys[j][1] for j in js], dtypes=dts, shapes=shapes, nbytes=total, position=cur[0][0])
        sched.pieces[r].append(p)
        for j in js:
            sched.piece_of[(r, j)] = p
        cur.clear()

    packed = 0
    for position, (r, j) in enumerate(order):
        if r == 0:
            close()
            continue
        y = metas[r]["yields"][j]
        size = _numel(y[2]) * _dtype(y[3]).itemsize
        if cur and (cur[0][1] != r or _align(packed) + size > bucket_bytes):
            close()
        if not cur:
            packed = 0
        packed = _align(packed) + size
        cur.append((position, r, j))
        if packed >= bucket_bytes:
            close()
    close()
    sched.pieces = dict(sched.pieces)
    for ps_ in sched.pieces.values():
        for p in ps_:
            if p.stage == stage0:
                sched.forced.setdefault(p.round, []).append(p)
            else:
                sched.queues.setdefault(p.stage, []).append(p)
    for lst in sched.forced.values():
        lst.sort(key=lambda p: p.position)
    for lst in sched.queues.values():
        lst.sort(key=lambda p: (p.round, p.position))
    return sched


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _align(pos: int) -> int:
    return -(-pos // ALIGN) * ALIGN


def _packed_total(dtypes, shapes) -> int:
    pos = 0
    for dt, shape in zip(dtypes, shapes):
        pos = _align(pos) + _numel(shape) * dt.itemsize
    return pos


# ------------------------------------------------------------------------------------------------
# transfer
# ------------------------------------------------------------------------------------------------


def _transfer_device(model) -> torch.device:
    """The model's GPU when the default group is NCCL, else the CPU (gloo)."""
    from model_bridge.load import model_chunks

    p = next((p for c in model_chunks(model) for p in c.parameters()), None)
    if p is not None and p.is_cuda and "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check(what: str, j: int, ys: list, name: str, t: torch.Tensor) -> None:
    if j >= len(ys):
        raise RuntimeError(f"export_to_rank0: {what} yielded {name!r} beyond its plan of {len(ys)} tensors")
    _, pname, pshape, pdtype = ys[j]
    if name != pname or tuple(t.shape) != tuple(pshape) or str(t.dtype).removeprefix("torch.") != pdtype:
        raise RuntimeError(f"export_to_rank0: {what} yielded {name!r} {tuple(t.shape)} {t.dtype}, its plan "
                           f"says {pname!r} {tuple(pshape)} {pdtype}")


def _send_side(sched: Schedule, rank: int, ys: list, own: Iterator, device: torch.device, stats: dict) -> None:
    pieces = sched.pieces.get(rank, [])
    k, buf, slots = 0, None, None
    n = 0
    for j, (name, t) in enumerate(own):
        _check(f"rank {rank}", j, ys, name, t)
        n = j + 1
        p = pieces[k]
        if j == p.first:
            buf = torch.empty(p.nbytes, dtype=torch.uint8, device=device)
            slots = [v for _, v in unpack_bucket(buf, p.names, p.dtypes, p.shapes)]
            stats["max_send_buffer_bytes"] = max(stats["max_send_buffer_bytes"], p.nbytes)
        slots[j - p.first].copy_(t)
        stats["max_sent_tensor_bytes"] = max(stats["max_sent_tensor_bytes"], t.nbytes)
        if j == p.last:
            dist.send(buf, dst=0)
            if buf.is_cuda:  # wait for rank 0 before the next gather is enqueued (module doc)
                torch.cuda.current_stream(buf.device).synchronize()
            stats["sent_buckets"] += 1
            stats["sent_bytes"] += p.nbytes
            k, buf, slots = k + 1, None, None
    if n != len(ys) or k != len(pieces):
        raise RuntimeError(f"export_to_rank0: rank {rank} yielded {n} tensors, its plan says {len(ys)}")


def _rank0_side(sched: Schedule, metas: Sequence[dict], own: Iterator, device: torch.device,
                stats: dict) -> Iterator[tuple[str, torch.Tensor]]:
    ys0 = metas[0]["yields"]
    last_of_round = {y[0]: j for j, y in enumerate(ys0)}
    held: dict[tuple[int, int], torch.Tensor] = {}  # taken or received, not yet yielded
    held_bytes = 0
    next_own = 0
    qpos = dict.fromkeys(sched.queues, 0)

    def keep(key, t):
        nonlocal held_bytes
        held[key] = t
        held_bytes += t.nbytes
        stats["max_held_bytes"] = max(stats["max_held_bytes"], held_bytes)

    def receive(p: Piece):
        buf = torch.empty(p.nbytes, dtype=torch.uint8, device=device)
        dist.recv(buf, src=p.rank)
        stats["recv_buckets"] += 1
        stats["recv_bytes"] += p.nbytes
        for j, (_, t) in zip(range(p.first, p.last + 1), unpack_bucket(buf, p.names, p.dtypes, p.shapes)):
            keep((p.rank, j), t)

    def take_own():
        nonlocal next_own
        try:
            name, t = next(own)
        except StopIteration:
            raise RuntimeError(f"export_to_rank0: rank 0 yielded {next_own} tensors, its plan says "
                               f"{len(ys0)}") from None
        _check("rank 0", next_own, ys0, name, t)
        keep((0, next_own), t)
        rnd = ys0[next_own][0]
        if last_of_round[rnd] == next_own:  # between this round's gather and the next one's
            for p in sched.forced.get(rnd, ()):
                receive(p)
        next_own += 1

    for r, j in sched.order:
        while (r, j) not in held:
            if r == 0 or sched.piece_of[(r, j)].stage == metas[0]["stage"]:
                take_own()
            else:
                p = sched.piece_of[(r, j)]
                q = sched.queues[p.stage]
                receive(q[qpos[p.stage]])
                qpos[p.stage] += 1
        t = held.pop((r, j))
        held_bytes -= t.nbytes
        yield metas[r]["yields"][j][1], t
    for name, _ in own:
        raise RuntimeError(f"export_to_rank0: rank 0 yielded {name!r} beyond its plan of {len(ys0)} tensors")


# ------------------------------------------------------------------------------------------------
# plan cache
# ------------------------------------------------------------------------------------------------


@dataclass
class _CachedPlan:
    signature: tuple
    """`_plan_signature` of the push that computed it."""
    export_kw: dict
    metas: list
    sched: Schedule


# First model chunk -> its last plan. Weak keys: a model that is freed takes its plan with it, and a
# new model never inherits one through a recycled id().
_PLAN_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, _CachedPlan]" = weakref.WeakKeyDictionary()


def _plan_signature(chunks: Sequence[torch.nn.Module], bucket_bytes: int) -> tuple:
    """Everything of this rank the plan depends on besides `export_kw`: the ranks, the bucket size and
    every chunk's parameters (name, shape, dtype), so that a parameter added, removed, reshaped or
    cast makes the next push plan again."""
    params = tuple((id(c), tuple((n, tuple(p.shape), p.dtype) for n, p in c.named_parameters()))
                   for c in chunks)
    return dist.get_rank(), dist.get_world_size(), bucket_bytes, params


def _cached_plan(model, bucket_bytes: int, device: torch.device, export_kw: dict) -> _CachedPlan:
    """The plan of this push: this model's last one when every rank still has it, else a new one.

    Every rank takes the same branch (a MIN all-reduce of the ranks' cache hits), because the new
    plan's `all_gather_object` is a collective: one rank planning alone would hang the others. The
    reused `metas` and `Schedule` are only read by the transfer, so sharing them is safe."""
    from model_bridge.load import model_chunks

    chunks = model_chunks(model)
    signature = _plan_signature(chunks, bucket_bytes)
    entry = _PLAN_CACHE.get(chunks[0])
    hit = entry is not None and entry.signature == signature and entry.export_kw == export_kw
    agreed = torch.tensor([int(hit)], dtype=torch.int32, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    if agreed.item():
        return entry
    metas: list = [None] * dist.get_world_size()
    dist.all_gather_object(metas, local_meta(model, **export_kw))
    entry = _CachedPlan(signature, dict(export_kw), metas, build_schedule(metas, bucket_bytes))
    _PLAN_CACHE[chunks[0]] = entry
    return entry


def _new_stats(bucket_bytes: int) -> dict:
    """Senders: sent_buckets / sent_bytes, max_send_buffer_bytes (<= max(bucket_bytes, the largest
    tensor)), max_sent_tensor_bytes. Rank 0: recv_buckets / recv_bytes, max_held_bytes (taken or
    received and not yet yielded, the tensor being yielded included). All: plan_s (plan gather +
    schedule, or the cache check when the model's last plan is reused)."""
    return {"bucket_bytes": bucket_bytes, "plan_s": 0.0, "sent_buckets": 0, "sent_bytes": 0,
            "max_send_buffer_bytes": 0, "max_sent_tensor_bytes": 0, "recv_buckets": 0, "recv_bytes": 0,
            "max_held_bytes": 0}


def export_to_rank0(model, *, bucket_bytes: int | None = None, stats: dict | None = None,
                    **export_kw) -> Iterator[tuple[str, torch.Tensor]]:
    """On rank 0: every (hf_name, tensor) of the model, in the single-rank `export_hf` order. On
    other ranks: yields nothing, but must be iterated to the end (it takes part in the collectives
    and sends this rank's tensors). `export_kw` go to `export_hf` (spec, bridge, dtype).

    Tensors from other ranks are views into the received bucket (on the model's GPU under NCCL,
    on the CPU under gloo); rank 0's own may share memory with its parameters, as with `export_hf`.
    `stats`, when given, is filled on every rank (see `_new_stats`: bucket and buffer sizes, bytes
    sent / received, bytes rank 0 held ahead of their turn, planning time)."""
    from model_bridge.export import export_hf

    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield from export_hf(model, **export_kw)
        return
    rank = dist.get_rank()
    device = _transfer_device(model)
    bucket_bytes = bucket_bytes or default_bucket_bytes(device)
    st = _new_stats(bucket_bytes)
    if stats is not None:
        stats.clear()
        stats.update(st)
        st = stats
    t0 = time.perf_counter()
    plan = _cached_plan(model, bucket_bytes, device, export_kw)
    st["plan_s"] = time.perf_counter() - t0
    own = export_hf(model, **export_kw)
    if rank == 0:
        yield from _rank0_side(plan.sched, plan.metas, own, device, st)
    else:
        _send_side(plan.sched, rank, plan.metas[rank]["yields"], own, device, st)
