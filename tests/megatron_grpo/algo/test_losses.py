"""Policy losses: a hand-computed case, a per-token Python-loop reference, micro-batch split
invariance of loss, gradients and metrics, KL estimators, numerical safety, config checks."""
from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_grpo.algo.kl import kl_estimate
from megatron_grpo.algo.losses import LossConfig, metric_reduce_op, policy_loss, reduce_metrics

VARIANTS = {
    "grpo": LossConfig(variant="grpo", eps_low=0.2),
    "dapo": LossConfig(variant="dapo", eps_low=0.2, eps_high=0.28),
    "dr_grpo": LossConfig(variant="dr_grpo", eps_low=0.2, max_response_len=16),
}
FULL = {  # every optional term switched on
    "grpo": LossConfig(variant="grpo", eps_low=0.2, kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01,
                       dual_clip_c=1.5),
    "dapo": LossConfig(variant="dapo", eps_low=0.2, eps_high=0.28, kl_coef=0.1, kl_estimator="k1",
                       entropy_coef=0.02, dual_clip_c=2.5),
    "dr_grpo": LossConfig(variant="dr_grpo", eps_low=0.1, kl_coef=0.2, kl_estimator="k2",
                          max_response_len=16, entropy_coef=0.01),
}


# ---------------------------------------------------------------- reference (explicit loops)

def reference_loss(cfg, samples, n_tokens, n_samples):
    """Per-token loop over samples as torch scalars, so autograd gives the reference gradient.

    ``samples``: list of dicts with per-token lists/leaf tensors ``logp, old, mask, ref, w, ent`` and a
    scalar ``adv``.
    """
    total = torch.zeros((), dtype=torch.float64)
    for s in samples:
        terms = []
        for t in range(len(s["mask"])):
            if not s["mask"][t]:
                continue
            ratio = torch.exp(s["logp"][t] - s["old"][t])
            A = s["adv"]
            r_clip = min(max(ratio.item(), 1 - cfg.eps_low), 1 + cfg.eps_high)
            unclipped, clipped = ratio * A, r_clip * A
            pg = -(unclipped if unclipped.item() <= clipped else torch.tensor(clipped, dtype=torch.float64))
            if cfg.dual_clip_c is not None and A < 0 and pg.item() > -cfg.dual_clip_c * A:
                pg = torch.tensor(-cfg.dual_clip_c * A, dtype=torch.float64)
            l_t = pg * s["w"][t]
            if cfg.kl_coef:
                d = s["logp"][t] - s["ref"][t]
                kl = {"k1": d, "k2": 0.5 * d * d, "k3": torch.exp(-d) + d - 1}[cfg.kl_estimator]
                l_t = l_t + cfg.kl_coef * kl
            if cfg.entropy_coef:
                l_t = l_t - cfg.entropy_coef * s["ent"][t]
            terms.append(l_t)
        if not terms:
            continue
        if cfg.variant == "grpo":
            total = total + sum(terms) / len(terms) / n_samples
        elif cfg.variant == "dapo":
            total = total + sum(terms) / n_tokens
        else:
            total = total + sum(terms) / (cfg.max_response_len * n_samples)
    return total


def make_samples(seed, n=7, max_len=9, scale=0.6):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = rng.randint(1, max_len)
        old = -torch.rand(L, generator=g, dtype=torch.float64) * 3
        mask = [rng.random() < 0.75 for _ in range(L)]
        if i == 2:
            mask = [False] * L  # a sample without loss tokens
        out.append(dict(
            id=100 + 3 * i,  # sparse global ids
            logp=(old + torch.randn(L, generator=g, dtype=torch.float64) * scale).requires_grad_(),
            old=old, mask=mask, adv=rng.choice([-1.5, -0.3, 0.0, 0.4, 2.0]),
            ref=old + torch.randn(L, generator=g, dtype=torch.float64) * 0.3,
            w=torch.rand(L, generator=g, dtype=torch.float64) * 2,
            ent=(torch.rand(L, generator=g, dtype=torch.float64) * 4).requires_grad_()))
    return out


