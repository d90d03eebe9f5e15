"""Megatron dist checkpoints (``torch_dist``) of the thinker: save/load under any TP/EP/PP, and the
streaming HF <-> dist-checkpoint converters behind ``mgrpo convert``.

Format. A directory written by megatron-core's ``dist_checkpointing`` (``metadata.json`` says
``torch_dist``; ``common.pt``; ``__R_I.distcp`` data files with a ``.metadata`` index) plus
:data:`META_FILE`, a small JSON with the model name, a fingerprint of the model spec
(:func:`spec_fingerprint`), the HF source it came from, the layout it was written at and the
versions. Every tensor is stored as one *global* tensor (decoder layers stacked along a layer axis,
experts along an expert axis, TP shards joined), which is what lets ``dist_checkpointing`` reshard
it on load to any TP/EP/ETP/PP. One departure from ``model.sharded_state_dict()``: the
vocab-parallel embedding and output layer are stored **unpadded** (``[vocab, hidden]``), because
Megatron's vocab padding (a multiple of ``128 * tp``) differs between TP sizes; loading pads them
again with zero rows (:func:`model_sharded_state_dict`).

API (collectives over the default process group; every rank calls them; megatron's parallel
state must be initialised, :func:`model_bridge.parallel.init_parallel`):

* :func:`save_model` / :func:`load_model`: a materialised model (training, tests).
* :func:`save_hf_as_dist_checkpoint`: HF safetensors -> dist checkpoint *without materialising the
  model*: the model is built on the meta device for its sharding metadata, and each tensor is read
  from the HF files and converted only when the checkpoint writer asks for it (one parameter at a
  time; bounded memory at any model size).
* :func:`iter_dist_checkpoint_as_hf`: dist checkpoint -> ``(hf_name, tensor)`` on one rank, loading
  a group of parameters (``group_bytes``) at a time.
* :class:`StreamingShardWriter`: safetensors shards written as the tensors arrive (headers from a
  known plan), optionally from a writer thread; :func:`forward_logits`: one sample through this
  rank's pipeline stage, full logits on the last stage.
* Spawn entry points (top-level, picklable, so ``run_ranks`` can start them from any ``__main__``):
  :func:`rank_hf_to_mcore`, :func:`rank_mcore_to_hf`, :func:`rank_save_model_from_hf`,
  :func:`rank_load_model_logits`. ``$MGRPO_CONVERT_PROFILE=DIR`` writes cProfile stats of the
  conversion ranks there.

Errors: :class:`model_bridge.io.CheckpointError` naming the directory and what is wrong (not a
directory, not a dist checkpoint, another model, a different spec, missing tensors).
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from model_bridge.io import CheckpointError

__all__ = [
    "META_FILE", "FORMAT_NAME", "FORMAT_VERSION", "SHARDED_SD_METADATA", "spec_fingerprint", "versions",
    "model_sharded_state_dict", "save_model", "load_model", "read_checkpoint_meta", "check_dist_checkpoint",
    "save_hf_as_dist_checkpoint", "iter_dist_checkpoint_as_hf", "build_meta_thinker",
    "StreamingShardWriter", "forward_logits",
    "rank_hf_to_mcore", "rank_mcore_to_hf", "rank_save_model_from_hf", "rank_load_model_logits",
]

META_FILE = "mgrpo_checkpoint.json"
FORMAT_NAME = "mgrpo-megatron-dist"
FORMAT_VERSION = 1
SHARDED_SD_METADATA = {"singleton_local_shards": False}
"""``sharded_state_dict(metadata=...)`` pinned so megatron-core 0.16 and 0.19 write the same keys."""
VOCAB_PARAMS = ("language_model.embedding.word_embeddings.weight", "language_model.output_layer.weight")


# ------------------------------------------------------------------------------------------------
# metadata
# ------------------------------------------------------------------------------------------------

def spec_fingerprint(spec) -> str:
    """A short hash of everything in the model spec that shapes or interprets the weights (text and
    audio architecture, special token ids); the full config.json is not hashed (it carries
    unrelated fields)."""
    d = dataclasses.asdict(spec)
    d.pop("raw", None)
    blob = json.dumps(d, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def versions() -> dict[str, str]:
    """Installed versions of what wrote the checkpoint (package metadata: no imports)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"torch": torch.__version__}
    for name, dist in (("megatron_core", "megatron-core"), ("transformers", "transformers"),
                       ("megatron_grpo", "megatron-grpo"), ("safetensors", "safetensors")):
        try:
            out[name] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def _spec_summary(spec) -> dict:
    t, a = spec.text, spec.audio
    return {"hidden_size": t.hidden_size, "num_layers": t.num_layers, "num_heads": t.num_heads,
            "num_kv_heads": t.num_kv_heads, "num_experts": t.num_experts, "moe_ffn_hidden_size": t.moe_ffn_hidden_size,
            "vocab_size": t.vocab_size, "audio_layers": a.num_layers, "audio_d_model": a.d_model}


