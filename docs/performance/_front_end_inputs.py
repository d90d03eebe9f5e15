"""Shared by the audio conv front-end timing scripts in this folder (run from the repository root as
``python3 docs/performance/NAME.py``): CUDA-event timing, and the front-end's tensors at ``k`` chunks
in bf16 at Qwen3-Omni's 480 channels, drawn in a fixed order after ``torch.manual_seed(0)``."""
import torch


def cuda_ms(fn, n: int = 20, warmup: int = 3) -> float:
    """Mean milliseconds of ``fn()`` over ``n`` back-to-back calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda.synchronize()
    s.record()
    for _ in range(n):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n


def front_end_inputs(k: int = 500, dev: str = "cuda"):
    """x (mel chunks [k, 1, 128, 100] as the tower passes them), the first conv's w and b, the second
    conv's output y2, and upstream gradients g1 / g2 of the first and second conv's outputs."""
    torch.manual_seed(0)
    cl = torch.channels_last
    x = torch.randn(k, 100, 128, device=dev, dtype=torch.bfloat16).transpose(1, 2).unsqueeze(1)
    w = (torch.randn(480, 1, 3, 3, device=dev) * 0.3).bfloat16().requires_grad_()
    b = (torch.randn(480, device=dev) * 0.1).bfloat16().requires_grad_()
    y2 = (torch.randn(k, 480, 32, 25, device=dev) * 2).bfloat16().contiguous(memory_format=cl).requires_grad_()
    g1 = torch.randn(k, 480, 64, 50, device=dev).bfloat16().contiguous(memory_format=cl)
    g2 = torch.randn(k, 480, 32, 25, device=dev).bfloat16().contiguous(memory_format=cl)
    return x, w, b, y2, g1, g2
