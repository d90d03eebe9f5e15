"""Packing invariants: every sample once, budget, determinism, DP balance, equal micro-batch counts
(also through a real 2-rank gloo MAX all-reduce), THD metadata (cu_seqlens, positions, padding)."""
from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_grpo.packing import (PackLimits, balance_samples, build_microbatch,
                                   build_rank_microbatches, empty_microbatch, equalize_microbatch_counts,
                                   first_fit_decreasing, next_token_targets, pack_per_token, pad_microbatches,
                                   plan_step, round_up, shift_within_samples)
from model_bridge.spawn import run_ranks


def skewed_lengths(seed, n):
    """Mostly short rollouts with a heavy tail (long audio + several tool turns)."""
    rng = random.Random(seed)
    return [min(int(rng.lognormvariate(6.0, 0.9)) + 1, 8000) for _ in range(n)]


def fake_samples(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(1, 1000, (n,), generator=g) for n in lengths]
    masks = [torch.rand(n, generator=g) < 0.6 for n in lengths]
    return ids, masks


# ---------------------------------------------------------------- bin packing and balance

def test_ffd_by_hand():
    # sorted: 6(0) 5(2) 4(1) 3(4) 2(3) 2(5); capacity 10
    assert first_fit_decreasing([6, 4, 5, 2, 3, 2], 10) == [[0, 1], [2, 4, 3], [5]]
    assert first_fit_decreasing([], 10) == []


def test_oversized_sample_is_an_error_naming_it_or_goes_alone():
    with pytest.raises(ValueError, match=r"sample 1 has 12 tokens, more than max_tokens_per_microbatch=10"):
        first_fit_decreasing([3, 12, 4], 10)
    assert first_fit_decreasing([3, 12, 4], 10, allow_oversized=True) == [[1], [2, 0]]
    cfg = PackLimits(max_tokens_per_microbatch=8, pad_multiple=4, allow_oversized=True)
    plan = plan_step([3, 13, 2], 1, cfg)
    assert plan.microbatches == (((1,), (0, 2)),) and plan.microbatch_tokens(0) == [16, 8]
    with pytest.raises(ValueError, match="sample 1 has 13 tokens"):
        plan_step([3, 13, 2], 1, PackLimits(max_tokens_per_microbatch=8))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dp_size", [1, 3, 8])
def test_plan_invariants(seed, dp_size):
    lengths = skewed_lengths(seed, 150)
    cfg = PackLimits(max_tokens_per_microbatch=8192, pad_multiple=8)
    plan = plan_step(lengths, dp_size, cfg)
    ids = [i for rank in plan.microbatches for mb in rank for i in mb]
    assert sorted(ids) == list(range(len(lengths)))  # every sample exactly once
    assert {len(rank) for rank in plan.microbatches} == {plan.num_microbatches}  # equal counts
    for r in range(dp_size):
        assert all(t <= cfg.max_tokens_per_microbatch and t % cfg.pad_multiple == 0
                   for t in plan.microbatch_tokens(r))
    assert plan == plan_step(list(lengths), dp_size, cfg)  # deterministic
    s = plan.summary()
    assert s["pack/num_microbatches"] == plan.num_microbatches and 0 <= s["pack/padding_fraction"] < 1


def test_balance_on_skewed_lengths():
    for seed in range(3):
        lengths = skewed_lengths(seed, 512)
        for dp in (2, 4, 8):
            per_rank = balance_samples(lengths, dp)
            toks = [sum(lengths[i] for i in ids) for ids in per_rank]
            mean = sum(toks) / dp
            assert max(toks) - mean < max(lengths)  # LPT bound
            plan = plan_step(lengths, dp, PackLimits(max_tokens_per_microbatch=16384))
            assert plan.balance <= 1.02, (seed, dp, plan.balance)