def _meta(spec, layout, dtype: torch.dtype, hf_source, world_size: int, extra: Optional[dict] = None) -> dict:
    d = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "model": "qwen3_omni_moe",
        "spec_fingerprint": spec_fingerprint(spec), "spec": _spec_summary(spec),
        "hf_source": None if hf_source is None else str(Path(hf_source).resolve()),
        "written_at_layout": {"tp": layout.tp, "ep": layout.ep, "etp": layout.expert_tp, "pp": layout.pp,
                              "world_size": world_size},
        "dtype": str(dtype).replace("torch.", ""), "vocab_stored_unpadded": True,
        "sharded_state_dict_metadata": SHARDED_SD_METADATA, "versions": versions(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    d.update(extra or {})
    return d


def read_checkpoint_meta(ckpt_dir: str | os.PathLike) -> dict:
    """:data:`META_FILE` of a dist checkpoint written here; ``{}`` for a foreign one that has none."""
    p = Path(ckpt_dir) / META_FILE
    if not p.is_file():
        return {}
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{p} is not valid JSON ({e})") from e


def check_dist_checkpoint(ckpt_dir: str | os.PathLike, spec=None) -> dict:
    """Raise ``CheckpointError`` unless ``ckpt_dir`` is a complete torch_dist checkpoint (and, with
    ``spec``, one of this model spec); return its :data:`META_FILE` content ({} when absent)."""
    d = Path(ckpt_dir)
    if not d.exists():
        raise CheckpointError(f"{d} does not exist (expected a Megatron dist checkpoint directory, e.g. from "
                              "`mgrpo convert hf-to-mcore`)")
    if not d.is_dir():
        raise CheckpointError(f"{d} is not a directory (expected a Megatron dist checkpoint directory)")
    cfg = d / "metadata.json"
    if not cfg.is_file():
        hint = ""
        if (d / "config.json").is_file() or any(d.glob("*.safetensors")):
            hint = " (it looks like an HF checkpoint: convert it with `mgrpo convert hf-to-mcore`)"
        raise CheckpointError(f"{d} has no metadata.json: not a Megatron dist checkpoint, or an incomplete one{hint}")
    try:
        backend = json.loads(cfg.read_text()).get("sharded_backend")
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg} is not valid JSON ({e})") from e
    if backend != "torch_dist":
        raise CheckpointError(f"{d}: sharded_backend {backend!r} is not supported (only torch_dist)")
    if not (d / ".metadata").is_file():
        raise CheckpointError(f"{d} has no .metadata (the torch_dist tensor index): the checkpoint is incomplete")
    meta = read_checkpoint_meta(d)
    if meta and meta.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{d / META_FILE}: format {meta.get('format')!r} is not {FORMAT_NAME!r}")
    if meta and meta.get("model") != "qwen3_omni_moe":
        raise CheckpointError(f"{d}: a checkpoint of model {meta.get('model')!r}, expected qwen3_omni_moe")
    if spec is not None and meta:
        want = spec_fingerprint(spec)
        if meta.get("spec_fingerprint") != want:
            raise CheckpointError(
                f"{d} was written for a different model spec (fingerprint {meta.get('spec_fingerprint')}, "
                f"{meta.get('spec')} from {meta.get('hf_source')}) than the one given (fingerprint {want}, "
                f"{_spec_summary(spec)}): use the HF checkpoint it was converted from")
    return meta


