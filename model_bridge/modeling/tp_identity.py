"""megatron's tensor-parallel region mappings skipped where their group has one rank.

With one tensor-parallel rank, megatron's ``copy_to_tensor_model_parallel_region`` (the column-
parallel linears' input) and ``reduce_from_tensor_model_parallel_region`` (the row-parallel
linears' output, the router's token counts for the aux loss) are identities both ways: their
autograd functions return the input in the forward and the gradient in the backward. Each still
costs a custom ``autograd.Function`` call (on an H200 machine ~45-60 us of host time at the start
of a step, where the host paces the GPU: ``docs/performance.md``) and an autograd node. The
wrappers below return the input itself when the group passed has one rank, and call megatron's
function otherwise (more ranks, or no group given: megatron resolves the default group).
"""
from __future__ import annotations

import functools

__all__ = ["install_tp1_identity_skips"]

_MARK = "_mgrpo_tp1_skip"


def _skip_single_rank(orig):
    @functools.wraps(orig)
    def mapping(input_, group=None, *args, **kwargs):
        if group is not None and group.size() == 1:
            return input_
        return orig(input_, group, *args, **kwargs)

    setattr(mapping, _MARK, True)
    return mapping


def install_tp1_identity_skips() -> None:
    """Wrap the two mappings where megatron's linear layers and MoE utilities call them (idempotent)."""
    import megatron.core.tensor_parallel.layers as layers
    import megatron.core.transformer.moe.moe_utils as moe_utils

    for mod, names in ((layers, ("copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region")),
                       (moe_utils, ("reduce_from_tensor_model_parallel_region",))):
        for name in names:
            fn = getattr(mod, name, None)
            if fn is not None and not getattr(fn, _MARK, False):
                setattr(mod, name, _skip_single_rank(fn))