def test_groups_stay_on_few_ranks_within_the_lpt_bound():
    """With GRPO groups, a group's samples gather on few DP ranks (its shared recording then runs
    through the audio tower on fewer ranks) and the LPT bound still holds."""
    rng = np.random.default_rng(0)
    total = [0, 0]
    for dp, n_groups, g in ((2, 2, 8), (4, 4, 8), (8, 4, 8), (4, 16, 8), (8, 8, 4)):
        for trial in range(5):
            base = rng.integers(500, 17000, size=n_groups)  # a group's recording sets most of its length
            lengths = [int(b + rng.integers(50, 600)) for b in base for _ in range(g)]
            groups = [k for k in range(n_groups) for _ in range(g)]
            spread = {}
            for with_groups in (False, True):
                per_rank = balance_samples(lengths, dp, groups if with_groups else None)
                toks = [sum(lengths[i] for i in ids) for ids in per_rank]
                assert sorted(i for ids in per_rank for i in ids) == list(range(len(lengths)))
                assert max(toks) - sum(toks) / dp < max(lengths), (dp, trial, toks)  # LPT bound
                spread[with_groups] = sum(len({groups[i] for i in ids}) for ids in per_rank)  # (group, rank) pairs
            assert spread[True] <= spread[False], (dp, n_groups, trial, spread)
            total[0] += spread[False]
            total[1] += spread[True]
    print(f"(group, rank) pairs without / with groups: {total[0]} / {total[1]}")
    assert total[1] < 0.7 * total[0], total
    # equal lengths, one group per rank's share: every group on one rank
    per_rank = balance_samples([100] * 32, 4, [i // 8 for i in range(32)])
    assert [sorted({i // 8 for i in ids}) for ids in per_rank] == [[0], [1], [2], [3]]
    plan = plan_step([100] * 32, 4, PackLimits(max_tokens_per_microbatch=400), groups=[i // 8 for i in range(32)])
    assert plan == plan_step([100] * 32, 4, PackLimits(max_tokens_per_microbatch=400), groups=[i // 8 for i in range(32)])
    with pytest.raises(ValueError, match="3 groups for 4 samples"):
        balance_samples([1, 2, 3, 4], 2, [0, 0, 1])


def test_ranks_without_samples_get_padding_microbatches():
    plan = plan_step([5, 3], 4, PackLimits(max_tokens_per_microbatch=4, allow_oversized=True))
    assert plan.num_microbatches == 1 and sum(1 for r in plan.microbatches for mb in r if not mb) == 2
    empty = plan_step([], 3, PackLimits(max_tokens_per_microbatch=4))
    assert empty.num_microbatches == 0 and empty.balance == 1.0 and empty.padding_fraction == 0.0


def test_config_and_length_checks():
    with pytest.raises(ValueError, match="multiple of pad_multiple=8"):
        PackLimits(max_tokens_per_microbatch=100, pad_multiple=8)
    for kw in (dict(max_tokens_per_microbatch=0), dict(max_tokens_per_microbatch=8, pad_multiple=0),
               dict(max_tokens_per_microbatch=8, pad_token_id=-1)):
        with pytest.raises(ValueError):
            PackLimits(**kw)
    with pytest.raises(ValueError, match="sample 1 has length 0"):
        plan_step([4, 0], 1, PackLimits(max_tokens_per_microbatch=8))
    with pytest.raises(ValueError, match="dp_size"):
        plan_step([4], 0, PackLimits(max_tokens_per_microbatch=8))


# ---------------------------------------------------------------- THD metadata

def test_microbatch_by_hand():
    cfg = PackLimits(max_tokens_per_microbatch=16, pad_multiple=4, pad_token_id=99)
    ids = {3: [10, 11, 12], 7: [20, 21]}
    masks = {3: [0, 1, 1], 7: [1, 0]}
    mb = build_microbatch([7, 3], ids, masks, cfg)
    assert mb.input_ids_T.tolist() == [20, 21, 10, 11, 12, 99, 99, 99]
    assert mb.loss_mask_T.tolist() == [True, False, False, True, True, False, False, False]
    assert mb.sample_index_T.tolist() == [7, 7, 3, 3, 3, -1, -1, -1]
    assert mb.cu_seqlens_S.dtype == torch.int32 and mb.cu_seqlens_S.tolist() == [0, 2, 5, 8]
    assert mb.position_ids_3T.tolist() == [[0, 1, 0, 1, 2, 0, 1, 2]] * 3
    assert mb.max_seqlen == 3 and mb.sample_ids == (7, 3)
    assert (mb.num_tokens, mb.num_real_tokens, mb.num_padding_tokens) == (8, 5, 3) and not mb.is_padding
    exact = build_microbatch([7, 3], ids, masks, PackLimits(max_tokens_per_microbatch=8))
    assert exact.cu_seqlens_S.tolist() == [0, 2, 5] and exact.num_padding_tokens == 0  # no empty segment


@pytest.mark.parametrize("pad_multiple", [1, 2, 8])
def test_built_microbatches_are_consistent(pad_multiple):
    lengths = skewed_lengths(5, 60)
    ids, masks = fake_samples(lengths)
    cfg = PackLimits(max_tokens_per_microbatch=round_up(9000, pad_multiple), pad_multiple=pad_multiple)
    plan = plan_step(lengths, 2, cfg)
    seen = []
    for rank in range(2):
        mbs = build_rank_microbatches(plan, rank, ids, masks, cfg)
        assert len(mbs) == plan.num_microbatches
        assert [mb.num_tokens for mb in mbs] == plan.microbatch_tokens(rank)
        for mb in mbs:
            T, cu = mb.num_tokens, mb.cu_seqlens_S.tolist()
            assert T % pad_multiple == 0 and cu[0] == 0 and cu[-1] == T  # megatron THD RoPE: freqs.size(0) == cu[-1]
            for k, i in enumerate(mb.sample_ids):
                a, b = cu[k], cu[k + 1]
                assert torch.equal(mb.input_ids_T[a:b], ids[i]) and torch.equal(mb.loss_mask_T[a:b], masks[i])
                assert mb.position_ids_3T[:, a:b].tolist() == [list(range(b - a))] * 3  # restart per sample
                assert set(mb.sample_index_T[a:b].tolist()) == {i}
            assert not mb.loss_mask_T[cu[mb.num_samples]:].any()
            # the packer skips the content checks of what it built; made again outside it they pass
            again = replace(mb)
            assert again == mb and again.scored_tokens == mb.scored_tokens == \
                int(mb.loss_mask_T.sum()) - int(mb.loss_mask_T[cu[:-1]].sum())
            seen += mb.sample_ids
    assert sorted(seen) == list(range(len(lengths)))


def test_positions_match_the_models_mrope_helper():
    from model_bridge.modeling.mrope import mrope_position_ids

    ids, masks = fake_samples([5, 9, 2], seed=1)
    mb = build_microbatch([1, 0, 2], ids, masks, PackLimits(max_tokens_per_microbatch=24, pad_multiple=8))
    spec = SimpleNamespace(image_token_id=-1, video_token_id=-2)
    real_cu = mb.cu_seqlens_S[: mb.num_samples + 1]
    assert torch.equal(mrope_position_ids(mb.input_ids_T, spec, real_cu), mb.position_ids_3T)
    assert torch.equal(mrope_position_ids(mb.input_ids_T, spec, mb.cu_seqlens_S), mb.position_ids_3T)


def test_empty_microbatch_and_padding_to_a_count():
    cfg = PackLimits(max_tokens_per_microbatch=16, pad_multiple=4)
    e = empty_microbatch(cfg)
    assert e.is_padding and e.num_tokens == 4 and e.cu_seqlens_S.tolist() == [0, 4] and e.max_seqlen == 4
    assert not e.loss_mask_T.any() and e.sample_index_T.tolist() == [-1] * 4
    ids, masks = fake_samples([3])
    mbs = pad_microbatches([build_microbatch([0], ids, masks, cfg)], 3, cfg)
    assert [mb.is_padding for mb in mbs] == [False, True, True]
    with pytest.raises(ValueError, match="MAX over ranks"):
        pad_microbatches(mbs, 2, cfg)


def test_microbatch_rejects_inconsistent_metadata():
    cfg = PackLimits(max_tokens_per_microbatch=8, pad_multiple=4)
    ids, masks = fake_samples([3, 2])
    mb = build_microbatch([0, 1], ids, masks, cfg)
    with pytest.raises(ValueError, match="rise strictly from 0 to T"):
        replace(mb, cu_seqlens_S=torch.tensor([0, 3, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        replace(mb, cu_seqlens_S=mb.cu_seqlens_S.long())
    with pytest.raises(ValueError, match="sample_index_T does not match"):
        replace(mb, sample_index_T=mb.sample_index_T.flip(0))
    with pytest.raises(ValueError, match="restart at 0"):
        replace(mb, position_ids_3T=torch.arange(8).expand(3, 8))
    with pytest.raises(ValueError, match="max_seqlen"):
        replace(mb, max_seqlen=5)
    with pytest.raises(ValueError, match="loss mask False"):
        replace(mb, loss_mask_T=torch.ones(8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"2 token ids and 3 mask entries"):
        build_microbatch([0], [[1, 2]], [[1, 1, 0]], cfg)


def test_per_token_fields_and_next_token_targets():
    cfg = PackLimits(max_tokens_per_microbatch=8, pad_multiple=4)
    ids = [torch.tensor([10, 11, 12]), torch.tensor([20, 21])]
    masks = [torch.tensor([0, 1, 1]), torch.tensor([1, 1])]
    mb = build_microbatch([1, 0], ids, masks, cfg)
    lp = [torch.tensor([-0.1, -0.2, -0.3]), torch.tensor([-1.0, -2.0])]
    assert pack_per_token(mb, lp, fill=0.0).tolist() == pytest.approx([-1.0, -2.0, -0.1, -0.2, -0.3, 0, 0, 0])
    labels, label_mask = next_token_targets(mb)
    # position t predicts token t+1 of the same segment; each segment's last position predicts nothing
    assert labels.tolist() == [21, 0, 11, 12, 0, 0, 0, 0]
    assert label_mask.tolist() == [True, False, True, True, False, False, False, False]
    assert shift_within_samples(torch.arange(4), torch.tensor([0, 4], dtype=torch.int32), -1).tolist() == [1, 2, 3, -1]
    with pytest.raises(ValueError, match="sample 0"):
        pack_per_token(mb, [torch.zeros(2), torch.zeros(2)])


# ---------------------------------------------------------------- agreeing on the count across ranks

def _rank_packs_its_own_samples(lengths_by_rank, budget):
    """Each rank packs only its own samples, agrees on the count by MAX all-reduce, pads."""
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        rank = int(os.environ["RANK"])
        cfg = PackLimits(max_tokens_per_microbatch=budget, pad_multiple=2)
        lengths = lengths_by_rank[rank]
        plan = plan_step(lengths, 1, cfg)
        ids, masks = fake_samples(lengths, seed=rank)
        mbs = build_rank_microbatches(plan, 0, ids, masks, cfg)
        count = equalize_microbatch_counts(len(mbs))
        mbs = pad_microbatches(mbs, count, cfg)
        return len(plan.microbatches[0]), count, [mb.is_padding for mb in mbs]
    finally:
        dist.destroy_process_group()


def test_equalize_microbatch_counts_over_two_gloo_ranks():
    # rank 0: 3 micro-batches of 10 tokens; rank 1: one
    out = run_ranks(_rank_packs_its_own_samples, 2, [[9, 9, 9], [4]], 10, timeout=120)
    assert out == [(3, 3, [False, False, False]), (1, 3, [False, True, True])]


def test_equalize_without_process_group_is_local():
    assert equalize_microbatch_counts(4) == 4
    with pytest.raises(ValueError):
        equalize_microbatch_counts(-1)


def test_lists_convert_exactly_as_numpy_does_and_odd_values_take_numpys_path():
    """``as_1d``'s one-pass list conversion (the rollout's lists) gives numpy's values and dtypes;
    values it cannot take (floats among ids, masks outside 0-255, numpy scalars) go through numpy."""
    from megatron_grpo.packing import as_1d

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 2**40, 5000).tolist() + [-(2**63), 2**63 - 1]
    mask = rng.integers(0, 2, 5000).tolist()
    lp = (-np.abs(rng.normal(size=5000))).tolist() + [0.0, -1e-45, -3.4e38, 1e-320]
    cases = [(ids, torch.int64, np.int64), (mask, torch.bool, np.bool_), (lp, torch.float32, np.float32),
             ([True, False, True], torch.int64, np.int64), ([0, 1, 2, -1, 300], torch.bool, np.bool_),
             ([1.0, 2.0], torch.int64, np.int64), ([0, -1, 3], torch.float32, np.float32),
             ([np.int64(7), np.int64(-2)], torch.int64, np.int64), ([], torch.float32, np.float32),
             ([], torch.bool, np.bool_)]
    for values, dtype, np_dtype in cases:
        got = as_1d(values, dtype)
        want = torch.from_numpy(np.asarray(values, dtype=np_dtype)).to(dtype)
        assert got.dtype == dtype and got.shape == want.shape, (values[:3], dtype)
        assert torch.equal(got, want), (values[:3], dtype)
    with pytest.raises(ValueError, match="input ids of sample 3 must be 1-D"):
        as_1d([[1, 2], [3, 4]], torch.int64, "input ids of sample 3")
