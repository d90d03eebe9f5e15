"""The once-per-destination EP exchange (``model_bridge.modeling.ep_dispatch``) on real gloo ranks.

Each rank routes its own tokens over all experts (two ranks, four experts each, top-3), the
"experts" are known functions (expert ``e`` multiplies its rows by ``e + 1`` and adds ``e``), and
the result must equal the dense reference ``out[t] = sum_e probs[t, e] * f_e(x[t])`` computed on
every rank from all ranks' inputs, together with the gradients of ``x`` and ``probs``. Routing
covers the edge cases: tokens with all their experts on one rank, tokens split over both, and (in
the second case) a rank that sends nothing to the other.
"""
from __future__ import annotations

import pytest
import torch

from model_bridge.spawn import run_ranks

P, EL, K, H = 2, 4, 3, 5


def _routing(rank: int, T: int, case: str, gen: torch.Generator):
    """probs ``[T, E]`` (zeros outside the top-k) and the bool map, seeded per rank."""
    E = P * EL
    scores = torch.rand(T, E, generator=gen)
    if case == "local_only" and rank == 1:
        scores[:, :EL] -= 10.0  # rank 1 sends nothing to rank 0
    if case == "mixed":
        scores[0, EL:] -= 10.0  # token 0: only rank 0's experts
        scores[1, :EL] -= 10.0  # token 1: only rank 1's experts
    top = scores.topk(K, dim=1).indices
    mask = torch.zeros(T, E, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.where(mask, torch.softmax(scores, 1), torch.zeros(()))
    return probs, mask


def _experts(rows, tokens_per_expert, probs_rows, ep_rank):
    """Known expert functions on rows sorted by local expert: ``probs * (x * (e + 1) + e)``."""
    e_R = torch.repeat_interleave(torch.arange(EL) + ep_rank * EL, torch.as_tensor(tokens_per_expert))
    return probs_rows.unsqueeze(1) * (rows * (e_R + 1).unsqueeze(1) + e_R.unsqueeze(1))


def _rank(case: str, T_by_rank: list[int]):
    import torch.distributed as dist

    from model_bridge.mcore_cpu import apply_cpu_patches
    from model_bridge.modeling.ep_dispatch import DedupExchange

    apply_cpu_patches()  # megatron's all_to_all asks torch.cuda for its device
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    inputs = []
    for r in range(P):  # every rank builds all ranks' inputs (same seeds) for the reference
        gen = torch.Generator().manual_seed(10 + r)
        x = torch.randn(T_by_rank[r], H, generator=gen, dtype=torch.float64)
        probs, mask = _routing(r, T_by_rank[r], case, gen)
        inputs.append((x, probs.double(), mask))
    x, probs, mask = (t.clone() for t in inputs[rank])
    x.requires_grad_(True)
    probs.requires_grad_(True)

    ex = DedupExchange(dist.group.WORLD, EL, K)
    x_send, pm_send = ex.preprocess(x, mask, probs)
    rows, tpe, probs_rows = ex.expand(ex.send(x_send), ex.send(pm_send))
    out = ex.reduce_ranks(ex.send_back(ex.reduce_rows(_experts(rows, tpe, probs_rows, rank))))
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(99 + rank), dtype=out.dtype)
    (out * w).sum().backward()

    # dense reference of this rank's tokens
    x_ref, probs_ref = x.detach().clone().requires_grad_(True), probs.detach().clone().requires_grad_(True)
    e = torch.arange(P * EL, dtype=x.dtype)
    ref = (probs_ref.unsqueeze(2) * (x_ref.unsqueeze(1) * (e + 1).view(1, -1, 1) + e.view(1, -1, 1))).sum(1)
    (ref * w).sum().backward()
    sent = [int(s) for s in ex.send_splits]
    return {"out": (out - ref).abs().max().item(), "gx": (x.grad - x_ref.grad).abs().max().item(),
            "gp": ((probs.grad - probs_ref.grad) * mask).abs().max().item(), "sent": sent,
            "rows": ex.R, "tokens_per_expert": tpe.tolist()}


@pytest.mark.parametrize("case", ["mixed", "local_only"])
def test_dedup_exchange_matches_dense_reference(case):
    T_by_rank = [7, 5]
    got = run_ranks(_rank, P, case, T_by_rank, timeout=120)
    for r, g in enumerate(got):
        assert g["out"] < 1e-12 and g["gx"] < 1e-12 and g["gp"] < 1e-12, (r, g)
        assert sum(g["sent"]) <= P * T_by_rank[r]  # at most one copy of a token per rank
    # every routed (token, expert) choice is computed exactly once
    assert sum(g["rows"] for g in got) == K * sum(T_by_rank)
    if case == "local_only":
        assert got[1]["sent"][0] == 0  # rank 1 had nothing for rank 0, and both still finished
