"""Asynchronous checkpoints: the shards are written while training goes on.

:func:`start_checkpoint` (collective) does what :func:`~megatron_grpo.engine.checkpoint.save_checkpoint`
does up to the write: ``.tmp-step_N`` is created, the sharded state dict built (the optimizer's
states gathered over DP) and planned by megatron's ``dist_checkpointing`` (``async_sharded_save``).
Then every tensor this rank writes is in host memory apart from the live state -- the
*snapshot* (:func:`snapshot_write_buckets`): the next steps change the parameters and optimizer
states in place, the checkpoint must hold those of step N -- and a background thread runs megatron's writer on the copies (its worker processes do the file
I/O). Training continues at once.

:meth:`PendingSave.done` (collective, called once a step by the loop) asks every rank whether its
writer is finished (one all-reduce); when all are, the save is finished exactly as a synchronous
one (megatron's metadata, then ``mgrpo_checkpoint.json``, the rename to ``step_N``, ``latest``,
rotation). Until then the checkpoint is the ``.tmp-step_N`` directory, which ``--resume`` never
picks: a run that dies during the write resumes from the checkpoint before. :meth:`PendingSave.wait`
blocks until the write is done and finishes it (before the next save, at a preemption, at the end).

Costs: host memory for one copy of this rank's shards while the write runs (pinned on GPU, for a
fast device-to-host copy) and the time of that copy inside the step; the write itself (disk bandwidth) is off the step.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_grpo.engine.checkpoint import DEFAULT_OPTIMIZER_SHARDING, SaveInProgress, begin_save
from megatron_grpo.engine.ckpt_comm import comm_device as _device
from megatron_grpo.engine.ckpt_comm import dist_or_none as _dist

__all__ = ["start_checkpoint", "PendingSave", "Checkpoints", "async_save_enabled", "snapshot_write_buckets"]

log = logging.getLogger(__name__)


def snapshot_write_buckets(buckets: list) -> list:
    """megatron's write buckets ``[(path, name, (bytes_data, [(item, tensor), ...])), ...]`` with
    every tensor replaced by a copy that the next steps cannot change: device tensors by pinned
    host copies (one non-blocking copy each, one sync), CPU tensors by plain copies. CPU tensors
    can be the live state too: at DP 1 the optimizer's states are saved from the optimizer's own
    tensors (``engine/optim_state.py``), which the next step updates in place
    (tests/megatron_grpo/engine/test_checkpoint.py holds the write until the next step is done and
    resumes bit-identically)."""
    cuda = False
    out = []
    for path, name, (bytes_data, tensor_data) in buckets:
        copies = []
        for item, t in tensor_data:
            if t.is_cuda:
                c = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                c.copy_(t.detach(), non_blocking=True)
                t, cuda = c, True
            else:
                t = t.detach().clone()
            copies.append((item, t))
        out.append((path, name, (bytes_data, copies)))
    if cuda:
        torch.cuda.synchronize()  # the non-blocking copies have landed before the writer reads them
    return out


class PendingSave:
    """One checkpoint being written in the background (module doc)."""

    def __init__(self, save: SaveInProgress):
        self.save = save
        self.step = save.step
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self.path: Optional[Path] = None
        """``step_N`` once finished."""
        req = save.request
        t0 = time.monotonic()
        if req is not None and req.async_fn is not None:  # None: this rank has nothing to write
            args = list(req.async_fn_args)
            args[1] = snapshot_write_buckets(args[1])  # (rank, write_buckets, results_queue)
            self._thread = threading.Thread(target=self._write, args=(req.async_fn, args, dict(req.async_fn_kwargs)),
                                            name=f"checkpoint-writer-step-{self.step}", daemon=True)
            self._thread.start()
        self.snapshot_s = time.monotonic() - t0

    def _write(self, fn, args, kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - reported by finish() on every rank
            self._error = e

    def _written_everywhere(self) -> bool:
        busy = int(self._thread is not None and self._thread.is_alive())
        d = _dist()
        if d is None or d.get_world_size() == 1:
            return not busy
        flag = torch.tensor([busy], dtype=torch.int32, device=_device())
        d.all_reduce(flag, op=d.ReduceOp.MAX)
        return not int(flag.item())

    def done(self) -> Optional[Path]:
        """Collective: finish the checkpoint if every rank's writer is done; its path, else None."""
        from megatron_grpo.hang import collective

        if self.path is not None:
            return self.path
        with collective(f"checkpoint write of step {self.step} (poll)"):
            if not self._written_everywhere():
                return None
        return self._finish()

    def wait(self) -> Path:
        """Collective: wait for this rank's writer, then finish the checkpoint; its path."""
        if self._thread is not None:
            self._thread.join()
        return self._finish()

    def _finish(self) -> Path:
        if self.path is None:
            if self._thread is not None:
                self._thread.join()
            self.path = self.save.finish(self._error)
        return self.path


def start_checkpoint(run_dir: os.PathLike | str, step: int, model_chunks, optimizer, scheduler,
                     extra_state: Any = None, *, keep_last: Optional[int] = 3,
                     optimizer_sharding: str = DEFAULT_OPTIMIZER_SHARDING) -> PendingSave:
    """Collective: :func:`~megatron_grpo.engine.checkpoint.save_checkpoint`'s arguments; returns once
    this rank's shards are copied to host memory, with the write running (module doc)."""
    save = begin_save(run_dir, step, model_chunks, optimizer, scheduler, extra_state, keep_last=keep_last,
                      optimizer_sharding=optimizer_sharding, async_write=True)
    pending = PendingSave(save)
    log.info("checkpoint of step %d: writing in the background (host copy %.2f s)", step, pending.snapshot_s)
    return pending


def async_save_enabled(setting) -> bool:
    """``checkpoint.async_save``: true, false, or "auto" = on when training on CUDA."""
    return torch.cuda.is_available() if setting == "auto" else bool(setting)


class Checkpoints:
    """A training loop's checkpoints, at most one in flight: synchronous, or asynchronous
    (``async_save``) with :meth:`poll` once a step and :meth:`wait` before the next save and at the
    end. Every method is collective."""

    def __init__(self, run_dir: os.PathLike | str, *, keep_last: Optional[int], async_save: bool):
        self.run_dir, self.keep_last, self.async_save = run_dir, keep_last, async_save
        self.pending: Optional[PendingSave] = None

    def save(self, step: int, model_chunks, optimizer, scheduler, extra_state: Any = None, *,
             wait: bool = False) -> Optional[Path]:
        """The checkpoint of ``step``; its path when written before returning (synchronous, or
        ``wait``: a preemption), else None (it finishes in a later :meth:`poll` or :meth:`wait`)."""
        from megatron_grpo.engine.checkpoint import save_checkpoint

        self.wait()
        if not self.async_save:
            return save_checkpoint(self.run_dir, step, model_chunks, optimizer, scheduler, extra_state,
                                   keep_last=self.keep_last)
        self.pending = start_checkpoint(self.run_dir, step, model_chunks, optimizer, scheduler, extra_state,
                                        keep_last=self.keep_last)
        return self.wait() if wait else None

    def poll(self) -> Optional[Path]:
        """Finish the checkpoint in flight if every rank's write is done; its path, else None."""
        if self.pending is None:
            return None
        path = self.pending.done()
        if path is not None:
            self.pending = None
        return path

    def wait(self) -> Optional[Path]:
        """Finish the checkpoint in flight (waiting for the write); its path, or None if none was."""
        pending, self.pending = self.pending, None
        return pending.wait() if pending is not None else None
