"""Rollout-correction IS: TIS truncation, MIS masking at token / sequence / geometric level, metrics."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_grpo.algo.importance import ISConfig, importance_weights
from megatron_grpo.algo.losses import LossConfig, policy_loss, reduce_metrics

# 5 loss tokens of two samples (+ one masked prompt token and one padding token).
# delta = old - rollout = log of the token ratios below.
RATIOS = [1.0, 3.0, 0.25, 1.5, 0.8, 7.0, 1.0]
MASK = torch.tensor([True, True, True, True, True, False, False])
SID = torch.tensor([0, 0, 0, 1, 1, 1, -1])
ROLLOUT = torch.full((7,), -2.0, dtype=torch.float64)
OLD = ROLLOUT + torch.log(torch.tensor(RATIOS, dtype=torch.float64))


def run(**cfg):
    return importance_weights(OLD, ROLLOUT, MASK, SID, config=ISConfig(**cfg))


def test_tis_token_truncates_at_cap():
    out = run(mode="tis", level="token", tis_cap=2.0)
    assert out.weights_T.tolist() == pytest.approx([1.0, 2.0, 0.25, 1.5, 0.8, 0.0, 0.0])
    assert torch.equal(out.keep_mask_T, MASK)
    m = {k: v.item() for k, v in out.metrics.items()}
    assert m["is_truncated_frac"] == pytest.approx(1 / 5)
    assert m["is_ratio_max"] == pytest.approx(3.0) and m["is_ratio_min"] == pytest.approx(0.25)
    assert m["is_ratio_mean"] == pytest.approx((1 + 3 + 0.25 + 1.5 + 0.8) / 5)
    # tokens come from the rollout: k1 = mean(log pi_rollout - log pi_old), k3 = mean(rho - log rho - 1)
    logs = [math.log(r) for r in RATIOS[:5]]
    assert m["mismatch_kl_k1"] == pytest.approx(-sum(logs) / 5)
    assert m["mismatch_kl_k3"] == pytest.approx(sum(r - math.log(r) - 1 for r in RATIOS[:5]) / 5)
    assert not out.weights_T.requires_grad


def test_mis_token_masks_outside_bounds():
    out = run(mode="mis", level="token", mis_low=0.5, mis_high=2.0)
    assert out.keep_mask_T.tolist() == [True, False, False, True, True, False, False]
    assert out.weights_T.tolist() == pytest.approx([1.0, 0.0, 0.0, 1.5, 0.8, 0.0, 0.0])
    assert out.metrics["is_masked_frac"].item() == pytest.approx(2 / 5)
    one_sided = run(mode="mis", level="token", mis_low=0.0, mis_high=2.0)
    assert one_sided.keep_mask_T.tolist() == [True, False, True, True, True, False, False]


def test_sequence_level_uses_the_product():
    # sample 0: 1 * 3 * 0.25 = 0.75; sample 1: 1.5 * 0.8 = 1.2 (its masked token does not count)
    tis = run(mode="tis", level="sequence", tis_cap=1.1)
    assert tis.weights_T.tolist() == pytest.approx([0.75] * 3 + [1.1] * 2 + [0.0, 0.0])
    assert tis.metrics["is_truncated_frac"].item() == pytest.approx(1 / 2)
    assert tis.metrics["is_ratio_mean"].item() == pytest.approx((0.75 + 1.2) / 2)
    mis = run(mode="mis", level="sequence", mis_low=0.8, mis_high=2.0)
    assert mis.keep_mask_T.tolist() == [False] * 3 + [True, True, False, False]
    assert mis.weights_T.tolist() == pytest.approx([0.0] * 3 + [1.2] * 2 + [0.0, 0.0])
    assert mis.metrics["is_masked_frac"].item() == pytest.approx(1 / 2)


def test_geometric_level_uses_the_mean_log_ratio():
    g0, g1 = 0.75 ** (1 / 3), 1.2 ** (1 / 2)
    out = run(mode="tis", level="geometric", tis_cap=1.05)
    assert out.weights_T.tolist() == pytest.approx([g0] * 3 + [1.05] * 2 + [0.0, 0.0])
    assert out.metrics["is_ratio_max"].item() == pytest.approx(g1)


def test_off_gives_unit_weights_and_metrics():
    out = run(mode="off")
    assert out.weights_T.tolist() == [1.0] * 5 + [0.0, 0.0]
    assert "mismatch_kl_k3" in out.metrics and "is_masked_frac" not in out.metrics


def test_huge_sequence_log_ratio_does_not_overflow():
    old = torch.zeros(400)
    rollout = torch.full((400,), -1.0)  # product ratio e^400
    out = importance_weights(old, rollout, torch.ones(400, dtype=torch.bool), torch.zeros(400, dtype=torch.long),
                             config=ISConfig(mode="tis", level="sequence"))
    assert torch.allclose(out.weights_T, torch.full((400,), 2.0))
    assert all(math.isfinite(v.item()) for v in out.metrics.values())


def test_metrics_sum_over_microbatches_with_global_normalisers():
    split = [slice(0, 3), slice(3, 7)]  # the packer never splits a sample
    for level in ("token", "sequence"):
        cfg = ISConfig(mode="mis", level=level)
        whole = importance_weights(OLD, ROLLOUT, MASK, SID, config=cfg)
        parts = [importance_weights(OLD[s], ROLLOUT[s], MASK[s], SID[s], config=cfg, global_num_tokens=5,
                                    global_num_samples=2) for s in split]
        assert torch.equal(torch.cat([p.weights_T for p in parts]), whole.weights_T)
        red = reduce_metrics([p.metrics for p in parts])
        for k, v in whole.metrics.items():
            assert red[k].item() == pytest.approx(v.item()), (level, k)


def test_weights_feed_the_policy_loss():
    out = run(mode="tis", level="token", tis_cap=2.0)
    logp = OLD.clone().requires_grad_()  # on-policy w.r.t. pi_old: ratio 1
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 0.0], dtype=torch.float64)
    loss, _ = policy_loss(logp, OLD, adv, out.keep_mask_T, SID, config=LossConfig(variant="dapo"),
                          global_num_tokens=5, global_num_samples=2, is_weights_T=out.weights_T)
    (g,) = torch.autograd.grad(loss, logp)
    assert g.tolist() == pytest.approx([-w * a / 5 for w, a in zip(out.weights_T.tolist(), adv.tolist())])


def test_checks():
    for kw in (dict(mode="both"), dict(level="word"), dict(tis_cap=0.5), dict(mis_low=1.5),
               dict(mis_high=0.9), dict(mis_high=float("inf"))):
        with pytest.raises(ValueError):
            ISConfig(**kw)
    with pytest.raises(ValueError, match="sample_index_T"):
        importance_weights(OLD, ROLLOUT, MASK, None, config=ISConfig(level="sequence"))
    with pytest.raises(ValueError, match="expected T=7"):
        importance_weights(OLD, ROLLOUT[:3], MASK, SID, config=ISConfig())
