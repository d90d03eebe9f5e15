"""Training micro-batches from trajectories (``engine/batch.py``): the fields line up with the
packer, the audio-token count is checked per sample, and the pooled tower batches are cut at
micro-batches. The step through them: test_step.py and test_shared_clips.py."""
from __future__ import annotations

import pytest
import torch

from test_step import BUDGET, _featurizer, make_data


def test_pooled_batches_cut_at_micro_batches_and_keep_the_local_ones():
    """Clips that one micro-batch alone uses go in batches of whole micro-batches (all kept); the
    ones several micro-batches use follow in first-use order, cut at ``max_frames``."""
    from megatron_grpo.engine.step_audio import _pooled_batches

    # clip -> (first, last) micro-batch; frames per clip
    span = {0: (0, 0), 1: (0, 3), 2: (0, 0), 3: (1, 1), 4: (2, 2), 5: (2, 2), 6: (2, 4), 7: (3, 3)}
    lens = [30, 50, 30, 40, 20, 20, 60, 90]
    batches, keep = _pooled_batches(span, lens, local_frames=100, max_frames=100)
    # mb 0 (60) + mb 1 (40) = 100; mb 2 (40) alone (+ mb 3's 90 > 100); mb 3; then the wide 50 + 60 > 100
    assert batches == [[0, 2, 3], [4, 5], [7], [1], [6]], batches
    assert keep == (0, 1, 2)
    # a smaller local limit (keep_shared < 1) cuts after every micro-batch, never inside one
    assert _pooled_batches(span, lens, local_frames=50, max_frames=100)[0] == [[0, 2], [3], [4, 5], [7], [1], [6]]


def _step(tiny_ckpt, dp: int):
    """The test step's trajectories (rollout logprobs -1 on the loss tokens), their plan over ``dp``
    ranks, the packing limits and the featurizer."""
    from megatron_grpo.packing import PackLimits, plan_step

    trajs = make_data(str(tiny_ckpt))["trajectories"]
    for t in trajs:
        t.rollout_logprobs_T = [-1.0 * m for m in t.loss_mask_T]
    cfg = PackLimits(max_tokens_per_microbatch=BUDGET, pad_multiple=2)
    return trajs, plan_step([t.num_tokens for t in trajs], dp, cfg), cfg, _featurizer(str(tiny_ckpt))


def test_build_train_microbatches_layout_and_audio_count_check(tiny_ckpt):
    """Micro-batch fields line up with the packer; a wrong audio token count names the sample."""
    import dataclasses

    from megatron_grpo.engine.batch import build_train_microbatches

    trajs, plan, cfg, featurize = _step(tiny_ckpt, 2)
    pooled = build_train_microbatches(trajs, plan, 0, cfg, featurize=featurize)[0]  # keep_shared 0.5
    assert pooled.audio_features is None and pooled.clip_use.order == (-1, -2) and pooled.clip_use.last == (0,)
    assert pooled.clip_use.shared.lens == [f.shape[-1] for f in pooled.clip_use.shared.features_MF]
    mbs = build_train_microbatches(trajs, plan, 0, cfg, featurize=featurize, keep_shared=0.0)  # clips its own
    assert [m.sample_ids for m in mbs] == [(0,), ()]
    a = mbs[0]
    assert a.has_audio and a.num_clips == 2 and a.audio_features.shape[0] == 128
    assert torch.equal(a.audio_features, torch.cat(pooled.clip_use.shared.features_MF, dim=1))
    assert int(a.audio_feature_lens.sum()) == a.audio_features.shape[1]
    assert torch.equal(a.rollout_logprobs_T[:220], -torch.tensor(trajs[0].loss_mask_T, dtype=torch.float32))
    assert (a.advantages_T[:220] == trajs[0].advantage).all() and a.advantages_T[220:].eq(0).all()
    assert tuple(a.position_ids().shape) == (3, 1, a.num_tokens)
    psp = a.packed_seq_params()
    assert psp.qkv_format == "thd" and psp.cu_seqlens_q.tolist() == [0, 220] and psp.max_seqlen_q == 220
    assert not mbs[1].has_audio and mbs[1].is_padding and mbs[1].num_tokens == 2

    wrong = list(trajs)
    wrong[0] = dataclasses.replace(trajs[0], audio_token_counts=[trajs[0].audio_token_counts[0] + 1,
                                                                 trajs[0].audio_token_counts[1]])
    with pytest.raises(ValueError, match=r"sample 0 \(prompt 0\): its clips give"):
        build_train_microbatches(wrong, plan, 0, cfg, featurize=featurize)

    # the shared batches are planned from the featurizer's frames(): one that disagrees with its own
    # features is named at the clip
    off_by_one = type("OffByOne", (), {"__call__": lambda self, w: featurize(w),
                                       "frames": lambda self, w: featurize.frames(w) + 1})()
    n = len(trajs[0].audios[0])
    with pytest.raises(ValueError, match=rf"sample 0 \(prompt 0\): audio clip 0 of {n} samples has "
                                         rf"{-(-n // 160)} feature frames, but the featurizer's frames\(\) gave "
                                         rf"{-(-n // 160) + 1}; they must agree"):
        build_train_microbatches(trajs, plan, 0, cfg, featurize=off_by_one)


