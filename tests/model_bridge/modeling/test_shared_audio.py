"""``frame_batches``: the greedy cut of clips into tower batches of at most a budget of frames that
``SharedClips`` and the trainer's pooled batches (``engine.step_audio._pooled_batches``) share. The
tower's values through those batches: tests/megatron_grpo/engine/test_shared_clips.py."""
from __future__ import annotations

import torch

from model_bridge.modeling.shared_audio import SharedClips, frame_batches


def test_frame_batches_cut_in_order_at_the_budget():
    lens = [300, 500, 200, 900, 1500, 100, 100]
    assert frame_batches(range(7), lens, 1000) == [[0, 1, 2], [3], [4], [5, 6]]  # 1000 fits, 1500 is alone
    assert frame_batches([6, 2, 0], lens, 400) == [[6, 2], [0]]  # the given order, not sorted
    assert frame_batches(range(7), lens, None) == [list(range(7))]
    assert frame_batches([], lens, 1000) == []


def test_shared_clips_without_batches_use_the_same_cut():
    lens = [300, 500, 200, 900]
    shared = SharedClips([torch.zeros(2, n) for n in lens], max_frames=1000)
    assert shared.batches == [(0, 1, 2), (3,)] and shared.batch_frames == [1000, 900]
    assert shared.batch_of == {0: 0, 1: 0, 2: 0, 3: 1}
