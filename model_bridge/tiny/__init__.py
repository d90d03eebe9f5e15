"""Tiny random Qwen3-Omni-MoE checkpoints in the released model's on-disk layout (`mgrpo make-tiny`).

``make_tiny(out_dir, preset="tiny", seed=0, with_talker=False)`` writes config.json,
generation_config.json, sharded safetensors with per-expert keys plus their index, the
tokenizer (local byte-level BPE with Qwen3-Omni's added tokens and chat template) and the
processor configs. Same arguments -> byte-identical files; nothing touches a hub.
``build_tiny_model`` gives the same model in memory (tests compare against it).
"""
from __future__ import annotations

import time
from pathlib import Path

from .presets import PRESETS, TinyPreset, get_preset

__all__ = ["make_tiny", "build_tiny_model", "PRESETS", "TinyPreset", "get_preset"]


def build_tiny_model(preset: str = "tiny", seed: int = 0, with_talker: bool = False):
    """(model, tokenizer) exactly as ``make_tiny`` with the same arguments writes them."""
    from .checkpoint import build_config, build_model
    from .tokenizer import build_tokenizer, padded_vocab_size, token_ids

    p = get_preset(preset)
    tok = build_tokenizer(p.bpe_vocab_size)
    config = build_config(p, token_ids(tok), padded_vocab_size(tok), with_talker=with_talker)
    return build_model(config, p, seed), tok


def make_tiny(out_dir, preset: str = "tiny", seed: int = 0, with_talker: bool = False) -> Path:
    """Write a randomly initialised Qwen3-Omni-MoE checkpoint of size ``preset`` into ``out_dir``
    and return its path. ``with_talker`` also writes ``talker.*`` and ``code2wav.*`` tensors
    (and sets ``enable_audio_output``)."""
    from .checkpoint import (checkpoint_tensors, config_json, fused_shapes_ok, generation_config,
                             write_sharded)
    from .tokenizer import processor_files, save_tokenizer, token_ids, write_json

    t0 = time.time()
    p: TinyPreset = get_preset(preset)
    out = Path(out_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)

    model, tok = build_tiny_model(preset, seed, with_talker)
    ids = token_ids(tok)
    files = save_tokenizer(tok, out)
    print(f"[make-tiny] tokenizer: {len(tok)} tokens (BPE {p.bpe_vocab_size} + "
          f"{len(tok) - p.bpe_vocab_size} added), embedding rows "
          f"{model.config.thinker_config.text_config.vocab_size} -> {', '.join(files)}")
    for name, obj in processor_files().items():
        write_json(out / name, obj)
    print(f"[make-tiny] processor: {', '.join(processor_files())}")

    (out / "config.json").write_text(config_json(model.config))
    write_json(out / "generation_config.json", generation_config(ids))

    fused_shapes_ok(model)
    tensors = checkpoint_tensors(model)
    shards = write_sharded(tensors, out, p.num_shards)
    n_params = sum(t.numel() for t in tensors.values())
    size_mb = sum(s.stat().st_size for s in shards) / 2**20
    parts = sorted({k.split(".")[0] for k in tensors})
    print(f"[make-tiny] weights ({preset}, seed {seed}, parts {'+'.join(parts)}): "
          f"{len(tensors)} tensors, {n_params / 1e6:.2f} M params, {size_mb:.1f} MiB fp32 in "
          f"{len(shards)} shards + model.safetensors.index.json")
    print(f"[make-tiny] wrote {out} in {time.time() - t0:.1f} s")
    return out
