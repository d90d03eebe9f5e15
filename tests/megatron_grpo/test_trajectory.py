"""Trajectory alignment check (exact messages for each broken case) and save/load round trips."""
import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from megatron_grpo.data.features import audio_token_count, num_frames
from megatron_grpo.trajectory import (Trajectory, TrajectoryError, check_alignment, load_trajectories,
                                      save_trajectories, token_arrays)

AUD = 9          # audio placeholder id used in these tests
WHERE = "trajectory (prompt 3, group 1)"


def make_traj(**over) -> Trajectory:
    # prompt: 1 2 [AUD x3] 4 | generated 5 6 | tool: 7 [AUD x2] 8 | generated 10
    ids = [1, 2, AUD, AUD, AUD, 4, 5, 6, 7, AUD, AUD, 8, 10]
    mask = [0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1]
    lps = [0.0] * 6 + [-0.5, -1.25, 0.0, 0.0, 0.0, 0.0, -0.125]
    t = Trajectory(prompt_index=3, group_id=1, input_ids_T=ids, loss_mask_T=mask, rollout_logprobs_T=lps,
                   audios=[np.zeros(4000, np.float32), np.zeros(1000, np.float32)],
                   audio_token_counts=[3, 2])
    return dataclasses.replace(t, **over)


def err(traj, **kw) -> str:
    with pytest.raises(TrajectoryError) as ei:
        check_alignment(traj, AUD, **kw)
    return str(ei.value)


def test_good_trajectory_passes():
    check_alignment(make_traj(), AUD)
    check_alignment(make_traj(audio_token_counts=[]), AUD)                  # counts optional
    check_alignment(Trajectory(0, 0, [], [], []), AUD)                       # empty is consistent
    t = make_traj()
    assert t.num_tokens == 13 and t.num_generated == 3


def test_mask_length():
    assert err(make_traj(loss_mask_T=[0] * 12)) == f"{WHERE}: loss_mask has 12 entries for 13 tokens"


def test_logprob_length():
    assert err(make_traj(rollout_logprobs_T=[0.0] * 14)) == \
        f"{WHERE}: rollout_logprobs has 14 entries for 13 tokens"


def test_logprob_on_mask0_token():
    lps = make_traj().rollout_logprobs_T.copy()
    lps[5] = -0.3
    assert err(make_traj(rollout_logprobs_T=lps)) == \
        f"{WHERE}: token 5 (id 4) is not generated (mask 0) but has rollout logprob -0.3"


@pytest.mark.parametrize("bad", [0.25, math.inf, -math.inf, math.nan])
def test_positive_or_nonfinite_logprob(bad):
    lps = make_traj().rollout_logprobs_T.copy()
    lps[7] = bad
    assert err(make_traj(rollout_logprobs_T=lps)) == (
        f"{WHERE}: token 7 (id 6) is generated but its rollout logprob is {bad} "
        "(must be a finite value <= 0)")


def test_first_problem_wins_and_other_token_checks():
    mask = make_traj().loss_mask_T.copy()
    mask[3] = 1                                   # generated audio placeholder at 3 ...
    lps = make_traj().rollout_logprobs_T.copy()
    lps[3], lps[1] = -0.1, -0.2                   # ... and an earlier logprob on a mask-0 token
    assert err(make_traj(loss_mask_T=mask, rollout_logprobs_T=lps)) == \
        f"{WHERE}: token 1 (id 2) is not generated (mask 0) but has rollout logprob -0.2"
    lps[1] = 0.0
    assert err(make_traj(loss_mask_T=mask, rollout_logprobs_T=lps)) == \
        f"{WHERE}: token 3 (id {AUD}) is an audio placeholder but marked as generated"
    mask = make_traj().loss_mask_T.copy()
    mask[4] = 2
    assert err(make_traj(loss_mask_T=mask)) == f"{WHERE}: loss_mask[4] = 2, expected 0 or 1"
    mask = make_traj().loss_mask_T.copy()
    mask[0] = 1
    lps = make_traj().rollout_logprobs_T.copy()
    lps[0] = -1.0
    assert err(make_traj(loss_mask_T=mask, rollout_logprobs_T=lps)) == \
        f"{WHERE}: the first token is marked generated; a conversation starts with the prompt"


def test_audio_run_count_mismatch():
    assert err(make_traj(audios=[np.zeros(4000, np.float32)], audio_token_counts=[])) == \
        f"{WHERE}: 2 audio-token runs in input_ids but 1 audio clips"
    assert err(make_traj(audio_token_counts=[3])) == \
        f"{WHERE}: audio_token_counts has 1 entries for 2 audio clips"


def test_audio_run_length_mismatch():
    assert err(make_traj(audio_token_counts=[3, 4])) == \
        f"{WHERE}: audio run 1 at token 9 has 2 tokens, expected 4"


def test_audio_samples_check():
    # frames -> tokens: 9..16 -> 2, 17..24 -> 3, 25..32 -> 4 (frames = ceil(samples / 160))
    assert [audio_token_count(num_frames(n)) for n in (2000, 3200, 3841, 4000)] == [2, 3, 4, 4]
    good = make_traj(audios=[np.zeros(3200, np.float32), np.zeros(2000, np.float32)])
    check_alignment(good, AUD, check_audio_samples=True)
    bad = make_traj(audios=[np.zeros(4000, np.float32), np.zeros(2000, np.float32)])
    assert err(bad, check_audio_samples=True) == (
        f"{WHERE}: audio clip 0 has 4000 samples -> 25 mel frames -> 4 audio tokens, but its run at "
        "token 2 has 3 (the waveform is not the one the rollout server saw)")


