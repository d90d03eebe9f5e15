"""A model's gradients in HF naming, for comparing runs of different parallel layouts tensor by tensor.

    from megatron_grpo.testing.grads import grads_by_hf_name

    loss.backward()
    grads = grads_by_hf_name(model, spec)   # {HF tensor name: float32 CPU gradient}

Runs on every rank of the model's process groups (the TP/ETP shard gather is a collective).
"""
from __future__ import annotations

import torch


def grads_by_hf_name(model, spec) -> dict[str, torch.Tensor]:
    """This rank's share of the gradients, merged over TP/ETP and named like the HF tensors.

    Only the exporting rank of each tensor (replica rank 0, the one ``gather_shards`` hands the
    shards to) fills it in, so the ranks' dicts together cover the model: each expert once, dense
    tensors once. A parameter without a gradient counts as zeros. Values are float32 copies on the
    CPU, so they outlive the model and can be returned from a rank process.
    """
    from model_bridge.export import export_tasks
    from model_bridge.mappings import gather_shards

    out = {}
    for t in export_tasks(model, spec):
        if t.shard.replica_rank != 0:
            continue
        grad = t.param.grad if t.param.grad is not None else torch.zeros_like(t.param)
        shards = gather_shards(grad.detach().float().contiguous(), t.shard)
        if shards is None:
            continue
        full = t.mapping.merge(shards)
        for role in t.mapping.roles:
            out[t.hf[role]] = full[role].cpu().clone()
    return out
