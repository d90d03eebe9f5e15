"""AdamW that writes the bf16 model weights in the same pass as the fp32 master weights.

megatron's distributed optimizer steps in two passes over every parameter: the inner torch AdamW
(fused kernel: reads master weight, gradient and both moments, writes weight and moments, 28 B per
parameter) and then ``_copy_main_params_to_model_params``, one ``copy_`` per parameter from the
fp32 master shard into the bf16 model weights (reads the master weight again, 6 B). On an H200 at
4 full-width layers (3.2 G parameters) that was 28.6 ms + 8.0 ms (353 copy launches) of a 42 ms
optimizer step whose bandwidth bound is 23 ms (``mgrpo bench train``).

:func:`install` gives each such sub-optimizer a step that runs one Triton pass per master shard of
at least :data:`MIN_NUMEL` elements: torch's AdamW update, in the same order of operations as
torch's fused kernel, and the rounded bf16 weight written into the model's parameter buffer where
megatron's copy would put it (30 B per parameter). The smaller shards (norms, biases: most
parameters by count, a sliver by size) keep torch's fused AdamW, and their bf16 weights are written
in one multi-tensor copy (``torch._foreach_copy_``) instead of megatron's ``copy_`` each. The moments
and ``step`` live in the inner optimizer's ``state`` as torch's fused AdamW keeps them (``step`` a
float32 tensor on the device), so checkpoints and ``engine/ckpt_adam.py`` see no difference.

Clipping by the global norm rides along: megatron scales every fp32 gradient in place before the
step (without Apex or TE, ``dst.copy_(src * coeff)`` per gradient: 16 B per parameter, ~17 ms for
the 3.2 G parameters of 4 full-width layers on an H100). :func:`clip_in_step` hands the coefficient to the next step instead, where
the kernel multiplies each gradient as it loads it and the small shards' gradients are scaled in
one multi-tensor call: the same fp32 product ``g * coeff``, so the same update bit for bit.

megatron's copy runs after every inner step (``step_with_ready_grads``); after ours that multi-tensor
copy of the shards the kernel did not write takes its place. Where it runs for another reason it
copies everything, as before. Not installed (torch's fused AdamW and megatron's copy stay) for amsgrad, maximize,
capturable or differentiable groups, FSDP, fp8/fp4 parameter gathers, the precision-aware
optimizer, or where Triton does not run.
"""
from __future__ import annotations

import functools
import math
import os

import torch

from model_bridge.modeling._triton import import_triton, triton_runs_on

__all__ = ["install", "uninstall", "adamw_", "clip_in_step"]

_BLOCK = 2048
"""Elements per Triton program (8 KiB of each fp32 stream)."""
MIN_NUMEL = int(os.environ.get("MGRPO_FUSED_ADAMW_MIN_NUMEL", 1 << 20))
"""Smaller master shards keep torch's fused AdamW and one multi-tensor copy: a Triton launch from Python
costs tens of microseconds of host time, more than a small shard's update takes on the device."""


@functools.lru_cache(maxsize=None)
def _kernel():
    got = import_triton("MGRPO_TRITON_ADAMW")
    if got is None:
        return None
    triton, tl = got

    @triton.jit
    def adamw_bf16(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, n, grad_scale, lr_wd, beta1, one_minus_beta1, beta2,
                   one_minus_beta2, eps, step_size, bias_correction2_sqrt, WRITE_OUT: tl.constexpr,
                   OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(p_ptr + offs, mask=mask)
        g = tl.load(g_ptr + offs, mask=mask) * grad_scale  # the clip; 1.0 leaves g as it is
        m = tl.load(m_ptr + offs, mask=mask)
        v = tl.load(v_ptr + offs, mask=mask)
        p = p - lr_wd * p  # decoupled weight decay first, as torch's AdamW
        m = beta1 * m + one_minus_beta1 * g
        v = beta2 * v + one_minus_beta2 * g * g
        # IEEE square root and divisions, as torch's kernels (Triton's plain ones are approximate)
        denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
        p = p - tl.div_rn(step_size * m, denom)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if OUT_BF16:  # round to nearest even on the bits, as torch's copy_ (NaN kept a NaN)
            bits = p.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            nan = (bits & 0x7FFFFFFF) > 0x7F800000
            half = tl.where(nan, (bits >> 16) | 0x40, rounded).to(tl.uint16)
            tl.store(out_ptr + offs, half.to(tl.bfloat16, bitcast=True), mask=mask)
        elif WRITE_OUT:
            tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)

    return triton, adamw_bf16


def adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
           step: int, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
           out: torch.Tensor | None = None, grad_scale: float = 1.0) -> None:
    """Update ``step`` (counted from 1) of AdamW on the fp32 ``param`` and its moments in place, and
    ``out`` (``param``'s number of elements, half precision) set to the new weight rounded to its
    dtype, in one Triton pass, with the gradient ``grad * grad_scale`` (fp32; ``grad`` is not
    written). The scalars are computed here in double precision and rounded once,
    as torch's AdamW computes them: the bias corrections (in fp32 on the device, ``1 - beta2**step``
    loses a quarter of its digits at the first steps), ``1 - beta`` (``1 - float32(0.999)`` is off by
    1.3e-5, which moved every update by 6.4e-6 of itself on an H200) and ``lr * weight_decay``."""
    k = _kernel()
    if k is None:
        raise RuntimeError("adamw_ needs Triton (MGRPO_TRITON_ADAMW=0 turns the fused step off)")
    triton, kernel = k
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.shape != param.shape or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 tensor of the param's shape {tuple(param.shape)}, "
                             f"got {t.dtype} {tuple(t.shape)}")
    if param.dtype != torch.float32 or not param.is_contiguous():
        raise ValueError(f"param must be a contiguous float32 tensor, got {param.dtype}")
    if out is not None and (out.numel() != param.numel() or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous tensor of {param.numel()} elements, got {tuple(out.shape)}")
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    step_size = lr / (1.0 - beta1 ** step)
    bias_correction2_sqrt = math.sqrt(1.0 - beta2 ** step)
    n = param.numel()
    if n:
        kernel[(triton.cdiv(n, _BLOCK),)](param, grad, exp_avg, exp_avg_sq, param if out is None else out, n,
                                          grad_scale, lr * weight_decay, beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps,
                                          step_size, bias_correction2_sqrt, WRITE_OUT=out is not None,
                                          OUT_BF16=out is not None and out.dtype == torch.bfloat16, BLOCK=_BLOCK)


def _shard_views(sub) -> dict:
    """{id(master shard): (master shard, the model parameter buffer's slice it is copied into)} for
    every parameter of the distributed optimizer ``sub``, as its ``_copy_main_params_to_model_params``
    finds them."""
    views = {}
    for shard_groups, model_groups in ((sub.shard_fp32_from_float16_groups, sub.model_float16_groups),
                                       (sub.shard_fp32_groups, sub.model_fp32_groups)):
        for shard_group, model_group in zip(shard_groups, model_groups):
            for main, model_param in zip(shard_group, model_group):
                if main is None:
                    continue
                world = sub._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
                gbuf_index, _, bucket_id = sub.model_param_gbuf_map[model_param]
                buf = sub.buffers[gbuf_index].buckets[bucket_id].param_data
                views[id(main)] = (main, buf.view(-1)[world.start:world.end])
    return views


def _eligible(sub) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from .ckpt_adam import is_torch_adam

    inner = getattr(sub, "optimizer", None)
    if not isinstance(sub, DistributedOptimizer) or not isinstance(inner, torch.optim.AdamW) or not is_torch_adam(inner):
        return False
    ddp, cfg = sub.ddp_config, sub.config
    if any(getattr(ddp, k, False) for k in ("use_megatron_fsdp", "fp8_param_gather", "fp4_param_gather")) \
            or getattr(cfg, "use_precision_aware_optimizer", False) or getattr(cfg, "reuse_grad_buf_for_mxfp8_param_ag", False):
        return False
    groups = [g for g in inner.param_groups if g["params"]]
    return bool(groups) and all(
        not any(g.get(k) for k in ("amsgrad", "maximize", "capturable", "differentiable"))
        and all(p.dtype == torch.float32 and triton_runs_on(p.is_cuda) for p in g["params"]) for g in groups)


def install(optimizer) -> int:
    """Give every eligible distributed sub-optimizer of ``optimizer`` the fused step (module doc).
    Returns how many master shards the kernel updates (0: nothing installed)."""
    if _kernel() is None:
        return 0
    from .ckpt_adam import inner_optimizers

    fused = 0
    for sub in inner_optimizers(optimizer):
        if getattr(sub, "_mgrpo_fused_adamw", False) or not _eligible(sub):
            continue
        views = _shard_views(sub)
        big = {k for k, (main, view) in views.items()
               if main.numel() >= MIN_NUMEL and view.dtype in (torch.bfloat16, torch.float16) and main.is_contiguous()}
        if not big:
            continue
        outs = {k: view for k, (_, view) in views.items() if k in big}
        rest = [(main, view) for k, (main, view) in views.items() if k not in big]
        sub.optimizer.step = functools.partial(_step, sub.optimizer, outs, sub)
        sub._copy_main_params_to_model_params = functools.partial(_copy_rest, sub, rest,
                                                                  sub._copy_main_params_to_model_params)
        sub._mgrpo_fused_adamw, sub._mgrpo_weights_written = True, False
        fused += len(big)
    return fused


def uninstall(optimizer) -> int:
    """Back to torch's AdamW step and megatron's copy (the reference in tests, or for a suspect
    update). Returns how many sub-optimizers were changed back."""
    from .ckpt_adam import inner_optimizers

    undone = 0
    for sub in inner_optimizers(optimizer):
        if getattr(sub, "_mgrpo_fused_adamw", False):
            del sub.optimizer.step, sub._copy_main_params_to_model_params  # the class's methods again
            sub._mgrpo_fused_adamw = False
            undone += 1
    return undone


def clip_in_step(sub, max_norm: float, total_norm: float) -> bool:
    """megatron's ``clip_grad_by_total_norm_fp32`` for a sub-optimizer with the fused step: its
    coefficient ``max_norm / (total_norm + 1e-6)``, where below 1, is applied by the next step as it
    reads the gradients (module doc) instead of in a pass of its own. False (nothing done) where the
    fused step is not installed: clip there as megatron does."""
    if not getattr(sub, "_mgrpo_fused_adamw", False):
        return False
    coeff = max_norm / (total_norm + 1.0e-6)  # megatron's formula
    sub._mgrpo_grad_scale = coeff if coeff < 1.0 else 1.0
    return True


def _state(inner, p: torch.Tensor) -> dict:
    st = inner.state[p]
    if not st:  # torch's fused AdamW's layout: zeros and a float32 step on the parameter's device
        st.update(step=torch.zeros((), dtype=torch.float32, device=p.device),
                  exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                  exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
    return st


def _step(inner, outs: dict, sub, closure=None):
    """The inner optimizer's ``step``: the shards in ``outs`` (``{id(master shard): its bf16 model
    weights}``) through the Triton pass, the others through torch's fused AdamW. Like torch's
    optimizers, runs ``closure`` with autograd on first and returns its loss."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    scale = getattr(sub, "_mgrpo_grad_scale", 1.0)
    sub._mgrpo_grad_scale = 1.0  # one step's clip
    with torch.no_grad():
        for group in inner.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            sts = [_state(inner, p) for p in params]
            steps = [s["step"] for s in sts]
            torch._foreach_add_(steps, 1.0)  # the state as torch's fused AdamW keeps it
            beta1, beta2 = group["betas"]
            hyper = dict(lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"])
            rest = [i for i, p in enumerate(params) if id(p) not in outs]
            if rest:  # torch's own fused AdamW, as before
                if scale != 1.0:  # megatron's clip of these gradients: the same fp32 product, one launch
                    torch._foreach_mul_([params[i].grad for i in rest], scale)
                torch._fused_adamw_([params[i] for i in rest], [params[i].grad for i in rest],
                                    [sts[i]["exp_avg"] for i in rest], [sts[i]["exp_avg_sq"] for i in rest], [],
                                    [steps[i] for i in rest], amsgrad=False, beta1=beta1, beta2=beta2,
                                    maximize=False, grad_scale=None, found_inf=None, **hyper)
            mine = [i for i, p in enumerate(params) if id(p) in outs]
            if mine:
                # the counts on the host for the bias corrections: one read per group (the device has
                # finished the gradient norm's read by now, so it waits for little)
                counts = torch.stack([steps[i] for i in mine]).tolist()
                for i, k in zip(mine, counts):
                    p, st = params[i], sts[i]
                    adamw_(p, p.grad, st["exp_avg"], st["exp_avg_sq"], int(k), beta1=beta1, beta2=beta2,
                           out=outs[id(p)], grad_scale=scale, **hyper)
    sub._mgrpo_weights_written = True
    return loss


@torch.no_grad()
def _copy_rest(sub, rest: list, original):
    """megatron's master-to-model copy after a fused step: only ``rest``, the (master shard, model
    weights) pairs the kernel did not write; any other time (not after a step of ours): megatron's
    own."""
    if not sub._mgrpo_weights_written:
        return original()
    sub._mgrpo_weights_written = False
    if rest:  # one multi-tensor launch for the hundreds of small shards, not a copy_ each
        torch._foreach_copy_([view for _, view in rest], [main.view(-1) for main, _ in rest])
    return None
