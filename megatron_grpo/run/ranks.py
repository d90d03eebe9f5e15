"""Start the trainer's ranks: under torchrun/srun use theirs; otherwise spawn `nproc` processes."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

from megatron_grpo.lifeline import child_env


def launched_externally() -> bool:
    """True under torchrun / srun / an already-set torch.distributed environment."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def slurm_to_torch_env() -> None:
    """srun gives SLURM_PROCID/SLURM_NTASKS; torch.distributed reads RANK/WORLD_SIZE."""
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ and "MASTER_ADDR" in os.environ:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(nproc: int, argv: list[str], extra_env: dict[str, str] | None = None) -> int:
    """Run `python -m megatron_grpo.cli <argv>` as `nproc` ranks on this machine (``extra_env``
    added to each one's environment); returns the first non-zero exit code (a failing rank takes
    the others down), else 0. The ranks die with this process, also on SIGKILL (they call
    `megatron_grpo.lifeline.die_with_parent`); call this on the main thread."""
    port = _free_port()
    procs = []
    for rank in range(nproc):
        env = dict(child_env(), RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **(extra_env or {}))
        if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
        procs.append(subprocess.Popen([sys.executable, "-m", "megatron_grpo.cli", *argv], env=env))
    code = 0
    try:
        pending = list(procs)
        while pending:
            for p in list(pending):
                rc = p.poll()
                if rc is None:
                    continue
                pending.remove(p)
                if rc != 0 and code == 0:
                    code = rc
                    for q in pending:  # one rank failed: the others would wait forever
                        q.terminate()
            if pending:
                try:
                    pending[0].wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    pass
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
        code = 130
    finally:
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    return code
