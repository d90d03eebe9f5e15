"""Multi-source push to GPU servers through vLLM's own many-to-many engine (`nccl_m2n`).

vLLM 0.32's `M2NTrainerWeightTransferEngine` (vllm/distributed/weight_transfer/m2n_trainer.py) puts
every trainer rank and every inference worker in one NCCL communicator (trainer ranks [0, T)) and
moves each parameter with one `nccl.m2n.reshard`, collective over all of them. What it needs from
the trainer, per rank (`M2NWeightSource`):

* one mesh for the whole trainer: `M2NMesh((a, b), 0)` over ranks [0, T), row-major;
* per HF-named parameter, the same list on every rank (`M2NParamMeta`): name, wire dtype, full HF
  shape, and its placement over that mesh: one axis shards a tensor dim evenly (`Shard(d)`), the
  other replicates, or `REPLICATED` (every trainer rank holds the whole tensor);
* iteration: this rank's local piece of each parameter, in the metadata's order.

`describe(model)` builds that from our export (`model_bridge.export.export_tasks`: every rank's own
TP/ETP slices and EP experts): the mesh is (T / s, s) with s the one split size of the job (TP, or
EP, or ETP), axis 1 being the rank's position in that group (megatron-core's default rank order puts
TP, and EP when ETP is 1, fastest; checked on the groups themselves). A TP slice of a fused Megatron
tensor becomes slices of the HF tensors (q/k/v, gate/up split locally, no communication); under
EP the experts of one layer travel as vLLM's fused checkpoint tensors
`...mlp.experts.gate_up_proj` [E, 2I, H] and `...mlp.experts.down_proj` [E, H, I], split along the
expert dim (vLLM's MoE loader takes both forms). A padded vocab-parallel embedding / output layer
(HF vocab not a multiple of 128 x TP) cannot be split evenly in HF rows: it is all-gathered in the
TP group and sent as replicated. The audio tower's Conv2d weights are 4-D, past m2n's rank limit of
3: they travel with their trailing dims merged, and our worker extension on the servers views them
back before loading (`rollout.vllm_ext.WorkerExtension.mgrpo_unflatten_on_load`, called by rank 0
before the engine's init). Every Qwen3-Omni parameter takes vLLM's fallback destination (its
checkpoint names are not vLLM's parameter names): every worker receives the full tensor and
`load_weights` shards it, as with the dense nccl engine; what m2n spreads is the trainer's side.
Jobs that do not fit raise `M2NUnfit` with the reason:

* pipeline parallelism (a stage's layers are on its ranks only; a reshard spans all trainer ranks);
* TP and EP both > 1 and unequal, or ETP > 1 with EP > 1, or ETP != TP (two split sizes, one mesh);
* a process-group layout other than megatron-core's default order (groups not contiguous ranks);
* a piece past vLLM's own checks (`validate`: dtype, even split, and at most 16 source shards into
  a replicated destination, so a split size (TP or EP) of at most 16).

`push_m2n` drives vLLM's engine on every trainer rank (collective over the default group) with rank
0 alone on the HTTP control plane, as `multisource.push_multisource` does: pause, start, the
reshards (the engine's `/update_weights` runs concurrently with them), finish with the version,
resume, through `push.PushSteps`; a failure is raised on every rank as `WeightPushError` naming the
stage. vLLM's engine loads as the reshards land, so after a failed transfer `PushSteps.recover`
aborts the update on the server (our extension restores the layers not yet complete) and leaves it
PAUSED when some layers already hold the new weights (named in the error), never resumed on a mix.
Needs CUDA, vLLM and the `nccl-extensions` package on the trainer and the servers, and servers
started with our worker extension (`mgrpo serve --weight-transfer nccl_m2n`); not run on this
project's machines yet (docs/rollout.md).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from megatron_grpo.weight_sync.m2n_link import shutdown_engine

__all__ = ["M2NUnfit", "M2NPiece", "M2NPlan", "describe", "validate", "unfit_reason", "make_source", "push_m2n"]

REPLICATE = -1  # vLLM's placement code for a replicating mesh axis (m2n_common.REPLICATE)
MAX_TENSOR_DIMS = 3  # ncclReshard's limit (m2n_common.MAX_TENSOR_DIMS)
_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.\d+\.(?P<proj>gate|up|down)_proj\.weight$")
_EXPERT_ID = re.compile(r"\.experts\.(\d+)\.")


class M2NUnfit(ValueError):
    """The job's export cannot be described for nccl_m2n; the message says which part and why."""


