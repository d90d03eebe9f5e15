"""The sharded state dict as dist checkpoints store it (vocab-parallel tensors unpadded), and
:func:`save_model` / :func:`load_model` of a materialised model."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

from model_bridge.dist_ckpt.meta import META_FILE, SHARDED_SD_METADATA, _meta, check_dist_checkpoint
from model_bridge.io import CheckpointError

VOCAB_PARAMS = ("language_model.embedding.word_embeddings.weight", "language_model.output_layer.weight")


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
