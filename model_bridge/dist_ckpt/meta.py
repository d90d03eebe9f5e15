"""The dist checkpoint's own metadata: :data:`META_FILE` (model, spec fingerprint, HF source, layout
written at, versions) and the check that a directory is a complete torch_dist checkpoint of this
model (:func:`check_dist_checkpoint`)."""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
from pathlib import Path
from typing import Optional

import torch

from model_bridge.io import CheckpointError

META_FILE = "mgrpo_checkpoint.json"
FORMAT_NAME = "mgrpo-megatron-dist"
FORMAT_VERSION = 1
SHARDED_SD_METADATA = {"singleton_local_shards": False}
"""``sharded_state_dict(metadata=...)`` pinned so megatron-core 0.16 and 0.19 write the same keys."""


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
