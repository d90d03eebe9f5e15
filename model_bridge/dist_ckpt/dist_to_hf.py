"""Dist checkpoint -> HF tensors on one rank, a group of parameters at a time
(:func:`iter_dist_checkpoint_as_hf`), with reads narrowed to the stored chunks each load needs.

Also reads megatron-grpo training checkpoints (model tensors only, never the optimizer state):
same keys, the vocab-parallel tensors requested at their stored padded global shape ``[Vp, H]``
and read for their first ``vocab_size`` rows only."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Iterator, Optional

import torch

from model_bridge.dist_ckpt.hf_to_dist import _progress_bar
from model_bridge.dist_ckpt.meta import check_dist_checkpoint, is_training_checkpoint, resolve_mcore_input
from model_bridge.dist_ckpt.meta_model import build_meta_thinker
from model_bridge.dist_ckpt.sharded import VOCAB_PARAMS, _wrap_megatron_error, model_sharded_state_dict
from model_bridge.io import CheckpointError


def _flat_for_load(sh):
    """A ShardedTensor to load into a fresh CPU buffer, as an irregular chunk without prepended axes
    (``[1, .., 1, *local]`` at the same global offset). megatron's regular-grid path for tensors
    with prepended (layer/expert) axes assumes every chunk of the key is held by some rank, which
    a single rank loading a few layers at a time violates; DCP itself reads any sub-box."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    p = sh.prepend_axis_num
    shape = (1,) * p + tuple(sh.local_shape)
    return ShardedTensor(key=sh.key, data=torch.empty(shape, dtype=sh.dtype), dtype=sh.dtype, local_shape=shape,
                         global_shape=tuple(sh.global_shape), global_offset=tuple(sh.global_offset),
                         axis_fragmentations=None, replica_id=sh.replica_id, prepend_axis_num=0)


def _load_request(entry):
    """(what to pass to dist_checkpointing.load, how to turn its result into the parameter)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(entry, ShardedTensor):
        shape = tuple(entry.local_shape)
        return _flat_for_load(entry), lambda t: t.view(shape)
    if isinstance(entry, ShardedTensorFactory):
        f = dataclasses.replace(entry, data=torch.empty(tuple(entry.data.shape), dtype=entry.data.dtype))
        built = f.build()
        parts = built if isinstance(built, list) else [built]
        if not all(isinstance(x, ShardedTensor) for x in parts):
            raise CheckpointError(f"{entry.key}: unsupported sharded factory output {type(built).__name__}")
        shapes = [tuple(x.local_shape) for x in parts]

        def finish(loaded):
            views = [t.view(sh) for t, sh in zip(loaded, shapes)]
            return f.merge_fn(views if isinstance(built, list) else views[0])
        return [_flat_for_load(x) for x in parts], finish
    raise CheckpointError(f"unsupported sharded state dict entry {type(entry).__name__}")


class _ChunkIndex:
    """The stored chunks of one checkpoint tensor, indexed along the dimension that separates them
    best (for stacked keys: the layer or expert axis), to find the few that overlap a request."""

    def __init__(self, md):
        import bisect

        self._bisect = bisect
        self.chunks = md.chunks
        nd = len(md.size)
        self.dim = None
        if nd == 0 or len(self.chunks) <= 16:
            return
        d = max(range(nd), key=lambda i: len({c.offsets[i] for c in self.chunks}))
        self.order = sorted(range(len(self.chunks)), key=lambda i: self.chunks[i].offsets[d])
        self.starts = [self.chunks[i].offsets[d] for i in self.order]
        self.maxlen = max(c.sizes[d] for c in self.chunks)
        self.dim = d

    def candidates(self, offsets, sizes) -> list[int]:
        if self.dim is None:
            return list(range(len(self.chunks)))
        d = self.dim
        a, b = offsets[d], offsets[d] + sizes[d]
        lo = self._bisect.bisect_left(self.starts, a - self.maxlen + 1)
        hi = self._bisect.bisect_left(self.starts, b)
        out = []
        for i in self.order[lo:hi]:
            c = self.chunks[i]
            if c.offsets[d] + c.sizes[d] > a:
                out.append(i)
        return out


class _narrowed_reads:
    """While active, megatron's torch_dist loads of ``ckpt_dir`` use one reader that caches the
    checkpoint's ``.metadata`` and shows DCP, for each requested key, only the stored chunks
    that overlap the request (``request(sharded tensors)`` before each load).

    Without it every group load re-reads the metadata, and DCP's planner compares every
    requested chunk with every stored chunk of its key: for a 48-layer, 128-expert model that
    is ~12k x 12k comparisons per expert key and load. No-op if megatron's reader hook moved."""

    def __init__(self, ckpt_dir):
        self.dir = Path(ckpt_dir)
        self.reqs: dict = {}
        self.indexes: dict = {}
        self._mod = None

    def request(self, sharded_tensors) -> None:
        reqs: dict = {}
        for sh in sharded_tensors:
            shape = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
            reqs.setdefault(sh.key, []).append((tuple(sh.global_offset), shape))
        self.reqs = reqs

    def _reader(self):
        from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import \
            CachedMetadataFileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        outer = self

        class NarrowingReader(CachedMetadataFileSystemReader):
            def read_metadata(self, *args, **kwargs):
                full = super().read_metadata()
                sdm = dict(full.state_dict_metadata)
                for fqn, reqs in outer.reqs.items():
                    md = sdm.get(fqn)
                    if not isinstance(md, TensorStorageMetadata):
                        continue
                    idx = outer.indexes.get(fqn)
                    if idx is None or idx.chunks is not md.chunks:
                        idx = outer.indexes[fqn] = _ChunkIndex(md)
                    keep = sorted({i for o, s in reqs for i in idx.candidates(o, s)})
                    sdm[fqn] = TensorStorageMetadata(md.properties, md.size, [md.chunks[i] for i in keep])
                return dataclasses.replace(full, state_dict_metadata=sdm)

        return NarrowingReader(str(self.dir))

    def __enter__(self):
        try:
            from megatron.core.dist_checkpointing.strategies import torch as mtorch

            orig = mtorch._get_filesystem_reader
        except (ImportError, AttributeError):
            return self
        reader = self._reader()
        target = self.dir.resolve()

        def get_reader(checkpoint_dir, cache_metadata: bool = False):
            if Path(checkpoint_dir).resolve() == target:
                return reader
            return orig(checkpoint_dir, cache_metadata)

        self._mod, self._orig = mtorch, orig
        mtorch._get_filesystem_reader = get_reader
        return self

    def __exit__(self, *exc):
        if self._mod is not None:
            self._mod._get_filesystem_reader = self._orig
            self._mod = None


