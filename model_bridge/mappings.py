"""Parameter mappings HF <-> Megatron: how one Megatron parameter is cut from HF tensors and put back.

Model-agnostic. A model's bridge is a *table* of ``Rule``s (e.g. the one in ``qwen3_omni.py``):

    Rule("language_model.decoder.layers.{layer}.self_attention.linear_qkv.weight",
         {"q": "model.layers.{layer}.self_attn.q_proj.weight", "k": ..., "v": ...},
         QKV(num_heads, num_kv_heads, head_dim))

Placeholders ``{name}`` match digits. Two names are special, everything else is copied as is:

* ``{layer}``: a Megatron decoder layer index local to the pipeline stage; on the HF side it becomes
  the global index (the layer module's ``layer_number - 1``, so any PP split works).
* ``{expert}``: an expert index local to the EP rank; on the HF side it becomes
  ``ep_rank * num_local_experts + expert``.

A mapping knows, for one Megatron parameter, which HF tensors ("roles") it is made of, what their
full shapes are (``hf_shapes``), how to read *only this rank's part* of them through a lazy source
(``load``: row/column slices of the safetensors, never the whole tensor when a slice suffices), and
how to turn the list of every group rank's shards back into full HF tensors (``merge``; for a group
of one, ``merge_one``, which returns views of the parameter wherever the HF layout allows). Which
process group a parameter is split over is the mapping's ``group`` role: ``"tp"`` (dense tensor
parallel) or ``"etp"`` (expert tensor parallel); an expert variant is the same class with
``group="etp"`` and ``{expert}`` in its patterns.

Mappings: ``Replicated`` (whole tensor on every rank of the group), ``ColumnParallel`` (split dim 0),
``RowParallel`` (split dim 1), ``QKV`` (q/k/v fused per KV group, split by groups), ``GatedMLP``
(gate/up fused, each split), ``VocabParallel`` (split dim 0 of the padded vocab, padding rows
zero on load and dropped on export), ``ExpertStacked`` (a layer's local experts stacked along dim 0
of one parameter, each expert mapped by an inner mapping; its HF patterns use ``{expert}``, which
``build_tasks`` expands over the local experts).
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Protocol, Sequence

import torch

from model_bridge import transforms as T

__all__ = [
    "MappingError", "Source", "DictSource", "Shard", "ParallelContext", "ParamMapping", "Replicated",
    "ColumnParallel", "RowParallel", "QKV", "GatedMLP", "VocabParallel", "ExpertStacked", "Rule", "Task",
    "build_tasks", "task_shard", "gather_shards", "SINGLE",
]

SINGLE = "hf"
"""The role name of a mapping made of one HF tensor (a ``Rule`` whose ``hf`` is a plain string)."""


class MappingError(ValueError):
    """The model and the mapping table do not fit (uncovered or doubly covered parameters, wrong
    local shapes); the message lists the parameters."""


# ------------------------------------------------------------------------------------------------
# sources and shards
# ------------------------------------------------------------------------------------------------


class Source(Protocol):
    """What a mapping reads from: ``SafetensorsReader`` or an in-memory ``DictSource``."""

    def read(self, key: str, dim: int = 0, start: int | None = None, stop: int | None = None,
             expect_shape: Iterable[int] | None = None) -> torch.Tensor: ...

    def shape(self, key: str) -> tuple[int, ...]: ...


class DictSource:
    """In-memory ``Source`` over a dict of full tensors (tests, in-process conversions)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape)

    def read(self, key, dim=0, start=None, stop=None, expect_shape=None):
        t = self.tensors[key]
        if expect_shape is not None and tuple(t.shape) != tuple(expect_shape):
            raise MappingError(f"shape mismatch for {key}: expected {list(expect_shape)}, found {list(t.shape)}")
        if start is None and stop is None:
            return t
        return t.narrow(dim, start or 0, (t.shape[dim] if stop is None else stop) - (start or 0))


