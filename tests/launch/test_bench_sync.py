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
