"""Resume at another layout: a checkpoint saved at one TP/PP/EP/DP trains on at another.

The engine and data of ``test_checkpoint`` (tiny thinker, megatron DDP + distributed Adam, cosine
LR, a data iterator drawing from the global RNGs), on real gloo ranks. The reference is the
saving run itself, trained on past the save: a same-layout resume is bit-identical to it
(``test_checkpoint``). Each resume at another layout:

* saves what it loaded again, at its own layout (megatron gathers the fp32 main parameters and
  Adam moments into their model-shaped tensors): every one equals the saved one bit for bit;
* trains the next step: loss within ``FIRST_TOL`` of the reference (only the reduction order of
  the new layout differs), then two more steps within ``NEXT_TOL``.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from model_bridge.spawn import run_ranks

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
LAST = 5  # save at step 2, resume for steps 3, 4, 5
FIRST_TOL = 1e-6
NEXT_TOL = 1e-5  # fp32, two optimizer steps after another reduction order (measured: <= 4.1e-6, at EP2)


def _quiet(out: dict) -> dict:
    return {k: v for k, v in out.items() if not k.startswith("params")}


def _reference(hf_dir: str, run_dir: str, layout: dict) -> dict:
    """Train steps 1..LAST at ``layout``, saving at step 2."""
    from test_checkpoint import _train_steps

    from model_bridge.parallel import destroy_parallel

    out = _quiet(_train_steps(hf_dir, run_dir, LAST, save_at=(2,), layout=layout))
    destroy_parallel()
    return out


def _resume_at(hf_dir: str, run_dir: str, layouts: list, copy_root: str) -> list:
    """Resume ``run_dir`` at each layout in turn (one process group), training to LAST."""
    import warnings

    from test_checkpoint import _train_steps

    from model_bridge.parallel import destroy_parallel

    records: list = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logger = logging.getLogger("megatron_grpo.engine.checkpoint")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    outs = []
    for i, layout in enumerate(layouts):
        records.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = _quiet(_train_steps(hf_dir, run_dir, LAST, resume=True, layout=layout,
                                      copy_to=f"{copy_root}/{i}"))
        out["warnings"] = [str(w.message) for w in caught if "checkpoint" in str(w.message)]
        out["log"] = list(records)
        outs.append(out)
        destroy_parallel(destroy_process_group=False)
    destroy_parallel()
    return outs


def _stored(ckpt: Path) -> dict:
    """Every tensor of a torch_dist checkpoint, whole (torch's own DCP reader, one process)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parent / f"{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    return {k: v for k, v in torch.load(out, weights_only=False).items() if torch.is_tensor(v)}


def _describe(layout: dict, world: int) -> str:
    return "x".join(f"{k.upper()}{v}" for k, v in layout.items()) or "TP1", f"world {world}"


def _check_layouts(hf_dir: str, tmp: Path, world: int, saved_at: dict, targets: list) -> list[str]:
    """Save at ``saved_at`` on ``world`` ranks; resume at every ``(world, layout)`` of ``targets``."""
    t0 = time.monotonic()
    run_dir = tmp / "run"
    ref = run_ranks(_reference, world, hf_dir, str(run_dir), saved_at, timeout=300, env=CPU_ONLY)[0]
    lines = [f"saved at {_describe(saved_at, world)}: reference steps 3-5 "
             f"{[round(ref['losses'][s], 8) for s in (3, 4, 5)]} ({time.monotonic() - t0:.1f}s)"]
    saved = _stored(run_dir / "checkpoints" / "step_00000002")
    opt_keys = sorted(k for k in saved if k.startswith("optimizer.state."))
    kinds = {k.split(".")[2] for k in opt_keys}
    assert kinds == {"param", "exp_avg", "exp_avg_sq"}, kinds
    by_world: dict = {}
    for w, layout in targets:
        by_world.setdefault(w, []).append(layout)
    for w, layouts in by_world.items():
        t1 = time.monotonic()
        copy_root = tmp / f"copies-w{w}"
        outs = run_ranks(_resume_at, w, hf_dir, str(run_dir), layouts, str(copy_root), timeout=300, env=CPU_ONLY)
        for i, layout in enumerate(layouts):
            what = f"{_describe(layout, w)}"
            got = outs[0][i]
            assert got["resumed_at"] == 2 and got["extra"]["data"] == {"position": 12}, (what, got["extra"])
            # every rank of the new layout: the same loss (metrics are global)
            assert all(o[i]["losses"] == got["losses"] for o in outs), what
            # the layout change is logged once, in one line, and the RNG consequence once
            moved = [m for m in got["log"] if "at another layout" in m]
            assert len(moved) == 1 and " -> " in moved[0], (what, got["log"])
            rng = [m for m in got["warnings"] if "not bit-identical" in m]
            assert len(rng) == 1 and "host RNG streams (Python, NumPy, torch CPU) continue from the checkpoint;" \
                in rng[0], (what, got["warnings"])
            copy = _stored(copy_root / str(i) / "checkpoints" / "step_00000002")
            assert sorted(k for k in copy if k.startswith("optimizer.state.")) == opt_keys, what
            bad = [k for k in saved if k in copy and not torch.equal(saved[k], copy[k])]
            assert not bad, f"{what}: {len(bad)} tensors differ after loading, e.g. {bad[:3]}"
            missing = [k for k in saved if k not in copy and "_extra_state" not in k]
            assert not missing, (what, missing[:5])
            d1 = abs(got["losses"][3] - ref["losses"][3])
            dn = max(abs(got["losses"][s] - ref["losses"][s]) for s in (4, 5))
            assert d1 <= FIRST_TOL, (what, got["losses"], ref["losses"])
            assert dn <= NEXT_TOL, (what, got["losses"], ref["losses"])
            assert got["lrs"] == {s: ref["lrs"][s] for s in (3, 4, 5)}, what
            lines.append(f"  -> {what}: |dloss| step 3 {d1:.1e}, steps 4-5 {dn:.1e}; {len(opt_keys)} optimizer "
                         f"tensors (fp32 params, exp_avg, exp_avg_sq) bit-exact; {moved[0].split(': ', 1)[1]}")
        lines.append(f"  ({len(layouts)} layout(s) on {w} rank(s): {time.monotonic() - t1:.1f}s)")
    return lines


@pytest.fixture(scope="module")
def hf_dir():
    from conftest import build_cached_tiny

    return str(build_cached_tiny())


@pytest.mark.slow
def test_resume_tp2_checkpoint_at_other_layouts(hf_dir, tmp_path):
    lines = _check_layouts(hf_dir, tmp_path, 2, {"tp": 2},
                           [(2, {"tp": 1, "ep": 2}), (2, {"pp": 2}), (1, {}), (4, {"tp": 2, "ep": 2})])
    print("\n" + "\n".join(lines))


def _fake_run(run: Path, hf_dir, **meta) -> Path:
    """A run dir whose one checkpoint says it was saved at TP2 on 2 ranks (no tensors: the
    pre-flight reads the metadata only)."""
    import json

    from megatron_grpo.engine.checkpoint import CHECKPOINT_FORMAT, META_FILE

    step = run / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"trainer": {"run_dir": str(run)}, "model": {"hf_dir": str(hf_dir)}}))
    layout = {"world_size": 2, "tp": 2, "pp": 1, "ep": 1, "etp": 2, "dp": 1}
    (step / META_FILE).write_text(json.dumps({"format": CHECKPOINT_FORMAT, "step": 4, "layout": layout,
                                              "optimizer": True, **meta}))
    return step


