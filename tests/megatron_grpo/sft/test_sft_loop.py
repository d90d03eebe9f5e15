"""`mgrpo sft` end to end on the tiny model (one rank, real megatron-core on gloo): the loss falls on
the synthetic expert trajectories, step 1's loss equals transformers' NLL of the same assistant
tokens, a resumed run is bit-identical, and the exported HF dir loads and is taken by `mgrpo train`."""
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from megatron_grpo.data.reader import DataIterator
from megatron_grpo.data.synth import make_data
from megatron_grpo.sft.rows import read_sft_jsonl
from megatron_grpo.sft.tokens import sft_sample
from megatron_grpo.testing.hf_reference import hf_logprobs_T, load_hf_thinker

from conftest import CACHE, REPO

pytestmark = pytest.mark.slow
N, STEPS = 4, 3


def _mgrpo(*args):
    import os

    env = dict(os.environ, MGRPO_CACHE=str(CACHE / "embedded"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="2")
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(hf_dir):
    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _hf_nll(hf_dir, samples) -> float:
    thinker, processor = load_hf_thinker(hf_dir)
    total, n = 0.0, 0
    for s in samples:
        lp = hf_logprobs_T(thinker, processor, s.input_ids_T, s.audios, per_clip=True).double()
        mask = torch.tensor(s.loss_mask_T[1:], dtype=torch.bool)
        total -= float(lp[mask].sum())
        n += int(mask.sum())
    return total / n


def test_sft_learns_matches_hf_resumes_bit_identical_and_exports(tiny_ckpt, tmp_path, mgrpo_inproc):
    data = tmp_path / "data"
    make_data(data, n=N, n_dev=0, seed=1, progress=False, sft=True)
    a, b = tmp_path / "a", tmp_path / "b"
    common = [f"model.hf_dir={tiny_ckpt}", f"sft.data={data / 'sft.jsonl'}", "parallel.nproc=1", "parallel.tp=1",
              f"sft.samples_per_step={N}", "checkpoint.every=1", "checkpoint.keep_last=3",
              "logging.tensorboard=false", "logging.plot=false"]
    r = _mgrpo("sft", *common, f"sft.steps={STEPS}", f"sft.run_dir={a}")
    assert r.returncode == 0, r.stderr[-3000:]
    m = _metrics(a)
    assert [x["step"] for x in m] == [1, 2, 3]
    assert m[2]["loss"] < m[1]["loss"] < m[0]["loss"], [x["loss"] for x in m]
    assert f"[sft] step 3/3 loss {m[2]['loss']:.4f}" in r.stdout
    assert (f"continue with `mgrpo train model.hf_dir={a / 'hf'} data.train_jsonl=PROMPTS.jsonl` (your GRPO "
            "prompts, docs/data.md; without data.train_jsonl it trains on the embedded synthetic data)") in r.stdout

    # step 1 trained the base checkpoint on these samples: its loss is transformers' token-mean NLL
    rows = DataIterator(read_sft_jsonl(data / "sft.jsonl"), N, seed=0).next_batch()
    tok = __import__("transformers").AutoTokenizer.from_pretrained(tiny_ckpt)
    samples = [sft_sample(x, tok, x.load_audios(), audio_token_id=512) for x in rows]
    base_nll = _hf_nll(tiny_ckpt, samples)
    assert abs(base_nll - m[0]["loss"]) <= 1e-5 * base_nll, (base_nll, m[0]["loss"])
    assert _hf_nll(a / "hf", samples) < base_nll - 1.0  # the export carries the trained weights

    # resume from step 2: step 3 and the exported weights are bit-identical
    shutil.copytree(a, b, ignore=shutil.ignore_patterns("step_00000003", "hf"))
    r = _mgrpo("sft", "--resume", str(b))
    assert r.returncode == 0, r.stderr[-3000:]
    mb = _metrics(b)
    assert [x["step"] for x in mb] == [1, 2, 3]
    assert {k: v for k, v in mb[2].items() if not k.startswith("time")} == \
        {k: v for k, v in m[2].items() if not k.startswith("time")}
    wa, wb = _weights(a / "hf"), _weights(b / "hf")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # resumed again with no step left: refused before any rank starts, nothing written
    before = (b / "config.json").read_bytes()
    r = _mgrpo("sft", "--resume", str(b))
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"mgrpo sft: config error: {b} is at step 3 (its newest checkpoint); sft.steps=3 leaves nothing to train: "
        "pass sft.steps greater than 3"), r.stderr[-2000:]
    assert (b / "config.json").read_bytes() == before

    # the export is a model.hf_dir for `mgrpo train`: its pre-flight (layout, tokenizer, data sizing) takes it
    with pytest.raises(AssertionError, match="got past its pre-flight checks"):
        mgrpo_inproc("train", f"model.hf_dir={a / 'hf'}", f"data.train_jsonl={data / 'train.jsonl'}",
                     f"trainer.run_dir={tmp_path / 'grpo'}")
