"""``export_hf(model)``: stream a sharded Megatron model's weights as full HF tensors, param by param.

Who yields what (each HF tensor exactly once across the job):

* dense parameters (attention, norms, router, embeddings, output layer, audio tower): the rank with
  tensor-parallel rank 0 and data-parallel rank 0 (context-parallel included) of each pipeline
  stage; TP shards are gathered onto it (``dist.gather`` in the TP group, one parameter at a time);
* expert parameters: on each pipeline stage, for each EP rank, the rank with expert-tensor-parallel
  rank 0 and expert-data-parallel rank 0 yields that EP rank's experts under their global indices
  (ETP shards gathered in the ETP group);
* pipeline stages yield their own layers, with global layer numbers; nothing crosses stages.

So on a TP2 x EP2 job of 4 ranks, rank 0 yields the dense weights and experts [0, E/2), rank 2 (or
whichever rank is EP rank 1 with ETP rank 0) the experts [E/2, E); other ranks yield nothing but
take part in the gathers.

Lockstep: the gathers are collectives inside TP / ETP groups, done lazily while the iterator is
consumed, in ``named_parameters`` order (the same on all ranks of a stage). Every rank must iterate
``export_hf`` to the end, also the ranks that yield nothing; ranks of data-parallel replicas
other than 0 skip the work and take part in no collective.

Memory: one full parameter at a time (the largest: embedding / output layer, or one fused expert
weight); tensors are yielded in on-disk naming (per-expert keys), vocab padding rows dropped, in
the model's dtype unless ``dtype`` is given. A yielded tensor may share memory with the parameter
(unsharded ones): copy it if you keep it across an optimizer step.

``export_plan`` gives this rank's (name, shape, dtype) list without any collective (for weight
sync metadata); ``passthrough_tensors`` streams the untrained parts (visual, talker, code2wav)
from the source checkpoint.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from model_bridge.io import SafetensorsReader
from model_bridge.load import model_chunks
from model_bridge.mappings import ParallelContext, Task, build_tasks, gather_shards
from model_bridge.qwen3_omni import QWEN3_OMNI, ModelBridge

__all__ = ["export_hf", "export_plan", "passthrough_tensors", "export_tasks"]


def _spec_of(chunks: list[torch.nn.Module], spec):
    spec = spec if spec is not None else getattr(chunks[0], "spec", None)
    if spec is None:
        raise ValueError("export_hf needs the model spec: pass spec=read_omni_config(hf_dir) (or give the "
                         "model a .spec attribute)")
    return spec


def export_tasks(model: torch.nn.Module | list[torch.nn.Module], spec=None, *,
                 bridge: ModelBridge = QWEN3_OMNI) -> list[Task]:
    """Every parameter's task on this rank (a model, or a list of virtual-pipeline chunks), in
    deterministic order."""
    chunks = model_chunks(model)
    spec = _spec_of(chunks, spec)
    ctx = ParallelContext.from_parallel_state()
    rules = bridge.rules(spec, ctx.shard("tp").size)
    return [t for chunk in chunks for t in build_tasks(chunk, rules, ctx)]


def export_plan(model: torch.nn.Module, spec=None, *, bridge: ModelBridge = QWEN3_OMNI,
                dtype: torch.dtype | None = None) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(HF name, full shape, dtype) of every tensor ``export_hf`` yields on this rank, in order.
    No collectives."""
    tasks = export_tasks(model, spec, bridge=bridge)
    out = []
    for t in tasks:
        if t.shard.replica_rank != 0 or t.shard.rank != 0:
            continue
        shapes = t.mapping.hf_shapes(t.param.shape, t.shard)
        for role in t.mapping.roles:
            out.append((t.hf[role], tuple(shapes[role]), dtype or t.param.dtype))
    return out


def export_hf(model: torch.nn.Module, spec=None, *, bridge: ModelBridge = QWEN3_OMNI,
              dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for the parameters this rank exports (see the module doc).

    Every rank must consume the iterator to the end (collectives inside TP / ETP groups).
    """
    tasks = export_tasks(model, spec, bridge=bridge)
    for t in tasks:
        if t.shard.replica_rank != 0:
            continue  # a data-parallel replica: its twin on replica 0 exports it
        # no_grad per parameter, not around the yields (a no_grad generator toggles grad mode on
        # every resume: two calls per yielded tensor); the yielded tensors come from a detached param
        with torch.no_grad():
            shards = gather_shards(t.param.detach(), t.shard)
            if shards is None:
                continue  # not group rank 0: it only contributed its shard
            full = t.mapping.merge(shards)
        for role in t.mapping.roles:
            tensor = full[role]
            if dtype is not None and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            yield t.hf[role], tensor
        del shards, full


def passthrough_tensors(hf_dir: str | Path, *, bridge: ModelBridge = QWEN3_OMNI
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the source checkpoint's tensors the model does not hold (``bridge.passthrough_prefixes``)
    unchanged, one at a time, in key order."""
    reader = SafetensorsReader(hf_dir)
    prefixes = tuple(bridge.passthrough_prefixes)
    for key in reader.keys():
        if key.startswith(prefixes):
            yield key, reader.read(key)
