"""Set up (and tear down) torch.distributed plus megatron-core's model-parallel groups.

``init_parallel`` reads the usual launcher environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``), uses gloo on a CPU machine (after ``apply_cpu_patches()``) and
NCCL on a CUDA one, checks the layout before creating anything, and seeds the RNGs the way
megatron expects. Layout terms: ``tp`` tensor parallel, ``pp`` pipeline parallel, ``ep`` expert
parallel, ``etp`` expert tensor parallel (defaults to ``tp``); data parallel is what is left.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from model_bridge.mcore_cpu import apply_compat_fixes, apply_cpu_patches

__all__ = ["RankLayout", "check_parallel_sizes", "init_parallel", "destroy_parallel"]


@dataclass(frozen=True)
class RankLayout:
    """The sizes of one initialised layout and this process's ranks in it (runtime view; the
    model-side declaration is `model_bridge.config.ParallelLayout`)."""

    world_size: int
    tp: int
    pp: int
    ep: int
    etp: int
    dp: int  # data-parallel size of the dense (non-expert) parameters
    expert_dp: int  # data-parallel size of the expert parameters
    rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    ep_rank: int = 0
    etp_rank: int = 0
    dp_rank: int = 0
    backend: str = ""


def check_parallel_sizes(world_size: int, tp: int = 1, ep: int = 1, etp: int | None = None,
                         pp: int = 1) -> RankLayout:
    """Validate a layout without touching torch.distributed; raise ValueError naming the numbers."""
    etp = tp if etp is None else etp
    for name, value in (("world size", world_size), ("tp", tp), ("pp", pp), ("ep", ep), ("etp", etp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}")
    per_stage = world_size // pp
    if per_stage % (ep * etp):
        raise ValueError(
            f"ep*etp = {ep}*{etp} = {ep * etp} must divide world size / pp = {world_size}/{pp} = "
            f"{per_stage} (the ranks of one pipeline stage)")
    if ep == 1 and etp != tp:
        # With ep == 1 megatron-core marks expert weights allreduce=True and reduces their grads
        # over the dense data-parallel group; that group only matches the expert one when etp == tp,
        # otherwise expert grads are never summed across the TP ranks (or summed over different
        # shards): training silently diverges.
        raise ValueError(
            f"tp={tp} with etp={etp} and ep=1 is not supported: megatron-core would never sync the "
            f"expert gradients across the tensor-parallel ranks. Use etp=tp ({tp}) or ep>1.")
    return RankLayout(world_size=world_size, tp=tp, pp=pp, ep=ep, etp=etp,
                          dp=world_size // (tp * pp), expert_dp=per_stage // (ep * etp))


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(f"torch.distributed is not initialised and ${name} is not set; "
                               f"start with torchrun (or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
        return default
    return int(value)


def init_parallel(tp: int = 1, ep: int = 1, etp: int | None = None, pp: int = 1, seed: int = 1234,
                  timeout_minutes: int = 30) -> RankLayout:
    """Initialise torch.distributed (if needed) and megatron's parallel groups; return the layout.

    The sizes are checked before anything is created. An existing megatron parallel state is
    destroyed first, so a process can switch layouts (tests do).
    """
    if dist.is_initialized():
        world_size = dist.get_world_size()
    else:
        world_size = _env_int("WORLD_SIZE", 1)
    layout = check_parallel_sizes(world_size, tp=tp, ep=ep, etp=etp, pp=pp)

    cuda = torch.cuda.is_available()
    if cuda:
        apply_compat_fixes()
    else:
        apply_cpu_patches()

    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        rank = _env_int("RANK", 0 if world_size == 1 else None)
        if cuda:
            torch.cuda.set_device(_env_int("LOCAL_RANK", rank % torch.cuda.device_count()))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if world_size == 1:
            from model_bridge.spawn import free_port

            os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                timeout=timedelta(minutes=timeout_minutes))

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        distributed_timeout_minutes=timeout_minutes,
    )
    # Same seed on every rank for the default generator (CPU weight init must agree across TP
    # ranks); megatron's tracker derives the per-TP-rank and per-expert-rank streams from it.
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)

    return RankLayout(
        world_size=world_size, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp,
        dp=ps.get_data_parallel_world_size(), expert_dp=ps.get_expert_data_parallel_world_size(),
        rank=dist.get_rank(), tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(), ep_rank=ps.get_expert_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
        backend=dist.get_backend())


def destroy_parallel(destroy_process_group: bool = True) -> None:
    """Destroy megatron's parallel groups and (by default) the torch.distributed process group."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()
