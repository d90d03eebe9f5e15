"""model_bridge/modeling/router.py: the aux loss reuses the routing's top-k, and nothing changes;
with the fused routing kernel (Triton's interpreter on CPU, the GPU) the same routing, and the
probabilities and gradients to a few fp32 ulps."""
from __future__ import annotations

import pytest
import torch

from model_bridge.spawn import run_ranks
from megatron_grpo.testing.interpreted import run_interpreted

_FUSED_EPS = 16.0
"""Largest difference of the fused routing's probabilities (of each value) and logits gradient (of
the largest), in fp32 epsilons: its exp and sum order are not torch's (test_routing.py)."""


def _rank_router(E: int, k: int, T: int, ties: bool, pre_softmax: bool = False, scaling=None,
                 device: str = "cpu") -> dict:
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    from model_bridge.modeling.router import ReusingTopKRouter, install_routing_reuse
    from model_bridge.parallel import destroy_parallel, init_parallel

    init_parallel(seed=1)
    install_routing_reuse()  # what the torch backend's spec does
    try:
        cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1, num_moe_experts=E,
                                moe_router_topk=k, moe_router_load_balancing_type="aux_loss",
                                moe_aux_loss_coeff=0.01, moe_router_pre_softmax=pre_softmax,
                                moe_router_topk_scaling_factor=scaling, use_cpu_initialization=True)
        g = torch.Generator().manual_seed(0)
        logits0 = (torch.randn(T, 1, E, generator=g) * 3).to(device)
        if ties:  # the k-th and (k+1)-th best logit equal in every token: the tie-break decides
            top = logits0.sort(-1, descending=True)
            logits0.scatter_(-1, top.indices[..., k:k + 1], top.values[..., k - 1:k])
        calls = {"n": 0, "softmax": 0}
        orig_topk, orig_softmax = torch.topk, torch.softmax

        def counting_topk(*a, **kw):
            calls["n"] += 1
            return orig_topk(*a, **kw)

        def counting_softmax(*a, **kw):
            calls["softmax"] += 1
            return orig_softmax(*a, **kw)

        out = {}
        for name, cls in (("megatron", TopKRouter), ("ours", ReusingTopKRouter)):
            router = TopKRouter(config=cfg, pg_collection=get_default_pg_collection()).to(device)
            router.__class__ = cls
            router.train()
            logits = logits0.clone().requires_grad_()
            calls["n"] = calls["softmax"] = 0
            logged = []  # what both routings hand megatron's tracker and autoscaler: the aux loss
            attach = router.attach_and_log_load_balancing_loss

            def capture(activation, coeff, aux_loss, *a, attach=attach, logged=logged, **kw):
                logged.append((float(coeff), float(aux_loss.detach()), a[0], kw.get("valid_token_count")))
                return attach(activation, coeff, aux_loss, *a, **kw)

            router.attach_and_log_load_balancing_loss = capture
            torch.topk, torch.softmax = counting_topk, counting_softmax
            try:
                probs, rmap = router.routing(logits)
            finally:
                torch.topk, torch.softmax = orig_topk, orig_softmax
            # the aux loss adds its gradient
            (probs * torch.arange(E, dtype=probs.dtype, device=device)).sum().backward()
            out[name] = {"probs": probs.detach().cpu(), "map": rmap.cpu(), "grad": logits.grad.cpu(),
                         "topk_calls": calls["n"], "softmax_calls": calls["softmax"], "logged": logged}
        m, o = out["megatron"], out["ours"]
        [(mc, ma, mn, mv)], [(oc, oa, on, ov)] = m["logged"], o["logged"]  # one aux loss each
        return {"probs_equal": torch.equal(m["probs"], o["probs"]), "map_equal": torch.equal(m["map"], o["map"]),
                "probs_eps": float(((m["probs"] - o["probs"]).abs() / m["probs"].abs().clamp_min(1e-30)).max())
                / torch.finfo(torch.float32).eps,
                "grad_max_diff": float((m["grad"] - o["grad"]).abs().max()),
                "grad_scale": float(m["grad"].abs().max()),
                "topk_calls": (m["topk_calls"], o["topk_calls"]),
                "softmax_calls": (m["softmax_calls"], o["softmax_calls"]),
                "aux_same_call": (mc, mn, mv) == (oc, on, ov), "aux": (ma, oa),
                "aux_eps": abs(ma - oa) / abs(ma) / torch.finfo(torch.float32).eps}
    finally:
        destroy_parallel()


def test_reusing_router_matches_megatron_with_one_topk():
    """No ties: the same probabilities, routing map and logits gradient (the aux loss's included),
    bit for bit, with one top-k instead of two."""
    res = run_ranks(_rank_router, 1, 8, 2, 37, False, timeout=300)[0]
    assert res["topk_calls"] == (2, 1)
    assert res["probs_equal"] and res["map_equal"] and res["grad_max_diff"] == 0.0, res
    assert res["aux_same_call"] and res["aux"][0] == res["aux"][1], res


def test_reusing_router_with_ties_counts_the_experts_tokens_were_sent_to():
    """Exact ties at the k-th place: routing unchanged; the aux-loss gradient may differ only by
    megatron's second tie-break (bounded by the aux loss's own scale, coefficient 0.01)."""
    res = run_ranks(_rank_router, 1, 8, 2, 37, True, timeout=300)[0]
    assert res["topk_calls"] == (2, 1)
    assert res["probs_equal"] and res["map_equal"], res
    assert res["grad_max_diff"] <= 0.01 * res["grad_scale"] + 1e-3, res


def _rank_router_fused(device: str) -> list:
    """:func:`_rank_router` in the cases of the fused kernel: without and with pre-softmax (and a
    scaling factor), a non-power-of-two expert count."""
    return [_rank_router(8, 2, 37, False, device=device),
            _rank_router(60, 4, 37, False, pre_softmax=True, scaling=2.5, device=device)]


def _check_fused(res: list) -> None:
    for r in res:
        # megatron two top-k calls; ours none (the fused kernel selects, the aux loss reuses it),
        # and no softmax either (the aux loss's scores are summed in the same kernel)
        assert r["topk_calls"] == (2, 0) and r["softmax_calls"][0] >= 1 and r["softmax_calls"][1] == 0, r
        assert r["map_equal"] and r["probs_eps"] <= _FUSED_EPS, r
        assert r["grad_max_diff"] <= _FUSED_EPS * torch.finfo(torch.float32).eps * r["grad_scale"], r
        # the load-balancing loss from the fused kernels: megatron's value (its sum order is
        # not torch's), logged and attached with megatron's arguments
        assert r["aux_same_call"] and r["aux_eps"] <= _FUSED_EPS, r


def test_reusing_router_with_the_fused_routing_matches_megatron_interpreted():
    """The fused routing kernel under ReusingTopKRouter: the same routing map as megatron's
    TopKRouter, probabilities, logits gradient and the aux loss (computed in the same kernels)
    to a few fp32 ulps, and no top-k left."""
    from model_bridge.modeling.routing import _kernels

    _check_fused(run_interpreted(_kernels, _rank_router_fused, "cpu", timeout=300))


@pytest.mark.gpu
def test_reusing_router_with_the_fused_routing_matches_megatron_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check_fused(run_ranks(_rank_router_fused, 1, "cuda", timeout=300)[0])
