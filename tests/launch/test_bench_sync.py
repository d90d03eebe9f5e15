"""``mgrpo bench sync``: the weight-sync stream between two processes rebuilds exactly what export_hf yields.

CPU: two processes over gloo at tiny widths (the product's GlooTransport + recv_bucket, and the
process-group transport the GPU run uses, here on gloo). GPU: the same over NCCL, cuda:0 -> cuda:1.
"""
import json
import math

import pytest
import torch

from launch.bench import sync as bs


def test_digest_sees_bytes_order_and_dtype_views():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1000, generator=g).to(torch.bfloat16)
    assert torch.equal(bs.tensor_digest(a), bs.tensor_digest(a.clone()))
    b = a.clone()
    b[[3, 7]] = b[[7, 3]]  # same bytes, two elements swapped
    assert a[3] != a[7] and not torch.equal(bs.tensor_digest(a), bs.tensor_digest(b))
    c = a.clone()
    c.view(torch.int16)[500] ^= 1  # one bit
    assert not torch.equal(bs.tensor_digest(a), bs.tensor_digest(c))
    big = torch.randint(0, 255, (bs._DIGEST_CHUNK + 17,), dtype=torch.uint8, generator=g)
    d = big.clone()
    d[-1] ^= 4  # in the second chunk
    assert not torch.equal(bs.tensor_digest(big), bs.tensor_digest(d))


def test_full_geometry_is_the_release_thinker():
    """The tensor list the bench pushes by default: the 48-layer thinker + 32-layer audio tower in the
    checkpoint's per-expert layout (the vision tower is never pushed)."""
    cfg = bs.sync_config(48, 32)
    layout = bs._checkpoint_layout(cfg, audio=True)
    text = {n: s for n, s in layout.items() if not n.startswith("thinker.audio_tower.")}
    assert len(text) == 48 * (9 + 128 * 3) + 3 == 18867
    assert sum(2 * math.prod(s) for s in text.values()) == 61_065_293_824  # the ~61 GB of the target
    assert layout["thinker.model.layers.47.mlp.experts.127.down_proj.weight"] == (2048, 768)
    assert layout["thinker.model.embed_tokens.weight"] == (152064, 2048)
    assert len(layout) == 19392 and sum(2 * math.prod(s) for s in layout.values()) == 62_361_148_160
    assert not any(n.startswith("thinker.visual.") for n in layout)


