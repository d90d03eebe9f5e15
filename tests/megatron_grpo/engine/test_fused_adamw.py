"""AdamW with the bf16 weight write in one Triton pass (``engine/fused_adamw.py``): the update of
torch's AdamW, the bf16 weights exactly the master weights rounded, megatron's copy for the rest,
through a real engine's steps and a checkpoint resume (CPU through Triton's interpreter, and on the
GPU)."""
from __future__ import annotations

import pytest
import torch

from megatron_grpo.testing.interpreted import INTERPRETED_ENV as INTERPRET, interpreting_only
from model_bridge.spawn import run_ranks

from test_fused_adam import MAX_ULPS, _masters, first_step_apart, ulp

CLIP = 1e-3
"""``clip_grad`` of the engine test: below the tiny model's gradient norm, so every step clips."""
MIXED = {"MGRPO_FUSED_ADAMW_MIN_NUMEL": "2048"}
"""The tiny model's parameters are all below the default size for the kernel: the larger ones go
through it, the norms and biases through torch's fused AdamW, as a full-width model's would."""


def _kernel_rank(device: str = "cpu") -> dict:
    from megatron_grpo.engine.fused_adamw import adamw_

    res = {"ulps": 0.0, "moments_rel": 0.0, "out_equal": True}
    g = torch.Generator().manual_seed(0)
    # three steps on weights near 1, and torch's default betas on weights as small as their updates
    # (the tiny checkpoint's): one unit in the last place of the weight is then ~1e-7 of the update,
    # so the update's own rounding shows; there the first step only, whose moments have no
    # cancellation (later, 0.9 m + 0.1 g can cancel, and torch's lerp rounds at the gradient's
    # scale, not at the result's)
    for lr, beta2, scale, steps in ((3e-3, 0.95, 1.0, (1, 2, 3)), (1e-6, 0.999, 1e-6, (1,))):
        hyper = dict(lr=lr, betas=(0.9, beta2), eps=1e-8, weight_decay=0.1)
        for n in (1, 2047, 2049, 5000):  # around the kernel's block
            p0 = (torch.randn(n, generator=g) * scale).to(device)
            ref = torch.nn.Parameter(p0.clone())
            opt = torch.optim.AdamW([ref], foreach=False, **hyper)
            p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
            out = torch.empty(n, dtype=torch.bfloat16, device=device)
            for step in steps:
                grad = (torch.randn(n, generator=g) * 1e-2).to(device)
                if opt.state[ref]:  # each step from the same state, so the error is one step's
                    ref.data.copy_(p)
                    opt.state[ref]["exp_avg"].copy_(m)
                    opt.state[ref]["exp_avg_sq"].copy_(v)
                ref.grad = grad.clone()
                before = ref.detach().clone()
                opt.step()
                adamw_(p, grad, m, v, step, lr=lr, beta1=0.9, beta2=beta2, eps=1e-8, weight_decay=0.1, out=out)
                want = ref.detach()
                # the update rounds at its own scale, the sum at the weight's: a unit in the last place of each
                res["ulps"] = max(res["ulps"], float(((p - want).abs() / (ulp(want) + ulp(want - before))).max()))
                st = opt.state[ref]
                res["moments_rel"] = max(res["moments_rel"],
                                         float((m - st["exp_avg"]).abs().max() / st["exp_avg"].abs().max()),
                                         float((v - st["exp_avg_sq"]).abs().max() / st["exp_avg_sq"].abs().max()))
                res["out_equal"] &= torch.equal(out, p.to(torch.bfloat16))
    # a clip coefficient: the same step as megatron's in-place clip (the fp32 product g * coeff) then
    # the step, bit for bit, and the gradient left as it was
    p0, grad = torch.randn(5000, generator=g).to(device), (torch.randn(5000, generator=g) * 1e-2).to(device)
    runs = []
    for pre, scale in ((0.37, 1.0), (1.0, 0.37)):
        p, m, v, out, gr = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0), torch.empty(5000, dtype=torch.bfloat16,
                                                                                               device=device), grad * pre
        adamw_(p, gr, m, v, 1, lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, out=out, grad_scale=scale)
        runs.append((p, m, v, out, gr))
    res["scaled_equal"] = all(torch.equal(a, b) for a, b in zip(runs[0][:4], runs[1][:4])) \
        and torch.equal(runs[1][4], grad) and not torch.equal(runs[0][1], (grad * 0.1).to(device))
    errors = []
    for bad in (dict(grad=torch.zeros(3, dtype=torch.bfloat16)), dict(param=torch.zeros(4, dtype=torch.bfloat16))):
        args = dict(param=torch.zeros(4), grad=torch.zeros(4), exp_avg=torch.zeros(4), exp_avg_sq=torch.zeros(4),
                    step=1)
        args.update(bad)
        try:
            adamw_(**args, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
        except ValueError as e:
            errors.append(str(e))
    res["errors"] = errors
    return res


def _check_kernel(res: dict) -> None:
    assert res.pop("errors") == [
        "grad must be a contiguous float32 tensor of the param's shape (4,), got torch.bfloat16 (3,)",
        "param must be a contiguous float32 tensor, got torch.bfloat16"]
    # fp32 rounding apart (each of the two kernels rounds its moments, square root and divisions)
    assert res["ulps"] <= MAX_ULPS and res["moments_rel"] < 1e-6 and res["out_equal"] and res["scaled_equal"], res


def test_kernel_matches_torch_adamw_through_the_interpreter():
    _check_kernel(run_ranks(_kernel_rank, 1, env=INTERPRET)[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_matches_torch_adamw_on_gpu():
    # the interpreter computes the scalars in double precision: a scalar rounded to fp32 on the
    # device (1 - beta2 with beta2 = 0.999 once moved every update by 6.4e-6) shows only here
    _check_kernel(run_ranks(_kernel_rank, 1, "cuda")[0])


def _weights(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.model[0].parameters()]


def _engine_rank(hf_dir: str, run_dir: str) -> dict:
    from megatron_grpo.engine import fused_adamw
    from megatron_grpo.engine.checkpoint import load_checkpoint, save_checkpoint
    from megatron_grpo.engine.setup import OptimConfig, build_engine
    from megatron_grpo.engine.step import StepConfig, train_step
    from model_bridge.config import ParallelLayout
    from model_bridge.parallel import init_parallel

    from test_graphs import _microbatches  # the same tiny trajectories and featurizer

    init_parallel(seed=1234)
    # a clip below the gradients' norm: megatron clips ref's gradients in place, the fused step
    # scales them as it reads them (fused_adamw.clip_in_step)
    fused, ref = (build_engine(hf_dir, ParallelLayout(), OptimConfig(clip_grad=CLIP), dtype=torch.bfloat16)
                  for _ in range(2))
    res = {"installed": fused_adamw.install(fused.optimizer),  # 0: build_engine already installed it
           "kernel_shards": sum(p.numel() >= fused_adamw.MIN_NUMEL for p in _masters(fused)),
           "torch_shards": sum(0 < p.numel() < fused_adamw.MIN_NUMEL for p in _masters(fused)),
           "uninstalled": fused_adamw.uninstall(ref.optimizer)}
    res["reinstalled"] = fused_adamw.install(fused.optimizer)
    mbs = _microbatches(fused, hf_dir, 512)
    cfg = StepConfig()
    res.update(first_step_apart(fused, ref, mbs, cfg))
    res["exp_avg_rel"] = _moments_apart(fused, ref)
    # the model's bf16 weights are the master weights rounded, written by the kernel
    res["weights_are_masters"] = _weights_equal_masters(fused)
    train_step(fused, mbs, cfg, step=2)
    res["weights_are_masters_2"] = _weights_equal_masters(fused)
    save_checkpoint(run_dir, 2, fused.model, fused.optimizer, fused.scheduler)
    resumed = build_engine(hf_dir, ParallelLayout(), OptimConfig(clip_grad=CLIP), dtype=torch.bfloat16)
    res["loaded_step"] = load_checkpoint(run_dir, resumed.model, resumed.optimizer, resumed.scheduler)[0]
    res["loaded_weights_equal"] = all(torch.equal(x, y) for x, y in zip(_weights(fused), _weights(resumed)))
    for e in (fused, resumed):
        train_step(e, mbs, cfg, step=3)
    res["resume_equal"] = all(torch.equal(x, y) for x, y in zip(_masters(fused), _masters(resumed))) \
        and all(torch.equal(x, y) for x, y in zip(_weights(fused), _weights(resumed)))
    return res


def _moments_apart(first, second) -> float:
    """The largest difference of the two engines' first moments (linear in the clipped gradient),
    relative to the largest first moment."""
    from megatron_grpo.engine.ckpt_adam import inner_optimizers

    pairs = [(sa.optimizer.state[p]["exp_avg"], sb.optimizer.state[q]["exp_avg"])
             for sa, sb in zip(inner_optimizers(first.optimizer), inner_optimizers(second.optimizer))
             for ga, gb in zip(sa.optimizer.param_groups, sb.optimizer.param_groups)
             for p, q in zip(ga["params"], gb["params"])]
    top = max(float(b.abs().max()) for _, b in pairs)
    return max(float((a - b).abs().max()) for a, b in pairs) / top


def _weights_equal_masters(engine) -> bool:
    from megatron_grpo.engine.ckpt_adam import inner_optimizers

    subs = inner_optimizers(engine.optimizer)
    for sub in subs:
        for shard_group, model_group in zip(sub.shard_fp32_from_float16_groups, sub.model_float16_groups):
            for main, model_param in zip(shard_group, model_group):
                if not torch.equal(model_param.detach().view(-1), main.to(model_param.dtype)):
                    return False
    return bool(subs)


def _check(res):
    assert res["installed"] == 0 and res["reinstalled"] == 0, res  # build_engine installs it, once
    assert res["uninstalled"] == 1 and res["kernel_shards"] > 10 and res["torch_shards"] > 10, res
    assert res["weights_are_masters"] and res["weights_are_masters_2"], res
    assert res["loaded_step"] == 2 and res["loaded_weights_equal"] and res["resume_equal"], res
    # one step from equal gradients, clipped, against megatron's clip and torch's AdamW: fp32 rounding apart
    assert res["grad_norm"] > 10 * CLIP and res["exp_avg_rel"] < 1e-6, res
    assert res["update_norm"] > 0 and res["update_ulps"] <= MAX_ULPS, res


@pytest.mark.slow
def test_engine_steps_match_torch_adamw_and_resume_on_cpu(tiny_ckpt, tmp_path):
    res = run_ranks(_engine_rank, 1, str(tiny_ckpt), str(tmp_path / "run"),
                    env={**interpreting_only("ADAMW"), **MIXED}, timeout=900)[0]
    _check(res)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_steps_match_torch_adamw_and_resume_on_gpu(tiny_ckpt, tmp_path):
    _check(run_ranks(_engine_rank, 1, str(tiny_ckpt), str(tmp_path / "run"), env=MIXED, timeout=900)[0])


def test_cpu_parameters_keep_torch_adamw():
    from megatron_grpo.engine.fused_adamw import install

    class Sub:  # the shape of megatron's optimizer wrapper: the torch optimizer under .optimizer
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)

    assert install(Sub()) == 0 and "step" not in vars(Sub.optimizer)


def test_step_runs_the_closure_and_returns_its_loss():
    from types import SimpleNamespace

    from megatron_grpo.engine.fused_adamw import _step

    w0 = torch.randn(5, generator=torch.Generator().manual_seed(0))

    def closure_for(opt, p):
        def closure():
            opt.zero_grad()
            loss = (p * torch.arange(5.0)).square().sum()
            loss.backward()
            return loss
        return closure

    ours_p, ref_p = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    ours = torch.optim.AdamW([ours_p], lr=1e-2, fused=True)
    ref = torch.optim.AdamW([ref_p], lr=1e-2, fused=True)
    sub = SimpleNamespace()
    loss = _step(ours, {}, sub, closure_for(ours, ours_p))  # no shard for the kernel: torch's fused AdamW
    assert torch.equal(loss, ref.step(closure_for(ref, ref_p)))
    assert torch.equal(ours_p, ref_p) and not torch.equal(ours_p, w0) and sub._mgrpo_weights_written