def flatten(samples, pad=0):
    """Concatenate samples (then ``pad`` padding tokens) into the flat [T] inputs of policy_loss."""
    cat = lambda k: torch.cat([s[k] for s in samples] + [torch.zeros(pad, dtype=torch.float64)])  # noqa: E731
    return dict(
        logprobs_T=cat("logp"), old_logprobs_T=cat("old"),
        advantages_T=torch.cat([torch.full((len(s["mask"]),), s["adv"], dtype=torch.float64) for s in samples]
                               + [torch.zeros(pad, dtype=torch.float64)]),
        loss_mask_T=torch.tensor([m for s in samples for m in s["mask"]] + [False] * pad, dtype=torch.bool),
        sample_index_T=torch.tensor([s["id"] for s in samples for _ in s["mask"]] + [-1] * pad),
        ref_logprobs_T=cat("ref"), is_weights_T=cat("w"), entropy_T=cat("ent"))


def counts(samples):
    return sum(sum(s["mask"]) for s in samples), len(samples)


def grads(samples, loss):
    leaves = [s[k] for s in samples for k in ("logp", "ent")]
    gs = torch.autograd.grad(loss, leaves, allow_unused=True)  # a sample without loss tokens: unused
    return torch.cat([(torch.zeros_like(x) if g is None else g).flatten() for g, x in zip(gs, leaves)])


# ---------------------------------------------------------------- hand-computed tiny case

def _tiny(cfg):
    """2 samples, 3 tokens: sample 0 = tokens 0, 1 (A = +1), sample 1 = token 2 (A = -2).
    Ratios 1.5, 0.5, 1.1 (old logprob -1 everywhere)."""
    old = torch.full((3,), -1.0, dtype=torch.float64)
    logp = (old + torch.log(torch.tensor([1.5, 0.5, 1.1], dtype=torch.float64))).requires_grad_()
    loss, m = policy_loss(logp, old, torch.tensor([1.0, 1.0, -2.0], dtype=torch.float64),
                          torch.tensor([True, True, True]), torch.tensor([0, 0, 1]), config=cfg,
                          global_num_tokens=3, global_num_samples=2)
    (g,) = torch.autograd.grad(loss, logp)
    return loss.item(), g.tolist(), m


def test_hand_computed_grpo():
    # pg = [-min(1.5, 1.2), -min(0.5, 0.8), -min(-2.2, -2.2)] = [-1.2, -0.5, 2.2]
    # L = ((-1.2 - 0.5) / 2 + 2.2 / 1) / 2 = 0.675
    # dL/dlogp = -A * ratio / (|o_i| * N) on unclipped tokens: [0, -0.5/4, 2.2/2]
    loss, g, m = _tiny(VARIANTS["grpo"])
    assert loss == pytest.approx(0.675, abs=1e-12)
    assert g == pytest.approx([0.0, -0.125, 1.1], abs=1e-12)
    assert m["clip_frac_high"].item() == pytest.approx(1 / 3) and m["clip_frac_low"].item() == 0
    assert m["ratio_max"].item() == pytest.approx(1.5) and m["ratio_min"].item() == pytest.approx(0.5)
    assert m["ratio_mean"].item() == pytest.approx(3.1 / 3) and m["tokens"].item() == 3


def test_hand_computed_dapo():
    # clip-higher 1.28: pg = [-1.28, -0.5, 2.2], L = 0.42 / 3 = 0.14; grads -A*ratio/3
    loss, g, _ = _tiny(VARIANTS["dapo"])
    assert loss == pytest.approx(0.14, abs=1e-12)
    assert g == pytest.approx([0.0, -0.5 / 3, 2.2 / 3], abs=1e-12)


def test_hand_computed_dr_grpo():
    # pg = [-1.2, -0.5, 2.2], L = 0.5 / (16 * 2) = 0.015625; grads -A*ratio/32
    loss, g, _ = _tiny(VARIANTS["dr_grpo"])
    assert loss == pytest.approx(0.5 / 32, abs=1e-12)
    assert g == pytest.approx([0.0, -0.5 / 32, 2.2 / 32], abs=1e-12)


# ---------------------------------------------------------------- reference comparison

