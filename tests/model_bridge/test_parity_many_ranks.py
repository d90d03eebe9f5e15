"""Four and eight ranks == one rank, the layouts of the 4- and 8-GPU machines: EP4, TP2 + SP x EP2
(expert-TP 1), EP8, TP2 + SP x EP4 (expert-TP 1). All route through the EP exchange that sends each
token once per destination rank (``model_bridge.modeling.ep_dispatch``; EP4: 4 experts per rank,
top-4, so a token reaches 1-4 ranks with 1-4 rows each; EP8: 2 experts per rank).

Same checkpoint, samples, losses, gradient reduction, devices and tolerances as
``test_parity_two_ranks.py`` (its module docstring). Micro-batches: one per data-parallel rank of
EP-N (four or eight); TP2 layouts run two per data-parallel group.

* ``cpu`` (``slow``): gloo, fp32, all four layouts at tiny width (EP8: logits within 1.5e-5,
  worst gradient 1.8e-6 relative; TP2 + SP x EP4: 1.9e-5 and 1.6e-6; no routing flip).
* ``cuda`` / ``cuda-fp32`` (``gpu``): NCCL, one rank per GPU, skipped with the reason when the
  machine has fewer GPUs than the layout has ranks.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from model_bridge.spawn import run_ranks
from test_parity_two_ranks import PRESET, _one_rank, _rank_layout, check_against_one_rank

LAYOUTS = [  # world, tp, ep, etp
    pytest.param(4, 1, 4, None, id="ep4"),
    pytest.param(4, 2, 2, 1, id="tp2sp-ep2-etp1"),
    pytest.param(8, 1, 8, None, id="ep8"),
    pytest.param(8, 2, 4, 1, id="tp2sp-ep4-etp1"),
]
DEVICES = [pytest.param("cpu", id="cpu", marks=pytest.mark.slow),
           pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
           pytest.param("cuda-fp32", id="cuda-fp32", marks=pytest.mark.gpu)]
CPU_MAX_WORLD = int(os.environ.get("MGRPO_TEST_CPU_RANKS", "8"))
"""The most gloo ranks a CPU variant starts (eight take ~30 s at this width on two cores;
``MGRPO_TEST_CPU_RANKS=4`` leaves the eight-rank layouts to the GPU machine)."""


@pytest.fixture(scope="module")
def ckpt():
    from conftest import build_cached_tiny

    return build_cached_tiny(PRESET)


@pytest.mark.parametrize("world,tp,ep,etp", LAYOUTS)
@pytest.mark.parametrize("device", DEVICES)
def test_many_ranks_match_one_rank(ckpt, device, world, tp, ep, etp):
    if device == "cpu" and world > CPU_MAX_WORLD:
        pytest.skip(f"{world} gloo ranks: this layout runs on the {world}-GPU machine (the cuda variants)")
    if device.startswith("cuda") and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices (one NCCL rank each), this machine has {torch.cuda.device_count()}")
    n_batches = world  # EP-N: one micro-batch per data-parallel rank; TP2: two per group
    t0 = time.time()
    ref = _one_rank(ckpt, device, n_batches)
    got = run_ranks(_rank_layout, world, str(ckpt), device, tp, ep, etp, n_batches, timeout=900)
    if got[0]["backend"] == "torch":
        assert all(g["dedup_exchange"] == [True] for g in got), [g["dedup_exchange"] for g in got]
    check_against_one_rank(ref, got, device, tp, n_batches,
                           f"{world} ranks tp{tp}{'+sp' if tp > 1 else ''} ep{ep} etp{etp or tp}", t0)
