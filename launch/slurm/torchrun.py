"""``python -m launch.slurm.torchrun [torchrun args]``: torchrun whose agent survives SIGUSR1 and
passes it on to its workers.

slurm's ``--signal=USR1@T`` (without ``B:``) signals every process of the job step: with
``proctrack/cgroup`` (or ``linuxproc``) the torchrun agent *and* its workers, with ``proctrack/pgid``
only the agent's process group -- and torchrun starts each worker in a session of its own, out of
that group. The agent's default action on SIGUSR1 is to die (taking the workers with it), and
torchrun's own ``--signals-to-handle`` would tear the workers down after a short grace period. So
this wrapper catches SIGUSR1 in the agent and sends it to each worker; the workers
(`megatron_grpo.engine.signals.PreemptionHandler`) checkpoint after the current step and exit 0,
and torchrun then exits 0. Workers that get the signal twice (cgroup delivery plus the forward)
just see their flag set twice.

Workers start through :mod:`launch.slurm.worker`, which ignores SIGUSR1 from its first line until
the training loop installs its handler, so an early signal cannot kill a rank that is still loading.
"""
from __future__ import annotations

import os
import signal
import sys

__all__ = ["main", "forward_to_children"]


def forward_to_children(signum: int, frame=None) -> None:
    """Send `signum` to every direct child (the torchrun workers)."""
    import psutil

    for child in psutil.Process().children(recursive=False):
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:
            pass


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGUSR1, forward_to_children)
    from torch.distributed.run import main as torchrun_main

    torchrun_main(list(sys.argv[1:] if argv is None else argv))  # raises on a failed worker
    return 0


if __name__ == "__main__":
    sys.exit(main())
