"""torch's fused AdamW behind megatron's distributed optimizer on CUDA (``setup.use_fused_torch_adam``):
the same updates as the foreach kernels megatron picks by default, and a checkpoint resume that
continues bit-identically (the fused kernel needs its ``step`` state on the device)."""
from __future__ import annotations

import pytest
import torch

from model_bridge.spawn import run_ranks

MAX_ULPS = 4
"""Two AdamW kernels' updated weights may differ by this many units in the last place
(:func:`update_ulps`): the moments, the square root and the division each round once, in
whatever order a kernel computes them."""


def _masters(engine) -> list[torch.Tensor]:
    from megatron_grpo.engine.ckpt_adam import inner_optimizers

    return [p.detach().float().clone() for sub in inner_optimizers(engine.optimizer)
            for g in sub.optimizer.param_groups for p in g["params"]]


def ulp(t: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each element's magnitude."""
    return torch.nextafter(t.abs(), torch.full_like(t, float("inf"))) - t.abs()


def update_ulps(after_a, after_b, start) -> float:
    """The largest difference between two optimizers' master weights after one step from ``start``,
    in units in the last place of the weight plus those of its update: each kernel rounds the update
    at its own scale and the sum at the weight's. A relative norm of the two updates would measure
    the weights' rounding instead: at a small learning rate one unit in the last place of the weight
    is a large part of the update (a norm weight of 1.0: 1.2e-7 against an update of 1e-6)."""
    worst = 0.0
    for x, y, s in zip(after_a, after_b, start):
        worst = max(worst, float(((x - y).abs() / (ulp(y) + ulp(y - s))).max()) if y.numel() else 0.0)
    return worst


def first_step_apart(first, second, mbs, cfg) -> dict:
    """Step 1 of two engines built alike on ``mbs`` (the same gradients, so only their optimizers'
    rounding differs): ``update_ulps`` (:func:`update_ulps`), ``update_norm``, the largest of
    ``second``'s updates, and ``grad_norm``, ``first``'s gradient norm."""
    from megatron_grpo.engine.step import train_step

    start = _masters(first)
    norms = [train_step(e, mbs, cfg, step=1)["grad_norm"] for e in (first, second)]
    a, b = _masters(first), _masters(second)
    return {"update_ulps": update_ulps(a, b, start), "grad_norm": norms[0],
            "update_norm": max(float((y - s).norm()) for y, s in zip(b, start))}


def _fused_vs_foreach_rank(hf_dir: str, run_dir: str) -> dict:
    from megatron_grpo.engine.checkpoint import load_checkpoint, save_checkpoint
    from megatron_grpo.engine.ckpt_adam import inner_optimizers
    from megatron_grpo.engine.setup import build_engine
    from megatron_grpo.engine.step import StepConfig, train_step
    from model_bridge.config import ParallelLayout
    from model_bridge.parallel import init_parallel

    from test_graphs import _microbatches  # the same tiny trajectories and featurizer

    init_parallel(seed=1234)
    fused, foreach = (build_engine(hf_dir, ParallelLayout(), dtype=torch.bfloat16) for _ in range(2))
    groups = lambda e: [g for s in inner_optimizers(e.optimizer) for g in s.optimizer.param_groups]  # noqa: E731
    res = {"fused_flags": [bool(g["fused"]) for g in groups(fused)]}
    for g in groups(foreach):  # megatron's default without TE/apex
        g["fused"], g["foreach"] = False, True
    mbs = _microbatches(fused, hf_dir, 512)
    cfg = StepConfig()
    res.update(first_step_apart(fused, foreach, mbs, cfg))
    train_step(fused, mbs, cfg, step=2)
    res["step_devices"] = sorted({str(st["step"].device) for s in inner_optimizers(fused.optimizer)
                                  for st in s.optimizer.state.values()})

    save_checkpoint(run_dir, 2, fused.model, fused.optimizer, fused.scheduler)
    resumed = build_engine(hf_dir, ParallelLayout(), dtype=torch.bfloat16)
    res["loaded_step"] = load_checkpoint(run_dir, resumed.model, resumed.optimizer, resumed.scheduler)[0]
    for e in (fused, resumed):
        train_step(e, mbs, cfg, step=3)
    res["resume_equal"] = all(torch.equal(x, y) for x, y in zip(_masters(fused), _masters(resumed)))
    return res


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_adam_matches_foreach_and_resumes_bit_identically(tiny_ckpt, tmp_path):
    res = run_ranks(_fused_vs_foreach_rank, 1, str(tiny_ckpt), str(tmp_path / "run"), timeout=900)[0]
    assert res["fused_flags"] and all(res["fused_flags"]), res
    assert res["step_devices"] == ["cuda:0"], res
    assert res["loaded_step"] == 2 and res["resume_equal"], res
    # one step from equal gradients: the kernels' fp32 rounding apart. Later steps differ by more: a
    # bf16 weight that rounds the other way changes the next gradient, as with any two kernels.
    assert res["update_norm"] > 0 and res["update_ulps"] <= MAX_ULPS, res


def test_cpu_parameters_keep_the_foreach_kernels():
    from megatron_grpo.engine.setup import use_fused_torch_adam

    class Sub:  # the shape of megatron's optimizer wrapper: the torch optimizer under .optimizer
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)

    assert use_fused_torch_adam(Sub()) == 0
    assert not Sub.optimizer.param_groups[0]["fused"]
