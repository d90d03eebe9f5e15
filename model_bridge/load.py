"""``load_hf(model, hf_dir)``: fill a (possibly TP/EP/ETP/PP-sharded) Megatron model from an HF checkpoint.

Every rank walks its own parameters through the model's mapping table and reads, through the lazy
``SafetensorsReader``, only what it owns: its layers (PP), its experts' per-expert keys (EP), and
of each tensor only its rows or columns (TP/ETP) where the layout allows a slice. Nothing is
broadcast; ranks share no data, only two small all-reduces at the end (did any rank fail? which
HF keys did some rank use, as a bitmap over the index), so that

* every Megatron parameter is covered exactly once by the table (``MappingError`` lists the rest);
* every HF tensor the model should hold (``bridge.owned_prefixes``) was used by some rank, and no
  key is neither owned nor passed through (``CheckpointError`` lists them; ``strict=False``
  only reports them);
* a failure on one rank is raised on every rank (no rank is left waiting in a collective).

Errors name the key and the file: missing shard, missing key, corrupt header, shape mismatch
(expected and found), wrong model type in config.json (``ConfigError``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model_bridge.io import CheckpointError, SafetensorsReader
from model_bridge.mappings import MappingError, ParallelContext, Task, build_tasks
from model_bridge.qwen3_omni import QWEN3_OMNI, ModelBridge

__all__ = ["load_hf", "LoadReport", "unwrap_model", "model_chunks", "check_task_shapes", "raise_if_any_failed"]


@dataclass
class LoadReport:
    """What one rank loaded."""

    num_params: int = 0
    """Megatron parameters filled on this rank."""
    hf_keys: set[str] = field(default_factory=set)
    """HF tensors this rank used (read whole or in part)."""
    reads: dict[str, int] = field(default_factory=dict)
    """Tensor reads by key on this rank (a slice is one read)."""
    read_bytes: int = 0
    unused: list[str] = field(default_factory=list)
    """Owned HF keys no rank used, and keys neither owned nor passed through (non-strict mode)."""
    seconds: float = 0.0


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module style wrappers (``.module``) so parameter names match the table."""
    seen = 0
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module) and seen < 8:
        if hasattr(model, "language_model"):
            break
        model = model.module
        seen += 1
    return model


def check_task_shapes(tasks: list[Task], reader) -> None:
    """Every HF key exists and has the full shape this rank's parameter implies; one error listing
    all problems (key, file, expected and found shape, Megatron parameter)."""
    missing, wrong = [], []
    for t in tasks:
        try:
            expected = t.mapping.hf_shapes(t.param.shape, t.shard)
        except MappingError as e:
            wrong.append(f"{t.name} {list(t.param.shape)}: {e}")
            continue
        for role, key in t.hf.items():
            if key not in reader:
                missing.append(f"{key} (for {t.name})")
                continue
            found = reader.shape(key)
            if tuple(found) != tuple(expected[role]):
                wrong.append(f"{key} in {reader.file_of(key)}: expected {list(expected[role])}, found "
                             f"{list(found)} (for {t.name} {list(t.param.shape)} at {t.mapping.group} size "
                             f"{t.shard.size})")
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing from the checkpoint {reader.source}: "
                        + "; ".join(missing[:20]) + (" ..." if len(missing) > 20 else ""))
    if wrong:
        problems.append(f"shape mismatch for {len(wrong)} tensor(s): " + "; ".join(wrong[:20])
                        + (" ..." if len(wrong) > 20 else ""))
    if problems:
        raise CheckpointError(" | ".join(problems))


def _collective_device(dist) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def raise_if_any_failed(error: BaseException | None, what: str = "load_hf", error_cls: type = None) -> None:
    """Collective: every rank learns whether one failed; all raise (the failing rank its own error,
    the others ``error_cls``, default :class:`CheckpointError`, naming ``what``, the first failing
    rank and its error)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=_collective_device(dist))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not int(flag.item()):
        return
    msgs: list = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(r, m) for r, m in enumerate(msgs) if m is not None]
    raise (error_cls or CheckpointError)(f"{what} failed on rank {failed[0][0]} ({len(failed)} rank(s) failed): "
                                         f"{failed[0][1]}")


def _used_anywhere(all_keys: list[str], used: set[str]) -> list[bool]:
    """Collective: for each key of the (same on every rank) checkpoint, did any rank use it?"""
    import torch.distributed as dist

    mask = torch.tensor([k in used for k in all_keys], dtype=torch.uint8)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        mask = mask.to(_collective_device(dist))
        dist.all_reduce(mask, op=dist.ReduceOp.MAX)
    return [bool(x) for x in mask.cpu().tolist()]


def model_chunks(model) -> list[torch.nn.Module]:
    """A model or a list of virtual-pipeline chunks, unwrapped."""
    return [unwrap_model(m) for m in (model if isinstance(model, (list, tuple)) else [model])]


@torch.no_grad()
def load_hf(model: torch.nn.Module | list[torch.nn.Module], hf_dir: str | Path, *, bridge: ModelBridge = QWEN3_OMNI,
            strict: bool = True, reader: SafetensorsReader | None = None) -> LoadReport:
    """Load ``hf_dir`` into ``model`` (this rank's part). Collective over the default process
    group when torch.distributed is initialised: every rank must call it."""
    t0 = time.time()
    report = LoadReport()
    error: BaseException | None = None
    all_keys: list[str] = []
    try:
        spec = bridge.read_spec(hf_dir)
        reader = reader or SafetensorsReader(hf_dir)
        all_keys = reader.keys()
        ctx = ParallelContext.from_parallel_state()
        rules = bridge.rules(spec, ctx.shard("tp").size)
        tasks = [t for chunk in model_chunks(model) for t in build_tasks(chunk, rules, ctx)]
        check_task_shapes(tasks, reader)
        for t in tasks:
            local = t.mapping.load(reader, t.hf, t.param.shape, t.shard)
            if tuple(local.shape) != tuple(t.param.shape):  # a mapping bug, not a checkpoint problem
                raise MappingError(f"{t.name}: {t.mapping!r} produced shape {list(local.shape)}, the parameter "
                                   f"is {list(t.param.shape)}")
            t.param.copy_(local)
            report.hf_keys.update(t.hf.values())
        report.num_params = len(tasks)
        report.reads = dict(reader.reads)
        report.read_bytes = reader.read_bytes
    except BaseException as e:  # noqa: BLE001 - shared with the other ranks below, then re-raised
        error = e
    raise_if_any_failed(error)

    used = _used_anywhere(all_keys, report.hf_keys)
    owned = tuple(bridge.owned_prefixes)
    passthrough = tuple(bridge.passthrough_prefixes)
    unused = [k for k, u in zip(all_keys, used) if k.startswith(owned) and not u]
    unknown = [k for k in all_keys if not k.startswith(owned) and not k.startswith(passthrough)]
    report.unused = unused + unknown
    if strict and report.unused:
        parts = []
        if unused:
            parts.append(f"{len(unused)} HF tensor(s) the model should hold were not loaded by any rank (is the "
                         f"model missing a part, e.g. the audio tower?): {', '.join(unused[:20])}"
                         + (" ..." if len(unused) > 20 else ""))
        if unknown:
            parts.append(f"{len(unknown)} HF tensor(s) are neither mapped nor passed through {list(passthrough)}: "
                         + ", ".join(unknown[:20]) + (" ..." if len(unknown) > 20 else ""))
        raise CheckpointError(f"{hf_dir}: " + " | ".join(parts) + " (strict=False to only report)")
    report.seconds = time.time() - t0
    return report