def test_resume_preflight_names_both_layouts(mgrpo_inproc, tiny_ckpt, tmp_path):
    """`mgrpo train --resume RUN parallel.*=...` before any rank starts: a checkpoint that cannot
    load at the new layout, or a layout the model cannot take, is one line naming both layouts
    and the fix (exit 2); a possible change is said in one line, from -> to."""
    from conftest import PreflightPassed

    old = _fake_run(tmp_path / "old", tiny_ckpt, optimizer_sharding="dp_reshardable")
    r = mgrpo_inproc("train", "--resume", str(tmp_path / "old"), "parallel.tp=1", "parallel.ep=2")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"mgrpo train: config error: cannot resume {old} (saved at tp2 pp1 ep1 etp2 dp1 (2 ranks)) at tp1 pp1 ep2 "
        "etp1 dp2 (2 ranks): its optimizer is stored as 'dp_reshardable', which reloads only at the same "
        "TP/PP/EP/ETP (any DP); resume with parallel.tp=2 parallel.pp=1 parallel.ep=1 parallel.etp=2 and any "
        "parallel.nproc that fits; its next checkpoint is then saved layout-free"], r.stderr
    new = _fake_run(tmp_path / "new", tiny_ckpt, optimizer_sharding="fully_reshardable", vocab_unpadded=True)
    r = mgrpo_inproc("train", "--resume", str(tmp_path / "new"), "parallel.nproc=6", "parallel.tp=1", "parallel.ep=3")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"mgrpo train: config error: cannot resume {new} (saved at tp2 pp1 ep1 etp2 dp1 (2 ranks)) at tp1 pp1 ep3 "
        "etp1 dp6 (6 ranks): parallel layout does not fit the model: ep=3 does not divide num_experts=8; choose "
        "parallel.tp/pp/ep/etp and parallel.nproc that fit (the saved layout does)"], r.stderr
    with pytest.raises(PreflightPassed):
        import contextlib
        import io

        from launch.cli import main

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main(["train", "--resume", str(tmp_path / "new"), "parallel.tp=1", "parallel.ep=2"])
    lines = [x for x in out.getvalue().splitlines() if "at another layout" in x]
    assert lines == [f"[train] resuming {new} at another layout: tp2 pp1 ep1 etp2 dp1 (2 ranks) -> tp1 pp1 ep2 etp1 "
                     "dp2 (2 ranks)"], out.getvalue()


@pytest.mark.slow
def test_resume_pp2_and_ep2_checkpoints_at_other_layouts(hf_dir, tmp_path):
    """The other direction: checkpoints saved at PP2 and at EP2 (world 2) resume at TP/EP/PP
    layouts they were not saved at (world 1 and 4 are covered from TP2 above)."""
    lines = _check_layouts(hf_dir, tmp_path / "pp2", 2, {"pp": 2}, [(2, {"tp": 1, "ep": 2})])
    lines += _check_layouts(hf_dir, tmp_path / "ep2", 2, {"ep": 2}, [(2, {"tp": 2}), (2, {"pp": 2})])
    print("\n" + "\n".join(lines))
