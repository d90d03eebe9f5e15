"""Multi-source weight push (gloo, CPU servers): every trainer rank that owns a unique shard sends
it to the vLLM servers itself; nothing is gathered to rank 0.

Why: with `gather.export_to_rank0` every byte crosses into rank 0 and leaves through its one NIC;
here each rank's bytes leave through its own (docs/performance.md, "Weight sync at scale").

Collective over the trainer's default group (every rank calls `push_multisource`):

1. Plan: each rank lists its own shards (`shards.owned_shards`: TP/ETP slices, an EP rank's
   experts, a stage's layers; a replicated tensor on exactly one rank) and cuts them into buckets
   of at most `bucket_bytes`; one `all_gather_object` of that metadata (no tensor data). The
   senders are the ranks with shards, rank 0 first; round k = every sender's k-th bucket.
2. Connect (rank 0, when a server has no group for these senders): rank 0 binds the rendezvous and
   hands it to the other ranks (`broadcast_object_list`); the senders join as group ranks 1..S-1
   while the server's workers join after them (`/init_weight_transfer_engine`, `rank_offset` S).
3. Rank 0 alone drives HTTP: pause, start, then per round one `/update_weights` listing every
   sender's bucket of the round (names, dtypes, shapes, source, shard metadata), finish, resume.
   Each sender sends its own packed bucket point-to-point to every worker; the worker receives
   the round's buckets concurrently, merges each parameter's shards with the mapping's own merge
   once all are in (`shards.ShardAssembler`) and stages them; `/finish_weight_update` loads them.
4. Outcome: rank 0 broadcasts success or its `WeightPushError` text; every rank returns or raises.

All or nothing, as the single-sender push: the gloo engine stages until finish, so a failure
anywhere leaves every server on its previous weights, resumed (`push.PushSteps.recover`). A sender that
fails sets the group store's `ABORT_KEY` to "trainer rank R failed at update_weights ..." (every
pending transfer then fails at once, the worker's error carries the reason to rank 0); a sender
that dies is named by the worker's failed receive ("from trainer rank R"). The error names the
stage, and the rank where known (`WeightPushError.rank`). After a failure every group is dropped
and the next push reconnects. A rendezvous that fails after the other senders started to join
leaves them waiting for the transfer timeout (the gloo group has no earlier way out).
"""
from __future__ import annotations

import re
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_grpo.weight_sync.buckets import default_bucket_bytes, dtype_name, pack_bucket
from megatron_grpo.weight_sync.gloo import (
    DEFAULT_TIMEOUT_S,
    TransportError,
    abort_reason,
    join_gloo_group,
    send_to,
    set_abort,
)
from megatron_grpo.weight_sync.push import PAUSE_MODES, PushStats, PushSteps, WeightPushError, WeightReceiver
from megatron_grpo.weight_sync.shards import ShardEntry, owned_shards

__all__ = ["push_multisource", "plan_buckets", "resolve_mode"]

# server index -> (pg, store, group world size) of this (non-zero) sender; rank 0 keeps its groups in
# the WeightReceivers' transports
_GROUPS: dict[int, tuple[Any, Any, int]] = {}


_FALLBACK_SAID: set[str] = set()


def resolve_mode(mode: str, backend: str | None = None, world_size: int | None = None,
                 m2n_unfit: Callable[[], str | None] | None = None) -> str:
    """`weight_sync.mode` -> "gather", "multisource" (gloo servers, `push_multisource`) or "m2n"
    (nccl_m2n servers, `m2n.push_m2n`) for this job, the same on every rank: from the servers' data
    plane (`backend`, default `push.default_backend`), the world size and, for nccl_m2n servers,
    `m2n_unfit()` (`m2n.unfit_reason` for the model: None when the job fits vLLM's contract). On
    nccl servers a multisource falls back to gather and says why, once; nccl_m2n servers take
    nothing but m2n, so a job that does not fit (or mode gather) is a ValueError naming the fix."""
    from megatron_grpo.weight_sync.push import default_backend

    if mode not in ("auto", "gather", "multisource"):
        raise ValueError(f"weight_sync.mode must be auto, gather or multisource, got {mode!r}")
    backend = backend or default_backend()
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    if backend == "nccl_m2n":  # vLLM's m2n engine is the only way into these servers: no gather path
        if mode == "gather":
            raise ValueError("weight_sync.mode=gather cannot push into servers running vLLM's nccl_m2n engine (it "
                             "takes every trainer rank's shards): set weight_sync.mode auto or multisource, or "
                             "start the servers with the dense nccl engine (rollout.weight_transfer: nccl)")
        why = m2n_unfit() if m2n_unfit is not None else "no model was given to check against its contract"
        if why is not None:
            raise ValueError(f"the servers run vLLM's nccl_m2n engine, which this job does not fit: {why}; start "
                             "them with the dense nccl engine (rollout.weight_transfer: nccl, `mgrpo serve "
                             "--weight-transfer nccl`), which takes the gather path")
        return "m2n"
    if mode == "gather" or world_size == 1:
        return "gather"  # one rank owns every shard: the same bytes from the same place
    if backend == "gloo":
        return "multisource"
    why = ("the servers run vLLM's dense nccl engine; on GPU the multi-source push goes through vLLM's "
           "nccl_m2n engine (servers started with --weight-transfer nccl_m2n, which needs the "
           "nccl-extensions package)")
    say = mode == "multisource"
    if say and backend not in _FALLBACK_SAID:
        _FALLBACK_SAID.add(backend)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"[weight_sync] mode={mode} falls back to gather on the {backend} data plane: {why}", flush=True)
    return "gather"


