"""The trainer's rank environment under torchrun / srun (without them `mgrpo train` spawns its ranks
with :func:`model_bridge.spawn.run_ranks`)."""
from __future__ import annotations

import os


def launched_externally() -> bool:
    """True under torchrun / srun / an already-set torch.distributed environment."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def slurm_to_torch_env() -> None:
    """srun gives SLURM_PROCID/SLURM_NTASKS; torch.distributed reads RANK/WORLD_SIZE."""
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ and "MASTER_ADDR" in os.environ:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