@pytest.mark.parametrize("name", sorted(FULL))
@pytest.mark.parametrize("full", [False, True], ids=["plain", "kl+ent+is+dual"])
def test_matches_loop_reference(name, full):
    cfg = (FULL if full else VARIANTS)[name]
    seen = {"clip_frac_low": 0.0, "clip_frac_high": 0.0, "dual_clip_frac": 0.0}
    for seed in range(3):
        samples = make_samples(seed)
        n_tok, n_samp = counts(samples)
        inputs = flatten(samples, pad=3)
        if not full:
            inputs.update(ref_logprobs_T=None, is_weights_T=None, entropy_T=None)
            for s in samples:
                s["w"] = torch.ones_like(s["w"])
        loss, metrics = policy_loss(**inputs, config=cfg, global_num_tokens=n_tok, global_num_samples=n_samp)
        ref = reference_loss(cfg, samples, n_tok, n_samp)
        assert loss.item() == pytest.approx(ref.item(), rel=1e-10, abs=1e-12)
        torch.testing.assert_close(grads(samples, loss), grads(samples, ref), rtol=1e-9, atol=1e-12)
        assert metrics["loss"].item() == pytest.approx(loss.item())
        assert metrics["tokens"].item() == n_tok
        for k in seen:
            seen[k] += metrics.get(k, torch.tensor(0.0)).item()
    # the random cases exercise both clip sides (and the dual clip when it is on)
    assert seen["clip_frac_low"] > 0 and seen["clip_frac_high"] > 0
    assert (seen["dual_clip_frac"] > 0) == (cfg.dual_clip_c is not None)


# ---------------------------------------------------------------- micro-batch split invariance

def _split(samples, rng):
    order = samples[:]
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, len(order)), 2))
    return [order[:cuts[0]], order[cuts[0]:cuts[1]], [], order[cuts[1]:]]  # [] = an empty padding micro-batch


@pytest.mark.parametrize("name", sorted(FULL))
def test_split_into_microbatches_sums_to_full_batch(name):
    cfg = FULL[name]
    for seed in range(3):
        samples = make_samples(seed, n=9)
        n_tok, n_samp = counts(samples)
        norms = dict(config=cfg, global_num_tokens=n_tok, global_num_samples=n_samp)
        whole, whole_m = policy_loss(**flatten(samples), **norms)
        parts, parts_m = [], []
        for mb in _split(samples, random.Random(seed)):
            loss, m = policy_loss(**flatten(mb, pad=2), **norms)
            parts.append(loss)
            parts_m.append(m)
        total = sum(parts)
        assert total.item() == pytest.approx(whole.item(), rel=1e-12, abs=1e-14)
        torch.testing.assert_close(grads(samples, total), grads(samples, whole), rtol=1e-10, atol=1e-14)
        reduced = reduce_metrics(parts_m)
        assert reduced.keys() == whole_m.keys()
        for k, v in whole_m.items():
            assert reduced[k].item() == pytest.approx(v.item(), rel=1e-10, abs=1e-14), k


def test_padding_only_microbatch_has_zero_loss_and_gradient():
    logp = torch.zeros(4, requires_grad=True)
    for cfg in VARIANTS.values():
        loss, m = policy_loss(logp, torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.bool),
                              torch.full((4,), -1), config=cfg, global_num_tokens=10, global_num_samples=2)
        assert loss.item() == 0.0 and m["tokens"].item() == 0
        (g,) = torch.autograd.grad(loss, logp)
        assert torch.equal(g, torch.zeros(4))
        assert m["ratio_max"].item() == -math.inf and m["ratio_min"].item() == math.inf  # reduction identities


# ---------------------------------------------------------------- pieces and safety

def test_kl_estimators_by_hand():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    ref = torch.tensor([-1.0, -1.0, -1.5], dtype=torch.float64)
    d = [0.0, -1.0, 1.0]
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx(d)
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.5 * x * x for x in d])
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([math.exp(-x) + x - 1 for x in d])
    assert (kl_estimate(torch.randn(50), torch.randn(50), "k3") >= 0).all()
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(logp, ref, "k4")


def test_k3_near_the_reference_keeps_its_sign_and_value():
    """|log r| ~ 1e-4 (a rollout engine against the trainer): fp32's exp(x) - 1 - x would make ~1
    token in 10 negative and the mean of the wrong sign; the estimate stays >= 0 and on float64's."""
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(100_000, generator=g) * 1e-4
    ref = torch.zeros_like(logp)
    k3 = kl_estimate(logp, ref, "k3")
    exact = torch.exp(-logp.double()) + logp.double() - 1.0
    assert k3.dtype == torch.float32 and (k3 >= 0).all()
    assert k3.double().mean().item() == pytest.approx(exact.mean().item(), rel=1e-5)
    assert (k3.double() - exact).abs().max().item() < 1e-10


