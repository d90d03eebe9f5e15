"""Data to ranks: each rank receives only the trajectories of its own data-parallel group's
micro-batches, and each audio clip once per rank and step.

Rank 0 holds the step's trajectories (it rolled them out). Every rank can compute the packing plan
from the token counts alone, so the step goes out in two parts:

1. a broadcast of the token counts (a few bytes per sample);
2. every rank computes the plan; rank 0 sends rank r (point to point) the trajectories of the
   micro-batches of r's DP rank, their audio clips by reference: one copy of each distinct clip
   (a prompt's recording is shared by all its generations) and per trajectory the clips' ids.

A rank gets back a list as long as the step with its own samples in place and an `Elsewhere`
(the sample's token count, for the plan) at every other position. The clips a recording's
generations share arrive as one array object, so the features of a shared recording are computed
once (`engine.batch.build_train_microbatches` caches them per clip object).

The broadcast this replaces sent every trajectory with every waveform to every rank: 64 prompts x
8 generations of 20-minute recordings is ~39 GB per rank per step (docs/performance.md, "Data to
ranks").
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch.distributed as dist


@dataclass(frozen=True)
class Elsewhere:
    """A sample of the step that another data-parallel group trains: only its token count and group."""

    num_tokens: int
    group_id: int = 0


def dp_ranks_of_all(dp_rank: int) -> list[int]:
    """Every rank's data-parallel rank, indexed by global rank (a collective: every rank calls it)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, dp_rank)
    return [int(x) for x in out]


def pack_share(trajs: Sequence, ids: Sequence[int]) -> dict:
    """What one rank receives: ``samples`` {global id: trajectory whose ``audios`` are clip ids} and
    ``clips`` {clip id: waveform}, each distinct waveform object once."""
    clips, samples = {}, {}
    for i in ids:
        t = trajs[i]
        keys = []
        for a in t.audios:
            clips.setdefault(id(a), a)
            keys.append(id(a))
        samples[i] = replace(t, audios=keys)
    return {"samples": samples, "clips": clips}


def unpack_share(share: dict, lengths: Sequence[int], groups: Sequence[int]) -> list:
    """The step's list on a receiving rank: its trajectories (clip ids resolved to the waveforms,
    shared clips as one object) in place, `Elsewhere` everywhere else."""
    out = [Elsewhere(int(n), int(g)) for n, g in zip(lengths, groups)]
    clips = share["clips"]
    for i, t in share["samples"].items():
        out[i] = replace(t, audios=[clips[k] for k in t.audios])
    return out


def rank_sample_ids(plan, dp_rank: int) -> list[int]:
    """Global ids of the samples in DP rank `dp_rank`'s micro-batches, in plan order."""
    return [i for mb in plan.microbatches[dp_rank] for i in mb]


def deliver(trajs, plan_of: Callable[..., object], dp_of_rank: Sequence[int], broadcast):
    """The step's trajectories on this rank (collective: every rank calls it). Rank 0 passes the
    list (or a picklable exception, which every rank raises); the others pass None. ``plan_of``
    maps the token counts and, as ``groups=``, the GRPO group ids to the packing plan (the one the
    step then trains on: ``plan_step``); ``broadcast`` sends a picklable object from rank 0 to every rank."""
    rank = dist.get_rank()
    head = None
    if rank == 0:
        head = trajs if isinstance(trajs, BaseException) else ([t.num_tokens for t in trajs],
                                                                [int(t.group_id) for t in trajs])
    head = broadcast(head)
    if isinstance(head, BaseException):
        raise head
    lengths, groups = head
    plan = plan_of(lengths, groups=groups)
    if rank == 0:
        for dst in range(1, dist.get_world_size()):
            dist.send_object_list([pack_share(trajs, rank_sample_ids(plan, dp_of_rank[dst]))], dst=dst)
        return list(trajs)
    box = [None]
    dist.recv_object_list(box, src=0)
    return unpack_share(box[0], lengths, groups)
