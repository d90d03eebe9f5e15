"""megatron's local tensor-parallel linears with the bias added by the GEMM, where no rank shares the layer.

megatron's local ``ColumnParallelLinear`` adds its bias after the matmul in a separate broadcast
pass (``output + bias``); with ``skip_bias_add`` (``linear_proj``, ``linear_fc1``, ``linear_fc2``)
it hands the bias to the caller, which adds it in another pass (bias-dropout-add, the MLP before
its activation). A broadcast add runs torch's non-vectorised elementwise kernel: in the audio
tower's 4-layer profile on an H200 those adds took 6.1 ms (34 calls) of the tower's 187.5 ms
(``docs/performance/train/train4_auto_lists_profile_audio_2026-12-04.txt``). ``F.linear`` adds
the bias in the GEMM's epilogue instead (cuBLASLt on CUDA), as HF's ``nn.Linear`` does: one
rounding of ``x @ W.T + b`` instead of two, and no extra pass over the output.

:class:`BiasInGemmColumnLinear` / :class:`BiasInGemmRowLinear` do that where the layer has no
communication to do: a tensor-parallel group of one rank (TP 1, or the audio encoder replicated
over a single-rank group) and none of megatron's fused weight-gradient accumulation, embedding
wgrad deferral, rematerialised weight shards or activation offloading. There ``forward`` returns ``(F.linear(x, W, b), None)``
whatever ``skip_bias_add`` says: the callers see no bias to add (megatron's bias-dropout-add and
MLP skip a ``None`` bias), and ``dropout(x @ W.T + b)`` is what they would compute. Elsewhere
(TP > 1) they are megatron's own classes, unchanged. Parameters, names, attributes and
checkpoints are megatron's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["BiasInGemmColumnLinear", "BiasInGemmRowLinear", "bias_in_gemm_applies"]


def bias_in_gemm_applies(layer) -> bool:
    """Whether ``layer`` (a megatron linear) computes alone: its TP group has one rank and it uses
    none of the features that need megatron's own autograd function."""
    group = getattr(layer, "tp_group", None)
    cfg = layer.config
    return (group is not None and group.size() == 1
            and not getattr(layer, "gradient_accumulation_fusion", False)
            and not getattr(layer, "sequence_parallel", False)
            and not getattr(layer, "explicit_expert_comm", False)
            and getattr(layer, "gtp_remat_size", 1) == 1  # megatron 0.19's rematerialised weight shards
            and not getattr(cfg, "defer_embedding_wgrad_compute", False))


class _BiasInGemm:
    """The shared constructor and forward (a mixin in front of megatron's class)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._bias_in_gemm = bias_in_gemm_applies(self)

    def forward(self, input_: torch.Tensor, *args, **kwargs):
        # another weight, a runtime gather or offloading's bookkeeping: megatron's own forward
        if (not self._bias_in_gemm or args or kwargs
                or getattr(self.config, "_cpu_offloading_context", None) is not None):
            return super().forward(input_, *args, **kwargs)
        # 2-D so the bias always goes to addmm's epilogue (a view for the contiguous [s, b, h] input)
        out = F.linear(input_.reshape(-1, input_.shape[-1]), self.weight, self.bias)
        return out.view(*input_.shape[:-1], out.shape[-1]), None


class BiasInGemmColumnLinear(_BiasInGemm, ColumnParallelLinear):
    """megatron's ``ColumnParallelLinear``; alone on its TP group, the bias in the GEMM (module docstring)."""


class BiasInGemmRowLinear(_BiasInGemm, RowParallelLinear):
    """megatron's ``RowParallelLinear``; alone on its TP group, the bias in the GEMM (module docstring)."""
