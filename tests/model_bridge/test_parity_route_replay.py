"""Routing replay under model parallelism == one rank replaying the same routes: logits, loss and
every gradient (the router's included), on THD-packed micro-batches of several samples with audio
on one data-parallel rank only.

Same checkpoint, micro-batches, losses, gradient reduction and tolerances as
``test_parity_two_ranks.py`` (its module docstring), with every micro-batch's forward replaying fixed
random routes ``[T, layers, top_k]`` (``-1`` at each sample's last token and on padding, where the
router keeps its own top-k). One spawn of two gloo ranks runs the one-rank reference (each rank on
its own, DP 2), then EP2, TP2 + SP and PP2 (two stages: hidden states and their gradient sent over
gloo); a spawn of four runs TP2 x EP2 (expert-TP 1). Checked besides
the parity: the routers routed every token with a row to exactly its experts, the router weights
got non-zero gradients, and the replay counts.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from model_bridge.spawn import run_ranks
from megatron_grpo.testing.grads import grads_by_hf_name
from test_parity_torch_backend import _packed
from test_parity_two_ranks import PRESET, _batches, _reduce_grads_like_megatron, check_against_one_rank

CPU_MAX_WORLD = int(os.environ.get("MGRPO_TEST_CPU_RANKS", "8"))


def _routes(spec, T: int, cu: list[int], b: int) -> torch.Tensor:
    """Fixed random routes of micro-batch ``b``: distinct experts per token and layer, -1 rows at
    each sample's last token and on the padding."""
    L, E, k = spec.text.num_layers, spec.text.num_experts, spec.text.topk
    g = torch.Generator().manual_seed(300 + b)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T * L)]).view(T, L, k).to(torch.int16)
    ids[[c - 1 for c in cu[1:]]] = -1
    ids[cu[-1]:] = -1
    return ids