def test_is_weights_scale_the_policy_gradient_only():
    cfg = LossConfig(variant="dapo", kl_coef=0.1)
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    args = (logp, logp.detach() - 0.05, torch.tensor([1.0, -1.0]), torch.tensor([True, True]), torch.tensor([0, 1]))
    kw = dict(config=cfg, global_num_tokens=2, global_num_samples=2, ref_logprobs_T=torch.tensor([-1.5, -1.5]))
    _, m1 = policy_loss(*args, **kw)
    _, m2 = policy_loss(*args, **kw, is_weights_T=torch.tensor([0.5, 0.0]))
    assert m2["pg_loss"].item() == pytest.approx(0.5 * (-1.0 * math.exp(0.05)) / 2)
    assert m1["kl_loss"].item() == pytest.approx(m2["kl_loss"].item())


def test_huge_log_ratio_stays_finite():
    logp = torch.tensor([0.0, 0.0], requires_grad=True)
    old = torch.tensor([-500.0, -1.0])  # ratio e^500 would overflow
    for cfg in (LossConfig(variant="dapo"), LossConfig(variant="grpo", dual_clip_c=3.0)):
        loss, m = policy_loss(logp, old, torch.tensor([-1.0, 1.0]), torch.tensor([True, True]),
                              torch.tensor([0, 1]), config=cfg, global_num_tokens=2, global_num_samples=2)
        (g,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(g).all() and math.isfinite(m["ratio_max"].item())


def test_bf16_inputs_compute_in_fp32():
    logp = torch.tensor([-1.0, -2.0], dtype=torch.bfloat16, requires_grad=True)
    loss, _ = policy_loss(logp, logp.detach(), torch.tensor([1.0, 1.0]), torch.tensor([True, True]),
                          torch.tensor([0, 0]), config=VARIANTS["grpo"], global_num_tokens=2, global_num_samples=1)
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(-1.0)
    loss.backward()
    assert logp.grad.dtype == torch.bfloat16


def test_metric_reductions():
    assert metric_reduce_op("ratio_max") == "max" and metric_reduce_op("ratio_min") == "min"
    assert metric_reduce_op("clip_frac") == "sum"
    out = reduce_metrics([{"a": torch.tensor(1.0), "x_max": torch.tensor(2.0)},
                          {"a": torch.tensor(2.0), "x_max": torch.tensor(1.0), "b_min": torch.tensor(4.0)}])
    assert {k: v.item() for k, v in out.items()} == {"a": 3.0, "x_max": 2.0, "b_min": 4.0}


def test_config_checks():
    assert LossConfig(variant="dapo").eps_high == 0.28
    assert LossConfig(variant="grpo", eps_low=0.1).eps_high == 0.1
    assert not LossConfig(variant="dr_grpo", max_response_len=8).scale_advantages_by_std
    assert LossConfig(variant="grpo").aggregation == "seq_mean_token_mean"
    bad = [dict(variant="ppo"), dict(eps_low=0.0), dict(eps_low=1.0), dict(eps_high=-0.1),
           dict(dual_clip_c=1.0), dict(kl_coef=-1), dict(kl_estimator="k9"), dict(entropy_coef=float("nan")),
           dict(variant="dr_grpo"), dict(variant="dr_grpo", max_response_len=0)]
    for kw in bad:
        with pytest.raises(ValueError):
            LossConfig(**kw)
    with pytest.raises(ValueError) as ei:  # named as the user types it: `mgrpo train loss.variant=dr_grpo`
        LossConfig(variant="dr_grpo")
    assert str(ei.value) == ("loss.variant=dr_grpo needs loss.max_response_len=N, a positive int: the constant "
                             "that normalises the token sum (the generation budget in tokens), got None")


def test_call_checks():
    z, m, s = torch.zeros(3), torch.ones(3, dtype=torch.bool), torch.zeros(3, dtype=torch.long)
    grpo = VARIANTS["grpo"]
    with pytest.raises(ValueError, match="sample_index_T"):
        policy_loss(z, z, z, m, None, config=grpo, global_num_tokens=3, global_num_samples=1)
    with pytest.raises(ValueError, match="expected T=3"):
        policy_loss(z, torch.zeros(4), z, m, s, config=grpo, global_num_tokens=3, global_num_samples=1)
    with pytest.raises(ValueError, match="global_num_tokens must be > 0"):
        policy_loss(z, z, z, m, s, config=grpo, global_num_tokens=0, global_num_samples=1)
    with pytest.raises(ValueError, match="ref_logprobs_T"):
        policy_loss(z, z, z, m, s, config=LossConfig(kl_coef=0.1), global_num_tokens=3, global_num_samples=1)
    with pytest.raises(ValueError, match="entropy_T"):
        policy_loss(z, z, z, m, s, config=LossConfig(entropy_coef=0.1), global_num_tokens=3, global_num_samples=1)
