"""``mgrpo bench layers``' kernel ceiling: the parts micro-benchmarked alone, and back to back
taking turns with our step.

The CPU test checks the order in which :func:`time_alternating` runs things (warm-up rounds
untimed, then one of each per round). The GPU tests run the real command at the tiny geometry
and check both ceilings and the ratios computed from them, and what the GPU-bound step time
(``step_diagnostics``) refuses to measure.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch.bench._layers_ceiling import micro_batch_shapes
from launch.bench._layers_timing import time_alternating

REPO = Path(__file__).resolve().parents[2]


def test_time_alternating_takes_turns_after_untimed_warmup():
    calls = []
    fns = [lambda: calls.append("a"), lambda: calls.append("b"), lambda: calls.append("c")]
    times = time_alternating(fns, torch.device("cpu"), warmup=2, iters=3)
    assert calls == ["a", "b", "c"] * 5
    assert [len(t) for t in times] == [3, 3, 3]
    assert all(s >= 0 for t in times for s in t)


def test_micro_batch_shapes_cut_lengths_and_counts_by_micro_batch():
    lengths = [5, 9, 3, 7]
    groups = [[1], [0, 3], [2]]
    counts = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12]]  # 3 micro-batches x 2 layers, in call order
    assert micro_batch_shapes(lengths, groups, counts, layers=2) == [
        ([9], [[1, 2], [3, 4]]), ([5, 7], [[5, 6], [7, 8]]), ([3], [[9, 10], [11, 12]])]
    with pytest.raises(ValueError) as e:
        micro_batch_shapes(lengths, groups, counts + [[0, 0]], layers=2)
    assert str(e.value) == ("expected the expert counts of 3 micro-batch(es) x 2 layer(s) = 6 expert calls, got 7 "
                            "(a system that recomputes the experts in its backward calls them twice: capture the "
                            "counts of one without)")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ceiling_step_alternates_with_ours(tmp_path):
    out = tmp_path / "l2"
    cmd = [sys.executable, "-m", "launch.bench.layers", "--tiny", "--layers", "2", "--systems", "ours",
           "--warmup", "1", "--iters", "3", "--out", str(out)]
    p = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True,
                       timeout=400)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    res = json.loads((out / "bench_layers.json").read_text())
    kc = res["kernel_ceiling"]
    assert len(kc["back_to_back_s"]) == len(kc["paired_step_s"]) == 3
    assert kc["back_to_back_s_median"] == sorted(kc["back_to_back_s"])[1]
    assert len(kc["layers"]) == 2
    assert kc["total_s"] == pytest.approx(sum(x["grouped_mm_s"] + x["varlen_attn_s"] + x["dense_s"] for x in kc["layers"]))
    r = res["ratios"]
    assert r["ours_vs_kernel_ceiling"] == pytest.approx(kc["total_s"] / res["systems"]["ours"]["step_s_median"])
    assert r["ours_vs_kernel_ceiling_back_to_back"] == pytest.approx(
        kc["back_to_back_s_median"] / kc["paired_step_s_median"])
    ours = res["systems"]["ours"]  # the step's diagnostics ride along (no host sync in ours' step)
    assert r["ours_gpu_bound_vs_kernel_ceiling"] == pytest.approx(kc["total_s"] / ours["step_s_gpu_bound_median"])
    assert r["ours_after_idle_vs_kernel_ceiling"] == pytest.approx(kc["total_s"] / ours["step_s_after_idle_median"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_systems_replay_the_eager_step(tmp_path):
    """``ours_graph`` / ``ours_mb_graph`` capture the whole step (micro-batches accumulating
    gradients) as one CUDA graph: the replay's output equals the eager step's bit for bit, its
    gradients are as close to an eager step's as two eager steps are to each other, and the
    replay's host time is a fraction of the eager step's (one graph launch, not ~1,000 kernels)."""
    out = tmp_path / "g"
    cmd = [sys.executable, "-m", "launch.bench.layers", "--tiny", "--layers", "2", "--systems",
           "ours_mb,ours_graph,ours_mb_graph", "--mb-tokens", "128", "--warmup", "1", "--iters", "3",
           "--out", str(out)]
    p = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True,
                       timeout=400)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    res = json.loads((out / "bench_layers.json").read_text())
    s = res["systems"]
    assert len(s["ours_mb_graph"]["micro_batch_tokens"]) > 1  # gradients accumulate inside the graph
    # the kernel ceiling at the micro-batches' own shapes: one entry per micro-batch, summed
    mbc = res["kernel_ceiling_micro_batches"]
    assert [m["tokens"] for m in mbc["micro_batches"]] == s["ours_mb"]["micro_batch_tokens"]
    assert all(len(m["layers"]) == 2 for m in mbc["micro_batches"])
    assert mbc["total_s"] == pytest.approx(sum(m["total_s"] for m in mbc["micro_batches"]))
    for name in ("ours_mb", "ours_mb_graph"):
        assert res["ratios"][f"{name}_vs_kernel_ceiling_at_micro_batches"] == pytest.approx(
            mbc["total_s"] / s[name]["step_s_median"])
    for name in ("ours_graph", "ours_mb_graph"):
        v = s[name]
        assert v["graph_output_equals_eager"] is True, name
        assert v["graph_grad_rel_diff_vs_eager"] <= max(4 * v["eager_grad_rel_diff_run_to_run"], 1e-3), v
    assert s["ours_mb_graph"]["host_issue_s_median"] < 0.25 * s["ours_mb"]["host_issue_s_median"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bound_time_needs_a_step_the_host_can_queue_ahead():
    """``step_s_gpu_bound`` is measured only where the host queues the whole step before the GPU
    starts it: a step that reads a result back (a host sync) gets None, one that does not gets
    ``iters`` times, none shorter than its kernels can run (20 GEMMs of 2 x 4096^3)."""
    from launch.bench._layers_timing import step_diagnostics

    dev = torch.device("cuda")
    x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)

    def queued():
        for _ in range(20):
            x @ x

    def syncing():
        (x @ x).sum().item()

    d = step_diagnostics(queued, dev, iters=3, host_issue_s=0.001)
    assert len(d["step_s_gpu_bound"]) == 3 and len(d["step_s_after_idle"]) == 3
    assert min(d["step_s_gpu_bound"]) > 20 * 2 * 4096**3 / 2.0e15  # no faster than 2 PFLOP/s
    assert step_diagnostics(syncing, dev, iters=2, host_issue_s=0.001)["step_s_gpu_bound"] is None


def test_dtype_takes_both_spellings():
    """``--dtype`` as model.dtype / ``mgrpo serve`` spell it, or short; anything else is refused."""
    from launch.cli import build_parser

    p = build_parser()
    for name in ("bf16", "bfloat16", "fp32", "float32"):
        assert p.parse_args(["bench", "layers", "--dtype", name]).dtype == name
    with pytest.raises(SystemExit):
        p.parse_args(["bench", "layers", "--dtype", "fp64"])


def test_lengths_are_the_batch_and_bad_ones_are_refused(capsys):
    """``--lengths 31500``: the batch is exactly those trajectories; a bad list or one given with
    ``--tokens`` is one line on stderr and exit 2 before anything runs."""
    from launch.bench._layers_geometry import _base_lengths
    from launch.cli import main

    assert _base_lengths([31500], tiny=False) == [31500] and _base_lengths([700, 90], tiny=True) == [700, 90]
    for argv, want in ((["--lengths", "5,x"], "mgrpo bench layers: --lengths '5,x': give comma-separated token "
                                              "counts >= 2, e.g. --lengths 31500"),
                       (["--lengths", "31500", "--tokens", "9000"],
                        "mgrpo bench layers: give --tokens (rescale the documented batch) or --lengths (the batch "
                        "itself), not both")):
        assert main(["bench", "layers", *argv]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == want


def test_sync_tally_leaves_out_the_mode_switch():
    """The bench's host-sync count: a sync warning attributed to torch's ``set_sync_debug_mode``
    (the switch itself) is not the step's; one from any other line, torch's ``synchronize``
    included, is counted by file and line."""
    import warnings

    from launch.bench._layers_timing import _tally_syncs

    code = torch.cuda.set_sync_debug_mode.__code__
    sync_code = torch.cuda.synchronize.__code__
    msg = "called a synchronizing CUDA operation"

    def w(text, filename, lineno):
        return warnings.WarningMessage(UserWarning(text), UserWarning, filename, lineno)

    caught = [w(msg, code.co_filename, code.co_firstlineno + 2),
              w(msg, sync_code.co_filename, sync_code.co_firstlineno + 1),
              w(msg, "/x/model.py", 7), w(msg, "/x/model.py", 7), w("something else", "/x/model.py", 9)]
    res = _tally_syncs(caught)
    assert res == {"total": 3, "by_line": {"model.py:7": 2, f"__init__.py:{sync_code.co_firstlineno + 1}": 1}}, res


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_routing_replay_full_width_uses_the_routes_at_the_unreplayed_speed(tmp_path):
    """``--routing-replay``: two full-width layers in bf16 (torch backend); a replayed step routes
    every token to exactly the recorded experts, within 5% of the unreplayed step's time."""
    out = tmp_path / "replay"
    cmd = [sys.executable, "-m", "launch.bench.layers", "--layers", "2", "--systems", "ours", "--routing-replay",
           "--out", str(out)]
    p = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True,
                       timeout=1200)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    res = json.loads((out / "bench_layers.json").read_text())
    s = res["systems"]
    assert s["ours_replay"]["replay_exact"] is True and s["ours_replay"]["backend"] == "torch"
    assert res["ratios"]["ours_replay_vs_ours_step_s"] <= 1.05, res["ratios"]