def _forward_backward(model, ids, pos, psp, feats, flens, routes, w, V):
    """fwd+bwd of one micro-batch under the replay: ``(logits or None off the last stage, loss, scale,
    counts)``; with two pipeline stages the hidden states and their gradient go over gloo."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from model_bridge.modeling.route_replay import RouteReplay, replay_scope
    from model_bridge.modeling.thinker import gather_logits

    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    h_in = None
    if not first:
        h_in = torch.empty(ids.shape[1], 1, model.spec.text.hidden_size)
        dist.recv(h_in, src=ps.get_pipeline_model_parallel_prev_rank())
        h_in.requires_grad_()
        model.set_input_tensor(h_in)
    with replay_scope(RouteReplay(routes)) as rp:
        out = model(ids, pos, psp, audio_features=feats, audio_feature_lens=flens)
    if not last:
        dist.send(out.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        g = torch.empty_like(out)
        dist.recv(g, src=ps.get_pipeline_model_parallel_next_rank())
        out.backward(g)
        return None, None, None, rp.counts()
    logits = gather_logits(out, V)
    prod = logits.float() * w
    loss = prod.sum()
    loss.backward()
    if h_in is not None:
        dist.send(h_in.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())
    return logits, loss.item(), prod.detach().abs().sum().item(), rp.counts()


def _run_layout(hf_dir: str, tp: int, ep: int, etp, n_batches: int, reference: bool, pp: int = 1) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from model_bridge.config import ParallelLayout, read_omni_config
    from model_bridge.load import load_hf
    from model_bridge.modeling.thinker import build_thinker
    from model_bridge.parallel import init_parallel

    init_parallel(tp=tp, ep=ep, etp=etp, pp=pp, seed=1234, timeout_minutes=10)
    spec = read_omni_config(hf_dir)
    V = spec.text.vocab_size
    model = build_thinker(spec, ParallelLayout(tp=tp, ep=ep, etp=etp, pp=pp), torch.float32, backend="torch")
    load_hf(model, hf_dir)
    model.train()
    D, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    res = {"backend": "torch", "rank": dist.get_rank(), "tp_rank": ps.get_tensor_model_parallel_rank(),
           "logits": {}, "loss": {}, "loss_scale": {}, "routing": {}, "exact": True, "counts": []}
    current = {}

    def keep_routing(layer: int):
        def hook(_module, _inp, out):
            current.setdefault(layer, out[1].detach().cpu())
        return hook

    for name, module in model.named_modules():
        if name.endswith("mlp.router"):  # megatron's global layer number: pipeline stages hold their own
            module.register_forward_hook(keep_routing(module.layer_number - 1))
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    for b, samples in enumerate(_batches(spec, n_batches)):
        if not reference and b % D != d:
            continue
        current = res["routing"].setdefault(b, {})
        n = sum(len(s[1]) for s in samples)
        pad = 5 + (n + 5) % 2  # T even: sequence parallelism splits it over 2 ranks
        ids, pos, psp, feats, flens, cu = _packed(samples, spec, pad=pad, device="cpu")
        routes = _routes(spec, ids.shape[1], cu, b)
        w = torch.randn(ids.shape[1], V, generator=torch.Generator().manual_seed(100 + b))
        w[cu[-1]:] = 0.0
        logits, loss, scale, counts = _forward_backward(model, ids, pos, psp, feats, flens, routes, w, V)
        if logits is not None:
            res["logits"][b] = logits.detach()[:cu[-1]].float()
            res["loss"][b], res["loss_scale"][b] = loss, scale
        res["counts"].append(counts)
        # every token with a row went to exactly its experts (this rank's SP slice under TP + SP)
        for layer, map_TE in current.items():
            want = routes[:, layer].long()
            if map_TE.shape[0] != want.shape[0]:
                n_loc = map_TE.shape[0]
                want = want[tp_rank * n_loc:(tp_rank + 1) * n_loc]
            has = (want >= 0).all(1)
            got = map_TE.nonzero()[:, 1].view(map_TE.shape[0], -1)
            res["exact"] &= bool((got[has] == want[has].sort(1).values).all())
    if not reference:
        _reduce_grads_like_megatron(model)
    res["router_grad_max"] = min(float(m.weight.grad.abs().max())
                                 for n, m in model.named_modules() if n.endswith("mlp.router"))
    res["grads"] = grads_by_hf_name(model, spec)
    return res


def _rank_layouts(hf_dir: str, layouts: list, n_batches: int, with_reference: bool) -> dict:
    from model_bridge.parallel import destroy_parallel

    torch.set_num_threads(1)
    out = {}
    try:
        if with_reference:  # the one-rank run: every rank on its own (DP only, no collectives)
            out["one"] = _run_layout(hf_dir, 1, 1, None, n_batches, reference=True)
        for name, tp, ep, etp, *pp in layouts:
            out[name] = _run_layout(hf_dir, tp, ep, etp, n_batches, reference=False, pp=pp[0] if pp else 1)
    finally:
        destroy_parallel()
    return out


@pytest.fixture(scope="module")
def ckpt():
    from conftest import build_cached_tiny

    return build_cached_tiny(PRESET)


def _check(ref: dict, got: list[dict], tp: int, n_batches: int, label: str, t0: float) -> None:
    assert all(g["exact"] for g in got), f"{label}: a token with a row went to other experts"
    assert ref["router_grad_max"] > 0 and all(g["router_grad_max"] > 0 for g in got)
    c = ref["counts"][0]
    assert c["rows"] < c["pairs"] and c["agree"] < c["rows"], c  # random routes: mostly overriding
    check_against_one_rank(ref, got, "cpu", tp, n_batches, f"route replay {label}", t0)


def _merge_stages(stages: list[dict]) -> dict:
    """Two pipeline stages' results as one rank's: the last stage's logits and losses, both
    stages' routing (each its own layers) and gradients."""
    merged = dict(stages[-1], routing={}, grads={}, exact=all(s["exact"] for s in stages),
                  router_grad_max=min(s["router_grad_max"] for s in stages))
    for s in stages:
        for b, layers in s["routing"].items():
            merged["routing"].setdefault(b, {}).update(layers)
        merged["grads"].update(s["grads"])
    return merged


@pytest.mark.slow
def test_replay_two_ranks_ep2_tp2sp_pp2_match_one_rank(ckpt):
    t0 = time.time()
    layouts = [("ep2", 1, 2, None), ("tp2sp", 2, 1, None), ("pp2", 1, 1, None, 2)]
    res = run_ranks(_rank_layouts, 2, str(ckpt), layouts, 2, True, timeout=900)
    ref = res[0]["one"]
    for name, tp, *_ in layouts[:2]:
        _check(ref, [r[name] for r in res], tp, 2, name, t0)
    _check(ref, [_merge_stages([r["pp2"] for r in res])], 1, 2, "pp2", t0)


@pytest.mark.slow
def test_replay_tp2_ep2_matches_one_rank(ckpt):
    if CPU_MAX_WORLD < 4:
        pytest.skip("4 gloo ranks (MGRPO_TEST_CPU_RANKS < 4)")
    t0 = time.time()
    got = run_ranks(_rank_layouts, 4, str(ckpt), [("tp2ep2", 2, 2, 1)], 2, True, timeout=900)
    ref = got[0]["one"]
    _check(ref, [r["tp2ep2"] for r in got], 2, 2, "tp2 x ep2", t0)
