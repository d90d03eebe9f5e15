"""One rollout sample as the trainer sees it: token ids from vLLM, never re-tokenised text.

Shape legend: T = tokens of the whole multi-turn conversation (prompt, every generated turn,
every tool turn's template tokens), A = audio clips in the conversation, in order of appearance.

Alignment (checked by `check_alignment`):
  - `input_ids_T[t]` is the t-th token of the conversation as vLLM saw it;
  - `loss_mask_T[t] == 1` only where the policy sampled `input_ids_T[t]` (generated turns);
    prompt, tool outputs and chat-template tokens are 0;
  - `rollout_logprobs_T[t]` is vLLM's log p(input_ids_T[t] | input_ids_T[:t]) where the mask
    is 1, and 0.0 elsewhere;
  - the A clips of `audios` fill the A runs of `audio_token_id` in `input_ids_T`, in order; run i
    has exactly `audio_token_counts[i]` tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


class TrajectoryError(ValueError):
    """A trajectory whose tokens, mask, logprobs or audio do not line up; the message says where."""


@dataclass
class Trajectory:
    """A finished multi-turn rollout of one prompt, ready for rewards, advantages and packing."""

    prompt_index: int
    """Row of the dataset this rollout answered (for data position and grouping)."""
    group_id: int
    """Samples of one prompt share a group id (GRPO normalises rewards within a group)."""
    input_ids_T: list[int]
    """Token ids of the whole conversation, exactly as the rollout server saw/sampled them."""
    loss_mask_T: list[int]
    """1 on policy-generated tokens, 0 elsewhere."""
    rollout_logprobs_T: list[float]
    """vLLM's per-token logprob of the sampled token where loss_mask is 1, else 0.0."""
    audios: list[np.ndarray] = field(default_factory=list)
    """16 kHz float32 mono waveforms of the audio clips, in order of appearance (prompt audio first,
    then clips returned by tools)."""
    audio_token_counts: list[int] = field(default_factory=list)
    """Length of each audio-token run in input_ids_T (from the server's prompt token ids)."""
    completion_texts: list[str] = field(default_factory=list)
    """Decoded text of each generated turn (for rewards and logs; never re-tokenised)."""
    num_turns: int = 0
    finish_reason: str = ""
    """Why the conversation ended: 'answer', 'max_turns', 'length', 'error: ...'."""
    weight_version: int = 0
    """Policy version (training step) of the server that sampled it (off-policy bookkeeping)."""
    routed_experts: Any = None
    """Optional rollout routing replay data (R3), when the server returns it."""
    columns: dict = field(default_factory=dict)
    """Extra dataset columns (e.g. ground_truth), passed through to reward functions."""
    reward: float = 0.0
    reward_terms: dict = field(default_factory=dict)
    advantage: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids_T)

    @property
    def num_generated(self) -> int:
        return int(sum(self.loss_mask_T))


def check_alignment(traj: Trajectory, audio_token_id: int) -> None:
    """Raise TrajectoryError naming the first place where tokens, mask, logprobs or audio disagree."""
    T = len(traj.input_ids_T)
    where = f"trajectory (prompt {traj.prompt_index}, group {traj.group_id})"
    if len(traj.loss_mask_T) != T:
        raise TrajectoryError(f"{where}: loss_mask has {len(traj.loss_mask_T)} entries for {T} tokens")
    if len(traj.rollout_logprobs_T) != T:
        raise TrajectoryError(f"{where}: rollout_logprobs has {len(traj.rollout_logprobs_T)} entries "
                              f"for {T} tokens")
    for t, (m, lp) in enumerate(zip(traj.loss_mask_T, traj.rollout_logprobs_T)):
        if m not in (0, 1):
            raise TrajectoryError(f"{where}: loss_mask[{t}] = {m}, expected 0 or 1")
        if m == 0 and lp != 0.0:
            raise TrajectoryError(f"{where}: token {t} (id {traj.input_ids_T[t]}) is not generated "
                                  f"(mask 0) but has rollout logprob {lp}")
        if m == 1 and not (lp <= 0.0):
            raise TrajectoryError(f"{where}: token {t} (id {traj.input_ids_T[t]}) is generated but its "
                                  f"rollout logprob is {lp} (must be a finite value <= 0)")
        if m == 1 and traj.input_ids_T[t] == audio_token_id:
            raise TrajectoryError(f"{where}: token {t} is an audio placeholder but marked as generated")
    if T and traj.loss_mask_T[0] == 1:
        raise TrajectoryError(f"{where}: the first token is marked generated; a conversation starts "
                              "with the prompt")
    runs = _audio_runs(traj.input_ids_T, audio_token_id)
    if len(runs) != len(traj.audios):
        raise TrajectoryError(f"{where}: {len(runs)} audio-token runs in input_ids but "
                              f"{len(traj.audios)} audio clips")
    if traj.audio_token_counts and [n for _, n in runs] != list(traj.audio_token_counts):
        for i, ((start, n), want) in enumerate(zip(runs, traj.audio_token_counts)):
            if n != want:
                raise TrajectoryError(f"{where}: audio run {i} at token {start} has {n} tokens, "
                                      f"expected {want}")


def _audio_runs(ids: list[int], audio_token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of audio_token_id."""
    runs, t = [], 0
    while t < len(ids):
        if ids[t] == audio_token_id:
            s = t
            while t < len(ids) and ids[t] == audio_token_id:
                t += 1
            runs.append((s, t - s))
        else:
            t += 1
    return runs
