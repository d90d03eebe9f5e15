"""Micro-batch gradients added into the fp32 grad buffers by our Triton kernel
(``engine/grad_accum.py``): bit-identical to megatron DDP's own add, through a real step's
forward and backward over several micro-batches (on CPU through Triton's interpreter)."""
from __future__ import annotations

import pytest
import torch

from megatron_grpo.testing.interpreted import INTERPRETED_ENV as INTERPRET, interpreting_only
from model_bridge.spawn import run_ranks

EVERY_PARAM = {"MGRPO_GRAD_ACCUM_MIN_NUMEL": "1"}
"""The tiny model's parameters are all below the default size for a hook: hook every one."""


def _kernel_rank() -> dict:
    from megatron_grpo.engine.grad_accum import accumulate_

    res = {}
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for n in (1, 4095, 4097, 10_000):  # around the kernel's block
            acc = torch.randn(n, generator=g) * 1e3
            grad = (torch.randn(n, generator=g) * 1e-3).to(dtype)
            want = acc.clone().add_(grad)
            res[f"{dtype}-{n}"] = torch.equal(accumulate_(acc, grad), want)
    try:
        accumulate_(torch.zeros(4), torch.zeros(5, dtype=torch.bfloat16))
    except ValueError as e:
        res["error"] = str(e)
    return res


def test_kernel_adds_exactly_like_torch_through_the_interpreter():
    res = run_ranks(_kernel_rank, 1, env=INTERPRET)[0]
    assert res.pop("error") == "gradient of shape (5,) for a main_grad of shape (4,)"
    assert all(res.values()), res


def _ddp_vs_hooks_rank(hf_dir: str) -> dict:
    from megatron_grpo.engine import grad_accum
    from megatron_grpo.engine.setup import build_engine
    from megatron_grpo.engine.step import StepConfig, forward_backward
    from model_bridge.config import ParallelLayout
    from model_bridge.parallel import init_parallel

    from test_graphs import _microbatches  # the same tiny trajectories and featurizer

    init_parallel(seed=1234)
    engine = build_engine(hf_dir, ParallelLayout(), dtype=torch.bfloat16)
    params = [p for p in engine.model[0].parameters() if p.requires_grad]
    mbs = _microbatches(engine, hf_dir, 512)
    res = {"microbatches": len(mbs), "hooked": sum(bool(getattr(p, "_mgrpo_grad_accum", False)) for p in params),
           "params": len(params)}
    grads = {}
    for name, ctx in (("hooks", None), ("ddp", grad_accum.paused)):
        engine.model[0].zero_grad_buffer()
        if ctx is None:
            forward_backward(engine, mbs, StepConfig())
        else:
            with ctx():
                forward_backward(engine, mbs, StepConfig())
        res[f"{name}_flagged"] = sum(bool(p.grad_added_to_main_grad) for p in params)
        grads[name] = [p.main_grad.detach().clone() for p in params]
    res["equal"] = all(torch.equal(a, b) for a, b in zip(grads["hooks"], grads["ddp"]))
    res["nonzero"] = sum(bool(a.abs().sum() > 0) for a in grads["hooks"])
    return res


def _check(res):
    assert res["microbatches"] >= 2, res  # accumulation over micro-batches, not one add
    assert res["hooked"] == res["params"] and res["hooks_flagged"] == res["params"], res
    assert res["ddp_flagged"] == 0, res  # paused: DDP's own add ran
    assert res["nonzero"] > res["params"] // 2, res
    assert res["equal"], res


@pytest.mark.slow
def test_hooks_give_ddp_main_grads_bit_identically_on_cpu(tiny_ckpt):
    _check(run_ranks(_ddp_vs_hooks_rank, 1, str(tiny_ckpt), env={**interpreting_only("GRAD_ACCUM"), **EVERY_PARAM},
                     timeout=900)[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hooks_give_ddp_main_grads_bit_identically_on_gpu(tiny_ckpt):
    _check(run_ranks(_ddp_vs_hooks_rank, 1, str(tiny_ckpt), env=EVERY_PARAM, timeout=900)[0])


def test_cpu_parameters_are_left_to_ddp():
    from megatron_grpo.engine.grad_accum import install

    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    p.main_grad = torch.zeros(3)
    assert install([torch.nn.ParameterList([p])]) == 0


def _size_rank() -> dict:
    from megatron_grpo.engine.grad_accum import MIN_NUMEL, install

    params = []
    for n in (2048, MIN_NUMEL - 1, MIN_NUMEL):
        p = torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16))
        p.main_grad = torch.zeros(n)
        params.append(p)
    return {"min_numel": MIN_NUMEL, "hooked": install([torch.nn.ParameterList(params)]),
            "which": [bool(getattr(p, "_mgrpo_grad_accum", False)) for p in params]}


def test_only_parameters_of_a_million_elements_or_more_are_hooked():
    """A norm's or a bias's gradient keeps DDP's add (a Triton launch costs more host time than it
    saves device time); the threshold is ``MGRPO_GRAD_ACCUM_MIN_NUMEL``, 2**20 by default."""
    res = run_ranks(_size_rank, 1, env=INTERPRET)[0]
    assert res == {"min_numel": 1 << 20, "hooked": 1, "which": [False, False, True]}, res
