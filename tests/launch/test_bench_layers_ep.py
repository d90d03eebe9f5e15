"""``mgrpo bench layers --ep 2`` on CPU (gloo): the EP-N path of ``launch/bench/layers.py`` end to end.

The real command (``python -m launch.bench.layers``) runs at the tiny geometry (hidden 64, 8
experts top-2, 2 layers; 16 samples of 563 tokens per rank) in fp32: first the EP1 baseline (one
rank), then two EP ranks with 4 experts each and their own micro-batch. The JSON must hold
per-rank results, and each EP rank's loss on its micro-batch must equal the EP1 model's loss on the
same tokens (the sharded experts are the same experts, the all-to-all brings every token to them
and back). About 25 s on 2 cores.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOSS_TOL = 1e-5  # fp32; relative to sum |out * R| (the loss is a sum of terms of both signs)


@pytest.mark.slow
def test_bench_layers_ep2_cpu(tmp_path):
    out = tmp_path / "ep2"
    cmd = [sys.executable, "-m", "launch.bench.layers", "--tiny", "--device", "cpu", "--ep", "2", "--dtype", "fp32",
           "--layers", "2", "--warmup", "0", "--iters", "1", "--hang-timeout", "120", "--timeout", "240",
           "--out", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    # progress lines from every rank of both launches
    for tag, ranks in (("ep1", [0]), ("ep2", [0, 1])):
        for r in ranks:
            assert f"[bench layers {tag} rank {r}] done" in log, log[-4000:]

    res = json.loads((out / "bench_layers.json").read_text())
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "bench_layers.png").exists()
    assert res["ep"] == 2 and res["dtype"] == "float32"
    assert set(res["systems"]) == {"ours_ep1", "ours_ep2_rank0", "ours_ep2_rank1"}
    ranks = res["per_rank"]
    assert [r["rank"] for r in ranks] == [0, 1]
    E = res["geometry"]["experts"]
    base_tokens = res["ep1_baseline"]["tokens"]
    for r in ranks:
        assert r["local_experts"] == E // 2
        assert r["tokens"] == base_tokens  # the same per-GPU micro-batch size as EP1
        assert r["tok_per_s"] > 0 and r["step_s_median"] > 0 and r["tok_per_s_vs_ep1"] > 0
        assert r["loss_rel_diff"] < LOSS_TOL and r["sumsq_rel_diff"] < LOSS_TOL, r
    # the ranks ran different tokens (own samples, seeded per rank), so the check compares two losses
    assert res["lengths_per_rank"][0] != res["lengths_per_rank"][1]
    assert sorted(res["lengths_per_rank"][0]) == sorted(res["lengths_per_rank"][1])
    assert abs(ranks[0]["loss"] - ranks[1]["loss"]) > 1e-3 * abs(ranks[0]["loss"])
    ratios = res["ratios"]
    assert ratios["ep2_vs_ep1_per_gpu_tok_s"] > 0 and "ep2_per_gpu_tok_s>=0.9x_ep1" in ratios["targets"]
    print("\n[bench layers --ep 2, cpu] " + "; ".join(
        f"rank {r['rank']}: loss {r['loss']:.6g} vs EP1 {r['loss_ep1']:.6g} (rel {r['loss_rel_diff']:.1e})"
        for r in ranks))
