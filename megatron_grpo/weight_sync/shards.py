"""A trainer rank's own shards as the multi-source push sends them, and their assembly into HF tensors
on the server.

Sender side (`owned_shards`): every parameter task of this rank (`model_bridge.export.export_tasks`)
that this rank owns: its local tensor as it sits in the Megatron model (a TP/ETP slice, an EP rank's
stacked experts, a pipeline stage's layers), never gathered. Ownership follows the mapping table's
own rule (`model_bridge.mappings.task_shard`): a split parameter is owned by each of its shard ranks
in data-parallel replica 0; a replicated one (norms under TP, the router, everything on DP replicas
> 0) by exactly one rank. So across the job every byte of the model leaves exactly one rank.

Receiver side (`ShardAssembler`): the shards of one parameter arrive (in any order, from several
senders) with the parameter's mapping in declarative form (`mapping_spec`); when all `size` of them
are in, the mapping's own `merge` (the one `export_hf` uses after its gather) turns them into the
HF-named tensors. Same shards + same merge = the gather path's tensors, bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ShardEntry", "owned_shards", "mapping_spec", "mapping_from_spec", "ShardAssembler"]

# constructor arguments of the mappings that have any (merge depends on nothing else)
_SPEC_ARGS = {"QKV": ("num_heads", "num_kv_heads", "head_dim"), "VocabParallel": ("vocab_size",)}


def mapping_spec(mapping) -> dict[str, Any]:
    """A JSON-able description of a `ParamMapping`, enough to `merge` its shards elsewhere."""
    kind = type(mapping).__name__
    if kind == "ExpertStacked":
        return {"kind": kind, "inner": mapping_spec(mapping.inner), "num_local": mapping.num_local}
    return {"kind": kind, **{a: getattr(mapping, a) for a in _SPEC_ARGS.get(kind, ())}}


def mapping_from_spec(spec: dict[str, Any]):
    """Inverse of `mapping_spec`."""
    from model_bridge import mappings as M

    kind = spec.get("kind")
    if kind == "ExpertStacked":
        return M.ExpertStacked(mapping_from_spec(spec["inner"]), spec["num_local"])
    cls = getattr(M, str(kind), None)
    if not (isinstance(cls, type) and issubclass(cls, M.ParamMapping)):
        raise ValueError(f"unknown parameter mapping {kind!r} in a multi-source weight push")
    return cls(**{a: spec[a] for a in _SPEC_ARGS.get(kind, ())})


@dataclass
class ShardEntry:
    """One shard a rank sends: shard `rank` of `size` of the parameter known as `key` (its first HF
    name), with the HF names it merges into (`hf`: role -> name) and its mapping (`mapping_spec`)."""

    key: str
    rank: int
    size: int
    hf: dict[str, str]
    mapping: dict[str, Any]
    tensor: torch.Tensor

    @property
    def wire_name(self) -> str:
        return f"{self.key}#shard{self.rank}of{self.size}"

    def meta(self) -> dict[str, Any]:
        """What the server needs to file this shard (travels over HTTP, no tensor data)."""
        return {"key": self.key, "rank": self.rank, "size": self.size, "hf": self.hf, "mapping": self.mapping}


def owned_shards(model, spec=None, *, dtype: torch.dtype | None = None, **bridge_kw) -> list[ShardEntry]:
    """This rank's shards in `export_tasks` order (no collectives, no copies unless `dtype` casts)."""
    from model_bridge.export import export_tasks

    out = []
    for t in export_tasks(model, spec, **bridge_kw):
        if t.shard.replica_rank != 0:
            continue  # a data-parallel replica (or a replicated parameter's non-owner): its twin sends it
        x = t.param.detach()
        if dtype is not None and x.is_floating_point() and x.dtype != dtype:
            x = x.to(dtype)
        out.append(ShardEntry(key=next(iter(t.hf.values())), rank=t.shard.rank, size=t.shard.size,
                              hf=dict(t.hf), mapping=mapping_spec(t.mapping), tensor=x))
    return out


class ShardAssembler:
    """Collects shards until a parameter is complete, then merges it into HF-named tensors."""

    def __init__(self):
        self._open: dict[str, dict[str, Any]] = {}

    def add(self, meta: dict[str, Any], tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """File one shard; returns the parameter's (hf_name, tensor) pairs once all its shards are in."""
        key, rank, size = meta["key"], int(meta["rank"]), int(meta["size"])
        entry = self._open.setdefault(key, {"size": size, "parts": {}, "meta": meta})
        if entry["size"] != size or not 0 <= rank < size:
            raise ValueError(f"shard {rank} of {size} of {key!r} does not fit the {entry['size']} shards "
                             "announced before")
        if rank in entry["parts"]:
            raise ValueError(f"shard {rank} of {key!r} was sent twice (two ranks claim it)")
        entry["parts"][rank] = tensor
        if len(entry["parts"]) < size:
            return []
        del self._open[key]
        m = entry["meta"]
        merged = mapping_from_spec(m["mapping"]).merge([entry["parts"][r] for r in range(size)])
        return [(m["hf"][role], t) for role, t in merged.items()]

    def missing(self) -> list[str]:
        """'key: shards a, b of n' for every parameter still incomplete."""
        return [f"{k}: have shards {sorted(e['parts'])} of {e['size']}" for k, e in self._open.items()]
