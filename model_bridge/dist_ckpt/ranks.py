"""Rank entry points (``run_ranks`` targets: top level, so they pickle by name) of the converters
and the checkpoint tests, and :func:`forward_logits`."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import torch

from model_bridge.dist_ckpt.direct_reader import _DirectReader
from model_bridge.dist_ckpt.dist_to_hf import _ckpt_dtype, iter_dist_checkpoint_as_hf
from model_bridge.dist_ckpt.hf_to_dist import _progress_bar, save_hf_as_dist_checkpoint
from model_bridge.dist_ckpt.meta import check_dist_checkpoint, resolve_mcore_input
from model_bridge.dist_ckpt.meta_model import build_meta_thinker
from model_bridge.dist_ckpt.shard_writer import StreamingShardWriter, _numel
from model_bridge.dist_ckpt.sharded import load_model, save_model


def _init(tp=1, ep=1, etp=None, pp=1):
    from model_bridge.config import ParallelLayout
    from model_bridge.parallel import init_parallel

    torch.set_num_threads(max(1, int(os.environ.get("MGRPO_CONVERT_THREADS", "1"))))
    init_parallel(tp=tp, ep=ep, etp=etp, pp=pp)
    return ParallelLayout(tp=tp, ep=ep, etp=etp, pp=pp)


def _profiled(name: str):
    """Run a rank entry point under cProfile when $MGRPO_CONVERT_PROFILE names a directory
    (stats go to DIR/NAME-rankR.prof; read them with ``python -m pstats``)."""
    import functools

    def deco(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            where = os.environ.get("MGRPO_CONVERT_PROFILE")
            if not where:
                return fn(*args, **kwargs)
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
            try:
                return fn(*args, **kwargs)
            finally:
                prof.disable()
                Path(where).mkdir(parents=True, exist_ok=True)
                prof.dump_stats(str(Path(where) / f"{name}-rank{os.environ.get('RANK', '0')}.prof"))
        return run
    return deco


@_profiled("hf_to_mcore")
def rank_hf_to_mcore(hf_dir: str, out_dir: str, tp: int = 1, ep: int = 1, etp: Optional[int] = None, pp: int = 1,
                     dtype: Optional[str] = None, progress: bool = True) -> dict:
    """One rank of ``mgrpo convert hf-to-mcore``."""
    from model_bridge.parallel import destroy_parallel

    layout = _init(tp, ep, etp, pp)
    try:
        return save_hf_as_dist_checkpoint(hf_dir, out_dir, layout, dtype=getattr(torch, dtype) if dtype else None,
                                          progress=progress)
    finally:
        destroy_parallel()


@_profiled("mcore_to_hf")
def rank_mcore_to_hf(ckpt_dir: str, hf_source: str, out_dir: str, max_shard_bytes: int,
                     group_bytes: int = 128 * 2**20, progress: bool = True, prefix: str = "model") -> dict:
    """The single rank of ``mgrpo convert mcore-to-hf``: stream the dist checkpoint's (or training
    checkpoint's model) tensors, then the source's pass-through tensors, straight into safetensors
    shards plus their index."""
    from model_bridge.config import ParallelLayout, read_omni_config
    from model_bridge.export import export_plan
    from model_bridge.io import SafetensorsReader
    from model_bridge.parallel import destroy_parallel
    from model_bridge.qwen3_omni import PASSTHROUGH_PREFIXES

    _init()
    t0 = time.perf_counter()
    stats: dict = {}
    writer = None
    try:
        spec = read_omni_config(hf_source)
        ckpt_dir, _ = resolve_mcore_input(ckpt_dir)  # a training run dir: its newest checkpoint
        meta = check_dist_checkpoint(ckpt_dir, spec, allow_training=True)
        model = build_meta_thinker(spec, ParallelLayout(), _ckpt_dtype(meta, None, ckpt_dir))
        reader = _DirectReader(SafetensorsReader(hf_source))
        keys = [k for k in reader.keys() if k.startswith(tuple(PASSTHROUGH_PREFIXES))]
        plan = list(export_plan(model, spec)) + [(k, reader.shape(k), reader.dtype(k)) for k in keys]
        writer = StreamingShardWriter(out_dir, plan, max_shard_bytes, prefix=prefix, background=True,
                                      max_pending_bytes=128 * 2**20)
        n_model = 0
        for name, tensor in iter_dist_checkpoint_as_hf(ckpt_dir, spec, model=model, group_bytes=group_bytes,
                                                       progress=progress, stats=stats):
            writer.add(name, tensor)
            n_model += 1
            del tensor
        stats["model_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        total = sum(_numel(reader.shape(k)) * reader.dtype(k).itemsize for k in keys)
        bar = _progress_bar(progress and bool(keys), total, "pass-through")
        for k in keys:
            t = reader.read(k)
            writer.add(k, t)
            if bar is not None:
                bar.update(t.numel() * t.element_size())
            del t
        if bar is not None:
            bar.close()
        reader.close()
        writer.close()
        stats["passthrough_s"] = time.perf_counter() - t1
        stats.update(total_size=writer.total_size, shards=writer.nshards, n_model_tensors=n_model,
                     write_s=writer.write_seconds,
                     n_passthrough=len(keys), total_s=time.perf_counter() - t0)
        return stats
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        destroy_parallel()


def rank_save_model_from_hf(hf_dir: str, out_dir: str, tp: int = 1, ep: int = 1, etp: Optional[int] = None,
                            pp: int = 1) -> dict:
    """Materialise the model at a layout, load the HF weights (``load_hf``) and ``save_model`` it:
    the plain (non-streaming) path, e.g. what a training run does."""
    from model_bridge.config import read_omni_config
    from model_bridge.load import load_hf
    from model_bridge.modeling import build_thinker
    from model_bridge.parallel import destroy_parallel

    layout = _init(tp, ep, etp, pp)
    try:
        model = build_thinker(read_omni_config(hf_dir), layout)
        load_hf(model, hf_dir)
        save_model(model, out_dir, hf_source=hf_dir)
        return {"rank": torch.distributed.get_rank()}
    finally:
        destroy_parallel()


def rank_load_model_logits(ckpt_dir: str, hf_dir: str, ids: list[int], tp: int = 1, ep: int = 1,
                           etp: Optional[int] = None, pp: int = 1, features=None, feature_lens=None):
    """Build the model at a layout, ``load_model`` the dist checkpoint and return the full logits
    [T, V] of one sample on the rank that has them (others return None)."""
    from model_bridge.config import read_omni_config
    from model_bridge.modeling import build_thinker
    from model_bridge.parallel import destroy_parallel

    layout = _init(tp, ep, etp, pp)
    try:
        spec = read_omni_config(hf_dir)
        model = build_thinker(spec, layout).eval()
        load_model(model, ckpt_dir)
        return forward_logits(model, spec, ids, features, feature_lens)
    finally:
        destroy_parallel()


@torch.no_grad()
def forward_logits(model, spec, ids: list[int], features=None, feature_lens=None) -> Optional[torch.Tensor]:
    """One sample through this rank's pipeline stage (hidden states handed over with send/recv);
    the full logits [T, V] float32 on CPU on the last stage's TP rank 0, None elsewhere."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from model_bridge.modeling.thinker import gather_logits, mrope_position_ids

    tp = ps.get_tensor_model_parallel_world_size()
    dev = next(model.parameters()).device
    T = len(ids)
    Tp = (T + tp - 1) // tp * tp  # sequence parallel: a multiple of tp (trailing tokens never matter)
    ids_t = torch.tensor([list(ids) + [0] * (Tp - T)], device=dev)
    pos = mrope_position_ids(ids_t, spec).unsqueeze(1)
    if features is not None:
        features = features.to(dev, next(model.parameters()).dtype)
        feature_lens = torch.as_tensor(feature_lens).to(dev)
    if not model.pre_process:
        buf = torch.empty((Tp // tp if tp > 1 else Tp, 1, spec.text.hidden_size), device=dev,
                          dtype=next(model.parameters()).dtype)
        dist.recv(buf, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(buf)
    out = model(ids_t, pos, audio_features=features, audio_feature_lens=feature_lens)
    if not model.post_process:
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    logits = gather_logits(out, spec.text.vocab_size)[:T].float().cpu()
    return logits if ps.get_tensor_model_parallel_rank() == 0 else None
