"""Bring a multi-rank `export_hf` stream to the one process that pushes to vLLM (global rank 0).

`export_hf` yields each HF tensor exactly once across the job, on different ranks under EP/PP
(model_bridge/export.py says which). Its iteration is collective (TP/ETP gathers), so every rank
runs it to the end first; the tensors a non-zero rank yielded are then sent to rank 0 rank by rank
(point-to-point, after the collectives, so nothing interleaves). Rank 0 streams its own tensors
while the others export. Memory on a non-zero rank: the tensors it yields (its experts under EP,
its stage's layers under PP). This is the CPU/gloo path; on GPUs each owning rank can push its own
tensors over NCCL instead (megatron_grpo/weight_sync/nccl.py).
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist


def export_to_rank0(model, **export_kw) -> Iterator[tuple[str, torch.Tensor]]:
    """On rank 0: every (hf_name, tensor) of the model. On other ranks: yields nothing, but must be
    iterated to the end (it takes part in the collectives)."""
    from model_bridge.export import export_hf

    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield from export_hf(model, **export_kw)
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        yield from export_hf(model, **export_kw)
        for src in range(1, world):
            box = [None]
            dist.recv_object_list(box, src=src)
            for name, t in box[0]:
                yield name, t
    else:
        mine = [(n, t.detach().to("cpu").clone()) for n, t in export_hf(model, **export_kw)]
        dist.send_object_list([mine], dst=0)
