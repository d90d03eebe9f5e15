"""``mgrpo convert mcore-to-hf`` of a training checkpoint (``megatron_grpo.engine.checkpoint``).

The tiny model trains one real optimizer step at TP2 on 2 gloo ranks (the engine pieces of
``tests/megatron_grpo/engine/test_checkpoint.py``) and saves a training checkpoint (model,
distributed-optimizer state, RNG; vocab stored padded to the TP2 multiple). Each rank also captures
``export_hf`` of the trained model right after the step. The checkpoint is then exported through the
real CLI (a subprocess, given the run's ``checkpoints/`` dir and no ``--hf-source``: the newest
checkpoint and the run's ``model.hf_dir`` are picked and printed) and through ``mcore_to_hf`` on the
``step_N`` dir: every converted tensor is bit-equal (``torch.equal``, same dtype) to ``export_hf``,
the pass-through tensors to the source, and transformers loads the result. Wrong inputs give one
clear line.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch.cli import main

REPO = Path(__file__).resolve().parents[2]
ENGINE_TESTS = REPO / "tests" / "megatron_grpo" / "engine"
if str(ENGINE_TESTS) not in sys.path:
    sys.path.append(str(ENGINE_TESTS))  # test_checkpoint's helpers (also seen by the spawned ranks)

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def _train_one_step_and_save(hf_dir: str, run_dir: str) -> dict:
    """One rank: build the engine at TP2, one optimizer step, save the training checkpoint, then
    ``export_hf`` of the trained model (every rank takes part; rank 0 returns the tensors)."""
    import random

    import numpy as np
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_grpo.algo.losses import LossConfig
    from megatron_grpo.engine.batch import build_train_microbatches
    from megatron_grpo.engine.checkpoint import save_checkpoint
    from megatron_grpo.engine.setup import OptimConfig, build_engine
    from megatron_grpo.engine.step import NonFiniteSkips, StepConfig, train_step
    from megatron_grpo.packing import PackLimits, plan_step
    from model_bridge.config import ParallelLayout
    from model_bridge.export import export_hf
    from model_bridge.parallel import destroy_parallel, init_parallel
    from test_checkpoint import _Data

    torch.set_num_threads(1)
    init_parallel(tp=2, seed=1234)
    engine = build_engine(hf_dir, ParallelLayout(tp=2), OptimConfig(lr=1e-2, warmup_steps=0, clip_grad=1.0),
                          dtype=torch.float32)
    random.seed(7)  # the same samples on both TP ranks
    np.random.seed(7)
    torch.manual_seed(7)
    data = _Data()
    trajs = data.next_batch()
    pack = PackLimits(max_tokens_per_microbatch=64, pad_multiple=2)
    plan = plan_step([t.num_tokens for t in trajs], ps.get_data_parallel_world_size(), pack)
    mbs = build_train_microbatches(trajs, plan, ps.get_data_parallel_rank(), pack)
    m = train_step(engine, mbs, StepConfig(loss=LossConfig(variant="grpo")), skips=NonFiniteSkips(3), step=1)
    exported = {k: v.detach().clone() for k, v in export_hf(engine.model, engine.spec)}
    save_checkpoint(run_dir, 1, engine.model, engine.optimizer, engine.scheduler, {"data": data.state_dict()})
    rank = dist.get_rank()
    destroy_parallel()
    return {"loss": m["loss"], "exported": exported if rank == 0 else None}


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _err(capsys, argv) -> str:
    capsys.readouterr()  # drop earlier output (transformers' warnings)
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, (rc, err)
    assert err.startswith("mgrpo convert: error: "), err
    return err


@pytest.mark.slow
def test_training_checkpoint_exports_bit_exact(tiny_ckpt, tmp_path, capsys):
    from model_bridge.spawn import run_ranks
    from model_bridge.checkpoint import check_dist_checkpoint
    from model_bridge.convert import mcore_to_hf
    from model_bridge.io import CheckpointError

    hf = tiny_ckpt
    run = tmp_path / "run"
    res = run_ranks(_train_one_step_and_save, 2, str(hf), str(run), timeout=300, env=CPU_ONLY)
    exported = res[0]["exported"]
    step = run / "checkpoints" / "step_00000001"
    meta = json.loads((step / "mgrpo_checkpoint.json").read_text())
    assert meta["format"] == "megatron-grpo/1" and meta["layout"]["tp"] == 2 and meta["optimizer"]
    (run / "config.json").write_text(json.dumps({"model": {"hf_dir": str(hf)}}))  # as train.py writes it

    # the CLI, given the run's checkpoints/ dir and no --hf-source
    out = tmp_path / "hf"
    r = subprocess.run([sys.executable, "-m", "launch.cli", "convert", "mcore-to-hf", "--mcore",
                        str(run / "checkpoints"), "--out", str(out), "--no-progress"], cwd=REPO,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"), text=True, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"using {step}, the newest complete checkpoint of run {run}" in r.stdout, r.stdout
    assert f"--hf-source not given: using the run's model.hf_dir, {hf}" in r.stdout, r.stdout
    assert re.search(r"wrote HF checkpoint .*: \d+ converted \+ \d+ pass-through tensors", r.stdout), r.stdout

    src, got = _tensors(hf), _tensors(out)
    assert set(got) == set(src)
    assert set(exported) <= set(got) and len(exported) > 100
    bad = [k for k in exported if got[k].dtype != exported[k].dtype or not torch.equal(got[k], exported[k])]
    assert not bad, bad[:5]
    passthrough = set(src) - set(exported)
    assert passthrough and all(torch.equal(got[k], src[k]) for k in passthrough)
    moved = [k for k in exported if not torch.equal(got[k], src[k])]
    assert len(moved) > len(exported) // 2, "the optimizer step should have changed most weights"
    from model_bridge.config import read_omni_config

    V = read_omni_config(hf).text.vocab_size  # 576; stored padded to 768 at TP2
    assert got["thinker.model.embed_tokens.weight"].shape[0] == V and got["thinker.lm_head.weight"].shape[0] == V

    # the step_N dir, through the function the CLI calls, with an explicit --hf-source
    out2 = tmp_path / "hf2"
    r2 = mcore_to_hf(step, hf, out2, progress=False)
    assert r2["notes"] == [] and r2["mcore"] == str(step)
    got2 = _tensors(out2)
    assert set(got2) == set(got) and all(torch.equal(got2[k], got[k]) for k in got)

    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    ids = torch.tensor([AutoTokenizer.from_pretrained(str(out))("hello world, hello megatron")["input_ids"]])
    with torch.no_grad():
        model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32)
        assert torch.equal(model.thinker.lm_head.weight, exported["thinker.lm_head.weight"])
        logits = model.thinker(input_ids=ids).logits
    assert logits.shape[-1] == V and torch.isfinite(logits).all()

    # clear errors: a bridge-only reader, non-checkpoint dirs, a run without checkpoints, no hf_dir
    with pytest.raises(CheckpointError, match=r"is a megatron-grpo training checkpoint \(format 'megatron-grpo/1', "
                                              r"step 1\).*mgrpo convert mcore-to-hf --mcore"):
        check_dist_checkpoint(step)
    o = str(tmp_path / "o")
    (tmp_path / "empty").mkdir()
    assert re.search(r"empty has no metadata\.json: not a Megatron dist checkpoint",
                     _err(capsys, ["convert", "mcore-to-hf", "--mcore", str(tmp_path / "empty"), "--out", o]))
    (tmp_path / "run2" / "checkpoints").mkdir(parents=True)
    assert re.search(r"run2 is a training run directory without a complete checkpoint",
                     _err(capsys, ["convert", "mcore-to-hf", "--mcore", str(tmp_path / "run2"), "--out", o]))
    loose = tmp_path / "loose"
    shutil.copytree(step, loose)
    assert re.search(r"--hf-source not given and .*loose is not inside a run directory",
                     _err(capsys, ["convert", "mcore-to-hf", "--mcore", str(loose), "--out", o]))
    assert not Path(o).exists()