def stored_tensors(ckpt_dir) -> dict:
    """``{key: (global shape, dtype)}`` of every tensor in a torch_dist checkpoint (its ``.metadata``)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        md = FileSystemReader(str(ckpt_dir)).read_metadata()
    except Exception as e:  # noqa: BLE001
        raise _wrap_megatron_error("reading the tensor index of", ckpt_dir, e) from e
    return {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def _ckpt_dtype(meta: dict, dtype: Optional[torch.dtype], ckpt_dir=None) -> torch.dtype:
    """The dtype to read in: ``dtype``, else the checkpoint's (a training checkpoint's: the stored
    dtype of its model tensors, e.g. bfloat16 for a bf16 run)."""
    if dtype is not None:
        return dtype
    if is_training_checkpoint(meta) and ckpt_dir is not None:
        st = stored_tensors(ckpt_dir)
        if VOCAB_PARAMS[0] in st:
            return st[VOCAB_PARAMS[0]][1]
        return torch.float32
    return getattr(torch, meta.get("dtype", "float32")) if meta else torch.float32


def _sharded_tensors(entry) -> list:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(entry, ShardedTensor):
        return [entry]
    if isinstance(entry, ShardedTensorFactory):  # built on the meta device: shapes only
        built = entry.build()
        return [x for x in (built if isinstance(built, list) else [built]) if isinstance(x, ShardedTensor)]
    return []


def _for_training_checkpoint(sd: dict, ckpt_dir, vocab_size: int) -> dict:
    """The model's sharded state dict as a training checkpoint stores it: same keys (checked
    against the stored shapes here, so a wrong ``--hf-source`` is one clear error), the
    vocab-parallel tensors at the stored padded global shape (their first ``vocab_size`` rows
    requested)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    stored = stored_tensors(ckpt_dir)
    sd = dict(sd)
    for name in VOCAB_PARAMS:
        sh = sd.get(name)
        if not isinstance(sh, ShardedTensor):
            continue
        shape = stored.get(sh.key, (None,))[0]
        if shape is None or len(shape) != len(sh.global_shape) or shape[0] < vocab_size \
                or tuple(shape[1:]) != tuple(sh.global_shape[1:]):
            raise CheckpointError(f"{ckpt_dir}: {sh.key} is stored with shape {None if shape is None else list(shape)}, "
                                  f"the model of the given HF checkpoint needs [>= {vocab_size}, "
                                  f"{', '.join(map(str, sh.global_shape[1:]))}]: give the HF checkpoint the run "
                                  "started from (--hf-source)")
        sd[name] = dataclasses.replace(sh, global_shape=tuple(shape))
    bad = []
    for entry in sd.values():
        for sh in _sharded_tensors(entry):
            have = stored.get(sh.key, (None,))[0]
            if have != tuple(sh.global_shape):
                bad.append(f"{sh.key}: stored {None if have is None else list(have)}, model {list(sh.global_shape)}")
    if bad:
        raise CheckpointError(f"{ckpt_dir} does not hold this model's tensors ({len(bad)} differ, e.g. "
                              f"{'; '.join(bad[:3])}): give the HF checkpoint the run started from (--hf-source)")
    return sd


