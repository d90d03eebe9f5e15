"""Megatron-Core modules of Qwen3-Omni: thinker (GPT MoE + interleaved MRoPE), audio tower, layer specs.

Submodules import megatron-core; this package itself imports nothing heavy, so
``from model_bridge.modeling import build_thinker`` loads only what it names.
"""
from __future__ import annotations

import importlib

__all__ = ["build_thinker", "OmniThinker", "gather_logits", "mrope_position_ids", "InterleavedMRoPE",
           "PackedCoreAttention", "packed_attention", "thinker_layer_spec", "register_backend", "AudioTower"]

_WHERE = {
    "build_thinker": "thinker", "OmniThinker": "thinker", "gather_logits": "thinker",
    "mrope_position_ids": "mrope", "InterleavedMRoPE": "mrope",
    "PackedCoreAttention": "attention", "packed_attention": "attention",
    "thinker_layer_spec": "specs", "register_backend": "specs",
    "AudioTower": "audio",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
