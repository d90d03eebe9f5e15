"""``packing.max_tokens_per_microbatch: auto``: the budget from free memory and the geometry."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_grpo.engine.budget import DEFAULT_BUDGET, activation_bytes_per_token, auto_token_budget, resolve_token_budget


def _release_spec():
    from launch.bench.convert import bench_config
    from model_bridge.config import parse_omni_config

    return parse_omni_config(bench_config(48, 32))


def test_activation_bytes_of_the_release_geometry():
    spec = _release_spec()
    # per decoder layer: attention 2*2048 + (32 + 8)*128 + 32*128 = 13,312; MoE 128*2 + 8*(2*2048 + 3*768) = 51,456
    # per audio layer: 6*1280 + 2*5120 = 17,920; bf16
    assert activation_bytes_per_token(spec, 48, 32) == 2 * (48 * (13312 + 51456) + 32 * 17920)


def test_budget_from_free_memory_and_its_log_line():
    spec = _release_spec()
    per = int(1.5 * activation_bytes_per_token(spec, 4, 4))
    free = 100 * 2**30
    budget, line = auto_token_budget(spec, free_bytes=free, layers=4, audio_layers=4, adam_params=10**9,
                                     chunk_tokens=1024, vocab_local=152064)
    avail = int(free * 0.9) - 8 * 10**9 - 2 * 2**30 - 12 * 1024 * 152064
    assert budget == min(65536, avail // per // 256 * 256) and budget % 256 == 0 and budget >= 4096
    assert line.startswith(f"packing.max_tokens_per_microbatch=auto -> {budget} tokens (free 100.0 GiB x 0.9")
    b2, _ = auto_token_budget(spec, free_bytes=free, layers=4, audio_layers=4, adam_params=10**9,
                              chunk_tokens=1024, vocab_local=152064, multiple=3)
    assert b2 % (256 * 3) == 0 and b2 <= budget


def test_budget_refuses_too_little_memory():
    with pytest.raises(RuntimeError, match=r"too little free GPU memory for 256 tokens per micro-batch .*set the "
                                           r"budget by hand"):
        auto_token_budget(_release_spec(), free_bytes=20 * 2**30, layers=48, audio_layers=32, adam_params=2 * 10**9,
                          chunk_tokens=1024, vocab_local=152064)


def test_auto_on_cpu_is_the_default(caplog):
    assert resolve_token_budget(3000, None, chunk_tokens=1024) == 3000
    with caplog.at_level("INFO", logger="megatron_grpo.engine.budget"):
        assert resolve_token_budget("auto", None, chunk_tokens=1024) == DEFAULT_BUDGET
    assert "auto on CPU -> 4096 tokens" in caplog.text


def test_config_takes_auto_and_it_is_the_default():
    from launch.recipes import qwen3_omni_30b_a3b_audio_agent_4x8_h200
    from megatron_grpo.config import load_train_config

    assert load_train_config(None, []).packing.max_tokens_per_microbatch == "auto"
    assert load_train_config(None, ["packing.max_tokens_per_microbatch=auto"]).packing.max_tokens_per_microbatch == "auto"
    assert load_train_config(None, ["packing.max_tokens_per_microbatch=8192"]).packing.max_tokens_per_microbatch == 8192
    assert qwen3_omni_30b_a3b_audio_agent_4x8_h200().packing.max_tokens_per_microbatch == "auto"
