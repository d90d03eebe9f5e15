"""The distributed optimizer's state in megatron-core's ``fully_reshardable`` form, saved without
whole-buffer copies.

megatron's own save-side builder (``DistributedOptimizer.sharded_param_state_fully_reshardable``)
first all-gathers every DP rank's shard of the fp32 main parameters and both Adam moments into
three CPU tensors as large as the whole gradient buffer, on every DP rank, then hands the writer
model-shaped *views* of them, which megatron's file writer clones (it clones every CPU view before
writing): 2 x 12 bytes per parameter on top of the engine, on every rank. A 3B model at world 1
needs 72 GB more than its engine to save.

:func:`fully_reshardable_param_state` builds the same sharded tensors (same keys, shapes, dtypes:
the checkpoint is byte-for-byte the same format, loaded by megatron's own loader) with each
parameter's state in a tensor of its own:

* DP 1: the optimizer's own tensors (the main parameter and Adam's moments), reshaped; no copy.
* DP > 1: one bucket at a time is all-gathered over the DP group and each parameter's state is
  kept by one writer only, the DP rank ``index % DP`` (its replica id says so), so the DP ranks
  write in parallel and hold 12 bytes per parameter *between them*, plus one bucket.

:func:`fully_reshardable_load_targets` is the load side: the state of the parameters this rank
holds a piece of, each loaded into a tensor of its own (at DP 1 the optimizer's own, in place),
where megatron's builder allocates the three buffer-sized tensors again on every rank.
:func:`light_fully_reshardable` installs both on the (sub-)optimizers for one
``sharded_state_dict`` call.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Iterator

import torch

__all__ = ["fully_reshardable_param_state", "fully_reshardable_load_targets", "light_fully_reshardable",
           "STATE_KEYS"]

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
"""The per-parameter state megatron's fully_reshardable form stores (Adam), in its order."""


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when it owns its whole storage, else a copy that does: megatron's writer clones
    CPU views, and a view of a larger buffer would also drag that buffer into the write."""
    t = t.detach()
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _sharded_metadata(model_sd: dict) -> dict:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    tensors, _ = extract_sharded_tensors_and_factories(model_sd)
    return {sh.data: sh for sh in nested_values(tensors)}


def _bucket_states(opt, gbuf_idx: int, bucket_idx: int, range_map: dict, writers: dict) -> dict:
    """{model param: {key: full model-shaped state}} for the parameters of one bucket that this DP
    rank writes (`writers`: model param -> its writer's DP rank)."""
    import torch.distributed as dist

    group = opt.data_parallel_group
    dp, dp_rank = group.size(), group.rank()
    buffer = opt.buffers[gbuf_idx]
    params = [p for p, (_, _, b) in buffer.param_index_map.items() if b == bucket_idx]
    if dp == 1:
        out = {}
        for p in params:
            tensors = opt._get_main_param_and_optimizer_states(p)
            out[p] = {k: _own_storage(tensors[k].view(p.shape)) for k in STATE_KEYS}
        return out
    bucket = buffer.buckets[bucket_idx]
    local_numel = bucket.grad_data.numel() // dp
    device = bucket.grad_data.device
    gathered = {}
    for key in STATE_KEYS:
        local = torch.zeros(local_numel, dtype=torch.float32, device=device)
        for p, ranges in range_map["param_map"].items():
            tensors = opt._get_main_param_and_optimizer_states(p)
            local[ranges["gbuf_local"].start:ranges["gbuf_local"].end].copy_(tensors[key].detach().view(-1))
        parts = [torch.empty_like(local) for _ in range(dp)]
        dist.all_gather(parts, local, group=group)
        gathered[key] = torch.cat(parts)
        del parts, local
    out = {}
    for p in params:
        if writers[p] != dp_rank:
            continue
        start, end, _ = buffer.param_index_map[p]
        s, e = start - bucket.offset, end - bucket.offset
        out[p] = {k: gathered[k][s:e].view(p.shape).to("cpu", copy=True) for k in STATE_KEYS}
    return out


def _placeholder(shape: torch.Size) -> torch.Tensor:
    """Shape-only data for a state this rank does not write (one element, broadcast)."""
    return torch.zeros((), dtype=torch.float32).expand(shape)


def _sharded(sh, key: str, data: torch.Tensor, replica_id):
    kw = dict(key=f"optimizer.state.{key}.{sh.key}", data=data, dtype=data.dtype, replica_id=replica_id)
    if type(sh).__name__ == "ShardedTensorFactory":
        kw.pop("dtype")
    out = replace(sh, **kw)
    out.validate_metadata_integrity()
    return out


def _buffers(opt) -> Iterator[tuple[int, list, object]]:
    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        if len(gbuf_range_maps) != 1:
            raise NotImplementedError("a gradient buffer with several dtypes (megatron's fully_reshardable "
                                      "form supports one)")
        (maps,) = gbuf_range_maps.values()
        yield gbuf_idx, maps, opt.buffers[gbuf_idx]


def _metadata_of(meta: dict, p) -> object:
    sh = meta.get(p)
    if sh is None:
        raise ValueError(f"model parameter {tuple(p.shape)} is not in the model's sharded state dict "
                         "(build it with keep_vars=True)")
    return sh


def fully_reshardable_param_state(opt, model_sd: dict) -> dict:
    """Save side of megatron's fully_reshardable ``param_state`` for one DistributedOptimizer:
    ``{index: {key: ShardedTensor}}`` in megatron's order and with its keys
    (``optimizer.state.<key>.<model key>``), each written by one DP rank."""
    meta = _sharded_metadata(model_sd)
    group = opt.data_parallel_group
    dp, dp_rank = group.size(), group.rank()
    out: dict = {}
    index = 0
    for gbuf_idx, maps, buffer in _buffers(opt):
        # the writer of the parameter at index i (megatron's order) is DP rank i % DP
        writers = {p: (index + i) % dp for i, p in enumerate(buffer.param_index_map)}
        mine: dict = {}
        for bucket_idx, range_map in enumerate(maps):
            mine.update(_bucket_states(opt, gbuf_idx, bucket_idx, range_map, writers))
        for p in buffer.param_index_map:
            sh = _metadata_of(meta, p)
            rid = _as_replica(sh, dp_rank, writers[p], dp)  # the writer is replica 0
            out[index] = {k: _sharded(sh, k, mine[p][k] if p in mine else _placeholder(p.shape), rid)
                          for k in STATE_KEYS}
            index += 1
    return out


def fully_reshardable_load_targets(opt, model_sd: dict) -> dict:
    """Load side: the same sharded tensors, for the parameters this DP rank holds a piece of only,
    each loaded into a tensor of its own -- at DP 1 the optimizer's own tensors (loaded in place),
    else a new model-shaped one -- where megatron's builder loads every parameter's whole state into
    three buffer-sized tensors on every rank. megatron's ``load_parameter_state_from_fully_reshardable``
    then copies each rank's range (it skips the parameters that are not local)."""
    from collections import ChainMap

    meta = _sharded_metadata(model_sd)
    group = opt.data_parallel_group
    dp, dp_rank = group.size(), group.rank()
    out: dict = {}
    index = 0
    for _, maps, buffer in _buffers(opt):
        local = ChainMap(*(m["param_map"] for m in maps))
        for p, (start, _, b) in buffer.param_index_map.items():
            if p in local:
                sh = _metadata_of(meta, p)
                if dp == 1:
                    tensors = opt._get_main_param_and_optimizer_states(p)
                    data = {k: tensors[k].detach().view(p.shape) for k in STATE_KEYS}
                else:
                    data = {k: torch.empty(p.shape, dtype=torch.float32) for k in STATE_KEYS}
                # megatron checks that a main replica reads every shard: the DP rank holding the
                # parameter's first element is the one (each DP rank holds an even slice of a bucket)
                bucket = buffer.buckets[b]
                first = (start - bucket.offset) // (bucket.grad_data.numel() // dp)
                out[index] = {k: _sharded(sh, k, data[k], _as_replica(sh, dp_rank, first, dp)) for k in STATE_KEYS}
            index += 1
    return out


def _as_replica(sh, dp_rank: int, main: int, dp: int) -> tuple:
    """`sh`'s replica id with its DP coordinate set so that DP rank `main` is replica 0."""
    rid = sh.replica_id
    if not (isinstance(rid, tuple) and len(rid) == 3 and rid[-1] == dp_rank):
        raise NotImplementedError(f"{sh.key}: replica id {rid!r} is not (PP, TP, DP rank {dp_rank}); "
                                  "use megatron's own fully_reshardable builder")
    return (*rid[:2], (dp_rank - main) % dp)


def _distributed_parts(optimizer) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [p for p in parts if isinstance(p, DistributedOptimizer)]


@contextlib.contextmanager
def light_fully_reshardable(optimizer) -> Iterator[None]:
    """While active, megatron's fully_reshardable form of `optimizer` (its (Chained)Optimizer) is
    built by :func:`fully_reshardable_param_state` (save) and :func:`fully_reshardable_load_targets`
    (load) instead of megatron's whole-buffer gathers."""
    parts = _distributed_parts(optimizer)

    def install(part):
        def build(model_sd, is_loading=False, metadata=None):
            if is_loading:
                return fully_reshardable_load_targets(part, model_sd)
            return fully_reshardable_param_state(part, model_sd)
        part.sharded_param_state_fully_reshardable = build

    for part in parts:
        install(part)
    try:
        yield
    finally:
        for part in parts:
            del part.sharded_param_state_fully_reshardable