def iter_dist_checkpoint_as_hf(ckpt_dir, spec, *, model=None, dtype: Optional[torch.dtype] = None,
                               group_bytes: int = 128 * 2**20, progress: bool = False,
                               stats: Optional[dict] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of the dist checkpoint, in on-disk HF naming
    (per-expert keys, vocab unpadded), in the order of ``model_bridge.export.export_plan(model)``.

    One rank (parallel state initialised at tp=ep=pp=1); ``model`` is the meta-device thinker
    (built here when None). Parameters are read ``group_bytes`` at a time, in model order, so
    memory holds about one group (the largest single tensor, e.g. the embedding, is a group alone).

    ``ckpt_dir`` may also be a megatron-grpo training checkpoint (a ``step_<8-digit step>`` dir, e.g. ``step_00000020``), or a
    run dir or its ``checkpoints/`` (the newest complete checkpoint is read); ``spec`` must then be
    the model the run started from. Its model weights are read in their stored dtype.
    """
    from megatron.core import dist_checkpointing

    from model_bridge.config import ParallelLayout
    from model_bridge.export import export_tasks

    ckpt_dir, _ = resolve_mcore_input(ckpt_dir)
    meta = check_dist_checkpoint(ckpt_dir, spec, allow_training=True)
    if model is None:
        model = build_meta_thinker(spec, ParallelLayout(), _ckpt_dtype(meta, dtype, ckpt_dir))
    sd = model_sharded_state_dict(model)
    if is_training_checkpoint(meta):
        sd = _for_training_checkpoint(sd, ckpt_dir, spec.text.vocab_size)
    tasks = export_tasks(model, spec)
    for t in tasks:
        if t.shard.size != 1:
            raise ValueError("iter_dist_checkpoint_as_hf runs on one rank (tp=ep=pp=1)")
    groups, cur, cur_bytes = [], [], 0
    for t in tasks:
        n = t.param.numel() * t.param.element_size()
        if cur and cur_bytes + n > group_bytes:
            groups.append(cur)
            cur, cur_bytes = [], 0
        cur.append(t)
        cur_bytes += n
    if cur:
        groups.append(cur)
    total = sum(t.param.numel() * t.param.element_size() for t in tasks)
    bar = _progress_bar(progress, total, "mcore -> hf")
    stats = stats if stats is not None else {}
    stats.setdefault("load_s", 0.0)
    stats["groups"] = len(groups)
    narrow = _narrowed_reads(ckpt_dir)
    try:
        narrow.__enter__()
        for group in groups:
            t0 = time.perf_counter()
            sub, finish = {}, {}
            for t in group:
                if t.name not in sd:
                    raise CheckpointError(f"{t.name} has no entry in the model's sharded state dict")
                sub[t.name], finish[t.name] = _load_request(sd[t.name])
            narrow.request(x for v in sub.values() for x in (v if isinstance(v, list) else [v]))
            try:
                loaded = dist_checkpointing.load(sub, str(ckpt_dir), validate_access_integrity=False)
            except Exception as e:  # noqa: BLE001
                raise _wrap_megatron_error("reading", ckpt_dir, e) from e
            del sub
            stats["load_s"] += time.perf_counter() - t0
            for t in group:
                value = finish[t.name](loaded.pop(t.name))
                if tuple(value.shape[1:]) != tuple(t.param.shape[1:]):
                    raise CheckpointError(f"{ckpt_dir}: {t.name} loaded with shape {list(value.shape)}, the model "
                                          f"has {list(t.param.shape)}")
                full = t.mapping.merge([value])  # a group of one: views of value, no copy
                del value
                for role in t.mapping.roles:
                    yield t.hf[role], full.pop(role)
                if bar is not None:
                    bar.update(t.param.numel() * t.param.element_size())
            del loaded
    finally:
        narrow.__exit__(None, None, None)
        if bar is not None:
            bar.close()
