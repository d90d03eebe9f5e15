"""Trajectories kept for `mgrpo report`: the trainer's side of what a rollout recording lacks.

A recording (``rollout.record_dir``, ``megatron_grpo/run/replay.py``) is written before the step
trains, so it holds vLLM's logprobs but not the trainer's. On a step that keeps trajectories every
rank hands ``train_step`` a dict that the last pipeline stage fills with each sample's behaviour
logprobs (the ones the rollout correction compares with vLLM's); one ``gather_object`` brings them
to rank 0, which writes:

* with ``rollout.record_dir``: ``<record_dir>/step_{k:06d}.trainer.pt``, ``torch.save`` of
  ``{"format": 1, "step": k, "trainer_logprobs": [float32 [T_i] per recorded trajectory]}``;
* with ``logging.trajectories.every``: ``<run_dir>/trajectories/step_{k:06d}.pt`` in the
  recording's format (and its ``manifest.json``) for at most ``max_samples`` samples, whole groups
  first, without routing-replay data, plus ``"trainer_logprobs"`` and ``"sample_index"`` (each kept
  trajectory's position in the step).

Steps that keep nothing cost nothing: no copy, no gather.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from megatron_grpo.run.replay import FORMAT, Recorder, _atomic

TRAJECTORIES_DIR = "trajectories"
"""run_dir/trajectories/: what ``logging.trajectories`` keeps."""


def trainer_logprobs_path(directory, step: int) -> Path:
    return Path(directory) / f"step_{step:06d}.trainer.pt"


def gather_sample_logprobs(local: dict, num_samples: int):
    """Collective over the world: rank 0 gets ``[float32 [T_i]]`` for samples ``0..num_samples-1``
    (None where no rank trained that sample), the other ranks None. ``local``: this rank's
    ``{global sample id: logprobs}`` from ``train_step(logprobs_out=...)``; only the first rank of
    each tensor-parallel group sends (its peers hold the same values)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from megatron.core import parallel_state as ps

        mine = local if ps.get_tensor_model_parallel_rank() == 0 else {}
        parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if dist.get_rank() != 0:
            return None
    else:
        parts = [local]
    merged = {}
    for part in parts:
        merged.update(part or {})
    return [merged.get(i) for i in range(num_samples)]


def pick_samples(trajs, max_samples: int) -> list[int]:
    """Positions of at most ``max_samples`` trajectories: whole groups in order of first
    appearance, then the start of the first group that does not fit whole (so never none)."""
    groups: dict = {}
    for i, t in enumerate(trajs):
        groups.setdefault(t.group_id, []).append(i)
    out: list[int] = []
    for members in groups.values():
        if len(out) + len(members) > max_samples:
            if not out:
                out = members[:max_samples]
            break
        out.extend(members)
    return out


class TrajectoryLog:
    """Built on every rank (all must agree on which steps gather); rank 0 writes."""

    def __init__(self, cfg, run_dir, rank: int):
        rc = cfg.rollout
        self.record_dir = Path(rc.record_dir) if rc.record_dir and rc.server != "replay" else None
        self.section = cfg.logging.trajectories
        self.rank = rank
        self.light = None
        if rank == 0 and self.section.every > 0:
            self.light = Recorder(cfg, Path(run_dir) / TRAJECTORIES_DIR)

    def wants(self, step: int) -> bool:
        """Whether ``step`` keeps trajectories (then pass a dict as ``train_step(logprobs_out=)``)."""
        return self.record_dir is not None or self.section.keeps(step)

    def keep(self, step: int, trajs, logprobs_out: dict) -> None:
        """Collective: gathers the trainer logprobs to rank 0, which writes (module doc)."""
        lps = gather_sample_logprobs(logprobs_out, len(trajs))
        if self.rank != 0:
            return
        if self.record_dir is not None:
            payload = {"format": FORMAT, "step": step, "trainer_logprobs": lps}
            _atomic(trainer_logprobs_path(self.record_dir, step), lambda p: torch.save(payload, p))
        if self.light is not None and self.section.keeps(step):
            idx = pick_samples(trajs, self.section.max_samples)
            self.light.record(step, [replace(trajs[i], routed_experts=None) for i in idx], None,
                              extra={"trainer_logprobs": [lps[i] for i in idx], "sample_index": idx})
