"""Four ranks == one rank (CPU, gloo, fp32, the ``"torch"`` backend): EP4, and TP2 + SP x EP2 with
expert-TP 1. Both route through the EP exchange that sends each token once per destination rank
(``model_bridge.modeling.ep_dispatch``; EP4: 4 experts per rank, top-4, so a token reaches 1-4
ranks with 1-4 rows each). The layouts the 4- and 8-GPU machines would run, at tiny width here.

Same checkpoint, samples, losses, gradient reduction and tolerances as
``test_parity_two_ranks.py`` (its module docstring); four micro-batches so that each of EP4's four
data-parallel ranks runs one (TP2 x EP2: two data-parallel groups of two TP ranks, two each).
"""
from __future__ import annotations

import time

import pytest

from megatron_grpo.testing.dist import run_ranks
from test_parity_two_ranks import PRESET, _one_rank, _rank_layout, check_against_one_rank

N_BATCHES = 4


@pytest.fixture(scope="module")
def ckpt():
    from conftest import build_cached_tiny

    return build_cached_tiny(PRESET)


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep,etp", [pytest.param(1, 4, None, id="ep4"),
                                       pytest.param(2, 2, 1, id="tp2sp-ep2-etp1")])
def test_four_ranks_match_one_rank(ckpt, tp, ep, etp):
    t0 = time.time()
    ref = _one_rank(ckpt, "cpu", N_BATCHES)
    got = run_ranks(_rank_layout, 4, str(ckpt), "cpu", tp, ep, etp, N_BATCHES, timeout=900)
    assert all(g["dedup_exchange"] == [True] for g in got), [g["dedup_exchange"] for g in got]
    check_against_one_rank(ref, got, "cpu", tp, N_BATCHES, f"four ranks tp{tp} ep{ep} etp{etp or tp}", t0)