@dataclass
class M2NPiece:
    """One HF-named tensor as nccl_m2n moves it: full `shape`, `placements` over the trainer mesh
    (None: replicated) and `local()`, this rank's piece read from the model at send time."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    placements: tuple[int, int] | None
    local: Callable[[], torch.Tensor]


@dataclass
class M2NPlan:
    mesh_dims: tuple[int, int]
    pieces: list[M2NPiece]
    split: str
    """Which group axis 1 is ("tp", "ep", "etp", or "none")."""
    flattened: dict[str, list[int]] = field(default_factory=dict)
    """Tensors of rank > 3 (the audio tower's Conv2d weights), which nccl_m2n cannot carry: sent
    with their trailing dims merged (rank 3), name -> the real shape, which the servers' worker
    extension restores (`rollout.vllm_ext.WorkerExtension.mgrpo_unflatten_on_load`)."""


def _sizes() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {"world": 1, "tp": 1, "ep": 1, "etp": 1, "pp": 1, "vpp": 1}
    return {"world": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
            "tp": ps.get_tensor_model_parallel_world_size(), "ep": ps.get_expert_model_parallel_world_size(),
            "etp": ps.get_expert_tensor_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1}


def _check_group(role: str, size: int) -> None:
    """Axis 1 of the mesh is `rank % size`: the group must be `size` consecutive ranks in order."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if size == 1 or not dist.is_initialized():
        return
    group = {"tp": ps.get_tensor_model_parallel_group, "ep": ps.get_expert_model_parallel_group,
             "etp": ps.get_expert_tensor_parallel_group}[role]()
    ranks = dist.get_process_group_ranks(group)
    base = dist.get_rank() // size * size
    if ranks != list(range(base, base + size)):
        raise M2NUnfit(f"the {role.upper()} group of trainer rank {dist.get_rank()} is ranks {ranks}, not "
                       f"{list(range(base, base + size))}: nccl_m2n's trainer mesh needs megatron-core's default "
                       "rank order (tensor, then expert parallel fastest)")


def _split_size(s: dict[str, int]) -> tuple[str, int]:
    if s["pp"] > 1 or s["vpp"] > 1:
        raise M2NUnfit(f"pipeline parallelism (PP={s['pp']}): a stage's layers are held by its ranks only, while "
                       "vLLM's nccl_m2n reshards every parameter over all trainer ranks (Shard or Replicate on one "
                       "mesh of them)")
    tp, ep, etp = s["tp"], s["ep"], s["etp"]
    if ep > 1 and etp > 1:
        raise M2NUnfit(f"EP={ep} with ETP={etp}: each expert tensor is split two ways (experts and rows), and "
                       "nccl_m2n shards a tensor along one mesh axis only")
    if ep > 1 and tp > 1 and ep != tp:
        raise M2NUnfit(f"TP={tp} and EP={ep} differ: dense and expert tensors would need two trainer meshes, and "
                       "nccl_m2n takes one")
    if etp > 1 and tp > 1 and etp != tp:
        raise M2NUnfit(f"TP={tp} and ETP={etp} differ: dense and expert tensors would need two trainer meshes")
    if tp > 1:
        return "tp", tp
    if ep > 1:
        return "ep", ep
    if etp > 1:
        return "etp", etp
    return "none", 1


def _reshaped(local: Callable[[], torch.Tensor], shape) -> Callable[[], torch.Tensor]:
    return lambda: local().reshape(shape)


def _cast(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return x.to(dtype) if dtype is not None and x.is_floating_point() and x.dtype != dtype else x


def _all_gathered(param: torch.Tensor, shard) -> list[torch.Tensor]:
    import torch.distributed as dist

    local = param.detach().contiguous()
    out = [torch.empty_like(local) for _ in range(shard.size)]
    dist.all_gather(out, local, group=shard.group)
    return out


def _dense_split(mapping, x: torch.Tensor, size: int) -> tuple[dict[str, torch.Tensor], int] | None:
    """This rank's slice `x` (one of `size`) of a Megatron tensor as slices of its HF tensors (role ->
    piece) and the HF dim they split, or None when that is not an even split of HF rows/columns."""
    from model_bridge import transforms as T
    from model_bridge.mappings import QKV, ColumnParallel, GatedMLP, RowParallel

    if isinstance(mapping, QKV):  # whole KV groups per rank: its q, k, v rows are contiguous HF rows
        q, k, v = T.split_qkv(x, mapping.num_heads // size, mapping.num_kv_heads // size, mapping.head_dim)
        return {"q": q, "k": k, "v": v}, 0
    if isinstance(mapping, GatedMLP):  # [gate_r; up_r]: rows r of gate and of up
        gate, up = T.split_gate_up(x)
        return {"gate": gate, "up": up}, 0
    if isinstance(mapping, ColumnParallel):
        return {"hf": x}, 0
    if isinstance(mapping, RowParallel):
        return {"hf": x}, 1
    return None


def describe(model, spec=None, *, dtype: torch.dtype | None = None, bridge=None) -> M2NPlan:
    """This rank's nccl_m2n description of `model` (see the module doc); raises `M2NUnfit`. No
    collectives; the same names, shapes and placements on every rank."""
    from model_bridge.export import export_tasks
    from model_bridge.mappings import ExpertStacked, VocabParallel
    from model_bridge.qwen3_omni import QWEN3_OMNI

    s = _sizes()
    split, n = _split_size(s)
    for role, size in (("tp", s["tp"]), ("ep", s["ep"]), ("etp", s["etp"])):
        _check_group(role, size)
    if s["world"] % n:
        raise M2NUnfit(f"world size {s['world']} is not a multiple of the {split.upper()} size {n}")
    mesh = (s["world"] // n, n)
    sharded = (REPLICATE, 0), (REPLICATE, 1)  # placements for HF dim 0 / dim 1 along axis 1
    pieces: list[M2NPiece] = []
    fused: dict[str, dict[str, Any]] = {}  # EP: fused expert name -> its piece's parts

    flattened: dict[str, list[int]] = {}

    def add(name, shape, placements, local, x_dtype):
        if len(shape) > MAX_TENSOR_DIMS:
            if placements is not None and placements[1] >= MAX_TENSOR_DIMS - 1:
                raise M2NUnfit(f"{name} {list(shape)}: split along dim {placements[1]}, which merging its trailing "
                               f"dims into rank {MAX_TENSOR_DIMS} would break")
            flattened[name] = [int(v) for v in shape]
            shape = (*shape[:MAX_TENSOR_DIMS - 1], math.prod(shape[MAX_TENSOR_DIMS - 1:]))
            local = _reshaped(local, shape)
        pieces.append(M2NPiece(name, dtype if dtype is not None and x_dtype.is_floating_point else x_dtype,
                               tuple(int(v) for v in shape), placements, local))

    for t in export_tasks(model, spec, bridge=bridge or QWEN3_OMNI):
        m, sh, p = t.mapping, t.shard, t.param
        hf_shapes = m.hf_shapes(p.shape, sh)
        if m.group == "etp" and s["ep"] > 1:  # ETP is 1 here: whole experts, per layer in vLLM's fused form
            _add_expert(fused, pieces, t)
            continue
        if sh.size == 1:  # the whole tensor on every rank (PP is 1): replicated
            for role, x in m.merge_one(p.detach().contiguous()).items():
                add(t.hf[role], x.shape, None,
                    lambda m=m, p=p, role=role: _cast(m.merge_one(p.detach().contiguous())[role], dtype), p.dtype)
            continue
        if isinstance(m, VocabParallel):
            if p.shape[0] * sh.size == m.vocab_size:
                add(t.hf["hf"], hf_shapes["hf"], sharded[0], lambda p=p: _cast(p.detach(), dtype), p.dtype)
            else:  # padding rows: uneven HF split, so every rank takes the whole (one TP all-gather)
                add(t.hf["hf"], hf_shapes["hf"], None,
                    lambda m=m, p=p, sh=sh: _cast(m.merge(_all_gathered(p, sh))["hf"], dtype), p.dtype)
            continue
        inner = m.inner if isinstance(m, ExpertStacked) else m
        if _dense_split(inner, p.detach()[0] if isinstance(m, ExpertStacked) else p.detach(), sh.size) is None:
            raise M2NUnfit(f"{t.name}: {m!r} split over {sh.size} ranks is not an even split of its HF tensor(s)")
        if isinstance(m, ExpertStacked):  # EP 1, ETP > 1: each expert's slices under its own names
            for e in range(p.shape[0]):
                parts, dim = _dense_split(inner, p.detach()[e], sh.size)
                for role in parts:
                    add(t.hf[f"{role}@{e}"], hf_shapes[f"{role}@{e}"], sharded[dim],
                        lambda inner=inner, p=p, e=e, role=role, k=sh.size:
                        _cast(_dense_split(inner, p.detach()[e], k)[0][role], dtype), p.dtype)
            continue
        parts, dim = _dense_split(m, p.detach(), sh.size)
        for role in parts:
            add(t.hf[role], hf_shapes[role], sharded[dim],
                lambda m=m, p=p, role=role, k=sh.size: _cast(_dense_split(m, p.detach(), k)[0][role], dtype), p.dtype)
    for key, e in fused.items():
        first, per = e["ids"][0], len(e["ids"])
        if e["ids"] != list(range(first, first + per)) or first % per:
            raise M2NUnfit(f"{key}: this rank's experts {e['ids'][:4]}... are not one contiguous block of the "
                           "expert dim, so they are not its even split")
        e["piece"].shape = (per * n, *e["row"])
        e["piece"].dtype = dtype if dtype is not None and e["params"][0].is_floating_point() else e["params"][0].dtype
        e["piece"].local = lambda e=e: _stack(e, dtype)
    return M2NPlan(mesh, pieces, split, flattened)


def _add_expert(fused: dict, pieces: list, t) -> None:
    """File one expert parameter (a local expert, or a layer's stacked local experts) under its
    layer's fused name; the piece takes its place in the order at the layer's first one."""
    from model_bridge.mappings import ExpertStacked

    stacked = isinstance(t.mapping, ExpertStacked)
    names = list(t.hf.values())
    hit = _EXPERT.match(names[0])
    if hit is None:
        raise M2NUnfit(f"{t.name}: expert tensor {names[0]!r} is not named '...mlp.experts.N.<gate|up|down>_proj"
                       ".weight', so it has no fused checkpoint name")
    key = f"{hit.group('prefix')}.{'down_proj' if hit.group('proj') == 'down' else 'gate_up_proj'}"
    per_expert = len(t.mapping.pattern_roles) if stacked else len(names)
    ids = [int(_EXPERT_ID.search(n).group(1)) for n in names[::per_expert]]
    entry = fused.get(key)
    if entry is None:
        entry = fused[key] = {"params": [], "ids": [], "stacked": stacked,
                              "piece": M2NPiece(key, t.param.dtype, (), (REPLICATE, 0), lambda: None)}
        pieces.append(entry["piece"])
    entry["params"].append(t.param)
    entry["ids"] += ids
    entry["row"] = tuple(t.param.shape[1:] if stacked else t.param.shape)


def _stack(entry: dict, dtype: torch.dtype | None) -> torch.Tensor:
    """This rank's experts of one layer as one [E_local, ...] tensor (a view for grouped experts)."""
    params = [q.detach() for q in entry["params"]]
    if entry["stacked"]:
        x = params[0] if len(params) == 1 else torch.cat(params)
    else:
        x = torch.stack(params)
    return _cast(x, dtype)


def validate(plan: M2NPlan, num_workers: int = 1) -> None:
    """vLLM's own checks of every piece (m2n_common: dtype, tensor rank, placement codes, even split,
    source shards into a replicated destination), as its trainer and worker engines run them at
    init; raises `M2NUnfit` naming the parameter."""
    from vllm.distributed.weight_transfer.m2n_common import (
        REPLICATED,
        M2NMesh,
        check_plan_limits,
        check_transferable,
        resolve_layout,
        validate_layout,
    )

    src = M2NMesh(plan.mesh_dims, 0)
    dst = resolve_layout(M2NMesh((num_workers, 1), plan.mesh_dims[0] * plan.mesh_dims[1]), REPLICATED)
    for p in plan.pieces:
        try:
            check_transferable(p.name, p.dtype, p.shape)
            layout = resolve_layout(src, p.placements, f"parameter '{p.name}' source placements")
            validate_layout(*layout, p.shape, "source")
            check_plan_limits(layout, dst, p.name)
        except ValueError as e:
            raise M2NUnfit(f"nccl_m2n refuses parameter '{p.name}' {list(p.shape)} placed {p.placements} on the "
                           f"trainer mesh {plan.mesh_dims}: {e}") from e


def unfit_reason(model, spec=None) -> str | None:
    """Why this job cannot push through nccl_m2n (None: it can). Collective over the default group
    (every rank calls it; all get the same answer: the first rank's reason that has one)."""
    import torch.distributed as dist

    reason = None
    try:
        import nccl.m2n  # noqa: F401 - vLLM's engine imports it at init
    except ImportError as e:
        reason = f"the nccl-extensions package (nccl.m2n) is not importable: {e}"
    try:
        if reason is None:
            validate(describe(model, spec))
    except M2NUnfit as e:
        reason = str(e)
    except ImportError as e:
        reason = f"vLLM is not importable on the trainer: {e}"
    if not dist.is_initialized():
        return reason
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, reason)
    return next((f"trainer rank {r}: {w}" for r, w in enumerate(every) if w is not None), None)


def make_source(plan: M2NPlan):
    """`plan` as vLLM's `M2NWeightSource` (what `M2NTrainerWeightTransferEngine.trainer_init` takes)."""
    from vllm.distributed.weight_transfer.m2n_common import M2NMesh, M2NParamMeta
    from vllm.distributed.weight_transfer.m2n_source import M2NWeightSource

    class PlanSource(M2NWeightSource):
        def mesh(self):
            return M2NMesh(plan.mesh_dims, 0)

        def metadata(self):
            return [M2NParamMeta(p.name, p.dtype, p.shape, p.placements) for p in plan.pieces]

        def __iter__(self):
            for p in plan.pieces:
                yield p.name, p.local()

    return PlanSource()


# ------------------------------------------------------------------------------------------------ push
# server index -> vLLM's trainer engine of this (non-zero) rank; rank 0 keeps its own in the
# receivers' `M2NLink`s
_ENGINES: dict[int, Any] = {}


class _ControlPlane:
    """vLLM's `VLLMWeightSyncClient` for rank 0's engine: init and `/update_weights` go to the server;
    start and finish are `PushSteps`' (every server started before the transfers, finished with the
    version after all of them)."""

    def __init__(self, receiver):
        self.receiver = receiver

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.receiver._call("POST", "init_weight_transfer_engine", json={"init_info": init_info})

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info) -> None:
        self.receiver._call("POST", "update_weights", json={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass


def _bcast(obj=None):
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _engine(info: dict, rank: int, num_trainer_ranks: int, client, source):
    from vllm.distributed.weight_transfer.m2n_trainer import M2NTrainerInitInfo, M2NTrainerWeightTransferEngine

    init = M2NTrainerInitInfo(rank=rank, world_size=info["world_size"], num_trainer_ranks=num_trainer_ranks,
                              master_address=info["master_address"], master_port=info["master_port"])
    return M2NTrainerWeightTransferEngine.trainer_init(init, client=client, source=source)


def push_m2n(model, version: int | str, servers: list | None, *, dtype: torch.dtype | None = None,
             pause_mode: str = "abort", spec=None):
    """Push `model` (this rank's part) to `servers` (rank 0's `WeightReceiver`s with backend
    "nccl_m2n"; ignored elsewhere) as `version` through vLLM's nccl_m2n engine. Every rank of the
    default group calls it. Returns `PushStats` on rank 0, None elsewhere; raises `WeightPushError`
    on every rank when the push failed, `ValueError` on every rank when it cannot start (no nccl_m2n
    receivers, a job that does not fit: `unfit_reason`).

    Hangs vLLM's engine cannot turn into errors: a server that refuses the init after the other
    trainer ranks began to join, or a rank that dies inside a reshard, leaves the others in NCCL
    until its timeout (the step watchdog names it)."""
    import torch.distributed as dist

    from megatron_grpo.weight_sync.push import PAUSE_MODES

    if pause_mode not in PAUSE_MODES:
        raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
    plan = describe(model, spec, dtype=dtype)
    source = make_source(plan)
    if dist.get_rank() == 0:
        return _drive(plan, source, str(version), servers or [], pause_mode)
    _follow(source, str(version))
    return None


def _drive(plan: M2NPlan, source, version: str, servers: list, pause_mode: str):
    import torch.distributed as dist

    from megatron_grpo.weight_sync.push import PushStats, PushSteps, WeightPushError
    from model_bridge.spawn import free_port

    bad = None
    if not servers:
        bad = "push_m2n needs at least one WeightReceiver on rank 0"
    elif any(s.backend != "nccl_m2n" for s in servers):
        bad = f"push_m2n needs nccl_m2n receivers: {[s.url for s in servers if s.backend != 'nccl_m2n']}"
    if bad is not None:
        _bcast({"refuse": bad})
        raise ValueError(bad)
    names = [p.name for p in plan.pieces]
    stats = PushStats(version=version, servers=len(servers))
    steps = PushSteps(servers, stats)
    go = False
    try:
        for i, s in enumerate(servers):
            if s.transport.engine is not None and s.transport.names == names:
                continue
            s.transport.close()
            steps.current = s
            info = {"connect": i, "master_address": s.transport.master_address,
                    "master_port": free_port(s.transport.master_address),
                    "world_size": dist.get_world_size() + s.world_size()}
            if plan.flattened:  # before the worker engine exists: nothing is loaded yet
                s._call("POST", "collective_rpc", json={"method": "mgrpo_unflatten_on_load",
                                                        "args": [json.dumps(plan.flattened)]})
            _bcast(info)
            s.transport.engine = _engine(info, 0, dist.get_world_size(), _ControlPlane(s), source)
            s.transport.names = names
        steps.pause_and_start(pause_mode)
        go = True
        _bcast({"go": len(servers)})
        for s in servers:
            steps.current = s
            s.transport.engine.source = source
            s.transport.engine.send_weights()
            stats.buckets += 1
            stats.tensors += len(plan.pieces)
            stats.bytes += sum(torch.Size(p.shape).numel() * p.dtype.itemsize for p in plan.pieces)
        steps.finish_and_resume(version)
    except BaseException as exc:
        stage, current = steps.stage, steps.current
        if not go:
            _bcast({"error": f"trainer rank 0 failed at {stage}: {type(exc).__name__}: {exc}", "stage": stage})
        states = steps.recover(version)
        for s in servers:  # the other ranks drop theirs too: everyone reconnects next time
            s.transport.close()
        who = current.url if current is not None else "the trainer"
        msg = (f"nccl_m2n weight push of version {version!r} failed at {stage} on {who}: {type(exc).__name__}: "
               f"{exc}\nserver states after recovery:\n" + "\n".join(f"  {u}: {st}" for u, st in states.items()))
        m = re.search(r"trainer rank (\d+)", str(exc))
        rank = int(m.group(1)) if m else None
        if go:
            try:
                _bcast({"ok": False, "error": msg, "stage": stage, "states": states, "rank": rank})
            except Exception:  # noqa: BLE001 - a dead rank: the error raised here says what happened
                pass
        if isinstance(exc, Exception):
            raise WeightPushError(msg, server=current.url if current else None, version=version, stage=stage,
                                  states=states, rank=rank) from exc
        raise
    _bcast({"ok": True})
    return stats


def _follow(source, version: str) -> None:
    import torch.distributed as dist

    from megatron_grpo.weight_sync.push import WeightPushError

    while True:
        msg = _bcast()
        if "refuse" in msg:
            raise ValueError(f"(from trainer rank 0) {msg['refuse']}")
        if "error" in msg:
            _drop_engines()
            raise WeightPushError(f"(from trainer rank 0) {msg['error']}", server=None, version=version,
                                  stage=msg["stage"], states={})
        if "connect" in msg:
            shutdown_engine(_ENGINES.pop(msg["connect"], None))
            _ENGINES[msg["connect"]] = _engine(msg, dist.get_rank(), dist.get_world_size(), None, source)
            continue
        break
    for i in range(msg["go"]):
        _ENGINES[i].source = source
        _ENGINES[i].send_weights()
    result = _bcast()
    if not result.get("ok"):
        _drop_engines()
        raise WeightPushError(f"(from trainer rank 0) {result['error']}", server=None, version=version,
                              stage=result.get("stage", "?"), states=result.get("states", {}),
                              rank=result.get("rank"))


def _drop_engines() -> None:
    for i in list(_ENGINES):
        shutdown_engine(_ENGINES.pop(i))
