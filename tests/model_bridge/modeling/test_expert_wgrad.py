"""The grouped experts' weight gradients added straight into an fp32 ``main_grad``
(``model_bridge/modeling/expert_wgrad.py``), on CPU through Triton's interpreter: the kernel
against an fp64 reference (empty experts untouched, rows past the last offset never read), and
the autograd path against ``grouped_mm``'s own (the same output and input gradient, the weight
gradient in ``main_grad`` closer to the exact sum than the bf16-rounded add, megatron's flags)."""
from __future__ import annotations

import pytest
import torch

from megatron_grpo.testing.interpreted import run_interpreted


def _kernels():
    from model_bridge.modeling.expert_wgrad import _kernel

    return _kernel()


def _case(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    E, O, I = 4, 40, 72  # not multiples of the 128 x 128 tile
    offs = torch.tensor([5, 5, 30, 131], dtype=torch.int32)  # expert 1 empty; expert 3 past one BK step
    N = 140  # 9 rows past the last offset
    dy = torch.randn(N, O, generator=g).to(dtype)
    x = torch.randn(N, I, generator=g).to(dtype)
    dy[131:], x[131:] = float("nan"), float("nan")  # must never be read
    acc = torch.randn(E, O, I, generator=g)
    return acc, dy, x, offs


def _exact(acc, dy, x, offs):
    want = acc.double().clone()
    lo = 0
    for e, hi in enumerate(offs.tolist()):
        want[e] += dy[lo:hi].double().t() @ x[lo:hi].double()
        lo = hi
    return want


def _kernel_child() -> dict:
    from model_bridge.modeling.expert_wgrad import wgrad_into_

    res = {}
    for dtype in (torch.float32, torch.bfloat16):
        acc, dy, x, offs = _case(dtype)
        before = acc.clone()
        want = _exact(acc, dy, x, offs)
        got = wgrad_into_(acc, dy, x, offs)
        res[f"{dtype}-same"] = got is acc
        res[f"{dtype}-err"] = float((acc.double() - want).abs().max())
        res[f"{dtype}-empty_untouched"] = torch.equal(acc[1], before[1])
        res[f"{dtype}-finite"] = bool(torch.isfinite(acc).all())
    errors = []
    acc, dy, x, offs = _case(torch.float32)
    for bad in ((acc.double(), dy, x, offs), (acc, dy[:, :39], x, offs), (acc, dy, x, offs[:3])):
        try:
            wgrad_into_(*bad)
        except ValueError as e:
            errors.append(str(e))
    res["errors"] = errors
    return res


def test_kernel_adds_each_experts_weight_gradient_in_fp32():
    res = run_interpreted(_kernels, _kernel_child)
    assert res.pop("errors") == [
        "the accumulator must be a contiguous fp32 [E, O, I], got torch.float64 (4, 40, 72) with strides (2880, 72, 1)",
        "dy (140, 39) and x (140, 72) with offsets (4,) do not match an accumulator of (4, 40, 72)",
        "dy (140, 40) and x (140, 72) with offsets (3,) do not match an accumulator of (4, 40, 72)"]
    for dtype in ("torch.float32", "torch.bfloat16"):
        assert res[f"{dtype}-same"] and res[f"{dtype}-empty_untouched"] and res[f"{dtype}-finite"], res
        assert res[f"{dtype}-err"] < 1e-4, res  # fp32 sums of <= 126 exact products of magnitude ~1


def _autograd_child() -> dict:
    import torch.nn.functional as F

    from model_bridge.modeling import expert_wgrad
    from model_bridge.modeling.experts import grouped_linear

    g = torch.Generator().manual_seed(1)
    E, O, I, N = 3, 24, 40, 50
    offs = torch.tensor([20, 20, 50], dtype=torch.int32)
    x0 = torch.randn(N, I, generator=g).bfloat16()
    w = torch.nn.Parameter(torch.randn(E, O, I, generator=g).bfloat16())
    dy = torch.randn(N, O, generator=g).bfloat16()
    start = torch.randn(E, O, I, generator=g)
    res = {}

    # the plain path: grouped_mm's own backward, its bf16 weight gradient added into fp32 (DDP's add)
    x = x0.clone().requires_grad_()
    y_plain = grouped_linear(x, w, offs)
    y_plain.backward(dy)
    dx_plain, dw_plain = x.grad.clone(), w.grad.clone()
    w.grad = None

    w.main_grad = start.clone()
    res["applies"] = expert_wgrad.applies(x0, w)
    x = x0.clone().requires_grad_()
    y = grouped_linear(x, w, offs, into_main_grad=True)
    res["fn"] = type(y.grad_fn).__name__
    y.backward(dy)
    res["y_equal"] = torch.equal(y, y_plain)
    res["dx_equal"] = torch.equal(x.grad, dx_plain)
    res["flag"] = bool(getattr(w, "grad_added_to_main_grad", False))
    res["placeholder_shape"] = tuple(w.grad.shape)
    res["take"] = (expert_wgrad.take_placeholder(w), expert_wgrad.take_placeholder(w))
    exact = start.double() + torch.stack([dy[a:b].double().t() @ x0[a:b].double()
                                          for a, b in ((0, 20), (20, 20), (20, 50))])
    res["fused_err"] = float((w.main_grad.double() - exact).norm() / exact.norm())
    res["plain_err"] = float(((start + dw_plain.float()).double() - exact).norm() / exact.norm())
    res["empty_untouched"] = torch.equal(w.main_grad[1], start[1])

    # paused (autograd.grad: CUDA-graph warm-up and capture): the plain path, main_grad untouched
    w.grad, w.main_grad = None, start.clone()
    with expert_wgrad.paused():
        res["applies_paused"] = expert_wgrad.applies(x0, w)
        x = x0.clone().requires_grad_()
        (gw,) = torch.autograd.grad(grouped_linear(x, w, offs, into_main_grad=True), w, dy)
    res["paused_grad_equal"] = torch.equal(gw, dw_plain)
    res["paused_main_grad_untouched"] = torch.equal(w.main_grad, start)
    res["no_main_grad"] = expert_wgrad.applies(x0, torch.nn.Parameter(w.detach().clone()))
    res["grouped_mm"] = hasattr(F, "grouped_mm")
    return res


def test_autograd_path_adds_into_main_grad_and_hands_megatron_a_placeholder():
    res = run_interpreted(_kernels, _autograd_child)
    assert res["applies"] and res["fn"] == "_GroupedLinearIntoMainGradBackward", res
    assert res["y_equal"] and res["dx_equal"], res  # the same forward and input gradient as grouped_mm's
    assert res["flag"] and res["placeholder_shape"] == (3, 24, 40) and res["take"] == (True, False), res
    assert res["empty_untouched"], res
    # no bf16 rounding of the micro-batch's gradient: at least as close to the exact sum
    assert res["fused_err"] < 1e-6 and res["fused_err"] <= res["plain_err"], res
    assert not res["applies_paused"] and res["paused_grad_equal"] and res["paused_main_grad_untouched"], res
    assert not res["no_main_grad"], res


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_on_gpu_at_full_width_is_closer_to_the_exact_sum_than_grouped_mm_and_an_add():
    """fc1's shape at full width (2 x 768 gate/up rows, hidden 2,048), 16 experts with uneven rows,
    two of them empty, 4,096 rows in all; bf16 on the tensor cores."""
    import torch.nn.functional as F

    from model_bridge.modeling.expert_wgrad import wgrad_into_

    g = torch.Generator(device="cuda").manual_seed(0)
    E, O, I = 16, 1536, 2048
    counts = torch.randint(1, 512, (E,), generator=g, device="cuda")
    counts[[3, 11]] = 0
    offs = torch.cumsum(counts, 0).to(torch.int32)
    N = int(offs[-1]) + 7  # rows past the last offset hold NaN: never read
    dy = torch.randn(N, O, generator=g, device="cuda").bfloat16()
    x = torch.randn(N, I, generator=g, device="cuda").bfloat16()
    dy[int(offs[-1]):], x[int(offs[-1]):] = float("nan"), float("nan")
    start = torch.randn(E, O, I, generator=g, device="cuda")
    exact = start.double().clone()
    lo = 0
    for e, hi in enumerate(offs.tolist()):
        exact[e] += dy[lo:hi].double().t() @ x[lo:hi].double()
        lo = hi
    fused = wgrad_into_(start.clone(), dy, x, offs)
    w = torch.zeros(E, O, I, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    (dw,) = torch.autograd.grad(F.grouped_mm(x, w.transpose(-2, -1), offs=offs), w, dy)
    plain = start + dw.float()
    err = lambda a: float((a.double() - exact).norm() / exact.norm())  # noqa: E731
    assert torch.equal(fused[3], start[3]) and torch.equal(fused[11], start[11])
    assert bool(torch.isfinite(fused).all())
    assert err(fused) < 1e-6 and err(fused) <= err(plain), (err(fused), err(plain))
