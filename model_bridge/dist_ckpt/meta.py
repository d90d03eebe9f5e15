"""The dist checkpoint's own metadata: :data:`META_FILE` (model, spec fingerprint, HF source, layout
written at, versions) and the check that a directory is a complete torch_dist checkpoint of this
model (:func:`check_dist_checkpoint`).

Training checkpoints (``megatron_grpo.engine.checkpoint``, format :data:`TRAINING_FORMAT`) are
torch_dist checkpoints too: their model tensors have the same keys, except that the vocab-parallel
embedding and output layer are stored padded (``[Vp, H]``, Vp as megatron padded it for the
training TP). :func:`resolve_mcore_input` turns a run directory (or its ``checkpoints/``) into its
newest complete checkpoint; ``check_dist_checkpoint(..., allow_training=True)`` accepts them."""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
from pathlib import Path
from typing import Optional

import torch

from model_bridge.dist_ckpt.runs import CHECKPOINT_FORMAT as TRAINING_FORMAT
from model_bridge.dist_ckpt.runs import META_FILE, find_latest_checkpoint
from model_bridge.io import CheckpointError

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


def is_training_checkpoint(meta: dict) -> bool:
    """Whether a :data:`META_FILE` content is a megatron-grpo training checkpoint's."""
    return bool(meta) and meta.get("format") == TRAINING_FORMAT


def _is_run_config(path: Path) -> bool:
    """``path`` is the config.json `mgrpo train` writes into its run dir (not an HF config)."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and isinstance(cfg.get("trainer"), dict) and "model_type" not in cfg


def _run_dir_of(d: Path) -> Optional[Path]:
    """The training run directory ``d`` names: the run dir itself (it has ``checkpoints/``) or its
    ``checkpoints/`` dir; None otherwise."""
    if d.name == "checkpoints" and d.is_dir() and ((d / "latest").exists() or any(d.glob("step_*"))):
        return d.parent
    if (d / "checkpoints").is_dir() and not (d / "metadata.json").is_file():
        return d
    return None


def resolve_mcore_input(path: str | os.PathLike) -> tuple[Path, Optional[str]]:
    """(checkpoint dir, note): ``path`` itself, or for a training run directory (or its
    ``checkpoints/``) the newest complete checkpoint in it (:func:`find_latest_checkpoint`), with a
    note saying which one was picked."""
    d = Path(path)
    run_dir = _run_dir_of(d)
    if run_dir is None:
        return d, None
    latest = find_latest_checkpoint(run_dir)
    if latest is None:
        raise CheckpointError(f"{d} is a training run directory without a complete checkpoint under "
                              f"{run_dir / 'checkpoints'} (a complete one is a step_<8-digit step> dir, e.g. step_00000020, with {META_FILE})")
    return latest, f"using {latest}, the newest complete checkpoint of run {run_dir}"


def training_run_hf_dir(ckpt_dir: str | os.PathLike) -> Optional[str]:
    """``model.hf_dir`` of the run a training checkpoint ``RUN/checkpoints/step_N`` belongs to
    (its ``RUN/config.json``); None when it cannot be found."""
    d = Path(ckpt_dir).resolve()
    cfg = d.parent.parent / "config.json"
    if d.parent.name != "checkpoints" or not cfg.is_file():
        return None
    try:
        hf = (json.loads(cfg.read_text()).get("model") or {}).get("hf_dir")
    except (json.JSONDecodeError, AttributeError):
        return None
    return str(hf) if hf else None


def _training_error(d: Path, meta: dict) -> CheckpointError:
    return CheckpointError(
        f"{d} is a megatron-grpo training checkpoint (format {TRAINING_FORMAT!r}, step {meta.get('step')}), "
        f"not a bridge dist checkpoint ({FORMAT_NAME!r}): resume training from it, or export its weights with "
        f"`mgrpo convert mcore-to-hf --mcore {d} --out DIR` (--hf-source defaults to the run's model.hf_dir)")


def _existing_steps_hint(d: Path, most: int = 8) -> str:
    """For a missing ``RUN/checkpoints/step_N``: the step dirs that do exist there (the newest
    ``most``), so a mistyped step shows the right ones."""
    if d.parent.name != "checkpoints" or not d.parent.is_dir():
        return ""
    steps = sorted(p.name for p in d.parent.iterdir() if p.is_dir() and p.name.startswith("step_"))
    if not steps:
        return f"; {d.parent} holds no step_* checkpoint yet"
    shown = ", ".join(steps[-most:])
    return f"; {d.parent} holds {shown}" + (f" (the newest {most} of {len(steps)})" if len(steps) > most else "")


def check_dist_checkpoint(ckpt_dir: str | os.PathLike, spec=None, *, allow_training: bool = False) -> dict:
    """Raise ``CheckpointError`` unless ``ckpt_dir`` is a complete torch_dist checkpoint (and, with
    ``spec``, one of this model spec); return its :data:`META_FILE` content ({} when absent).

    ``allow_training``: also accept a megatron-grpo training checkpoint (one model chunk); its
    spec is not fingerprinted (``iter_dist_checkpoint_as_hf`` compares the stored shapes)."""
    d = Path(ckpt_dir)
    if not d.exists():
        what = "a Megatron dist checkpoint directory, e.g. from `mgrpo convert hf-to-mcore`"
        if allow_training:
            what += ", a training run directory, or one of its checkpoints/step_<8-digit step> dirs"
        raise CheckpointError(f"{d} does not exist (expected {what}){_existing_steps_hint(d)}")
    if not d.is_dir():
        raise CheckpointError(f"{d} is not a directory (expected a Megatron dist checkpoint directory)")
    cfg = d / "metadata.json"
    if not cfg.is_file():
        hint = ""
        if _run_dir_of(d) is not None:
            hint = (" (it is a training run directory: `mgrpo convert mcore-to-hf --mcore` takes it and picks its "
                    "newest checkpoint; elsewhere pass one of its checkpoints/step_<8-digit step> dirs)")
        elif _is_run_config(d / "config.json"):
            hint = (" (it is a training run directory without a checkpoint yet: `mgrpo train` saves one every "
                    "checkpoint.every steps and at the end; convert after the first one exists)")
        elif (d / "config.json").is_file() or any(d.glob("*.safetensors")):
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
    if is_training_checkpoint(meta):
        if not allow_training:
            raise _training_error(d, meta)
        if int(meta.get("num_model_chunks", 1)) != 1:
            raise CheckpointError(f"{d}: a training checkpoint of {meta.get('num_model_chunks')} virtual-pipeline "
                                  "model chunks is not supported")
        return meta
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