# ------------------------------------------------------------------------------------------------
# the sharded state dict (vocab stored unpadded)
# ------------------------------------------------------------------------------------------------

def _single_model(model):
    from model_bridge.load import model_chunks

    chunks = model_chunks(model)
    if len(chunks) != 1:
        raise NotImplementedError("dist checkpoints of virtual-pipeline model chunks are not supported yet")
    return chunks[0]


def _unpadded_vocab(sh, vocab_size: int):
    """The rows of a vocab-parallel ShardedTensor below ``vocab_size``, as an (irregularly sharded)
    piece of a ``[vocab_size, ...]`` global tensor; None on a rank that holds padding rows only."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if sh.prepend_axis_num or getattr(sh, "flattened_range", None) is not None:
        raise CheckpointError(f"{sh.key}: unexpected sharding {sh} for a vocab-parallel tensor")
    start = sh.global_offset[0]
    rows = max(0, min(sh.local_shape[0], vocab_size - start))
    if rows == 0:
        return None
    data = None if sh.data is None else sh.data[:rows]
    return ShardedTensor(key=sh.key, data=data, dtype=sh.dtype, local_shape=(rows, *sh.local_shape[1:]),
                         global_shape=(vocab_size, *sh.global_shape[1:]), global_offset=tuple(sh.global_offset),
                         axis_fragmentations=None, replica_id=sh.replica_id, prepend_axis_num=0)


def model_sharded_state_dict(model) -> dict:
    """``model.sharded_state_dict()`` as this module saves and loads it: vocab-parallel tensors
    unpadded (a rank whose rows are all padding has no entry for them)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    m = _single_model(model)
    sd = m.sharded_state_dict(metadata=dict(SHARDED_SD_METADATA))
    vocab = m.spec.text.vocab_size
    for name in VOCAB_PARAMS:
        if name in sd:
            if not isinstance(sd[name], ShardedTensor):
                raise CheckpointError(f"{name}: expected a ShardedTensor, got {type(sd[name]).__name__}")
            piece = _unpadded_vocab(sd[name], vocab)
            if piece is None:
                del sd[name]
            else:
                sd[name] = piece
    return sd


def _wrap_megatron_error(what: str, ckpt_dir, e: BaseException) -> CheckpointError:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if len(msg) > 600:
        msg = msg[:600] + " ..."
    return CheckpointError(f"{what} {ckpt_dir} failed: {type(e).__name__}: {msg}")


def save_model(model, ckpt_dir: str | os.PathLike, *, hf_source=None, extra_meta: Optional[dict] = None) -> Path:
    """Save this rank's part of a materialised thinker as a torch_dist checkpoint (collective).

    ``ckpt_dir`` must be empty or not exist. Returns its path.
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    m = _single_model(model)
    d = _prepare_out_dir(ckpt_dir)
    dist_checkpointing.save(model_sharded_state_dict(m), str(d))
    if dist.get_rank() == 0:
        meta = _meta(m.spec, m.layout, next(m.parameters()).dtype, hf_source, dist.get_world_size(), extra_meta)
        (d / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    dist.barrier()
    return d


@torch.no_grad()
def load_model(model, ckpt_dir: str | os.PathLike, *, check_spec: bool = True) -> dict:
    """Load a torch_dist checkpoint (written at any layout) into this rank's part of ``model``
    (collective). Padded vocab rows are zeroed. Returns the checkpoint's :data:`META_FILE` content."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    m = _single_model(model)
    meta = check_dist_checkpoint(ckpt_dir, m.spec if check_spec else None)
    sd = model_sharded_state_dict(m)
    try:
        state = dist_checkpointing.load(sd, str(ckpt_dir), strict=StrictHandling.RAISE_UNEXPECTED)
    except Exception as e:  # noqa: BLE001 - megatron raises many types; name the checkpoint
        raise _wrap_megatron_error("loading the dist checkpoint", ckpt_dir, e) from e
    params = dict(m.named_parameters())
    for name in VOCAB_PARAMS:
        if name not in params:
            continue
        p = params[name]
        t = state.pop(name, None)
        rows = 0 if t is None else t.shape[0]
        if rows:
            p.data[:rows].copy_(t)
        p.data[rows:].zero_()
    missing, unexpected = m.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in VOCAB_PARAMS and not k.endswith("_extra_state")]
    if missing or unexpected:
        raise CheckpointError(f"{ckpt_dir}: state dict mismatch after loading: missing {missing[:10]}, "
                              f"unexpected {list(unexpected)[:10]}")
    return meta