def _full_traj():
    rng = np.random.default_rng(0)
    return make_traj(audios=[rng.standard_normal(3200).astype(np.float32),
                             rng.standard_normal(1000).astype(np.float32)],
                     completion_texts=["<tool_call>x</tool_call>", "[00:01 - 00:02]"], num_turns=2,
                     finish_reason="answer", weight_version=7,
                     routed_experts=rng.integers(0, 128, size=(3, 2, 8)).astype(np.int16),
                     columns={"ground_truth": "[00:01 - 00:02]", "event": {"type": "beep", "amp": 0.1}},
                     reward=0.1 + 0.2, reward_terms={"iou": 1 / 3, "format": np.float32(1.0)},
                     advantage=-1.2345678901234567)


def _assert_same(a: Trajectory, b: Trajectory):
    for f in dataclasses.fields(Trajectory):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "audios":
            assert len(x) == len(y) and all(u.dtype == v.dtype == np.float32 and np.array_equal(u, v)
                                            for u, v in zip(x, y))
        elif isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y)
        elif f.name == "reward_terms":
            assert y == {"iou": 1 / 3, "format": 1.0}
        else:
            assert x == y, f.name


def test_to_from_dict_inline_roundtrip():
    t = _full_traj()
    d = json.loads(json.dumps(t.to_dict()))          # through real JSON text
    assert d["format"] == 1 and isinstance(d["audios"], list)
    _assert_same(t, Trajectory.from_dict(d))
    # torch tensors in routed_experts save as arrays
    t2 = dataclasses.replace(t, routed_experts=torch.arange(6, dtype=torch.int32).reshape(2, 3))
    back = Trajectory.from_dict(json.loads(json.dumps(t2.to_dict())))
    assert back.routed_experts.dtype == np.int32 and back.routed_experts.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_token_arrays_as_the_rollout_hands_them():
    """int64 ids, bool mask, float64 logprobs; the checks, the JSON form (lists of 0s and 1s) and
    equality are those of the lists'."""
    t = make_traj()
    ids, mask, lps = token_arrays(t.input_ids_T, t.loss_mask_T, t.rollout_logprobs_T)
    assert (ids.dtype, mask.dtype, lps.dtype) == (np.int64, np.bool_, np.float64)
    a = dataclasses.replace(t, input_ids_T=ids, loss_mask_T=mask, rollout_logprobs_T=lps)
    check_alignment(a, AUD)
    assert a == t and a.num_generated == t.num_generated == 3
    d = json.loads(json.dumps(a.to_dict()))
    assert d["loss_mask_T"] == t.loss_mask_T and d["input_ids_T"] == t.input_ids_T
    assert Trajectory.from_dict(d) == a
    assert a != dataclasses.replace(a, rollout_logprobs_T=lps * 2)
    assert err(dataclasses.replace(a, rollout_logprobs_T=np.where(mask, lps, -0.5))).startswith(
        f"{WHERE}: token 0 (id 1) is not generated (mask 0) but has rollout logprob -0.5")
    with pytest.raises(TrajectoryError, match=r"^loss_mask\[3\] = 2, expected 0 or 1$"):
        token_arrays(t.input_ids_T, [0, 0, 0, 2] + t.loss_mask_T[4:], t.rollout_logprobs_T)


def test_save_load_jsonl_with_npz(tmp_path):
    trajs = [_full_traj(), make_traj(prompt_index=4, audios=[], audio_token_counts=[],
                                     input_ids_T=[1, 2, 3], loss_mask_T=[0, 1, 1],
                                     rollout_logprobs_T=[0.0, -1.0, -2.0])]
    p = save_trajectories(tmp_path / "rollouts" / "step_000001.jsonl", trajs)
    lines = p.read_text().splitlines()
    assert json.loads(lines[0])["audios"] == {"npz": "step_000001.jsonl.audio/000000.npz", "count": 2}
    assert (tmp_path / "rollouts" / "step_000001.jsonl.audio" / "000000.npz").is_file()
    moved = tmp_path / "moved"
    (tmp_path / "rollouts").rename(moved)                 # relative npz paths survive a move
    back = load_trajectories(moved / "step_000001.jsonl")
    _assert_same(trajs[0], back[0])
    assert back[1].audios == [] and back[1].input_ids_T == [1, 2, 3]
    check_alignment(back[1], AUD)
    inline = save_trajectories(tmp_path / "inline.jsonl", trajs, inline_audio=True)
    assert not (tmp_path / "inline.jsonl.audio").exists()
    _assert_same(trajs[0], load_trajectories(inline)[0])


def test_from_dict_rejects_unknown():
    d = make_traj().to_dict()
    with pytest.raises(ValueError, match=r"unknown trajectory fields: \['bogus'\]"):
        Trajectory.from_dict({**d, "bogus": 1})
    with pytest.raises(ValueError, match="trajectory format 2 is not supported"):
        Trajectory.from_dict({**d, "format": 2})
