"""Megatron dist checkpoints of the thinker (``model_bridge.checkpoint``).

* Cross-layout: checkpoints written at world 1 (streaming, from HF), at EP2 (streaming, 2 ranks)
  and at TP2+SP (``save_model`` of a materialised model) each load at other layouts (TP2+SP,
  PP2, EP2, (1,1,1)) and give the same logits as the world-1 model loaded from HF (<= 1e-5;
  the vocab is stored unpadded, so TP sizes with different vocab padding load each other).
* Fast pieces without ranks: checkpoint-directory checks and their messages, the spec
  fingerprint, the streaming safetensors writer and the pread reader.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from model_bridge.spawn import run_ranks

TOL = 1e-5


# ------------------------------------------------------------------------------------------------
# rank bodies
# ------------------------------------------------------------------------------------------------

def _ids(spec) -> list[int]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 400, (27,), generator=g).tolist()


def _world1_body(hf_dir: str, ckpt_a: str) -> dict:
    """World 1: stream HF -> dist checkpoint A; logits of the load_hf model and of load_model(A)."""
    from model_bridge.checkpoint import forward_logits, load_model, save_hf_as_dist_checkpoint
    from model_bridge.config import ParallelLayout, read_omni_config
    from model_bridge.load import load_hf
    from model_bridge.modeling import build_thinker
    from model_bridge.parallel import destroy_parallel, init_parallel

    init_parallel()
    spec = read_omni_config(hf_dir)
    stats = save_hf_as_dist_checkpoint(hf_dir, ckpt_a, ParallelLayout())
    model = build_thinker(spec, ParallelLayout()).eval()
    load_hf(model, hf_dir)
    ref = forward_logits(model, spec, _ids(spec))
    model = build_thinker(spec, ParallelLayout()).eval()
    meta = load_model(model, ckpt_a)
    got = forward_logits(model, spec, _ids(spec))
    destroy_parallel()
    return {"ref": ref, "a": got, "stats": stats, "meta": meta}


def _world2_body(hf_dir: str, ckpt_a: str, ckpt_b: str, ckpt_c: str) -> dict:
    """World 2: write B (EP2, streaming) and C (TP2+SP, save_model), then load A, B, C at other
    layouts; return the logits (on the rank that has them) per case."""
    import torch.distributed as dist

    from model_bridge.checkpoint import forward_logits, load_model, save_hf_as_dist_checkpoint, save_model
    from model_bridge.config import ParallelLayout, read_omni_config
    from model_bridge.load import load_hf
    from model_bridge.modeling import build_thinker
    from model_bridge.parallel import destroy_parallel, init_parallel

    spec = read_omni_config(hf_dir)
    out: dict = {}

    def build(tp=1, ep=1, etp=None, pp=1):
        init_parallel(tp=tp, ep=ep, etp=etp, pp=pp)
        return build_thinker(spec, ParallelLayout(tp=tp, ep=ep, etp=etp, pp=pp)).eval()

    init_parallel(ep=2, etp=1)
    out["b_stats"] = save_hf_as_dist_checkpoint(hf_dir, ckpt_b, ParallelLayout(ep=2, etp=1))
    model = build(tp=2)
    load_hf(model, hf_dir)
    save_model(model, ckpt_c, hf_source=hf_dir)
    cases = [("A@tp2sp", ckpt_a, dict(tp=2)), ("A@pp2", ckpt_a, dict(pp=2)), ("A@ep2", ckpt_a, dict(ep=2, etp=1)),
             ("B@dp2", ckpt_b, {}), ("B@tp2sp", ckpt_b, dict(tp=2)), ("C@dp2", ckpt_c, {}),
             ("C@pp2", ckpt_c, dict(pp=2))]
    for name, ckpt, lay in cases:
        model = build(**lay)
        load_model(model, ckpt)
        logits = forward_logits(model, spec, _ids(spec))
        if logits is not None and (name not in out):
            out[name] = logits
    out["rank"] = dist.get_rank()
    destroy_parallel()
    return out


def test_dist_checkpoint_loads_at_any_layout(tiny_ckpt, tmp_path):
    a, b, c = (str(tmp_path / n) for n in ("A", "B", "C"))
    w1 = run_ranks(_world1_body, 1, str(tiny_ckpt), a, timeout=300)[0]
    assert w1["meta"]["written_at_layout"] == {"tp": 1, "ep": 1, "etp": 1, "pp": 1, "world_size": 1}
    assert (w1["a"] - w1["ref"]).abs().max().item() == 0.0
    w2 = run_ranks(_world2_body, 2, str(tiny_ckpt), a, b, c, timeout=400)
    got = {k: v for r in w2 for k, v in r.items() if isinstance(v, torch.Tensor)}
    want = {"A@tp2sp", "A@pp2", "A@ep2", "B@dp2", "B@tp2sp", "C@dp2", "C@pp2"}
    assert set(got) == want, sorted(got)
    diffs = {k: (v - w1["ref"]).abs().max().item() for k, v in sorted(got.items())}
    print("\n[cross-layout] max |logits - world-1 HF-loaded logits|: "
          + ", ".join(f"{k}: {d:.2e}" for k, d in diffs.items()))
    assert all(d <= TOL for d in diffs.values()), diffs
    # EP2 streaming: each rank converted only its own experts, rank 0 the dense part as well
    b0, b1 = (r["b_stats"] for r in sorted(w2, key=lambda r: r["rank"]))
    assert b0["bytes"] > b1["bytes"] > 0
    assert json.loads((Path(b) / "mgrpo_checkpoint.json").read_text())["written_at_layout"]["ep"] == 2
    assert json.loads((Path(c) / "mgrpo_checkpoint.json").read_text())["written_at_layout"]["tp"] == 2


# ------------------------------------------------------------------------------------------------
# fast: directory checks, fingerprint, writer, reader
# ------------------------------------------------------------------------------------------------

def _fake_dist_ckpt(d: Path, fingerprint: str, model: str = "qwen3_omni_moe", backend: str = "torch_dist") -> Path:
    d.mkdir(parents=True)
    (d / "metadata.json").write_text(json.dumps({"sharded_backend": backend, "sharded_backend_version": 1}))
    (d / ".metadata").write_bytes(b"")
    (d / "mgrpo_checkpoint.json").write_text(json.dumps(
        {"format": "mgrpo-megatron-dist", "model": model, "spec_fingerprint": fingerprint, "spec": {},
         "hf_source": "/somewhere/else"}))
    return d


def test_check_dist_checkpoint_errors(tiny_ckpt, tmp_path):
    from model_bridge.checkpoint import check_dist_checkpoint, spec_fingerprint
    from model_bridge.config import read_omni_config
    from model_bridge.io import CheckpointError

    spec = read_omni_config(tiny_ckpt)
    fp = spec_fingerprint(spec)
    ok = _fake_dist_ckpt(tmp_path / "ok", fp)
    assert check_dist_checkpoint(ok, spec)["spec_fingerprint"] == fp

    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "run").mkdir()  # `mgrpo train`'s run dir before its first checkpoint
    (tmp_path / "run" / "config.json").write_text(json.dumps({"trainer": {"steps": 20}, "model": {}}))
    cases = {
        tmp_path / "run": r"it is a training run directory without a checkpoint yet: `mgrpo train` saves one",
        tmp_path / "nope": r"does not exist",
        tmp_path / "file": r"is not a directory",
        tmp_path / "empty": r"has no metadata\.json: not a Megatron dist checkpoint",
        Path(tiny_ckpt): r"looks like an HF checkpoint: convert it with `mgrpo convert hf-to-mcore`",
        _fake_dist_ckpt(tmp_path / "zarr", fp, backend="zarr"): r"sharded_backend 'zarr' is not supported",
        _fake_dist_ckpt(tmp_path / "other", fp, model="llama"): r"a checkpoint of model 'llama'",
        _fake_dist_ckpt(tmp_path / "spec", "0123456789abcdef"): r"was written for a different model spec "
                                                                  r"\(fingerprint 0123456789abcdef",
    }
    for d, pattern in cases.items():
        with pytest.raises(CheckpointError, match=pattern):
            check_dist_checkpoint(d, spec)
    shutil.copytree(ok, tmp_path / "partial")
    (tmp_path / "partial" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"has no \.metadata .*incomplete"):
        check_dist_checkpoint(tmp_path / "partial", spec)


def test_spec_fingerprint(tiny_ckpt):
    import dataclasses

    from model_bridge.checkpoint import spec_fingerprint
    from model_bridge.config import read_omni_config

    spec = read_omni_config(tiny_ckpt)
    assert spec_fingerprint(spec) == spec_fingerprint(read_omni_config(tiny_ckpt))
    assert re.fullmatch(r"[0-9a-f]{16}", spec_fingerprint(spec))
    other = dataclasses.replace(spec, text=dataclasses.replace(spec.text, num_experts=16))
    assert spec_fingerprint(other) != spec_fingerprint(spec)
    assert spec_fingerprint(dataclasses.replace(spec, audio_token_id=1)) != spec_fingerprint(spec)


@pytest.mark.parametrize("background", [False, True], ids=["inline", "thread"])
def test_streaming_shard_writer(tmp_path, background):
    from safetensors.torch import load_file

    from model_bridge.checkpoint import StreamingShardWriter
    from model_bridge.io import CheckpointError

    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(64, 32, generator=g), "b.bias": torch.randn(7, generator=g).bfloat16(),
               "c.big": torch.randn(300, 200, generator=g), "d.ids": torch.arange(5), "e.empty": torch.zeros(0, 3),
               "f.flag": torch.tensor([True, False])}
    plan = [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    w = StreamingShardWriter(tmp_path / "out", plan, max_shard_bytes=100_000, background=background,
                             max_pending_bytes=50_000)
    for k, v in tensors.items():
        w.add(k, v)
    wm = w.close()
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert wm["c.big"] == "model-00002-of-00003.safetensors"  # bigger than a shard: alone
    loaded = {}
    for f in files:
        loaded.update(load_file(str(tmp_path / "out" / f)))
    assert set(loaded) == set(tensors) and all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype
                                               for k, v in tensors.items())
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == wm
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in tensors.values())
    assert not list((tmp_path / "out").glob(".*"))  # no temporary files left

    w = StreamingShardWriter(tmp_path / "bad", plan, max_shard_bytes=100_000, background=background)
    with pytest.raises(CheckpointError, match=r"tensor #0 is b\.bias .* the plan says a\.weight"):
        w.add("b.bias", tensors["b.bias"])
    w.add("a.weight", tensors["a.weight"])
    with pytest.raises(CheckpointError, match=r"tensor #1 is b\.bias \[7\] torch\.float32, the plan says b\.bias "
                                              r"\[7\] torch\.bfloat16"):
        w.add("b.bias", tensors["b.bias"].float())
    with pytest.raises(CheckpointError, match=r"5 planned tensor\(s\) never arrived"):
        w.close()
    w.abort()
    assert not list((tmp_path / "bad").glob("*"))


def test_direct_reader_matches_safetensors(tiny_ckpt):
    from model_bridge.checkpoint import _DirectReader
    from model_bridge.io import CheckpointError, SafetensorsReader

    ref, direct = SafetensorsReader(tiny_ckpt), _DirectReader(SafetensorsReader(tiny_ckpt))
    try:
        for key in ("thinker.model.embed_tokens.weight", "thinker.model.layers.1.self_attn.o_proj.weight",
                    "thinker.audio_tower.conv2d1.weight", "thinker.model.norm.weight"):
            t = direct.read(key)
            assert torch.equal(t, ref.read(key)) and t.untyped_storage().resizable()
            n = t.shape[0]
            assert torch.equal(direct.read(key, 0, n // 4, n // 2), ref.read(key, 0, n // 4, n // 2))
            if t.dim() >= 2:
                m = t.shape[1]
                assert torch.equal(direct.read(key, 1, m // 2, m), ref.read(key, 1, m // 2, m))
        with pytest.raises(CheckpointError, match=r"slice \[3, 1\) along dim 0 is out of its shape"):
            direct.read("thinker.model.norm.weight", 0, 3, 1)
        with pytest.raises(CheckpointError, match=r"shape mismatch for thinker\.model\.norm\.weight"):
            direct.read("thinker.model.norm.weight", expect_shape=(3,))
        with pytest.raises(CheckpointError, match=r"not in the checkpoint"):
            direct.read("thinker.model.nope.weight")
        assert direct.reads["thinker.model.embed_tokens.weight"] == 3  # full, rows, columns
    finally:
        direct.close()


def test_missing_checkpoint_names_what_is_expected_and_the_steps_that_exist(tmp_path):
    """A mistyped ``RUN/checkpoints/step_N`` lists the step dirs that do exist; the export path
    (``allow_training``) also names run dirs and step dirs as accepted inputs."""
    from model_bridge.dist_ckpt.meta import check_dist_checkpoint
    from model_bridge.io import CheckpointError

    ckpts = tmp_path / "run" / "checkpoints"
    for step in (10, 20):
        (ckpts / f"step_{step:08d}").mkdir(parents=True)
    (ckpts / "latest.txt").write_text("20\n")  # not a step dir: not listed
    missing = ckpts / "step_00000030"
    with pytest.raises(CheckpointError) as e:
        check_dist_checkpoint(missing, allow_training=True)
    assert str(e.value) == (
        f"{missing} does not exist (expected a Megatron dist checkpoint directory, e.g. from `mgrpo convert "
        "hf-to-mcore`, a training run directory, or one of its checkpoints/step_<8-digit step> dirs); "
        f"{ckpts} holds step_00000010, step_00000020")
    with pytest.raises(CheckpointError) as e:
        check_dist_checkpoint(tmp_path / "nope")
    assert str(e.value) == (f"{tmp_path / 'nope'} does not exist (expected a Megatron dist checkpoint directory, "
                            "e.g. from `mgrpo convert hf-to-mcore`)")
