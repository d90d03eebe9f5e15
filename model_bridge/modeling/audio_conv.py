"""The audio tower's conv front-end: three 3x3 stride-2 Conv2d + GELU, laid out for speed.

Shapes: ``K`` chunks, ``M`` mel bins (the image height), ``L`` frames (its width), ``C`` conv
channels, ``Ho x Wo`` an output's height and width.

Same arithmetic as ``nn.Conv2d(…, 3, stride=2, padding=1)`` three times, two changes of layout:

* the first conv has one input channel, so each output is a dot product of 9 input values: it
  runs as im2col (a ``[K*Ho*Wo, 9]`` strided view of the padded input, copied) times the
  ``[9, C]`` weight in one GEMM with the bias in its epilogue. cuDNN runs this conv with a
  generic kernel and its output in NCHW;
* the GEMM's output is ``[K, Ho, Wo, C]``, i.e. channels-last, so the two ``C -> C`` convs run
  in cuDNN's NHWC kernels without the NCHW <-> NHWC transposes cuDNN adds around them for NCHW
  tensors (a quarter of the front-end's time, measured on an H200).

On an H200 (bf16, 3,850 full chunks, first pass + recomputation + backward) the front-end took
455 ms as three ``F.conv2d`` and 203 ms this way (docs/performance.md, "Training phase"). On CUDA
each bias and GELU then run fused into one Triton pass (``audio_conv_fused.py``), the first conv's
straight from the mel image; ``conv1_as_gemm`` stays the path elsewhere (CPU, an input with gradient).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .audio_conv_fused import bias_gelu, conv1_gelu, fused_conv_available

__all__ = ["conv_front_end", "conv1_as_gemm"]

_K_ALIGNED = 16
"""The first conv's 9 taps padded to 16 columns: rows of 9 bf16 (18 bytes) are not 16-byte
aligned, and cuBLAS then ran its align-1 kernels (33 of the 203 ms above)."""


def conv1_as_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, stride=2, padding=1)`` for one input channel.

    x [K, 1, M, L], weight [C, 1, 3, 3], bias [C] -> [K, C, Ho, Wo] with channels-last strides
    (``Ho = ceil(M / 2)``, ``Wo = ceil(L / 2)``).
    """
    k, _, m, length = x.shape
    ho, wo = (m + 1) // 2, (length + 1) // 2
    # zero border: 1 before, and after enough that the last window (rows 2*Ho-2 .. 2*Ho) exists
    padded_KMpLp = F.pad(x[:, 0], (1, 2 * wo + 1 - length, 1, 2 * ho + 1 - m))
    s0, s1, s2 = padded_KMpLp.stride()
    taps = padded_KMpLp.as_strided((k, ho, wo, 3, 3), (s0, 2 * s1, 2 * s2, s1, s2))  # a view: windows
    cols_N16 = x.new_zeros(k * ho * wo, _K_ALIGNED)
    cols_N16[:, :9].view(k, ho, wo, 3, 3).copy_(taps)  # the windows straight into their columns, one copy
    w_16C = F.pad(weight.reshape(weight.shape[0], 9), (0, _K_ALIGNED - 9)).T
    out_NC = torch.addmm(bias, cols_N16, w_16C)  # [K*Ho*Wo, C]
    return out_NC.view(k, ho, wo, -1).permute(0, 3, 1, 2)


def conv_front_end(x: torch.Tensor, convs: list[tuple[torch.Tensor, torch.Tensor]],
                   fused: Optional[bool] = None) -> torch.Tensor:
    """x [K, 1, M, L] -> GELU(conv3(GELU(conv2(GELU(conv1(x)))))) [K, C, M/8, L/8] (rounded up;
    channels-last strides). ``convs``: the three (weight, bias) pairs, all in x's dtype. ``fused``
    (default: where it runs, ``fused_conv_available``): each bias and GELU in one Triton pass
    (``audio_conv_fused.py``), the first conv's too; False: the first conv as a GEMM, cuDNN's bias,
    ``F.gelu``."""
    (w1, b1), *rest = convs
    if fused is None:
        fused = fused_conv_available(x)
    h = conv1_gelu(x, w1, b1) if fused else F.gelu(conv1_as_gemm(x, w1, b1))
    for w, b in rest:  # a channels-last weight too (4 MB): cuDNN then takes its NHWC kernels as they are
        w_cl = w.contiguous(memory_format=torch.channels_last)
        if fused:
            h = bias_gelu(F.conv2d(h, w_cl, None, stride=2, padding=1), b)
        else:
            h = F.gelu(F.conv2d(h, w_cl, b, stride=2, padding=1))
    return h
