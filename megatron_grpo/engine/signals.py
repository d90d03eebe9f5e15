"""Preemption: SIGTERM / SIGUSR1 ask the run to checkpoint after the current step and exit cleanly.

slurm signals a job before it kills it: ``#SBATCH --signal=USR1@300`` sends SIGUSR1 to every task
300 s before the time limit, and preemption or ``scancel`` sends SIGTERM (then SIGKILL after
``KillWait``, 30 s by default). The handler only sets a flag -- nothing heavy runs inside a signal
handler -- and the loop asks after every step::

    stop = PreemptionHandler().install()
    for step in range(start, total + 1):
        ...train step...
        preempted = stop.agreed()                  # collective: every rank gets the same answer
        if preempted or step % save_every == 0:
            save_checkpoint(run_dir, step, ...)
        if preempted:
            sys.exit(PREEMPT_EXIT_CODE)            # 0: a clean exit, the job is requeued and resumes

:meth:`PreemptionHandler.agreed` is a MAX all-reduce of the local flag. slurm signals the ranks at
slightly different moments, so without it one rank could start the checkpoint (a collective) while
another starts the next step's collectives: a hang. Every rank must call it after every step.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Optional, Sequence

import torch

__all__ = ["PreemptionHandler", "PREEMPT_SIGNALS", "PREEMPT_EXIT_CODE"]

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPT_EXIT_CODE = 0
"""Exit status after a preemption checkpoint: success, so slurm's requeue (or the job script) just
starts the run again, and it resumes from the checkpoint."""


class PreemptionHandler:
    """Turns the preemption signals into a flag the training loop reads between steps."""

    def __init__(self, signals: Sequence[int] = PREEMPT_SIGNALS):
        self.signals = tuple(signals)
        self._previous: dict[int, object] = {}
        self.requested = False
        self.signal_name: Optional[str] = None
        self.received_at: Optional[float] = None

    def install(self) -> "PreemptionHandler":
        """Install the handlers (main thread only, as Python requires); the previous ones are kept for
        :meth:`restore`."""
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> "PreemptionHandler":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()

    def _handle(self, signum, frame) -> None:
        first = not self.requested
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        self.received_at = time.time()
        if first:
            msg = (f"megatron-grpo: received {self.signal_name} (pid {os.getpid()}); will checkpoint after the "
                   "current step and exit\n")
            try:
                os.write(2, msg.encode())
            except OSError:
                pass

    def request(self, reason: str = "request") -> None:
        """Set the flag from code (tests, a stop file, a time budget)."""
        self.requested = True
        self.signal_name = self.signal_name or reason
        self.received_at = self.received_at or time.time()

    def agreed(self, group=None) -> bool:
        """Collective over ``group`` (default: the world): True on every rank when any rank has the
        flag set. Without an initialised process group, the local flag."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self.requested
        backend = str(dist.get_backend(group)).lower()
        on_gpu = "nccl" in backend and "gloo" not in backend
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=device)
        from megatron_grpo.hang import collective

        with collective("preemption_flag_all_reduce"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if int(flag.item()) and not self.requested:
            self.request("another rank")
        return bool(int(flag.item()))