def _prepare_out_dir(ckpt_dir) -> Path:
    import torch.distributed as dist

    d = Path(ckpt_dir)
    if dist.get_rank() == 0:
        if d.exists() and not d.is_dir():
            raise CheckpointError(f"{d} exists and is not a directory")
        if d.is_dir() and any(d.iterdir()):
            raise CheckpointError(f"{d} is not empty: write the dist checkpoint into a new or empty directory")
        d.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    return d


# ------------------------------------------------------------------------------------------------
# a model with no storage (meta device): sharding metadata at any size
# ------------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------------
# HF -> dist checkpoint without materialising the model
# ------------------------------------------------------------------------------------------------

class _LazyTensors:
    """Materialises checkpoint chunks on demand for the DCP writer, one parameter at a time.

    ``materialize(param_name) -> tensor`` gives a parameter's local value; chunks are views of it
    (``_param_views``). A parameter cut into several chunks (gated fc1: gate and up halves) is
    kept until its last chunk is written. Every tensor handed to the writer owns its storage and is
    freed (storage resized to 0) at the next request: the writer keeps a reference to the last
    tensor of every checkpoint key, which would otherwise hold ~ the embedding and output layer.

    Once the writer's order is known (``set_order``, from the final save plan), the next
    parameters (up to ``prefetch_bytes`` ahead, at least one) are read and converted in a worker
    thread while the current one is written: file reads and torch copies release the GIL, so
    reading overlaps writing.
    """

    def __init__(self, views: dict, materialize: Callable[[str], torch.Tensor], param_shapes: dict,
                 progress=None, prefetch_bytes: int = 64 * 2**20, param_bytes: Optional[dict] = None):
        self.views = views
        self.materialize = materialize
        self.param_shapes = param_shapes
        self.param_bytes = param_bytes or {}
        self.remaining: dict[str, int] = {}
        for name, *_ in views.values():
            self.remaining[name] = self.remaining.get(name, 0) + 1
        self.cache: dict[str, torch.Tensor] = {}
        self.handed: list[torch.Tensor] = []
        self.progress = progress
        self.bytes = 0
        self.seconds = 0.0
        self.wait_seconds = 0.0
        self.prefetch_bytes = prefetch_bytes
        self.order: list[str] = []
        self.pos: dict[str, int] = {}
        self.started: set[str] = set()
        self.futures: dict = {}
        self.inflight_bytes = 0
        self.next_idx = 0
        self.pool = None

    def set_order(self, keys) -> None:
        """The chunk keys in the order the writer will ask for them (enables prefetching)."""
        from concurrent.futures import ThreadPoolExecutor

        seen, order = set(), []
        for k in keys:
            v = self.views.get(k)
            if v is not None and v[0] not in seen:
                seen.add(v[0])
                order.append(v[0])
        self.order, self.pos = order, {n: i for i, n in enumerate(order)}
        if self.prefetch_bytes > 0 and self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mgrpo-convert-prefetch")

    def _checked(self, name: str) -> torch.Tensor:
        full = self.materialize(name).contiguous()
        want = self.param_shapes[name]
        if tuple(full.shape) != tuple(want):
            raise CheckpointError(f"{name}: converted value has shape {list(full.shape)}, the parameter is {list(want)}")
        return full

    def _prefetch_after(self, name: str) -> None:
        """Keep up to ``prefetch_bytes`` (at least one parameter, at most 16) converting ahead of
        the parameter the writer is on."""
        i = self.pos.get(name)
        if self.pool is None or i is None:
            return
        self.next_idx = max(self.next_idx, i + 1)
        while self.next_idx < len(self.order) and len(self.futures) < 16 and (
                not self.futures or self.inflight_bytes < self.prefetch_bytes):
            n = self.order[self.next_idx]
            self.next_idx += 1
            if n not in self.started:
                self.started.add(n)
                self.futures[n] = self.pool.submit(self._checked, n)
                self.inflight_bytes += self.param_bytes.get(n, 0)

    def _free_handed(self) -> None:
        for t in self.handed:
            st = t.untyped_storage()
            if st.resizable():  # tensors straight from safetensors are not; they are small here
                st.resize_(0)
        self.handed.clear()

    def __call__(self, write_item) -> torch.Tensor:
        t0 = time.perf_counter()
        self._free_handed()
        key = (write_item.index.fqn, tuple(int(x) for x in write_item.index.offset))
        if key not in self.views:
            raise CheckpointError(f"the checkpoint writer asked for {key}, which no parameter provides")
        name, size, stride, offset = self.views[key]
        full = self.cache.pop(name, None)
        if full is None:
            fut = self.futures.pop(name, None)
            if fut is not None:
                self.inflight_bytes -= self.param_bytes.get(name, 0)
                t1 = time.perf_counter()
                full = fut.result()
                self.wait_seconds += time.perf_counter() - t1
            else:
                self.started.add(name)
                full = self._checked(name)
            self._prefetch_after(name)
        self.remaining[name] -= 1
        whole = size == tuple(full.shape) and stride == tuple(full.stride()) and offset == 0
        if whole and self.remaining[name] == 0:
            chunk = full
        else:
            chunk = full.as_strided(size, stride, offset).clone()
            if self.remaining[name] > 0:
                self.cache[name] = full
        del full
        chunk = chunk.view(tuple(write_item.tensor_data.chunk.sizes))
        self.handed.append(chunk)
        n = chunk.numel() * chunk.element_size()
        self.bytes += n
        if self.progress is not None:
            self.progress.update(n)
        self.seconds += time.perf_counter() - t0
        return chunk

    def close(self) -> None:
        for f in self.futures.values():
            f.cancel()
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        self.futures.clear()
        self._free_handed()
        self.cache.clear()


