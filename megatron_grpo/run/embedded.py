"""The embedded default's inputs: the tiny checkpoint and synthetic audio-agent data, built into
the cache dir ($MGRPO_CACHE, default ~/.cache/megatron-grpo) the first time a run needs them."""
from __future__ import annotations

from pathlib import Path

from megatron_grpo.config import TrainConfig, default_cache_dir

TINY_SEED = 0
DATA_ROWS = 64


def ensure_embedded_inputs(cfg: TrainConfig, cache: Path | None = None) -> TrainConfig:
    """Fill model.hf_dir / data.train_jsonl when unset, building what is missing (rank 0 only)."""
    cache = Path(cache or default_cache_dir())
    _ensure_tiny(cfg, cache)
    if cfg.data.train_jsonl is None and cfg.rollout.server != "replay":  # a replay reads no data
        out = cache / "audio-agent-data"
        if not (out / "train.jsonl").exists():
            from megatron_grpo.data.synth import make_data
            print(f"[train] building the embedded synthetic data in {out}", flush=True)
            make_data(out, n=DATA_ROWS, n_dev=4, seed=0, progress=False)
        cfg.data.train_jsonl = str(out / "train.jsonl")
    return cfg


def ensure_sft_inputs(cfg: TrainConfig, cache: Path | None = None) -> TrainConfig:
    """Fill model.hf_dir / sft.data when unset: the embedded tiny checkpoint and the synthetic
    expert trajectories (`mgrpo make-data --sft`: the embedded GRPO data's recordings and
    questions), built once (rank 0 only)."""
    cache = Path(cache or default_cache_dir())
    _ensure_tiny(cfg, cache)
    if cfg.sft.data is None:
        out = cache / "audio-agent-sft"
        if not (out / "sft.jsonl").exists():
            from megatron_grpo.data.synth import make_data
            print(f"[sft] building the embedded expert trajectories in {out}", flush=True)
            make_data(out, n=DATA_ROWS, n_dev=4, seed=0, progress=False, sft=True)
        cfg.sft.data = str(out / "sft.jsonl")
    return cfg


def _ensure_tiny(cfg: TrainConfig, cache: Path) -> None:
    if cfg.model.hf_dir is None:
        out = cache / "tiny-omni"
        if not (out / "model.safetensors.index.json").exists():
            from model_bridge.tiny import make_tiny
            print(f"[train] building the embedded tiny checkpoint in {out}", flush=True)
            make_tiny(out, preset="tiny", seed=TINY_SEED)
        cfg.model.hf_dir = str(out)
