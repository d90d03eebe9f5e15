"""``mgrpo bench audio_front`` at tiny size: the unfused path on plain CPU, and both paths through
Triton's interpreter, where the fused path must give the unfused path's output and gradients."""
from __future__ import annotations

import json

import pytest

from model_bridge.spawn import run_ranks

TINY = dict(chunks=3, part=2, channels=16, mels=16, iters=1)


def _run(out: str) -> dict:
    from launch.bench.audio_front import run_bench

    return run_bench(out, **TINY)


def test_bench_audio_front_on_cpu(tmp_path):
    res = _run(str(tmp_path))
    assert json.loads((tmp_path / "bench_audio_front.json").read_text())["paths"].keys() == {"unfused"}
    assert res["fused_available"] is False and res["paths"]["unfused"]["step_s_median"] > 0


def test_bench_audio_front_interpreted_compares_the_paths(tmp_path):
    pytest.importorskip("triton")
    from megatron_grpo.testing.interpreted import INTERPRETED_ENV

    res = run_ranks(_run, 1, str(tmp_path), env=INTERPRETED_ENV, timeout=600)[0]
    assert res["fused_available"] and set(res["paths"]) == {"unfused", "fused"}
    # fp32 on CPU: the two paths differ by float rounding only
    assert res["max_rel_diff"]["output"] < 1e-5 and res["max_rel_diff"]["grads"] < 1e-4, res["max_rel_diff"]
    assert res["fused_vs_unfused_time"] > 0


def test_bench_audio_front_cli_rejects_a_bad_size(capsys):
    from launch.bench.audio_front import main

    with pytest.raises(SystemExit):
        main(["--chunks", "0"])
    assert "expected a positive integer, got '0'" in capsys.readouterr().err
