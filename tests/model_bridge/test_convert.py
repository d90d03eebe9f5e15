"""``mgrpo convert`` (``model_bridge.convert``): HF -> mcore -> HF round trip, the logits check, bad inputs.

* Round trip on a checkpoint made with ``--with-talker``, through the real CLI (a subprocess each
  way, single process) and through a dist checkpoint written by 2 ranks at TP2 x EP2: every
  tensor of the output, the pass-through ones (visual, talker, code2wav) included, is bit-equal
  (``torch.equal``, same dtype) to the source; the side files are copied; transformers loads the
  output and computes the source's logits exactly.
* ``convert check`` at (1,1,1) with the built-in sample (text + audio) and at TP2+SP with a
  sample file holding two audio clips: the printed max |logit diff| <= 1e-4; the dumped logits
  (``.npy`` and ``torch.save``) are float32 [T, V].
* Bad inputs give one clear line (``mgrpo convert: error: ...``, exit code 2) before any rank starts.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from launch.cli import main

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-4


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _cli(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "launch.cli", *argv], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=timeout)


@pytest.fixture(scope="module")
def talker_ckpt() -> Path:
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import build_cached_tiny

    return build_cached_tiny("tiny", seed=0, with_talker=True)


def _assert_same_checkpoint(src_dir: Path, out_dir: Path) -> None:
    src, out = _tensors(src_dir), _tensors(out_dir)
    assert set(out) == set(src)
    bad = [k for k in src if out[k].dtype != src[k].dtype or not torch.equal(out[k], src[k])]
    assert not bad, bad[:5]
    for prefix in ("thinker.visual.", "talker.", "code2wav.", "thinker.audio_tower.", "thinker.model."):
        assert any(k.startswith(prefix) for k in out), prefix
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(src)
    for f in src_dir.iterdir():  # config, tokenizer, processor, chat template, generation config
        if f.is_file() and not f.name.startswith(".") and not f.name.endswith(".safetensors") \
                and f.name != "model.safetensors.index.json":
            assert (out_dir / f.name).read_bytes() == f.read_bytes(), f.name


@pytest.mark.slow
def test_round_trip_with_talker_is_bit_exact(talker_ckpt, tmp_path):
    """One process each way (the CLI converts in its own process), then a dist checkpoint written
    by 2 ranks at TP2 x EP2 (each rank converting its TP slices and experts) read back by one."""
    mc, back = tmp_path / "mcore", tmp_path / "hf"
    r = _cli("convert", "hf-to-mcore", "--hf", str(talker_ckpt), "--out", str(mc), "--no-progress",
             "--stats-json", str(tmp_path / "a.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"wrote Megatron dist checkpoint .* \(torch_dist, loadable at any TP/EP/PP", r.stdout)
    meta = json.loads((mc / "mgrpo_checkpoint.json").read_text())
    assert meta["hf_source"] == str(talker_ckpt.resolve()) and meta["dtype"] == "float32"
    r = _cli("convert", "mcore-to-hf", "--mcore", str(mc), "--hf-source", str(talker_ckpt), "--out", str(back),
             "--max-shard-size", "300KiB", "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"wrote HF checkpoint .*: \d+ converted \+ \d+ pass-through tensors", r.stdout)
    _assert_same_checkpoint(talker_ckpt, back)
    assert len(list(back.glob("model-*.safetensors"))) > 3

    from model_bridge.convert import hf_to_mcore, mcore_to_hf

    mc2, back2 = tmp_path / "mcore_tp2ep2", tmp_path / "hf2"
    r2 = hf_to_mcore(talker_ckpt, mc2, tp=2, ep=2, etp=1, progress=False)
    assert r2["world_size"] == 2 and len(r2["ranks"]) == 2
    assert json.loads((mc2 / "mgrpo_checkpoint.json").read_text())["written_at_layout"]["tp"] == 2
    mcore_to_hf(mc2, talker_ckpt, back2, progress=False)
    _assert_same_checkpoint(talker_ckpt, back2)

    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    ids = torch.tensor([AutoTokenizer.from_pretrained(str(back))("hello world, hello megatron")["input_ids"]])
    with torch.no_grad():
        a = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(talker_ckpt), dtype=torch.float32)
        b = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(back), dtype=torch.float32)
        assert b.has_talker
        assert torch.equal(a.thinker(input_ids=ids).logits, b.thinker(input_ids=ids).logits)


def _sample_file(tmp_path: Path) -> Path:
    import soundfile as sf

    rng = np.random.RandomState(1)
    for name, sec in (("a.wav", 1.7), ("b.wav", 0.6)):
        sf.write(str(tmp_path / name), (0.1 * rng.randn(int(16000 * sec))).astype(np.float32), 16000)
    sample = {"messages": [{"role": "system", "content": "You listen."},
                           {"role": "user", "content": "<audio>\nAnd this one: <audio> Which is longer?"}],
              "audios": ["a.wav", "b.wav"]}
    p = tmp_path / "sample.json"
    p.write_text(json.dumps(sample))
    return p


def test_check_prints_small_diff_and_dumps_logits(tiny_ckpt, tmp_path, capfd):
    npy, pt = tmp_path / "l1.npy", tmp_path / "l2.pt"
    assert main(["convert", "check", "--hf", str(tiny_ckpt), "--dump-logits", str(npy)]) == 0
    out1, err1 = capfd.readouterr()
    sample = _sample_file(tmp_path)
    assert main(["convert", "check", "--hf", str(tiny_ckpt), "--tp", "2", "--sample", str(sample),
                 "--dump-logits", str(pt), "--stats-json", str(tmp_path / "s.json")]) == 0
    out2, err2 = capfd.readouterr()
    print(out1 + out2)
    # the spawned ranks' output included: megatron's notices about options we do not use stay out
    assert "Warning" not in err1 + err2, err1 + err2
    for out, lay, clips in ((out1, r"tp=1 ep=1 etp=1 pp=1 \(world 1", 1), (out2, r"tp=2\+sp ep=1 etp=2 pp=1 \(world 2", 2)):
        assert re.search(lay + rf", (gloo|nccl), float32\); sample: \d+ tokens, {clips} audio clip\(s\)", out), out
        diff = float(re.search(r"max \|logit diff\| megatron vs transformers: (\S+)", out).group(1))
        assert diff <= TOL, out
    a = np.load(npy)
    b = torch.load(pt)
    assert a.dtype == np.float32 and b.dtype == torch.float32
    from model_bridge.config import read_omni_config

    V = read_omni_config(tiny_ckpt).text.vocab_size
    assert a.shape[1] == b.shape[1] == V and a.shape[0] > 50 and b.shape[0] > 30
    assert json.loads((tmp_path / "s.json").read_text())["audio_clips"] == 2


# ------------------------------------------------------------------------------------------------
# bad inputs: one clear line, exit code 2, before any rank starts
# ------------------------------------------------------------------------------------------------

def _err(capsys, argv) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, (rc, err)
    assert err.startswith("mgrpo convert: error: "), err
    return err


def test_bad_inputs_are_clear_errors(tiny_ckpt, tmp_path, capsys):
    from model_bridge.checkpoint import spec_fingerprint
    from model_bridge.config import read_omni_config

    hf = str(tiny_ckpt)
    out = str(tmp_path / "out")
    e = lambda *a: _err(capsys, list(a))  # noqa: E731

    assert re.search(r"--hf .*/nope does not exist", e("convert", "hf-to-mcore", "--hf", str(tmp_path / "nope"),
                                                       "--out", out))
    (tmp_path / "empty").mkdir()
    assert re.search(r"config\.json not found: point at an HF Qwen3-Omni checkpoint",
                     e("convert", "hf-to-mcore", "--hf", str(tmp_path / "empty"), "--out", out))
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps(dict(cfg, model_type="qwen2_5_omni")))
    assert re.search(r"model_type 'qwen2_5_omni' is not supported",
                     e("convert", "hf-to-mcore", "--hf", str(wrong), "--out", out))
    assert re.search(r"model_type 'qwen2_5_omni' is not supported",
                     e("convert", "check", "--hf", str(wrong)))
    broken = tmp_path / "broken"
    shutil.copytree(tiny_ckpt, broken)
    (broken / "model-00002-of-00002.safetensors").unlink()
    assert re.search(r"lists shard file\(s\) missing .*model-00002-of-00002\.safetensors",
                     e("convert", "hf-to-mcore", "--hf", str(broken), "--out", out))

    # found by the rank (the parent only reads config and index): a tensor missing from its shard
    from safetensors.torch import load_file, save_file

    gap = tmp_path / "gap"
    shutil.copytree(tiny_ckpt, gap)
    index = json.loads((gap / "model.safetensors.index.json").read_text())
    key = "thinker.model.layers.1.mlp.experts.3.up_proj.weight"
    shard = gap / index["weight_map"].pop(key)
    tensors = load_file(str(shard))
    del tensors[key]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (gap / "model.safetensors.index.json").write_text(json.dumps(index))
    assert re.search(r"1 tensor\(s\) missing from the checkpoint .*experts\.3\.up_proj\.weight",
                     e("convert", "hf-to-mcore", "--hf", str(gap), "--out", out, "--spawn"))
    assert not Path(out).exists() or not any(Path(out).iterdir())

    # parallel sizes that do not fit the model or the process count
    assert re.search(r"tp=3 does not divide num_attention_heads=4",
                     e("convert", "hf-to-mcore", "--hf", hf, "--out", out, "--tp", "3"))
    assert re.search(r"ep=3 does not divide num_experts=8", e("convert", "check", "--hf", hf, "--ep", "3"))
    assert re.search(r"tp=2 with etp=1 and ep=1 is refused",
                     e("convert", "hf-to-mcore", "--hf", hf, "--out", out, "--tp", "2", "--etp", "1"))
    assert re.search(r"pp=4 does not divide num_hidden_layers=2", e("convert", "check", "--hf", hf, "--pp", "4"))
    assert re.search(r"world size 3 is not a multiple of tp\*pp=2",
                     e("convert", "hf-to-mcore", "--hf", hf, "--out", out, "--tp", "2", "--nproc", "3"))

    # output directory in use
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert re.search(r"--out .*/full is not empty", e("convert", "hf-to-mcore", "--hf", hf, "--out",
                                                      str(tmp_path / "full")))

    # mcore-to-hf: not a dist checkpoint; a dist checkpoint of another model spec
    assert re.search(r"has no metadata\.json: not a Megatron dist checkpoint.*looks like an HF checkpoint",
                     e("convert", "mcore-to-hf", "--mcore", hf, "--hf-source", hf, "--out", out))
    d = tmp_path / "dist"
    d.mkdir()
    (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    (d / ".metadata").write_bytes(b"")
    small = read_omni_config(tiny_ckpt)
    import dataclasses

    other = dataclasses.replace(small, text=dataclasses.replace(small.text, num_experts=16))
    (d / "mgrpo_checkpoint.json").write_text(json.dumps(
        {"format": "mgrpo-megatron-dist", "model": "qwen3_omni_moe", "spec_fingerprint": spec_fingerprint(other),
         "spec": {"num_experts": 16}, "hf_source": "/data/other-model"}))
    assert re.search(r"was written for a different model spec .*from /data/other-model.*use the HF checkpoint it was "
                     r"converted from", e("convert", "mcore-to-hf", "--mcore", str(d), "--hf-source", hf, "--out", out))
    assert re.search(r"--mcore .*/nope does not exist|/nope does not exist",
                     e("convert", "mcore-to-hf", "--mcore", str(tmp_path / "nope"), "--hf-source", hf, "--out", out))

    # check: sample problems
    assert re.search(r"--sample .*/none\.json does not exist",
                     e("convert", "check", "--hf", hf, "--sample", str(tmp_path / "none.json")))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "<audio> <audio> hi"}], "audios": []}))
    assert re.search(r"the messages hold 2 <audio> tag\(s\) but 'audios' lists 0 file\(s\)",
                     e("convert", "check", "--hf", hf, "--sample", str(bad)))
    assert not Path(out).exists() or not any(Path(out).iterdir())
