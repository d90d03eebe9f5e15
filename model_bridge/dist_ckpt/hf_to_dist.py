"""HF safetensors -> dist checkpoint without materialising the model
(:func:`save_hf_as_dist_checkpoint`)."""
from __future__ import annotations

import json
import time
from typing import Optional

import torch

from model_bridge.dist_ckpt.direct_reader import _DirectReader
from model_bridge.dist_ckpt.lazy_save import _LazyTensors, _lazy_save_strategy
from model_bridge.dist_ckpt.meta import META_FILE, _meta
from model_bridge.dist_ckpt.meta_model import _flatten_prepended, _param_views, build_meta_thinker
from model_bridge.dist_ckpt.shard_writer import _numel
from model_bridge.dist_ckpt.sharded import _prepare_out_dir, model_sharded_state_dict
from model_bridge.io import CheckpointError


def _source_dtype(reader) -> torch.dtype:
    for key in ("thinker.model.embed_tokens.weight", "thinker.lm_head.weight"):
        if key in reader:
            return reader.dtype(key)
    return torch.float32


def _all_ranks_ok(error: Optional[BaseException]) -> None:
    from model_bridge.load import raise_if_any_failed

    raise_if_any_failed(error)


def save_hf_as_dist_checkpoint(hf_dir, out_dir, layout, *, dtype: Optional[torch.dtype] = None,
                               progress: bool = False, strict: bool = True) -> dict:
    """Write the HF checkpoint ``hf_dir`` as a torch_dist checkpoint in ``out_dir`` (collective; the
    parallel state must match ``layout``). This rank converts only what it owns (its layers, experts
    and TP slices), one parameter at a time, as the writer asks for it. ``dtype`` defaults to the
    source's. Returns stats (bytes, seconds, per phase)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import apply_factories

    from model_bridge.config import read_omni_config
    from model_bridge.io import SafetensorsReader
    from model_bridge.load import _used_anywhere, check_task_shapes
    from model_bridge.mappings import ParallelContext, build_tasks
    from model_bridge.qwen3_omni import OWNED_PREFIXES, PASSTHROUGH_PREFIXES, mapping_rules

    t0 = time.perf_counter()
    stats: dict = {}
    error = None
    try:
        spec = read_omni_config(hf_dir)
        reader = SafetensorsReader(hf_dir)
        dtype = dtype or _source_dtype(reader)
        model = build_meta_thinker(spec, layout, dtype)
        ctx = ParallelContext.from_parallel_state()
        tasks = {t.name: t for t in build_tasks(model, mapping_rules(spec, ctx.shard("tp").size), ctx)}
        check_task_shapes(list(tasks.values()), reader)
        keys = reader.keys()
    except BaseException as e:  # noqa: BLE001 - shared with every rank
        error = e
    _all_ranks_ok(error)
    used = set(k for t in tasks.values() for k in t.hf.values())
    used_any = _used_anywhere(keys, used)
    unused = [k for k, u in zip(keys, used_any) if k.startswith(OWNED_PREFIXES) and not u]
    unknown = [k for k in keys if not k.startswith(OWNED_PREFIXES) and not k.startswith(PASSTHROUGH_PREFIXES)]
    if strict and (unused or unknown):
        raise CheckpointError(f"{hf_dir}: {len(unused)} tensor(s) the model should hold are not mapped "
                              f"({unused[:10]}); {len(unknown)} tensor(s) neither mapped nor passed through "
                              f"({unknown[:10]})")
    stats["setup_s"] = time.perf_counter() - t0

    d = _prepare_out_dir(out_dir)
    t1 = time.perf_counter()
    sd = model_sharded_state_dict(model)
    apply_factories(sd)
    sd = _flatten_prepended(sd)
    params = dict(model.named_parameters())
    views = _param_views(sd, params)
    src = _DirectReader(reader)

    def materialize(name: str) -> torch.Tensor:
        t = tasks[name]
        return t.mapping.load(src, t.hf, t.param.shape, t.shard).to(dtype)

    total = sum(_numel(v[1]) for v in views.values()) * torch.empty((), dtype=dtype).element_size()
    bar = _progress_bar(progress and dist.get_rank() == 0, total, "hf -> mcore")
    lazy = _LazyTensors(views, materialize, {n: tuple(p.shape) for n, p in params.items()}, bar,
                        param_bytes={n: p.numel() * p.element_size() for n, p in params.items()})
    stats["plan_s"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    try:
        with _no_crc32():
            dist_checkpointing.save(sd, str(d), sharded_strategy=_lazy_save_strategy(lazy))
    finally:
        lazy.close()
        src.close()
        if bar is not None:
            bar.close()
    if dist.get_rank() == 0:
        meta = _meta(spec, layout, dtype, hf_dir, dist.get_world_size())
        (d / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    dist.barrier()
    stats.update(write_s=time.perf_counter() - t2, convert_s=lazy.seconds, convert_wait_s=lazy.wait_seconds,
                 bytes=lazy.bytes,
                 read_bytes=reader.read_bytes, total_s=time.perf_counter() - t0, dtype=str(dtype))
    return stats


class _no_crc32:
    """Skip the zip CRC32 that torch.save computes over every tensor record of the DCP files
    (~10% of the write time; torch.load does not need it). No-op where torch lacks the switch."""

    def __enter__(self):
        try:
            from torch.utils.serialization import config

            self._cfg = config.save
            self._old = self._cfg.compute_crc32
            self._cfg.compute_crc32 = False
        except (ImportError, AttributeError):
            self._cfg = None
        return self

    def __exit__(self, *exc):
        if self._cfg is not None:
            self._cfg.compute_crc32 = self._old


def _progress_bar(enabled: bool, total: int, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True,
                mininterval=0.5)