def _lazy_save_strategy(lazy: _LazyTensors):
    """A megatron SaveShardedStrategy ('torch_dist', 1) that writes with torch's FileSystemWriter
    (one file per rank, serial), asking ``lazy`` for each tensor's bytes as it is written."""
    from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
    from megatron.core.dist_checkpointing.strategies.torch import (MCoreSavePlanner,
                                                                   _replace_state_dict_keys_with_sharded_keys,
                                                                   mcore_to_pyt_state_dict)
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.planner import WriteItemType

    class LazyPlanner(MCoreSavePlanner):
        def finish_plan(self, new_plan):
            plan = super().finish_plan(new_plan)
            lazy.set_order([(i.index.fqn, tuple(int(x) for x in i.index.offset)) for i in plan.items
                            if i.type != WriteItemType.BYTE_IO])
            return plan

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            return lazy(write_item)

    class LazyTorchDistSave(SaveShardedStrategy):
        def __init__(self):
            super().__init__("torch_dist", 1)

        @property
        def can_handle_sharded_objects(self):
            return True

        def save(self, sharded_state_dict, checkpoint_dir):
            sd, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica=True)
            pyt = mcore_to_pyt_state_dict(sd, False)
            writer = FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True, sync_files=True,
                                      thread_count=1, per_thread_copy_ahead=0)
            dcp_save(pyt, storage_writer=writer,
                     planner=LazyPlanner(dedup_replicated_tensors=False, flatten_state_dict=False))

    return LazyTorchDistSave()