def test_a_steps_shared_clips_are_freed_with_its_micro_batches(tiny_ckpt):
    """The micro-batches hold the step's SharedClips (its features on the device): dropping them
    frees it at once, by reference counting (no reference cycle), before the next step's build."""
    import gc
    import weakref

    from megatron_grpo.engine.batch import build_train_microbatches

    trajs, plan, cfg, featurize = _step(tiny_ckpt, 2)
    mbs = build_train_microbatches(trajs, plan, 0, cfg, featurize=featurize)
    ref = weakref.ref(mbs[0].clip_use.shared)
    gc.collect()
    gc.disable()
    try:
        del mbs
        assert ref() is None
    finally:
        gc.enable()


def test_microbatches_are_checked_when_built_and_assembled_when_read(tiny_ckpt):
    """``build_train_microbatches`` assembles nothing; each micro-batch's info (what the step reads
    before the schedule) is what the assembled micro-batch says; bad per-token input fails in the
    build, naming the sample, not later inside the schedule."""
    import dataclasses

    from megatron_grpo.engine.batch import MicroBatchInfo, build_train_microbatches, microbatch_infos
    from megatron_grpo.hang import StepSchedule

    trajs, plan, cfg, featurize = _step(tiny_ckpt, 1)
    for keep in (0.5, 0.0):  # every clip pooled / each micro-batch's clips its own
        mbs = build_train_microbatches(trajs, plan, 0, cfg, featurize=featurize, keep_shared=keep)
        assert len(mbs) == plan.num_microbatches >= 2 and mbs.assembled == 0
        schedule = StepSchedule.from_microbatches(1, mbs)  # read through the infos
        assert mbs.assembled == 0
        assert mbs[-1] is mbs[len(mbs) - 1] and mbs.assembled == 1  # kept once assembled
        assembled = list(mbs)
        assert mbs.assembled == len(mbs)
        assert microbatch_infos(mbs) == tuple(MicroBatchInfo.of(m) for m in assembled)
        assert schedule == StepSchedule.from_microbatches(1, assembled)
        assert sum(i.loss_tokens for i in mbs.infos) == sum(sum(t.loss_mask_T) for t in trajs)
        assert [m.sample_ids for m in mbs[0:2]] == [i.sample_ids for i in mbs.infos[:2]]

    for field, value, message in (
            ("rollout_logprobs_T", lambda t: t.rollout_logprobs_T[:-1],
             rf"rollout logprobs of sample 1: {trajs[1].num_tokens - 1} values for {trajs[1].num_tokens} tokens"),
            ("input_ids_T", lambda t: t.input_ids_T[:-1] + ["x"], "could not convert|invalid literal")):
        bad = list(trajs)
        bad[1] = dataclasses.replace(trajs[1], **{field: value(trajs[1])})
        with pytest.raises(ValueError, match=message):
            build_train_microbatches(bad, plan, 0, cfg, featurize=featurize)
