"""Megatron dist checkpoints (``torch_dist``) of the thinker: save/load under any TP/EP/PP, and the
streaming HF <-> dist-checkpoint converters behind ``mgrpo convert``.

Format. A directory written by megatron-core's ``dist_checkpointing`` (``metadata.json`` says
``torch_dist``; ``common.pt`` before megatron-core 0.19; ``__R_I.distcp`` data files with a ``.metadata`` index) plus
:data:`META_FILE`, a small JSON with the model name, a fingerprint of the model spec
(:func:`spec_fingerprint`), the HF source it came from, the layout it was written at and the
versions. Every tensor is stored as one *global* tensor (decoder layers stacked along a layer axis,
experts along an expert axis, TP shards joined), which is what lets ``dist_checkpointing`` reshard
it on load to any TP/EP/ETP/PP. One departure from ``model.sharded_state_dict()``: the
vocab-parallel embedding and output layer are stored **unpadded** (``[vocab, hidden]``), because
Megatron's vocab padding (a multiple of ``128 * tp``) differs between TP sizes; loading pads them
again with zero rows (:func:`model_sharded_state_dict`).

API (collectives over the default process group; every rank calls them; megatron's parallel
state must be initialised, :func:`model_bridge.parallel.init_parallel`), re-exported here from the
parts in ``model_bridge/dist_ckpt/``:

* ``meta.py``: :data:`META_FILE`, :func:`spec_fingerprint`, :func:`read_checkpoint_meta`,
  :func:`check_dist_checkpoint`.
* ``sharded.py``: :func:`save_model` / :func:`load_model`: a materialised model (training, tests);
  :func:`model_sharded_state_dict`.
* ``hf_to_dist.py``: :func:`save_hf_as_dist_checkpoint`: HF safetensors -> dist checkpoint *without
  materialising the model*: the model is built on the meta device for its sharding metadata
  (``meta_model.py``: :func:`build_meta_thinker`), and each tensor is read from the HF files
  (``direct_reader.py``) and converted only when the checkpoint writer asks for it
  (``lazy_save.py``; one parameter at a time; bounded memory at any model size).
* ``dist_to_hf.py``: :func:`iter_dist_checkpoint_as_hf`: dist checkpoint -> ``(hf_name, tensor)`` on
  one rank, loading a group of parameters (``group_bytes``) at a time.
* ``shard_writer.py``: :class:`StreamingShardWriter`: safetensors shards written as the tensors
  arrive (headers from a known plan), optionally from a writer thread.
* ``ranks.py``: :func:`forward_logits`: one sample through this rank's pipeline stage, full logits
  on the last stage; the spawn entry points (top-level, picklable, so ``run_ranks`` can start them
  from any ``__main__``): :func:`rank_hf_to_mcore`, :func:`rank_mcore_to_hf`,
  :func:`rank_save_model_from_hf`, :func:`rank_load_model_logits`. ``$MGRPO_CONVERT_PROFILE=DIR``
  writes cProfile stats of the conversion ranks there.

Errors: :class:`model_bridge.io.CheckpointError` naming the directory and what is wrong (not a
directory, not a dist checkpoint, another model, a different spec, missing tensors).
"""
from model_bridge.dist_ckpt.direct_reader import _DirectReader  # noqa: F401 - the tests import it from here
from model_bridge.dist_ckpt.dist_to_hf import iter_dist_checkpoint_as_hf
from model_bridge.dist_ckpt.hf_to_dist import save_hf_as_dist_checkpoint
from model_bridge.dist_ckpt.meta import (FORMAT_NAME, FORMAT_VERSION, META_FILE, SHARDED_SD_METADATA,
                                         check_dist_checkpoint, read_checkpoint_meta, spec_fingerprint, versions)
from model_bridge.dist_ckpt.meta_model import build_meta_thinker
from model_bridge.dist_ckpt.ranks import (forward_logits, rank_hf_to_mcore, rank_load_model_logits, rank_mcore_to_hf,
                                          rank_save_model_from_hf)
from model_bridge.dist_ckpt.shard_writer import StreamingShardWriter
from model_bridge.dist_ckpt.sharded import load_model, model_sharded_state_dict, save_model

__all__ = [
    "META_FILE", "FORMAT_NAME", "FORMAT_VERSION", "SHARDED_SD_METADATA", "spec_fingerprint", "versions",
    "model_sharded_state_dict", "save_model", "load_model", "read_checkpoint_meta", "check_dist_checkpoint",
    "save_hf_as_dist_checkpoint", "iter_dist_checkpoint_as_hf", "build_meta_thinker",
    "StreamingShardWriter", "forward_logits",
    "rank_hf_to_mcore", "rank_mcore_to_hf", "rank_save_model_from_hf", "rank_load_model_logits",
]
