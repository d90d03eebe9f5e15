"""Group advantages: GRPO / Dr.GRPO against plain-Python references, degenerate groups, DAPO filter."""
from __future__ import annotations

import statistics

import pytest
import torch

from megatron_grpo.algo.advantages import (ADV_STD_EPS, Advantages, broadcast_to_tokens, compute_advantages,
                                           dapo_keep_mask, dr_grpo_advantages, group_stats, grpo_advantages)


def _reference(rewards, groups, use_std):
    out = []
    for r, g in zip(rewards, groups):
        members = [x for x, h in zip(rewards, groups) if h == g]
        mean = sum(members) / len(members)
        if max(members) == min(members):
            out.append(0.0)
        elif use_std:
            out.append((r - mean) / (statistics.stdev(members) + ADV_STD_EPS))
        else:
            out.append(r - mean)
    return out


def test_grpo_hand_computed():
    # group 7: rewards 1, 0 -> mean 0.5, stdev sqrt(0.5); group 3: 0.2, 0.4, 0.9
    rewards = torch.tensor([1.0, 0.0, 0.2, 0.4, 0.9])
    groups = torch.tensor([7, 7, 3, 3, 3])
    adv = grpo_advantages(rewards, groups)
    s = 0.5 ** 0.5
    assert adv[:2].tolist() == pytest.approx([0.5 / (s + 1e-6), -0.5 / (s + 1e-6)], rel=1e-6)
    mean3, std3 = 0.5, statistics.stdev([0.2, 0.4, 0.9])
    assert adv[2:].tolist() == pytest.approx([(x - mean3) / (std3 + 1e-6) for x in (0.2, 0.4, 0.9)], rel=1e-6)
    assert adv.dtype == rewards.dtype


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_against_reference_with_unsorted_group_ids(seed):
    g = torch.Generator().manual_seed(seed)
    groups = torch.randint(0, 5, (40,), generator=g) * 13 - 20  # negative, sparse, interleaved ids
    rewards = torch.rand(40, generator=g, dtype=torch.float64).round(decimals=1)  # some ties
    for fn, use_std in ((grpo_advantages, True), (dr_grpo_advantages, False)):
        ref = _reference(rewards.tolist(), groups.tolist(), use_std)
        assert fn(rewards, groups).tolist() == pytest.approx(ref, rel=1e-9, abs=1e-12)


def test_group_means_are_zero():
    g = torch.Generator().manual_seed(3)
    rewards = torch.rand(32, generator=g)
    groups = torch.arange(32) // 8
    for adv in (grpo_advantages(rewards, groups), dr_grpo_advantages(rewards, groups)):
        assert adv.view(4, 8).sum(1).abs().max() < 1e-5


def test_degenerate_groups_give_exact_zeros():
    # 0.1 three times: the float mean is not exactly 0.1, yet the advantages must be exactly 0
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.7])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])  # group 2 has a single sample
    for adv in (grpo_advantages(rewards, groups), dr_grpo_advantages(rewards, groups)):
        assert adv[[0, 1, 2, 5]].tolist() == [0.0, 0.0, 0.0, 0.0]
        assert adv[3] > 0 > adv[4]
    s = group_stats(rewards, groups)
    assert s.spread_N.tolist() == pytest.approx([0, 0, 0, 1, 1, 0])
    assert s.size_N.tolist() == [3, 3, 3, 2, 2, 1] and s.std_N[5] == 0


def test_dapo_filter_drops_zero_variance_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.52])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    assert dapo_keep_mask(rewards, groups).tolist() == [False, False, False, False, True, True, True, True]
    assert dapo_keep_mask(rewards, groups, min_spread=0.05).tolist()[-2:] == [False, False]
    out = compute_advantages(rewards, groups, "dapo")
    assert out.keep_N.tolist() == [False] * 4 + [True] * 4
    assert torch.equal(out.values_N, grpo_advantages(rewards, groups))
    with pytest.raises(ValueError, match="min_spread"):
        dapo_keep_mask(rewards, groups, min_spread=-1)


def test_compute_advantages_dispatch():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 1, 1])
    grpo = compute_advantages(rewards, groups, "grpo")
    dr = compute_advantages(rewards, groups, "dr_grpo")
    assert grpo.keep_N.all() and dr.keep_N.all()
    assert dr.values_N.tolist() == [0.5, -0.5, 0.0, 0.0]
    assert grpo.values_N[0] == pytest.approx(0.5 / (0.5 ** 0.5 + 1e-6))
    with pytest.raises(ValueError, match="unknown variant"):
        compute_advantages(rewards, groups, "ppo")


def test_input_checks():
    with pytest.raises(ValueError, match=r"not finite"):
        grpo_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match=r"\[N\]"):
        grpo_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        grpo_advantages(torch.zeros(3), torch.zeros(3))
    with pytest.raises(TypeError, match="floating"):
        grpo_advantages(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="keep_N"):
        Advantages(torch.zeros(3), torch.ones(2, dtype=torch.bool))


def test_broadcast_to_tokens():
    values = torch.tensor([0.5, -1.0, 2.0])
    idx = torch.tensor([2, 2, 0, 0, 0, -1, -1])
    assert broadcast_to_tokens(values, idx).tolist() == [2.0, 2.0, 0.5, 0.5, 0.5, 0.0, 0.0]
    assert broadcast_to_tokens(values, idx, fill=9.0).tolist()[-1] == 9.0
    with pytest.raises(IndexError, match="sample 3"):
        broadcast_to_tokens(values, torch.tensor([3]))
