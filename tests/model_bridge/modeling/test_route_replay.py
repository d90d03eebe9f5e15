"""model_bridge/modeling/route_replay.py at one router: replayed tokens go to exactly the given
experts, the others keep the router's own top-k; gate weights and the router weight's gradient equal
a reference computed by hand from the same fixed ids; record mode returns the router's own choice.
Both routers: megatron-core's ``TopKRouter`` and the torch backend's ``ReusingTopKRouter``."""
from __future__ import annotations

import torch

from model_bridge.spawn import run_ranks


def _router_case(pre_softmax: bool) -> dict:
    """One router config: replay, a hand-made reference with the same ids, record mode."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    from model_bridge.modeling.route_replay import RouteReplay, replay_scope
    from model_bridge.modeling.router import ReusingTopKRouter

    E, k, T, h, L = 8, 2, 12, 16, 3
    out = {}
    cfg = TransformerConfig(num_layers=L, hidden_size=h, num_attention_heads=1, num_moe_experts=E,
                            moe_router_topk=k, moe_router_load_balancing_type="none",
                            moe_router_pre_softmax=pre_softmax,
                            use_cpu_initialization=True)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(T, 1, h, generator=g)
    ids_TLK = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T * L)]).view(T, L, k)
    ids_TLK[[3, T - 1]] = -1  # tokens without rows (a sample's last token, padding)
    c_TE = torch.randn(T, E, generator=g)
    for name, cls in (("megatron", TopKRouter), ("ours", ReusingTopKRouter)):
        router = TopKRouter(config=cfg, pg_collection=get_default_pg_collection())
        router.__class__ = cls
        router.set_layer_number(2)
        torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(5))
        router.train()
        own = router(x0)[1].detach()
        router.zero_grad()
        rp = RouteReplay(ids_TLK)
        x = x0.clone().requires_grad_()
        with replay_scope(rp):
            probs, rmap = router(x)
        (probs * c_TE).sum().backward()
        # reference: the same ids by hand, from the router's own gate logits
        g_replay = router.weight.grad.clone()
        router.zero_grad()
        logits = router.gating(x0).view(T, E)
        rows = ids_TLK[:, 1]
        own_idx = torch.topk(logits.detach(), k, dim=1).indices
        idx = torch.where((rows >= 0).all(1, keepdim=True), rows, own_idx)
        if pre_softmax:
            p = torch.softmax(logits, -1).gather(1, idx)
        else:
            p = torch.softmax(logits.gather(1, idx), -1)
        (torch.zeros(T, E).scatter(1, idx, p) * c_TE).sum().backward()
        want_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, idx, True)
        # record mode: the router's own choice, written at this layer's rows
        rec = RouteReplay(record=True, num_tokens=T, num_layers=L, topk=k)
        with replay_scope(rec):
            router(x0)
        got_rec = rec.recorded()[:, 1].long().sort(1).values
        out[f"{name} router, pre_softmax={pre_softmax}"] = {"map_ok": bool((rmap == want_map).all()),
                     "probs_err": float((probs - torch.zeros(T, E).scatter(1, idx, p.detach())).abs().max()),
                     "grad_err": float((g_replay - router.weight.grad).abs().max() / router.weight.grad.abs().max()),
                     "grad_max": float(g_replay.abs().max()),
                     "counts": rp.counts(),
                     "own_differs": int((own != want_map).any(1).sum()),
                     "record_ok": bool((got_rec == own.nonzero()[:, 1].view(T, k)).all()),
                     "record_other_layers": int((rec.recorded()[:, [0, 2]] != -1).sum()),
                     "agree_want": int(((own == want_map).all(1) & (rows >= 0).all(1)).sum())}
    return out


def _rank_replay() -> dict:
    from model_bridge.modeling.router import install_routing_reuse
    from model_bridge.parallel import destroy_parallel, init_parallel

    init_parallel(seed=1)
    install_routing_reuse()
    try:
        return {**_router_case(False), **_router_case(True)}
    finally:
        destroy_parallel()


def test_replay_routes_exactly_and_router_learns():
    res = run_ranks(_rank_replay, 1, timeout=300)[0]
    assert len(res) == 4
    for name, r in res.items():
        where = f"{name}: {r}"
        assert r["map_ok"] and r["own_differs"] >= 8, where  # the replay changed most tokens' experts
        assert r["probs_err"] < 1e-6 and r["grad_err"] < 1e-5 and r["grad_max"] > 0, where
        assert r["counts"] == {"pairs": 12.0, "rows": 10.0, "agree": float(r["agree_want"])}, where
        assert r["record_ok"] and r["record_other_layers"] == 0, where


def test_replay_over_the_fused_routing_kernel_interpreted():
    """The same with the torch backend's router on its fused routing kernel (Triton's interpreter):
    the replay starts from the kernel's own routing and must still route and learn exactly."""
    from megatron_grpo.testing.interpreted import run_interpreted
    from model_bridge.modeling.routing import _kernels

    res = run_interpreted(_kernels, _rank_replay, timeout=300)
    for name, r in res.items():
        where = f"{name}: {r}"
        assert r["map_ok"] and r["own_differs"] >= 8, where
        assert r["probs_err"] < 1e-6 and r["grad_err"] < 1e-5 and r["grad_max"] > 0, where
        assert r["counts"] == {"pairs": 12.0, "rows": 10.0, "agree": float(r["agree_want"])}, where
        assert r["record_ok"] and r["record_other_layers"] == 0, where