def plan_buckets(entries: list[ShardEntry], bucket_bytes: int) -> list[list[ShardEntry]]:
    """Consecutive runs of `entries` of at most `bucket_bytes` (a larger shard alone)."""
    out, cur, size = [], [], 0
    for e in entries:
        n = e.tensor.nbytes
        if cur and size + n > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += n
    if cur:
        out.append(cur)
    return out


def _bcast(obj=None):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _round_info(metas: list, senders: list[int], k: int) -> dict:
    info = {"names": [], "dtype_names": [], "shapes": [], "sources": [], "shards": []}
    for s, r in enumerate(senders):
        if k < len(metas[r]):
            for name, dt, shape, meta in metas[r][k]:
                info["names"].append(name)
                info["dtype_names"].append(dt)
                info["shapes"].append(shape)
                info["sources"].append(s)
                info["shards"].append(meta)
    return info


def _drop_groups(which: list[int] | None = None) -> None:
    for i in list(_GROUPS) if which is None else which:
        pg = _GROUPS.pop(i)[0]
        try:
            pg.abort()
        except Exception:  # noqa: BLE001 - dropping it anyway
            pass


def push_multisource(model, version: int | str, servers: list[WeightReceiver] | None, *,
                     bucket_bytes: int | None = None, dtype: torch.dtype | None = None,
                     pause_mode: str = "abort", timeout_s: float = DEFAULT_TIMEOUT_S,
                     stats: dict | None = None, **export_kw) -> PushStats | None:
    """Push `model` (sharded Megatron model, this rank's part) to `servers` (rank 0's receivers,
    gloo backend; ignored elsewhere) as `version`. Every rank of the default group calls it.

    Returns `PushStats` on rank 0 (bytes = all senders' payload per server), None elsewhere; fills
    `stats` on every rank with what this rank sent: sent_bytes, sent_buckets, shards. Raises
    `WeightPushError` on every rank when the push failed (see the module doc)."""
    if pause_mode not in PAUSE_MODES:
        raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
    version = str(version)
    rank = dist.get_rank()
    bucket_bytes = bucket_bytes or default_bucket_bytes("cpu")
    mine = plan_buckets(owned_shards(model, dtype=dtype, **export_kw), bucket_bytes)
    my_meta = [[(e.wire_name, dtype_name(e.tensor.dtype), list(e.tensor.shape), e.meta()) for e in b]
               for b in mine]
    metas: list = [None] * dist.get_world_size()
    dist.all_gather_object(metas, my_meta)
    senders = [r for r, m in enumerate(metas) if m]
    if not senders or senders[0] != 0:
        raise RuntimeError("push_multisource: trainer rank 0 owns no shard (it must: it drives the push)")
    me = senders.index(rank) if rank in senders else None
    st = {"sent_bytes": 0, "sent_buckets": 0, "shards": sum(len(b) for b in mine)}
    if stats is not None:
        stats.clear()
        stats.update(st)
        st = stats
    if rank == 0:
        return _drive(servers, version, mine, metas, senders, pause_mode, st)
    _follow(me, mine, senders, version, timeout_s, st)
    return None


