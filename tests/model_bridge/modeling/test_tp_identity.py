"""The TP-region mappings return their input where the group has one rank, and defer otherwise."""
from __future__ import annotations

import torch

from model_bridge.modeling.tp_identity import _skip_single_rank, install_tp1_identity_skips


class _Group:
    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


def test_one_rank_returns_the_input_and_more_ranks_call_megatron():
    calls = []

    def megatron_mapping(input_, group=None):
        calls.append(group)
        return input_ * 2

    wrapped = _skip_single_rank(megatron_mapping)
    x = torch.ones(3, requires_grad=True)
    assert wrapped(x, group=_Group(1)) is x and calls == []
    two = _Group(2)
    assert torch.equal(wrapped(x, group=two), x * 2) and calls == [two]
    assert torch.equal(wrapped(x), x * 2) and calls == [two, None]  # no group: megatron resolves it


def test_install_wraps_where_megatron_calls_them_once():
    import megatron.core.tensor_parallel.layers as layers
    import megatron.core.transformer.moe.moe_utils as moe_utils

    install_tp1_identity_skips()
    first = (layers.copy_to_tensor_model_parallel_region, layers.reduce_from_tensor_model_parallel_region,
             moe_utils.reduce_from_tensor_model_parallel_region)
    install_tp1_identity_skips()  # idempotent: no wrapper around a wrapper
    again = (layers.copy_to_tensor_model_parallel_region, layers.reduce_from_tensor_model_parallel_region,
             moe_utils.reduce_from_tensor_model_parallel_region)
    assert first == again and all(getattr(f, "_mgrpo_tp1_skip", False) for f in again)
    x = torch.ones(2)
    assert all(f(x, group=_Group(1)) is x for f in again)
