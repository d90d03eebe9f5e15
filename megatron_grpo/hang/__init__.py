"""Hang guards: every rank checks the step's schedule before it starts, and a watchdog turns a stalled
step into a stack dump and a non-zero exit (design.md, hang invariant 3). The ``guard`` section of
the config (``HangGuardSection``) sets the watchdog's timeouts.

* :mod:`megatron_grpo.hang.schedule`: :func:`check_schedule`, the collective agreement on what each
  rank is about to run;
* :mod:`megatron_grpo.hang.watchdog`: :class:`Watchdog`, the per-rank thread that dumps every stack
  and exits when a step stalls.
"""
from megatron_grpo.hang.schedule import ScheduleMismatchError, StepSchedule, check_schedule
from megatron_grpo.hang.watchdog import (HANG_EXIT_CODE, Watchdog, active_watchdog, collective, iter_hang_files,
                                         note_collective)

__all__ = ["StepSchedule", "ScheduleMismatchError", "check_schedule", "Watchdog", "HANG_EXIT_CODE",
           "note_collective", "collective", "active_watchdog", "iter_hang_files"]