def _byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory. Not ``t.numpy()``: that marks
    the storage non-resizable for good, and ``_LazyTensors`` frees storages by resizing them."""
    import ctypes

    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    if not t.is_contiguous():
        raise ValueError("byte view of a non-contiguous tensor")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class _DirectReader:
    """A SafetensorsReader whose data reads go through ``os.preadv`` into fresh tensors.

    safetensors' ``safe_open`` maps each file and hands out views of the mapping: the pages read
    stay resident (and count as this process's RSS) as long as any tensor viewing the file is
    alive, so a streaming converter would grow to the size of the checkpoint. Reading the bytes
    with plain file I/O gives tensors that own their memory (freed when dropped) and costs the
    same one copy out of the page cache. Names, shapes, dtypes and all checks come from the
    wrapped reader (``model_bridge.io.SafetensorsReader``), so errors are the same.
    """

    def __init__(self, reader):
        self._r = reader
        self._headers: dict[str, tuple[int, dict]] = {}
        self._fds: dict[str, int] = {}

    def __getattr__(self, name):
        return getattr(self._r, name)

    def __contains__(self, key):
        return key in self._r

    def _header(self, fname: str) -> tuple[int, dict]:
        h = self._headers.get(fname)
        if h is None:
            path = self._r.dir / fname
            try:
                with open(path, "rb") as f:
                    n = int.from_bytes(f.read(8), "little")
                    meta = json.loads(f.read(n))
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{path}: corrupt or unreadable safetensors header ({e})") from e
            h = (8 + n, {k: tuple(v["data_offsets"]) for k, v in meta.items() if k != "__metadata__"})
            self._headers[fname] = h
        return h

    def _fd(self, fname: str) -> int:
        fd = self._fds.get(fname)
        if fd is None:
            fd = self._fds[fname] = os.open(self._r.dir / fname, os.O_RDONLY)
        return fd

    def _pread_into(self, fname: str, offset: int, t: torch.Tensor, key: str) -> None:
        buf = _byte_view(t)
        done = 0
        fd = self._fd(fname)
        while done < len(buf):
            n = os.preadv(fd, [buf[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(f"{self._r.dir / fname}: file ends inside {key} (truncated?)")
            done += n

    def read(self, key: str, dim: int = 0, start: Optional[int] = None, stop: Optional[int] = None,
             expect_shape=None) -> torch.Tensor:
        if expect_shape is not None:
            self._r.check_shape(key, expect_shape)
        shape = tuple(self._r.shape(key))
        dtype = self._r.dtype(key)
        fname = self._r.file_of(key)
        data_start, offsets = self._header(fname)
        if key not in offsets:
            raise CheckpointError(f"{self._r.source} maps {key!r} to {fname}, but that file has no such tensor")
        begin, end = offsets[key]
        if start is None and stop is None:
            t = torch.empty(shape, dtype=dtype)
            if t.numel() * t.element_size() != end - begin:
                raise CheckpointError(f"{self._r.dir / fname}: {key} has {end - begin} bytes, shape {list(shape)} "
                                      f"needs {t.numel() * t.element_size()}")
            self._pread_into(fname, data_start + begin, t, key)
        else:
            if dim not in (0, 1) or len(shape) <= dim:
                raise CheckpointError(f"{key}: cannot slice dim {dim} of shape {list(shape)}")
            n = shape[dim]
            a, b = 0 if start is None else start, n if stop is None else stop
            if not 0 <= a <= b <= n:
                raise CheckpointError(f"{key}: slice [{a}, {b}) along dim {dim} is out of its shape {list(shape)}")
            if dim == 0:
                row = (end - begin) // max(n, 1)
                t = torch.empty((b - a, *shape[1:]), dtype=dtype)
                self._pread_into(fname, data_start + begin + a * row, t, key)
            else:  # columns: read the rows whole, keep the slice (conversion reads full tensors anyway)
                full = torch.empty(shape, dtype=dtype)
                self._pread_into(fname, data_start + begin, full, key)
                t = full[:, a:b].contiguous()
        self._r.reads[key] += 1
        self._r.read_bytes += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._r.close()


_ST_DTYPE = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}


class StreamingShardWriter:
    """Write tensors that arrive in a known order straight into safetensors shards, no buffering.

    ``plan`` is the full list of ``(name, shape, dtype)`` in arrival order; it is cut into shards
    of at most ``max_shard_bytes`` (a bigger tensor gets a shard of its own), so each shard's
    header is known before its first tensor arrives and every tensor goes to disk as soon as it
    is added. With ``background=True`` a writer thread does the file writes while the caller
    produces the next tensors; ``add`` blocks while more than ``max_pending_bytes`` wait (memory:
    about that much plus the tensor being written). ``close()`` checks that everything arrived,
    names the shards ``{prefix}-0000i-of-0000n.safetensors`` and writes the index.
    """

    def __init__(self, out_dir, plan: list, max_shard_bytes: int, prefix: str = "model",
                 metadata: Optional[dict] = None, background: bool = False, max_pending_bytes: int = 256 * 2**20):
        import threading

        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metadata = dict(metadata or {"format": "pt"})
        self.plan = [(n, tuple(int(x) for x in shape), dt) for n, shape, dt in plan]
        names = [n for n, _, _ in self.plan]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise CheckpointError(f"tensor name(s) planned twice: {dup[:5]}")
        for n, _, dt in self.plan:
            if dt not in _ST_DTYPE:
                raise CheckpointError(f"{n}: dtype {dt} cannot be written to safetensors")
        self.shard_of: list[int] = []
        self.shards: list[list[int]] = []
        cur, cur_bytes = [], 0
        for i, (_, shape, dt) in enumerate(self.plan):
            nb = _numel(shape) * torch.empty((), dtype=dt).element_size()
            if cur and cur_bytes + nb > max_shard_bytes:
                self.shards.append(cur)
                cur, cur_bytes = [], 0
            cur.append(i)
            self.shard_of.append(len(self.shards))
            cur_bytes += nb
        if cur:
            self.shards.append(cur)
        self.nshards = len(self.shards)
        self.prefix = prefix
        self.total_size = 0
        self.write_seconds = 0.0
        self._next = 0
        self._shard = -1
        self._file = None
        self._tmp: list[Path] = []
        self.weight_map: dict[str, str] = {}
        self._background = background
        self._max_pending = max_pending_bytes
        self._pending: list = []
        self._pending_bytes = 0
        self._error: Optional[BaseException] = None
        self._stop = False
        self._cv = threading.Condition()
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._worker, name="mgrpo-shard-writer", daemon=True)
            self._thread.start()

    def _final_name(self, i: int) -> str:
        return f"{self.prefix}-{i + 1:05d}-of-{self.nshards:05d}.safetensors"

    def _open_shard(self, i: int) -> None:
        header, off = {"__metadata__": self.metadata}, 0
        for j in self.shards[i]:
            name, shape, dt = self.plan[j]
            nb = _numel(shape) * torch.empty((), dtype=dt).element_size()
            header[name] = {"dtype": _ST_DTYPE[dt], "shape": list(shape), "data_offsets": [off, off + nb]}
            off += nb
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        tmp = self.dir / f".{self._final_name(i)}.tmp"
        self._file = open(tmp, "wb")
        self._file.write(len(blob).to_bytes(8, "little"))
        self._file.write(blob)
        self._tmp.append(tmp)
        self._shard = i

    def _write(self, shard: int, t: torch.Tensor) -> None:
        t0 = time.perf_counter()
        if shard != self._shard:
            if self._file is not None:
                self._file.close()
            self._open_shard(shard)
        if t.numel():
            self._file.write(_byte_view(t))
        self.write_seconds += time.perf_counter() - t0

    def _worker(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._stop:
                    self._cv.wait()
                if not self._pending:
                    return
                shard, t = self._pending[0]
            try:
                if self._error is None:
                    self._write(shard, t)
            except BaseException as e:  # noqa: BLE001 - handed to the caller at its next add/close
                self._error = e
            with self._cv:
                self._pending.pop(0)
                self._pending_bytes -= t.numel() * t.element_size()
                self._cv.notify_all()
            del t

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            raise CheckpointError(f"writing {self.dir} failed: {type(self._error).__name__}: {self._error}") \
                from self._error

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._raise_pending_error()
        if self._next >= len(self.plan):
            raise CheckpointError(f"{name}: more tensors than planned ({len(self.plan)})")
        want, shape, dt = self.plan[self._next]
        t = tensor.detach()
        if name != want or tuple(t.shape) != shape or t.dtype != dt:
            raise CheckpointError(f"tensor #{self._next} is {name} {list(t.shape)} {t.dtype}, the plan says {want} "
                                  f"{list(shape)} {dt}")
        shard = self.shard_of[self._next]
        t = t.to("cpu").contiguous()
        nb = t.numel() * t.element_size()
        if self._background:
            with self._cv:
                while self._pending and self._pending_bytes + nb > self._max_pending and self._error is None:
                    self._cv.wait()
                self._pending.append((shard, t))
                self._pending_bytes += nb
                self._cv.notify_all()
        else:
            self._write(shard, t)
        self.weight_map[name] = self._final_name(shard)
        self.total_size += nb
        self._next += 1

    def _drain(self) -> None:
        if self._thread is not None:
            with self._cv:
                self._stop = True
                self._cv.notify_all()
            self._thread.join()
            self._thread = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self) -> dict[str, str]:
        from model_bridge.io import write_index

        self._drain()
        self._raise_pending_error()
        if self._next != len(self.plan):
            missing = [n for n, _, _ in self.plan[self._next:]]
            raise CheckpointError(f"{len(missing)} planned tensor(s) never arrived: {missing[:5]}")
        for i, tmp in enumerate(self._tmp):
            tmp.replace(self.dir / self._final_name(i))
            (self.dir / self._final_name(i)).chmod(0o644)
        write_index(self.dir, self.weight_map, self.total_size)
        return self.weight_map

    def abort(self) -> None:
        """Stop (queued tensors are dropped) and remove the partial shards."""
        if self._error is None:
            self._error = CheckpointError("aborted")
        self._drain()
        for tmp in self._tmp:
            tmp.unlink(missing_ok=True)


def _source_dtype(reader) -> torch.dtype:
    for key in ("thinker.model.embed_tokens.weight", "thinker.lm_head.weight"):
        if key in reader:
            return reader.dtype(key)
    return torch.float32


def _all_ranks_ok(error: Optional[BaseException]) -> None:
    from model_bridge.load import _raise_if_any_failed

    _raise_if_any_failed(error)


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


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _progress_bar(enabled: bool, total: int, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True,
                mininterval=0.5)


# ------------------------------------------------------------------------------------------------
# dist checkpoint -> HF tensors, a group of parameters at a time
# ------------------------------------------------------------------------------------------------

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


def _ckpt_dtype(meta: dict, dtype: Optional[torch.dtype]) -> torch.dtype:
    if dtype is not None:
        return dtype
    return getattr(torch, meta.get("dtype", "float32")) if meta else torch.float32


def _merge_one(mapping, value: torch.Tensor) -> dict:
    """``mapping.merge([value])`` for a world-size-1 shard, without the copy a one-tensor cat makes
    for the plain split mappings (the vocab padding rows are dropped by a view)."""
    from model_bridge.mappings import SINGLE, ColumnParallel, Replicated, RowParallel, VocabParallel

    if type(mapping) in (ColumnParallel, RowParallel, Replicated):
        return {SINGLE: value}
    if type(mapping) is VocabParallel:
        return {SINGLE: value[:mapping.vocab_size]}
    return mapping.merge([value])


def iter_dist_checkpoint_as_hf(ckpt_dir, spec, *, model=None, dtype: Optional[torch.dtype] = None,
                               group_bytes: int = 128 * 2**20, progress: bool = False,
                               stats: Optional[dict] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of the dist checkpoint, in on-disk HF naming
    (per-expert keys, vocab unpadded), in the order of ``model_bridge.export.export_plan(model)``.

    One rank (parallel state initialised at tp=ep=pp=1); ``model`` is the meta-device thinker
    (built here when None). Parameters are read ``group_bytes`` at a time, in model order, so
    memory holds about one group (the largest single tensor, e.g. the embedding, is a group alone).
    """
    from megatron.core import dist_checkpointing

    from model_bridge.config import ParallelLayout
    from model_bridge.export import export_tasks

    meta = check_dist_checkpoint(ckpt_dir, spec)
    if model is None:
        model = build_meta_thinker(spec, ParallelLayout(), _ckpt_dtype(meta, dtype))
    sd = model_sharded_state_dict(model)
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
                full = _merge_one(t.mapping, value)
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


# ------------------------------------------------------------------------------------------------
# rank entry points (run_ranks targets)
# ------------------------------------------------------------------------------------------------

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
    """The single rank of ``mgrpo convert mcore-to-hf``: stream the dist checkpoint's tensors, then
    the source's pass-through tensors, straight into safetensors shards plus their index."""
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
        meta = check_dist_checkpoint(ckpt_dir, spec)
        model = build_meta_thinker(spec, ParallelLayout(), _ckpt_dtype(meta, None))
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
