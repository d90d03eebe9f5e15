"""A thinker with no storage (meta device): sharding metadata at any model size, and which
parameter each of its checkpoint chunks views."""
from __future__ import annotations

import torch

from model_bridge.io import CheckpointError


def build_meta_thinker(spec, layout, dtype: torch.dtype):
    """This rank's thinker on the meta device (no memory, no init cost): its names, shapes and
    ``sharded_state_dict`` are those of the real model. Parallel state must be initialised."""
    from model_bridge.modeling import build_thinker

    with torch.device("meta"):
        return build_thinker(spec, layout, dtype, dummy_audio=False, perform_initialization=False)


def _flatten_prepended(obj):
    """Replace every ShardedTensor with prepended (layer/expert) axes by the same chunk written as a
    plain irregular chunk (``[1, .., 1, *local]`` at the same global offset; the stored layout is
    identical). megatron turns the prepended form into a torch ``ShardedTensor`` whose constructor
    checks all local shards pairwise: ~75M checks for 48 layers x 128 experts on one rank."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(obj, dict):
        return {k: _flatten_prepended(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_flatten_prepended(v) for v in obj]
    if isinstance(obj, ShardedTensor) and obj.prepend_axis_num:
        shape = (1,) * obj.prepend_axis_num + tuple(obj.local_shape)
        return ShardedTensor(key=obj.key, data=obj.data.view(shape), dtype=obj.dtype, local_shape=shape,
                             global_shape=tuple(obj.global_shape), global_offset=tuple(obj.global_offset),
                             axis_fragmentations=None, replica_id=obj.replica_id, prepend_axis_num=0)
    return obj


def _storage_id(t: torch.Tensor):
    """Identity of a tensor's storage (works on the meta device, where data_ptr() is 0)."""
    try:
        return t.untyped_storage()._cdata
    except (AttributeError, RuntimeError, NotImplementedError):
        return None


def _param_views(sd: dict, params: dict) -> dict[tuple, tuple]:
    """(checkpoint key, global offset) -> (param name, size, stride, storage offset) for every
    ShardedTensor of ``sd`` (factories applied) whose data views a parameter."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out: dict[tuple, tuple] = {}

    def visit(name, obj):
        if isinstance(obj, dict):
            for v in obj.values():
                visit(name, v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                visit(name, v)
        elif isinstance(obj, ShardedTensorFactory):
            raise AssertionError("factories must be applied first")
        elif isinstance(obj, ShardedTensor):
            k = (obj.key, tuple(int(x) for x in obj.global_offset))
            if k in out:
                raise CheckpointError(f"two shards of {obj.key} at offset {k[1]} on one rank")
            d, p = obj.data, params[name]
            if _storage_id(d) != _storage_id(p):
                raise CheckpointError(f"{name}: its sharded-state-dict entry {obj.key} is not a view of the parameter "
                                      "(a computed tensor), which the streaming converter cannot produce lazily")
            rel = int(d.storage_offset()) - int(p.storage_offset())
            out[k] = (name, tuple(d.shape), tuple(d.stride()), rel)

    for name, obj in sd.items():
        if name in params:
            visit(name, obj)
    return out