@dataclass(frozen=True)
class Shard:
    """This rank's place in the process group one parameter is split over."""

    size: int = 1
    rank: int = 0
    group: object = None
    """The torch ProcessGroup (None when size is 1 or in pure tests)."""
    replica_rank: int = 0
    """Rank among the data-parallel replicas of this shard (0 = the one that exports it)."""


@dataclass(frozen=True)
class ParallelContext:
    """Shards by group role plus the EP position: everything mappings need from the parallel state."""

    shards: Mapping[str, Shard] = field(default_factory=lambda: {"tp": Shard(), "etp": Shard()})
    ep_rank: int = 0
    ep_size: int = 1

    def shard(self, role: str) -> Shard:
        try:
            return self.shards[role]
        except KeyError:
            raise MappingError(f"unknown process-group role {role!r}; known: {sorted(self.shards)}") from None

    @classmethod
    def from_parallel_state(cls) -> "ParallelContext":
        """Read TP/ETP/EP/DP positions from megatron-core's parallel_state (single rank if unset)."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return cls()
        tp = Shard(size=ps.get_tensor_model_parallel_world_size(), rank=ps.get_tensor_model_parallel_rank(),
                   group=ps.get_tensor_model_parallel_group(),
                   replica_rank=ps.get_data_parallel_rank(with_context_parallel=True))
        etp = Shard(size=ps.get_expert_tensor_parallel_world_size(), rank=ps.get_expert_tensor_parallel_rank(),
                    group=ps.get_expert_tensor_parallel_group(),
                    replica_rank=ps.get_expert_data_parallel_rank())
        return cls(shards={"tp": tp, "etp": etp}, ep_rank=ps.get_expert_model_parallel_rank(),
                   ep_size=ps.get_expert_model_parallel_world_size())


def gather_shards(local: torch.Tensor, shard: Shard) -> list[torch.Tensor] | None:
    """Every group rank's shard (in rank order) on group rank 0, None elsewhere. Collective over
    ``shard.group``: all its ranks must call it for the same parameter in the same order."""
    if shard.size == 1:
        return [local]
    import torch.distributed as dist

    local = local.detach().contiguous()
    dst = dist.get_global_rank(shard.group, 0)
    out = [torch.empty_like(local) for _ in range(shard.size)] if shard.rank == 0 else None
    dist.gather(local, out, dst=dst, group=shard.group)
    return out


# ------------------------------------------------------------------------------------------------
# mappings
# ------------------------------------------------------------------------------------------------


def _shape(x) -> tuple[int, ...]:
    return tuple(int(v) for v in x)


class ParamMapping(ABC):
    """How one Megatron parameter relates to one or more HF tensors (see the module docstring)."""

    roles: tuple[str, ...] = (SINGLE,)

    def __init__(self, group: str = "tp", replicated: bool = False):
        self.group = group
        self.replicated = replicated
        """Every rank of the group holds the whole parameter: load it unsplit, export it from group
        rank 0 without a collective (e.g. the fused QKV of an encoder replicated over TP)."""

    def __repr__(self) -> str:
        rep = ", replicated=True" if self.replicated else ""
        return f"{type(self).__name__}(group={self.group!r}{rep})"

    @abstractmethod
    def hf_shapes(self, local_shape: Sequence[int], shard: Shard) -> dict[str, tuple[int, ...]]:
        """Full HF shape of each role implied by this rank's parameter shape."""

    @abstractmethod
    def load(self, src: Source, keys: Mapping[str, str], local_shape: Sequence[int], shard: Shard
             ) -> torch.Tensor:
        """This rank's shard, reading only the part of the HF tensors it needs."""

    @abstractmethod
    def merge(self, shards: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full HF tensor per role from all group ranks' shards (rank order)."""

    def merge_one(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        """``merge([full])`` for a group of one, ``full`` contiguous: the mappings whose HF tensors
        are plain slices of the parameter return views of it (no copy)."""
        return self.merge([full])

    # helpers
    def _read(self, src: Source, key: str, full: Sequence[int], dim: int = 0, start=None, stop=None):
        return src.read(key, dim=dim, start=start, stop=stop, expect_shape=_shape(full))


class Replicated(ParamMapping):
    """The whole HF tensor on every rank of the group (norms, router, biases of row-parallel layers)."""

    def __init__(self, group: str = "tp"):
        super().__init__(group, replicated=True)

    def __repr__(self) -> str:
        return f"Replicated(group={self.group!r})"

    def hf_shapes(self, local_shape, shard):
        return {SINGLE: _shape(local_shape)}

    def load(self, src, keys, local_shape, shard):
        return self._read(src, keys[SINGLE], local_shape)

    def merge(self, shards):
        return {SINGLE: shards[0]}

    def merge_one(self, full):
        return {SINGLE: full}


class ColumnParallel(ParamMapping):
    """Split along dim 0 (output features of a column-parallel linear, or its bias)."""

    def hf_shapes(self, local_shape, shard):
        s = _shape(local_shape)
        return {SINGLE: (s[0] * shard.size, *s[1:])}

    def load(self, src, keys, local_shape, shard):
        full = self.hf_shapes(local_shape, shard)[SINGLE]
        a, b = T.shard_range(full[0], shard.size, shard.rank, keys[SINGLE])
        return self._read(src, keys[SINGLE], full, 0, a, b)

    def merge(self, shards):
        if len(shards) == 1:
            return self.merge_one(shards[0].contiguous())
        return {SINGLE: torch.cat(list(shards), dim=0)}

    def merge_one(self, full):
        return {SINGLE: full}


class RowParallel(ParamMapping):
    """Split along dim 1 (input features of a row-parallel linear)."""

    def hf_shapes(self, local_shape, shard):
        s = _shape(local_shape)
        if len(s) < 2:
            raise MappingError(f"RowParallel needs a 2-D parameter, got shape {list(s)} (a row-parallel bias "
                               "is Replicated)")
        return {SINGLE: (s[0], s[1] * shard.size, *s[2:])}

    def load(self, src, keys, local_shape, shard):
        full = self.hf_shapes(local_shape, shard)[SINGLE]
        a, b = T.shard_range(full[1], shard.size, shard.rank, keys[SINGLE])
        return self._read(src, keys[SINGLE], full, 1, a, b)

    def merge(self, shards):
        if len(shards) == 1:
            return self.merge_one(shards[0].contiguous())
        return {SINGLE: torch.cat(list(shards), dim=1)}

    def merge_one(self, full):
        return {SINGLE: full}


class QKV(ParamMapping):
    """Megatron ``linear_qkv`` (weight or bias) <-> HF q/k/v projections, fused per KV group.

    ``num_kv_heads == num_heads`` is plain multi-head attention (fused per head).
    """

    roles = ("q", "k", "v")

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, group: str = "tp",
                 replicated: bool = False):
        super().__init__(group, replicated)
        if num_heads % num_kv_heads:
            raise MappingError(f"QKV: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    def __repr__(self) -> str:
        rep = ", replicated=True" if self.replicated else ""
        return f"QKV({self.num_heads}, {self.num_kv_heads}, {self.head_dim}, group={self.group!r}{rep})"

    def hf_shapes(self, local_shape, shard):
        s = _shape(local_shape)
        want = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        if s[0] * shard.size != want:
            raise MappingError(f"QKV: local rows {s[0]} x {shard.size} ranks != (heads {self.num_heads} + 2 x "
                               f"kv heads {self.num_kv_heads}) x head_dim {self.head_dim} = {want}")
        return {"q": (self.num_heads * self.head_dim, *s[1:]), "k": (self.num_kv_heads * self.head_dim, *s[1:]),
                "v": (self.num_kv_heads * self.head_dim, *s[1:])}

    def load(self, src, keys, local_shape, shard):
        full = self.hf_shapes(local_shape, shard)
        rows = T.qkv_group_rows(self.num_heads, self.num_kv_heads, self.head_dim, shard.size, shard.rank)
        q, k, v = (self._read(src, keys[r], full[r], 0, a, b) for r, (a, b) in zip(self.roles, rows))
        return T.fuse_qkv(q, k, v, self.num_heads // shard.size, self.num_kv_heads // shard.size, self.head_dim)

    def merge(self, shards):
        fused = shards[0] if len(shards) == 1 else torch.cat(list(shards), dim=0)
        q, k, v = T.split_qkv(fused, self.num_heads, self.num_kv_heads, self.head_dim)
        return {"q": q, "k": k, "v": v}


class GatedMLP(ParamMapping):
    """Megatron gated ``linear_fc1`` (``[gate_r; up_r]`` per rank) <-> HF gate_proj and up_proj."""

    roles = ("gate", "up")

    def hf_shapes(self, local_shape, shard):
        s = _shape(local_shape)
        if s[0] % 2:
            raise MappingError(f"GatedMLP: odd local rows {s[0]}")
        full = (s[0] // 2 * shard.size, *s[1:])
        return {"gate": full, "up": full}

    def load(self, src, keys, local_shape, shard):
        full = self.hf_shapes(local_shape, shard)
        a, b = T.shard_range(full["gate"][0], shard.size, shard.rank, keys["gate"])
        gate = self._read(src, keys["gate"], full["gate"], 0, a, b)
        up = self._read(src, keys["up"], full["up"], 0, a, b)
        return T.fuse_gate_up(gate, up)

    def merge(self, shards):
        if len(shards) == 1:
            return self.merge_one(shards[0].contiguous())
        gate, up = T.split_gate_up_shards(list(shards))
        return {"gate": gate, "up": up}

    def merge_one(self, full):
        gate, up = T.split_gate_up(full)  # the halves of a contiguous tensor: views
        return {"gate": gate, "up": up}


class VocabParallel(ParamMapping):
    """Embedding / output layer over a padded vocab split along dim 0; padding rows are zero on load
    and dropped on export."""

    def __init__(self, vocab_size: int, group: str = "tp", replicated: bool = False):
        super().__init__(group, replicated)
        self.vocab_size = vocab_size

    def __repr__(self) -> str:
        return f"VocabParallel({self.vocab_size}, group={self.group!r})"

    def hf_shapes(self, local_shape, shard):
        s = _shape(local_shape)
        if s[0] * shard.size < self.vocab_size:
            raise MappingError(f"VocabParallel: {s[0]} rows x {shard.size} ranks < vocab {self.vocab_size}")
        return {SINGLE: (self.vocab_size, *s[1:])}

    def load(self, src, keys, local_shape, shard):
        full = self.hf_shapes(local_shape, shard)[SINGLE]
        n = int(local_shape[0])
        a, b = shard.rank * n, min((shard.rank + 1) * n, self.vocab_size)
        if a >= b:  # this rank holds padding rows only
            src.shape(keys[SINGLE])  # still fail clearly on a missing key
            return torch.zeros(_shape(local_shape))
        return T.pad_vocab(self._read(src, keys[SINGLE], full, 0, a, b), n)

    def merge(self, shards):
        full = shards[0] if len(shards) == 1 else torch.cat(list(shards), dim=0)
        return {SINGLE: T.unpad_vocab(full, self.vocab_size).contiguous()}


class ExpertStacked(ParamMapping):
    """The local experts of one layer stacked along dim 0 of one parameter (``[E_local, *expert]``,
    e.g. grouped-GEMM experts), expert ``e`` mapped by ``inner`` to its own HF tensors.

    In a ``Rule`` the HF patterns name the per-expert tensors with ``{expert}`` (the global expert
    index), which the Megatron pattern does not capture; ``build_tasks`` binds the mapping to the
    parameter's expert count (:meth:`bind`) and expands the roles to ``"<role>@<local expert>"``
    with ``{expert} = ep_rank * E_local + e``. Group and shard layout are the inner mapping's (one
    ETP shard of every expert on each rank).
    """

    expands = "expert"
    """The HF placeholder expanded over dim 0."""

    def __init__(self, inner: ParamMapping, num_local: int | None = None):
        super().__init__(inner.group, inner.replicated)
        self.inner = inner
        self.num_local = num_local
        self.pattern_roles = tuple(inner.roles)
        self.roles = () if num_local is None else tuple(
            f"{r}@{e}" for e in range(num_local) for r in self.pattern_roles)

    def __repr__(self) -> str:
        n = "" if self.num_local is None else f", num_local={self.num_local}"
        return f"ExpertStacked({self.inner!r}{n})"

    def bind(self, num_local: int) -> "ExpertStacked":
        """This mapping for a parameter holding ``num_local`` experts."""
        return ExpertStacked(self.inner, int(num_local))

    def _check(self, local_shape) -> tuple[int, ...]:
        s = _shape(local_shape)
        if self.num_local is None:
            raise MappingError(f"{self!r} is not bound to an expert count (use build_tasks)")
        if len(s) < 2 or s[0] != self.num_local:
            raise MappingError(f"ExpertStacked: parameter shape {list(s)} does not stack {self.num_local} experts "
                               "along dim 0")
        return s

    def hf_shapes(self, local_shape, shard):
        s = self._check(local_shape)
        per = self.inner.hf_shapes(s[1:], shard)
        return {f"{r}@{e}": per[r] for e in range(s[0]) for r in self.pattern_roles}

    def load(self, src, keys, local_shape, shard):
        s = self._check(local_shape)
        return torch.stack([self.inner.load(src, {r: keys[f"{r}@{e}"] for r in self.pattern_roles}, s[1:], shard)
                            for e in range(s[0])])

    def merge(self, shards):
        if len(shards) == 1:  # one unbind, then each expert's views of the parameter (no copy)
            out = {}
            for e, x in enumerate(shards[0].contiguous().unbind(0)):
                m = self.inner.merge_one(x)
                for r in self.pattern_roles:
                    out[f"{r}@{e}"] = m[r]
            return out
        n = shards[0].shape[0]
        out = {}
        for e in range(n):
            for r, t in self.inner.merge([sh[e] for sh in shards]).items():
                out[f"{r}@{e}"] = t
        return out


# ------------------------------------------------------------------------------------------------
# rules and tasks
# ------------------------------------------------------------------------------------------------

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def _pattern_regex(pattern: str) -> re.Pattern:
    out, pos = [], 0
    for m in _PLACEHOLDER.finditer(pattern):
        out.append(re.escape(pattern[pos:m.start()]))
        out.append(f"(?P<{m.group(1)}>\\d+)")
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    return re.compile("".join(out) + r"\Z")


@dataclass(frozen=True)
class Rule:
    """One line of a mapping table: a Megatron parameter pattern, its HF tensor pattern(s), a mapping."""

    megatron: str
    hf: str | Mapping[str, str]
    mapping: ParamMapping

    def __post_init__(self):
        object.__setattr__(self, "_regex", _pattern_regex(self.megatron))
        hf = {SINGLE: self.hf} if isinstance(self.hf, str) else dict(self.hf)
        roles = getattr(self.mapping, "pattern_roles", self.mapping.roles)
        if set(hf) != set(roles):
            raise MappingError(f"rule {self.megatron}: HF roles {sorted(hf)} do not match {self.mapping!r} "
                               f"roles {sorted(roles)}")
        names = set(_PLACEHOLDER.findall(self.megatron))
        expands = getattr(self.mapping, "expands", None)
        if expands is not None:
            if expands in names:
                raise MappingError(f"rule {self.megatron}: {self.mapping!r} expands {{{expands}}}, which the Megatron "
                                   "pattern must not capture")
            names = names | {expands}
        for role, pat in hf.items():
            extra = set(_PLACEHOLDER.findall(pat)) - names
            if extra:
                raise MappingError(f"rule {self.megatron}: HF pattern {pat!r} uses {sorted(extra)} which the "
                                   "Megatron pattern does not capture")
        object.__setattr__(self, "_hf", hf)

    def match(self, name: str) -> re.Match | None:
        return self._regex.match(name)  # type: ignore[attr-defined]

    def hf_names(self, values: Mapping[str, int]) -> dict[str, str]:
        return {role: pat.format(**values) for role, pat in self._hf.items()}  # type: ignore[attr-defined]

    def expanded_hf_names(self, values: Mapping[str, int], num_local: int, offset: int) -> dict[str, str]:
        """For an expanding mapping (``ExpertStacked``): ``"<role>@<e>"`` -> HF name with the expanded
        placeholder set to ``offset + e`` for each of the ``num_local`` stacked entries."""
        key = self.mapping.expands
        # the other placeholders once per role, then only the expanded one per entry
        parts = {role: pat.format(**{**values, key: "\0"}).split("\0")
                 for role, pat in self._hf.items()}  # type: ignore[attr-defined]
        return {f"{role}@{e}": str(offset + e).join(p) for e in range(num_local) for role, p in parts.items()}


@dataclass
class Task:
    """One Megatron parameter of this rank, resolved: its HF tensor names and shard position."""

    name: str
    param: torch.nn.Parameter
    rule: Rule
    hf: dict[str, str]
    shard: Shard
    bound: ParamMapping | None = None
    """The rule's mapping bound to this parameter (expanding mappings such as ``ExpertStacked``)."""

    @property
    def mapping(self) -> ParamMapping:
        return self.bound if self.bound is not None else self.rule.mapping


def _global_values(model: torch.nn.Module, name: str, m: re.Match, ctx: ParallelContext) -> dict[str, int]:
    values = {k: int(v) for k, v in m.groupdict().items()}
    if "layer" in values:
        layer = model.get_submodule(name[:m.end("layer")])
        number = getattr(layer, "layer_number", None)
        if number is None:
            raise MappingError(f"{name}: module {name[:m.end('layer')]} has no layer_number (not a Megatron "
                               "TransformerLayer?), cannot tell its global layer index")
        values["layer"] = int(number) - 1
    if "expert" in values:
        container = model.get_submodule(name[:m.start("expert") - 1])
        values["expert"] = ctx.ep_rank * len(container) + values["expert"]
    return values


def task_shard(mapping: ParamMapping, ctx: ParallelContext) -> Shard:
    """The shard a mapping works with on this rank: its group's, or for a replicated mapping a group
    of one whose replica_rank is 0 only on group rank 0 of the exporting replica."""
    shard = ctx.shard(mapping.group)
    if not mapping.replicated:
        return shard
    return Shard(size=1, rank=0, group=None, replica_rank=0 if shard.rank == 0 and shard.replica_rank == 0 else 1)


def build_tasks(model: torch.nn.Module, rules: Sequence[Rule], ctx: ParallelContext) -> list[Task]:
    """One ``Task`` per parameter of ``model`` (in ``named_parameters`` order, the same on every
    rank of a stage). Raises ``MappingError`` listing the parameters no rule covers, or that
    several rules cover."""
    tasks, uncovered, doubly = [], [], []
    for name, param in model.named_parameters():
        hits = [(r, m) for r in rules if (m := r.match(name)) is not None]
        if not hits:
            uncovered.append(f"{name} {list(param.shape)}")
            continue
        if len(hits) > 1:
            doubly.append(f"{name}: {[r.megatron for r, _ in hits]}")
            continue
        rule, m = hits[0]
        values = _global_values(model, name, m, ctx)
        if getattr(rule.mapping, "expands", None) is not None:  # stacked experts: one HF set per local expert
            if param.dim() < 2:
                raise MappingError(f"{name} {list(param.shape)}: {rule.mapping!r} needs a stacked (>= 2-D) parameter")
            n = int(param.shape[0])
            bound = rule.mapping.bind(n)
            tasks.append(Task(name, param, rule, rule.expanded_hf_names(values, n, ctx.ep_rank * n),
                              task_shard(bound, ctx), bound))
            continue
        tasks.append(Task(name, param, rule, rule.hf_names(values), task_shard(rule.mapping, ctx)))
    problems = []
    if uncovered:
        problems.append(f"{len(uncovered)} Megatron parameter(s) not covered by the mapping table: "
                        + "; ".join(uncovered))
    if doubly:
        problems.append(f"{len(doubly)} parameter(s) covered by several rules: " + "; ".join(doubly))
    if problems:
        raise MappingError(" | ".join(problems))
    return tasks
