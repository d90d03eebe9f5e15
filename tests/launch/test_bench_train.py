"""``mgrpo bench train`` at tiny width on the CPU: the real training phase runs and the report's
shares add up to the phase; GPU: the full command at tiny width with device features."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path, ckpt, *extra):
    out = tmp_path / "bt"
    cmd = [sys.executable, "-m", "launch.bench.train", "--tiny", "--hf-dir", str(ckpt), "--samples", "4",
           "--mb-tokens", "512", "--warmup", "0", "--iters", "1", "--out", str(out), *extra]
    p = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    return json.loads((out / "bench_train.json").read_text()), out


def _check(res):
    s, r = res["systems"], res["report"]
    assert set(s) == {"train", "train_recompute", "train_serial", "train_split", "stack", "stack_lm", "audio", "h2d"}
    for other in ("train_recompute", "train_serial"):
        assert r[f"train_vs_{other}_tok_s"] == pytest.approx(s[other]["phase_s_median"] / s["train"]["phase_s_median"])
    kept = res["shared_batches_kept"]  # the tiny run's clips, pooled; its budget keeps them all
    assert res["shared_clips_keep"] == 0.5 and kept["batches"] >= 1 and kept["kept"] == kept["batches"], kept
    assert res["audio_clips"] >= 8 and len(res["micro_batches"]) >= 2
    assert all(t <= 512 for t in res["micro_batches"])
    split = s["train_split"]
    parts = r["parts_s"]
    # featurise + pack + forward/backward + optimizer + other is the phase, exactly
    total = parts["featurise"] + parts["pack"] + split["forward_backward_s_median"] + parts["optimizer"] + parts["other"]
    assert total == pytest.approx(r["phase_s"], rel=1e-9)
    assert r["train_vs_stack_lm_tok_s"] == pytest.approx(s["stack_lm"]["step_s_median"] / s["train"]["phase_s_median"])
    assert r["featurise_pack_h2d_share"] == pytest.approx(
        (parts["featurise"] + parts["pack"] + parts["h2d"]) / r["phase_s"])
    assert parts["featurise"] > 0 and parts["optimizer"] > 0
    runs = split["pack_s"], split["plan_s"], split["build_s"], split["check_s"]
    assert all(p == pytest.approx(a + b + c, rel=1e-9) for p, a, b, c in zip(*runs))
    assert set(r["pack_parts_s"]) == {"plan", "build", "check"} and min(r["pack_parts_s"].values()) >= 0
    ob = res["optimizer_bound"]
    assert ob["bound_s"] == pytest.approx(ob["params"] * ob["bytes_per_param"] / ob["copy_bandwidth_B_s"])
    stack_lm, audio = s["stack_lm"]["step_s_median"], s["audio"]["step_s_median"]
    assert r["parts_bound_vs_stack_lm"] == pytest.approx(stack_lm / (stack_lm + audio + ob["bound_s"]))
    m = res["last_train_metrics"]  # the real train_step ran: loss tokens, clips and a finite grad norm
    assert m["audio_clips"] == res["audio_clips"] and m["grad_norm"] > 0 and m["skipped"] == 0.0


def test_bench_train_tiny_cpu(tmp_path, tiny_ckpt):
    res, out = _run(tmp_path, tiny_ckpt, "--device", "cpu", "--profile", "audio", "--profile-top", "7", "--cuda-graphs")
    _check(res)
    assert res["featurizer"] == "host" and res["device"] == "cpu"
    prof = res["profiles"]["audio"]
    assert set(prof) == {"host"}  # no device table without CUDA
    rows = prof["host"]  # the tower's own ops, largest first, the 7 largest
    assert len(rows) == 7 and any("conv" in r["name"] for r in rows), rows
    assert [r["total_ms"] for r in rows] == sorted((r["total_ms"] for r in rows), reverse=True)
    assert (out / "profile_audio.txt").read_text().count("\n") == len(rows) + 1
    assert res["cuda_graphs"] is False and res["cuda_graphs_fallback"] == "no CUDA device (graphs are a GPU feature)"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_train_tiny_gpu(tmp_path, tiny_ckpt):
    res, _ = _run(tmp_path, tiny_ckpt, "--profile", "audio", "--cuda-graphs", "--syncs", "train")
    _check(res)
    prof = res["profiles"]["audio"]
    assert any("conv" in r["name"].lower() for r in prof["device"]) and prof["host"], prof
    assert res["featurizer"] == "device" and res["device"].startswith("cuda")
    tl = prof["timeline"]
    assert 0 < tl["busy_ms"] <= tl["step_ms"] and tl["idle_ms"] == pytest.approx(tl["step_ms"] - tl["busy_ms"])
    assert res["cuda_graphs"] is True and res["graph_replays"] > 0 and res["graph_buckets"]
    syncs = res["host_syncs"]["train"]
    assert syncs["total"] >= sum(r["count"] for r in syncs["sites"]) >= 1  # the grad norm's read at least


def test_device_timeline_of_overlapping_and_gapped_spans():
    """Busy time is the union of the activities (overlaps counted once, a span inside another not at
    all); idle is the rest of the step, before the first, between, after the last; gaps longest first."""
    from launch.bench._idle import device_timeline

    spans = [(1000.0, 3000.0), (2000.0, 2500.0), (2800.0, 4000.0), (4500.0, 5000.0), (7000.0, 7100.0)]
    tl = device_timeline(spans, start_us=0.0, end_us=8000.0)
    assert tl["busy_ms"] == pytest.approx(3.0 + 0.5 + 0.1) and tl["step_ms"] == pytest.approx(8.0)
    assert tl["idle_ms"] == pytest.approx(8.0 - 3.6)
    assert tl["idle_before_first_ms"] == pytest.approx(1.0) and tl["idle_after_last_ms"] == pytest.approx(0.9)
    assert tl["longest_gaps"] == [{"ms": pytest.approx(2.0), "at_ms": pytest.approx(5.0)},
                                  {"ms": pytest.approx(0.5), "at_ms": pytest.approx(4.0)}]
    assert device_timeline([], 0.0, 2000.0) == {"step_ms": 2.0, "busy_ms": 0.0, "idle_ms": 2.0}


def test_idle_time_goes_to_the_innermost_open_range():
    """Idle stretches are charged to the shortest host range open at the time (nested ranges
    inside longer ones), the rest to "(no range)"; the charges add up to the idle time."""
    from launch.bench._idle import NO_RANGE, idle_by_owner, idle_intervals

    spans = [(100.0, 300.0), (250.0, 400.0), (600.0, 700.0)]
    idle = idle_intervals(spans, 0.0, 1000.0)
    assert idle == [(0.0, 100.0), (400.0, 600.0), (700.0, 1000.0)]
    ranges = [("mgrpo/step", 0.0, 900.0), ("mgrpo/pack", 450.0, 550.0), ("mgrpo/loss", 720.0, 760.0)]
    rows = {r["name"]: r["idle_ms"] for r in idle_by_owner(idle, ranges, 0.0, 1000.0)}
    assert rows == {"mgrpo/step": pytest.approx((100 + 100 + 160) / 1e3),
                    "mgrpo/pack": pytest.approx(0.1), "mgrpo/loss": pytest.approx(0.04),
                    NO_RANGE: pytest.approx(0.1)}
    assert sum(rows.values()) == pytest.approx(sum(b - a for a, b in idle) / 1e3)
    assert idle_intervals([(0.0, 50.0), (40.0, 80.0)], 0.0, 80.0) == []


def test_profile_timeline_covers_the_phase_without_device_annotations():
    """The timeline of a profile: the ``mgrpo/phase`` window only (not the profiler's teardown after
    it), device mirrors of host ranges (user annotations) not counted as device work."""
    from types import SimpleNamespace as NS

    from launch.bench.train import timeline_of

    def ev(name, a, b, cuda=False, note=False):
        return NS(name=name, time_range=NS(start=a, end=b), device_type=NS(name="CUDA" if cuda else "CPU"),
                  is_user_annotation=note)

    events = [ev("mgrpo/phase", 0.0, 1000.0), ev("mgrpo/pack", 0.0, 300.0), ev("mgrpo/schedule", 300.0, 1000.0),
              ev("mgrpo/schedule", 300.0, 1000.0, cuda=True, note=True),  # spans the gap below: not work
              ev("gemm", 200.0, 500.0, cuda=True), ev("gemm", 600.0, 1000.0, cuda=True),
              ev("Activity Buffer Request", 1000.0, 1500.0)]  # after the phase: left out
    tl = timeline_of(events)
    assert tl["step_ms"] == pytest.approx(1.0) and tl["busy_ms"] == pytest.approx(0.7)
    assert tl["idle_before_first_ms"] == pytest.approx(0.2) and tl["idle_after_last_ms"] == pytest.approx(0.0)
    assert {r["name"]: r["idle_ms"] for r in tl["idle_by_range"]} == {"mgrpo/pack": pytest.approx(0.2),
                                                                       "mgrpo/schedule": pytest.approx(0.1)}
    # the one gap between device activities names the host ops that ran in it (ranges left out)
    events.append(ev("cudaMalloc", 520.0, 580.0))
    gap = timeline_of(events)["longest_gaps"][0]
    assert gap["ms"] == pytest.approx(0.1) and [o["name"] for o in gap["host"]] == ["cudaMalloc"]
    assert gap["host"][0]["overlap_ms"] == pytest.approx(0.06)


def test_busy_host_ops_by_overlap_with_the_gap():
    from launch.bench._idle import busy_host_ops

    ops = [("aten::cat", 0.0, 1000.0), ("cudaMalloc", 400.0, 900.0), ("aten::copy_", 50.0, 120.0),
           ("before", 0.0, 90.0)]
    rows = busy_host_ops((100.0, 600.0), ops, top=2)
    assert [(r["name"], r["overlap_ms"], r["ms"]) for r in rows] == [("aten::cat", 0.5, 1.0), ("cudaMalloc", 0.2, 0.5)]
    assert busy_host_ops((2000.0, 3000.0), ops) == []


def _read_back(n):
    import warnings

    for _ in range(n):
        warnings.warn("called a synchronizing CUDA operation")  # what set_sync_debug_mode("warn") says


def test_host_syncs_are_counted_by_call_site():
    """``--syncs``: each sync warning is counted once, under the frames that made it; other
    warnings still reach the caller."""
    import warnings
    from pathlib import Path

    from launch.bench._syncs import count_syncs, sync_sites

    def step():
        _read_back(3)
        _read_back(1)
        warnings.warn("something else")

    with pytest.warns(UserWarning, match="something else"):
        res = sync_sites(step, roots=(str(Path(__file__).parent),))
    assert res["total"] == 4
    where = [(r["where"].split(" <- "), r["count"]) for r in res["sites"]]
    assert [c for _, c in where] == [3, 1]
    assert all(w[0].startswith("tests/launch/test_bench_train.py:") and w[0].endswith(" _read_back")
               and w[1].endswith(" step") for w, _ in where)
    assert where[0][0][1] != where[1][0][1]  # the two calls of _read_back are two sites
    if not __import__("torch").cuda.is_available():
        assert count_syncs(step) == {"note": "host syncs are counted on CUDA only (torch.cuda.set_sync_debug_mode)"}


def test_bench_train_auto_budget_cpu(tmp_path, tiny_ckpt):
    """``--mb-tokens auto``: the budget ``packing.max_tokens_per_microbatch: auto`` picks (the default on CPU)."""
    res, _ = _run(tmp_path, tiny_ckpt, "--device", "cpu", "--mb-tokens", "auto", "--systems", "train",
                  "--syncs", "train")
    assert res["mb_tokens"] == res["auto_budget"] == 4096
    assert all(t <= 4096 for t in res["micro_batches"]) and set(res["systems"]) == {"train"}
    assert res["host_syncs"] == {"train": {"note": "host syncs are counted on CUDA only "
                                                   "(torch.cuda.set_sync_debug_mode)"}}


@pytest.mark.parametrize("value", ["lots", "0", "-512"])
def test_bench_train_refuses_a_bad_budget(value, capsys):
    from launch.bench.train import main

    with pytest.raises(SystemExit) as e:
        main(["--mb-tokens", value])
    assert e.value.code == 2
    assert f"argument --mb-tokens: expected a positive number of tokens or auto, got {value!r}" in capsys.readouterr().err


@pytest.mark.parametrize("res,line", [
    (dict(cuda_graphs_fallback="expert parallelism (ep=2): x", device="cuda", cuda_graphs_setting=True),
     "off: expert parallelism (ep=2): x"),
    (dict(cuda_graphs_fallback=None, device="cpu", cuda_graphs_setting="auto"), "off (no CUDA device)"),
    (dict(cuda_graphs_fallback=None, device="cuda", cuda_graphs_setting="auto"),
     "off (trainer.cuda_graphs auto: on at budgets of at most 4,096 tokens; --cuda-graphs turns them on)"),
    (dict(cuda_graphs_fallback=None, device="cuda", cuda_graphs_setting=False),
     "off (--no-cuda-graphs; --cuda-graphs turns them on)"),
])
def test_the_table_says_why_graphs_are_off(res, line):
    from launch.bench.train import _graphs_off

    assert _graphs_off(res) == line
