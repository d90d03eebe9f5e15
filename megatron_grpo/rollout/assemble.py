"""Result assembly: a finished conversation's `RolloutState` -> the `Trajectory` the trainer gets,
with the per-turn routed-expert rows (R3) stitched into one array.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from megatron_grpo.rollout.state import RolloutConsistencyError, RolloutState
from megatron_grpo.trajectory import Trajectory, check_alignment, token_arrays


def stitch_routed_experts(parts: Sequence[np.ndarray], total_tokens: int) -> np.ndarray:
    """Concatenate per-turn routed-expert rows ([rows_i, layers, top_k], turn i covering positions
    [end of turn i-1's rows, P_i + O_i - 1)) into ``[total_tokens - 1, layers, top_k]``: the
    experts that routed every input position whose output the policy's logprobs came from (the
    last sampled token is never fed, so it has none)."""
    if not parts:
        raise ValueError("no routed-expert rows")
    out = np.concatenate([np.asarray(p) for p in parts], axis=0)
    if out.shape[0] != total_tokens - 1:
        raise RolloutConsistencyError(f"routed experts cover {out.shape[0]} positions, expected "
                                      f"{total_tokens - 1} (tokens - 1)")
    return out


def _version_int(v: Optional[str]) -> int:
    """A turn's weight version as a number; 0 when the server sent none or not a number."""
    try:
        return int(str(v))
    except (TypeError, ValueError):
        return 0


def build_trajectory(state: RolloutState, pidx, audio_token_id: int) -> Trajectory:
    """The trajectory of a finished conversation, checked for alignment (token, mask and logprob
    lists, audio placeholders against the clips' token counts)."""
    T = len(state.input_ids)
    if not (len(state.loss_mask) == len(state.logprobs) == T):
        raise RolloutConsistencyError("token, mask and logprob lists differ in length")
    routed = None
    if state.routed_rows:
        routed = stitch_routed_experts(state.routed_rows, T)
    versions = [v for v in state.weight_versions if v is not None]
    ids, mask, logprobs = token_arrays(state.input_ids, state.loss_mask, state.logprobs)  # the trainer's form
    traj = Trajectory(
        prompt_index=pidx, group_id=state.group_id, input_ids_T=ids, loss_mask_T=mask, rollout_logprobs_T=logprobs,
        audios=[a.waveform for a in state.audios],
        audio_token_counts=list(state.audio_token_counts),
        completion_texts=list(state.completion_texts), num_turns=state.num_turns,
        finish_reason=state.finish_reason or "stop",
        weight_version=min((_version_int(v) for v in versions), default=0),
        routed_experts=routed, columns=dict(state.columns))
    check_alignment(traj, audio_token_id)
    return traj