# ------------------------------------------------------------------------------------------------ rank 0
def _drive(servers, version, mine, metas, senders, pause_mode, st) -> PushStats:
    bad = None
    if not servers:
        bad = "push_multisource needs at least one WeightReceiver on rank 0"
    elif any(s.backend != "gloo" for s in servers):
        bad = (f"push_multisource needs gloo receivers (CPU servers; nccl_m2n servers take weight_sync.m2n."
               f"push_m2n): {[s.url for s in servers if s.backend != 'gloo']}")
    if bad is not None:  # the other ranks wait in the broadcasts below: release them, then raise everywhere
        _bcast({"n": 0, "need": []})
        _bcast({"error": bad})
        _bcast({"ok": False, "error": bad, "stage": "connect"})
        raise ValueError(bad)
    need = [i for i, s in enumerate(servers) if not s.connected or s.transport.sender_ranks != senders]
    _bcast({"n": len(servers), "need": need})
    rounds = max(len(m) for m in metas)
    stats = PushStats(version=version, servers=len(servers))
    steps = PushSteps(servers, stats)
    k = -1
    go_sent = False
    try:
        for i in need:
            steps.current = servers[i]
            handed = []

            def hand_over(init_info, handed=handed):
                handed.append(1)
                _bcast(init_info)

            servers[i].use_senders(senders)
            try:
                servers[i].connect(on_prepared=hand_over)
            except BaseException:
                if not handed:
                    _bcast({"error": "rank 0 could not prepare the rendezvous"})
                for j in need[need.index(i) + 1:]:
                    _bcast({"error": "skipped"})
                raise
        steps.pause_and_start(pause_mode)
        go_sent = True
        _bcast("go")
        for k in range(rounds):
            info = _round_info(metas, senders, k)
            buf = pack_bucket([e.tensor for e in mine[k]], device="cpu") if k < len(mine) else None
            for s in servers:
                steps.current = s
                s.send_round(info, buf)
            if buf is not None:
                st["sent_buckets"] += 1
                st["sent_bytes"] += sum(e.tensor.nbytes for e in mine[k])
            stats.buckets += 1
            stats.tensors += len(info["names"])
            stats.bytes += sum(torch.Size(sh).numel() * getattr(torch, dt).itemsize
                               for sh, dt in zip(info["shapes"], info["dtype_names"]))
            del buf
        steps.finish_and_resume(version)
    except BaseException as exc:
        stage, current = steps.stage, steps.current
        where = f"round {k + 1} of {rounds} " if stage == "update_weights" else ""
        reason = f"trainer rank 0 failed at {stage} {where}: {type(exc).__name__}: {exc}"
        for s in servers:
            set_abort(s.transport.store, reason)
        if not go_sent:
            _bcast({"error": reason})
        states = steps.recover(version)
        for s in servers:  # the other senders drop their groups: everyone reconnects next time
            s.drop_transport()
        m = re.search(r"trainer rank (\d+)", str(exc))
        failed_rank = int(m.group(1)) if m else (0 if current is None else None)
        who = current.url if current is not None else "trainer rank 0 (its shards)"
        msg = (f"multi-source weight push of version {version!r} failed at {stage} {where}on {who}"
               + (f" (trainer rank {failed_rank})" if failed_rank is not None else "")
               + f": {type(exc).__name__}: {exc}\nserver states after recovery:\n"
               + "\n".join(f"  {url}: {s_}" for url, s_ in states.items()))
        err = WeightPushError(msg, server=current.url if current else None, version=version, stage=stage,
                              states=states, rank=failed_rank)
        _outcome({"ok": False, "error": msg, "stage": stage, "rank": failed_rank, "states": states})
        if isinstance(exc, Exception):
            raise err from exc
        raise
    _outcome({"ok": True})
    return stats


def _outcome(result: dict) -> None:
    """Rank 0: tell every rank how the push ended (a dead rank makes the collective fail: ignored)."""
    try:
        _bcast(result)
    except Exception:  # noqa: BLE001 - the error rank 0 raises says what happened
        pass


# ------------------------------------------------------------------------------------------------ others
def _follow(me, mine, senders, version, timeout_s, st) -> None:
    ctl = _bcast()
    _drop_groups([i for i in _GROUPS if i in ctl["need"] or i >= ctl["n"]])
    for i in ctl["need"]:
        info = _bcast()
        if "error" in info or me is None:
            continue
        try:
            pg, store = join_gloo_group(info["master_address"], info["master_port"], me, info["world_size"],
                                        info.get("timeout_s", timeout_s), with_store=True)
        except Exception:  # noqa: BLE001 - rank 0's connect failed too; its outcome says so below
            continue
        _GROUPS[i] = (pg, store, int(info["world_size"]))
    go = _bcast()
    if go == "go" and me is not None:
        k = -1
        try:
            for k, bucket in enumerate(mine):
                buf = pack_bucket([e.tensor for e in bucket], device="cpu")
                for i in range(ctl["n"]):
                    pg, store, ws = _GROUPS[i]

                    def poll(store=store):
                        reason = abort_reason(store)
                        if reason is not None:
                            raise TransportError(reason)

                    send_to(pg, buf, list(range(len(senders), ws)), poll)
                st["sent_buckets"] += 1
                st["sent_bytes"] += sum(e.tensor.nbytes for e in bucket)
                del buf
        except Exception as exc:  # noqa: BLE001 - reported to everyone through the store
            reason = (f"trainer rank {dist.get_rank()} failed at update_weights (its bucket {k + 1} of "
                      f"{len(mine)}): {type(exc).__name__}: {exc}")
            for _, store, _ in _GROUPS.values():
                if abort_reason(store) is None:
                    set_abort(store, reason)
    result = _bcast()
    if not result.get("ok"):
        _drop_groups()
        raise WeightPushError(f"(from trainer rank 0) {result['error']}", server=None, version=version,
                              stage=result.get("stage", "?"), states=result.get("states", {}),
                              rank=result.get("rank"))