def _check_exact(res: dict, min_buckets: int = 2) -> None:
    assert res["check"]["ok"], res["check"]
    sent, got = res["tensors"]["sent"], res["tensors"]["received"]
    assert list(sent) == list(got)  # same names, same order
    assert len(sent) == res["plan"]["tensors"] == res["check"]["tensors"]
    for name, t in sent.items():
        r = got[name]
        assert r.dtype == t.dtype and r.shape == t.shape, name
        assert torch.equal(r.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
    assert res["plan"]["buckets"] >= min_buckets
    assert sum(t.numel() * t.element_size() for t in got.values()) == res["plan"]["payload_bytes"]
    # what export_hf yields: the checkpoint's names (per-expert keys), none of the vision tower
    assert "thinker.model.layers.1.mlp.experts.7.up_proj.weight" in got
    assert "thinker.audio_tower.layers.1.fc2.weight" in got
    assert not any(n.startswith("thinker.visual") for n in got)
    for k in ("raw", "raw_bucketed", "pipelined", "serial"):
        assert res[k]["seconds"] > 0 and res[k]["gb_per_s"] > 0


@pytest.mark.parametrize("transport", ["gloo", pytest.param("pg", marks=pytest.mark.slow)])
def test_cpu_receiver_rebuilds_export_hf_bit_exactly(tmp_path, transport):
    res = bs.run_bench(tmp_path, layers=2, audio_layers=2, tiny=True, device="cpu", transport=transport,
                       bucket_mb=0.125, iters=1, warmup=0, keep_tensors=True, quiet=True, plot=False,
                       timeout_s=300)
    _check_exact(res, min_buckets=4)
    saved = json.loads((tmp_path / "bench_sync.json").read_text())
    assert saved["check"]["ok"] and "tensors" not in saved
    assert saved["transport"]["kind"] == transport and saved["transport"]["backend"] == "gloo"
    assert set(saved["serial"]["trainer_phases_s"]) == {"export", "pack", "broadcast"}


def _two_gpus():
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA devices (trainer cuda:0, receiver cuda:1)")
def test_gpu_nccl_bit_exact_tiny(tmp_path):
    res = bs.run_bench(tmp_path, layers=2, audio_layers=2, tiny=True, device="cuda", bucket_mb=0.125, iters=1,
                       warmup=1, keep_tensors=True, quiet=True, plot=False, timeout_s=600)
    assert res["transport"] == {"kind": "pg", "backend": "nccl", "buffers": 2}
    _check_exact(res, min_buckets=4)


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA devices (trainer cuda:0, receiver cuda:1)")
def test_gpu_nccl_full_width_reduced(tmp_path):
    """Two full-width layers, four audio layers (866 tensors, 3.93 GB with the embedding and LM head):
    the checksummed check, and sane bandwidths."""
    res = bs.run_bench(tmp_path, layers=2, audio_layers=4, device="cuda", iters=2, warmup=1, quiet=True,
                       timeout_s=600)
    assert res["check"]["ok"], res["check"]
    assert res["plan"]["tensors"] == 866 and res["plan"]["payload_bytes"] == 3_932_112_640
    assert res["plan"]["buckets"] >= 7  # 512 MiB buckets
    assert res["raw"]["gb_per_s"] > 20  # NVLink; a PCIe-only pair would still pass
    assert 0 < res["vs_raw"] <= 1.2
    assert (tmp_path / "bench_sync.png").exists()


def _check_ep(res: dict, ep: int, out) -> None:
    """``--ep N``: the receiver's tensors of both modes are the single-rank export_hf's, bit for bit."""
    from launch.bench._sync_ep import _SeededSource

    assert res["check"]["ok"], res["check"]
    t = res["tensors"]
    direct, gather, ref = t["direct"], t["gather"], t["reference"]
    assert len(ref) == res["plan"]["tensors"] == res["check"]["tensors"]
    assert list(gather) == list(ref)  # gather (export_to_rank0) keeps the single-rank order
    assert set(direct) == set(ref)  # direct: each sender's own order, senders interleaved
    for name, r in ref.items():
        for got in (direct[name], gather[name]):
            assert got.dtype == r.dtype and got.shape == r.shape, name
            assert torch.equal(got.reshape(-1).view(torch.uint8), r.reshape(-1).view(torch.uint8)), name
    assert sum(x.numel() * x.element_size() for x in direct.values()) == res["plan"]["payload_bytes"]
    # the weights are the seeded HF-space tensors: export(load(W)) == W, every expert under its global index
    cfg = bs.sync_config(2, 2, tiny=True)
    src = _SeededSource(bs._checkpoint_layout(cfg, audio=True), 0, torch.device("cpu"))
    for name in ("thinker.model.layers.1.mlp.experts.7.up_proj.weight", "thinker.model.layers.0.mlp.experts.0."
                 "down_proj.weight", "thinker.model.embed_tokens.weight", "thinker.audio_tower.layers.1.fc2.weight"):
        assert torch.equal(direct[name], src.read(name).to(direct[name].dtype)), name
    assert not torch.equal(direct["thinker.model.layers.1.mlp.experts.7.up_proj.weight"],
                           direct["thinker.model.layers.1.mlp.experts.6.up_proj.weight"])
    # each EP rank sent its own experts, rank 0 also the dense tensors
    senders = res["plan"]["senders"]
    assert [s["rank"] for s in senders] == list(range(ep))
    per = 8 // ep
    assert [s["experts"] for s in senders] == [[per * r, per * r + per - 1] for r in range(ep)]
    assert senders[0]["dense_tensors"] > 0 and all(s["dense_tensors"] == 0 for s in senders[1:])
    saved = json.loads((out / f"bench_sync_ep{ep}.json").read_text())
    assert saved["check"]["ok"] and "tensors" not in saved and saved["ep"] == ep
    assert saved["transport"] == {"kind": "pg", "backend": "gloo", "buffers": 2, "group_ranks": ep + 1}
    for k in ("raw_direct", "raw_single", "direct", "gather"):
        assert saved[k]["seconds"] > 0 and saved[k]["gb_per_s"] > 0, k
    for mode in ("direct", "gather"):
        phases = saved[mode]["serial"]["phases_s"]
        assert set(phases) == {f"rank {r}" for r in range(ep)} | {"receiver"}
        assert set(phases["receiver"]) == {"receive", "unpack"}
    assert set(saved["direct"]["serial"]["phases_s"]["rank 1"]) == {"export", "pack", "send"}
    assert set(saved["gather"]["serial"]["phases_s"]["rank 0"]) == {"gather", "pack", "send"}
    assert saved["gather"]["gather_stats"]["rank 0"]["recv_bytes"] > 0
    assert saved["plan"]["direct_buckets"] >= ep and saved["plan"]["gather_buckets"] >= 2
    assert [p["role"] for p in saved["processes"]] == ["trainer"] * ep + ["receiver"]


@pytest.mark.parametrize("ep", [2, pytest.param(4, marks=pytest.mark.slow)])  # ~15 s / ~20 s on 2 cores
def test_cpu_ep_direct_and_gather_equal_single_rank_export(tmp_path, ep):
    """``--tiny --ep N`` over real gloo processes: N EP trainer ranks + a receiver."""
    res = bs.run_bench(tmp_path, layers=2, audio_layers=2, tiny=True, device="cpu", ep=ep, bucket_mb=0.03,
                       iters=1, warmup=0, keep_tensors=True, quiet=True, plot=False, timeout_s=240,
                       hang_timeout_s=120)
    _check_ep(res, ep, tmp_path)


def test_ep_check_catches_changed_missing_and_duplicate_tensors():
    from launch.bench._sync_ep import _compare_named

    ref = {"meta": [("a", "bfloat16", (2,)), ("b", "float32", (1,))], "digests": [(1, 2), (3, 4)]}
    assert _compare_named(ref, {"meta": ref["meta"][::-1], "digests": ref["digests"][::-1]})["ok"]  # any order
    bad = _compare_named(ref, {"meta": ref["meta"], "digests": [(1, 2), (3, 5)]})
    assert not bad["ok"] and bad["mismatched"] == ["b"] and bad["equal"] == 1
    miss = _compare_named(ref, {"meta": ref["meta"][:1], "digests": ref["digests"][:1]})
    assert not miss["ok"] and miss["missing"] == ["b"]
    dup = _compare_named(ref, {"meta": ref["meta"] + ref["meta"][:1], "digests": ref["digests"] + ref["digests"][:1]})
    assert not dup["ok"] and dup["duplicates"] == 1


def test_ep_argument_errors(tmp_path):
    with pytest.raises(SystemExit, match="must divide the number of experts"):
        bs.run_bench(tmp_path, tiny=True, device="cpu", ep=3)
    with pytest.raises(SystemExit, match="one-sender product transport"):
        bs.run_bench(tmp_path, tiny=True, device="cpu", ep=2, transport="gloo")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 3),
                    reason="needs 3 CUDA devices (EP2 trainers cuda:0-1, receiver cuda:2)")
def test_gpu_ep2_nccl_bit_exact_tiny(tmp_path):
    res = bs.run_bench(tmp_path, layers=2, audio_layers=2, tiny=True, device="cuda", ep=2, bucket_mb=0.03, iters=1,
                       warmup=1, keep_tensors=True, quiet=True, plot=False, timeout_s=500, hang_timeout_s=200)
    assert res["transport"]["backend"] == "nccl"
    assert res["check"]["ok"], res["check"]
    t = res["tensors"]
    assert set(t["direct"]) == set(t["reference"]) and list(t["gather"]) == list(t["reference"])
