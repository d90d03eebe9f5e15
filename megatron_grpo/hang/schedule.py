"""The step schedule check (hang invariant 1, checked before every step).

Collective: before each step every rank describes what it is about to
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
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Optional, Sequence

import torch

from megatron_grpo.hang.watchdog import collective

__all__ = ["StepSchedule", "ScheduleMismatchError", "check_schedule"]

_MAGIC = 0x6D67_7270_6F67  # "mgrpog": a rank that sends anything else is out of step
_VERSION = 1
_HEADER = 9  # magic, version, step, count, peer key, token digest, audio digest, tokens, clips
_NO_KEY = -1


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
        ``num_clips`` / ``num_audio_clips``, ``audio_feature_lens`` (its length) or ``has_audio`` when present, else 0.
        A sequence with ``infos`` (``engine.batch.StepMicroBatches``) is read through them, unassembled."""
        toks, audio = [], []
        for mb in getattr(microbatches, "infos", microbatches):
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
    process group, or with a group of one rank, it only validates ``schedule`` (no collective, no
    device read: the device may still be busy with the step's first work).
    """
    import torch.distributed as dist

    if not isinstance(schedule, StepSchedule):
        raise TypeError(f"check_schedule needs a StepSchedule, got {type(schedule).__name__}")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
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
