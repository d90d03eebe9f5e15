"""model_bridge/modeling/empty_groups.py: experts without rows get exactly zero weight gradients,
whatever the memory held (the torch path, the Triton kernel under the interpreter and on the GPU),
and grouped_linear's gradients stay equal to a per-expert loop."""
from __future__ import annotations

import pytest
import torch

from model_bridge.modeling.empty_groups import _expert_blocks, _kernels, zero_empty_group_grads

COUNTS = [3, 0, 5, 0, 0, 2]
"""Rows per expert; experts 1, 3 and 4 get none."""


def _nan_grads_zeroed(device: str) -> dict:
    """Every expert's incoming gradient is NaN; the empty experts' must leave as zeros. Both layouts
    the grouped GEMM's backward hands over (contiguous, and its last two dims transposed)."""
    offs = torch.tensor(COUNTS, device=device).cumsum(0).to(torch.int32)
    empty = torch.tensor([n == 0 for n in COUNTS], device=device)
    out = {}
    for transposed in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            w = torch.randn(6, 4, 3, device=device, dtype=dtype, requires_grad=True)
            v = zero_empty_group_grads(w, offs)
            nan = torch.full((6, 3, 4) if transposed else (6, 4, 3), float("nan"), device=device, dtype=dtype)
            # through a transpose the gradient arrives as a transposed view (strides (12, 1, 4))
            ((v.transpose(-2, -1) if transposed else v) * nan).sum().backward()
            g = w.grad
            out[f"{'transposed' if transposed else 'contiguous'} {dtype}"] = (
                bool((g[empty] == 0).all()), bool(g[~empty].isnan().all()), _expert_blocks(g) is not None)
    return out


def _check(res: dict) -> None:
    assert len(res) == 4
    for k, (zeros, nans, blocks) in res.items():
        assert zeros and nans and blocks, (k, res)


def test_empty_experts_get_zero_grads_torch_path():
    _check(_nan_grads_zeroed("cpu"))


def test_empty_experts_get_zero_grads_interpreted():
    from megatron_grpo.testing.interpreted import run_interpreted

    _check(run_interpreted(_kernels, _nan_grads_zeroed, "cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_linear_empty_experts_after_dirty_memory_gpu():
    """The caching allocator first holds a NaN-filled block of the weight gradient's size (as a CUDA
    graph's pool or a long run does), then grouped_linear runs with empty experts: their gradient is
    zero and every gradient equals the per-expert loop's."""
    from model_bridge.modeling.experts import _loop_linear, grouped_linear

    _check(_nan_grads_zeroed("cuda"))
    E, out_f, in_f = len(COUNTS), 256, 128
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(COUNTS), in_f, generator=g).cuda().bfloat16().requires_grad_()
    w = torch.randn(E, out_f, in_f, generator=g).cuda().bfloat16().requires_grad_()
    gy = torch.randn(sum(COUNTS), out_f, generator=g).cuda().bfloat16()
    offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32).cuda()
    for _ in range(3):
        dirty = torch.full((E, in_f, out_f), float("nan"), device="cuda", dtype=torch.bfloat16)
        del dirty
        gw = torch.autograd.grad(grouped_linear(x, w, offs), w, gy)[0]
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    gwr = torch.autograd.grad(_loop_linear(xr, wr, COUNTS), wr, gy.float())[0]
    empty = torch.tensor([n == 0 for n in COUNTS], device="cuda")
    assert bool((gw[empty] == 0).all()) and bool(gw.isfinite().all())
    torch.testing.assert_close(gw.float(), gwr, rtol=2e-2, atol=2e-2)
