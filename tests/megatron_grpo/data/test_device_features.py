"""Log-mel on the device == the Whisper feature extractor (``data.features.audio_features``)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_grpo.data.device_features import DeviceFeaturizer
from megatron_grpo.data.features import audio_features


def _extractor():
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=30, n_fft=400)


def _clips(seed: int):
    rng = np.random.default_rng(seed)
    # odd lengths (not multiples of the hop), one shorter than a window, a loud and a quiet one
    return [(rng.standard_normal(n) * s).astype(np.float32) for n, s in
            ((16000 * 3 + 77, 0.1), (401, 1.0), (16000 + 160, 1e-3), (5 * 16000 + 13, 0.5))]


def _check(device: str, tol: float):
    fe = _extractor()
    clips = _clips(0 if device == "cpu" else 1)
    ref, ref_lens = audio_features(fe, clips)
    got, lens = DeviceFeaturizer(fe, device)(clips)
    assert got.device.type == device and got.dtype == torch.float32
    assert lens.device.type == "cpu" and lens.tolist() == ref_lens.tolist()
    assert got.shape == ref.shape
    diff = (got.cpu() - ref).abs().max().item()
    assert diff < tol, diff


def test_cpu_matches_extractor():
    _check("cpu", 1e-4)


def test_frames_in_small_chunks_match_the_extractor(monkeypatch):
    """Chunk boundaries inside clips and between them (37 frames a chunk) change nothing."""
    import megatron_grpo.data.device_features as df

    monkeypatch.setattr(df, "FRAME_CHUNK", 37)
    _check("cpu", 1e-4)


def test_staging_in_threaded_pieces_is_exact(monkeypatch):
    """The staging copy in small pieces over 3 threads: each clip, then zeros to its padded length."""
    import megatron_grpo.data.device_features as df

    monkeypatch.setattr(df, "STAGE_PIECE", 1000)
    monkeypatch.setattr(df, "_stage_threads", lambda: 3)
    monkeypatch.setattr(df, "_POOL", None)
    clips = _clips(2)
    padded = [-(-len(w) // 160) * 160 for w in clips]
    host = np.full(sum(padded), np.nan, dtype=np.float32)
    df._stage_clips(host, clips, padded)
    want = np.concatenate([np.pad(w, (0, n - len(w))) for w, n in zip(clips, padded)])
    assert np.array_equal(host, want)
    # in ranges (the CUDA path copies each to the device once written): bounds inside clips, at a
    # clip's end, inside its zeros; each call writes its range and nothing else
    cuts = sorted({0, 7, len(clips[0]), len(clips[0]) + 3, padded[0], padded[0] + 2500, sum(padded)})
    ranged = np.full(sum(padded), np.nan, dtype=np.float32)
    for lo, hi in zip(cuts, cuts[1:]):
        df._stage_clips(ranged, clips, padded, lo, hi)
        assert np.array_equal(ranged[:hi], want[:hi]) and np.isnan(ranged[hi:]).all(), (lo, hi)
    _check("cpu", 1e-4)  # the featurizer through the same path


@pytest.mark.parametrize("length,n", [(7, 160), (160, 160), (199, 320), (201, 320), (401, 480), (48077, 48160)])
def test_reflections_are_numpys_reflect_padding(length, n):
    """The samples before and after each staged clip: ``np.pad(..., mode="reflect")`` of the clip
    zero-padded to its hop multiple, from the clip's ends alone (one clip shorter than the pad)."""
    from megatron_grpo.data.device_features import _reflections

    w = np.random.default_rng(length).standard_normal(length).astype(np.float32)
    want = np.pad(np.pad(w, (0, n - length)), 200, mode="reflect")
    left, right = _reflections(w, n, 200)
    assert left.dtype == right.dtype == np.float32
    assert np.array_equal(left, want[:200]) and np.array_equal(right, want[-200:])


def _indexed_log_mel(feat, clips):
    """The log-mel rows (before the per-clip floor) with every frame's samples indexed one by one
    and reflected at the clip's edges: the frames the strided rows must equal."""
    rows = []
    for w in clips:
        n = -(-len(w) // feat.hop) * feat.hop
        x = torch.from_numpy(np.pad(w, (0, n - len(w))))
        j = torch.arange(n // feat.hop).unsqueeze(1) * feat.hop - feat.n_fft // 2 + torch.arange(feat.n_fft)
        j = j.abs()
        j = torch.where(j > n - 1, 2 * (n - 1) - j, j)
        rows.append(x[j])
    frames = torch.cat(rows)
    spec = torch.fft.rfft(frames * feat.window, n=feat.n_fft)
    return (spec.abs().square() @ feat.mel_T.T).clamp_min(1e-10).log10()


def test_strided_frames_equal_indexed_frames_bit_for_bit():
    """Each frame as one row of a strided view over the staged waveform (its clip between its
    reflections) gives the features of frames indexed sample by sample, to the bit."""
    feat = DeviceFeaturizer(_extractor(), "cpu")
    clips = _clips(5)
    ref = _indexed_log_mel(feat, clips)
    lens = torch.tensor([-(-len(w) // feat.hop) for w in clips])
    arrays, slots, grid = feat._layout(clips, lens)
    wave = feat._to_device(arrays, slots)
    pos = torch.cat([g + torch.arange(int(k)) for g, k in zip(grid, lens)])
    assert torch.equal(feat._log_mel(wave, pos), ref)
    assert all(s % feat.hop == 0 for s in np.add.reduceat(slots, range(0, len(slots), 3)))  # segments on the grid


def test_dither_is_refused():
    fe = _extractor()
    fe.dither = 1e-5
    with pytest.raises(NotImplementedError, match="dither"):
        DeviceFeaturizer(fe, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_matches_extractor():
    _check("cuda", 2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_copies_in_small_pieces_match_one_copy(monkeypatch):
    """The waveforms cross to the device in many small copies (each issued once its range is
    staged; 999 samples, so bounds fall inside clips and padding): the same features, to the bit."""
    import megatron_grpo.data.device_features as df

    feat = DeviceFeaturizer(_extractor(), "cuda")
    clips = _clips(3)
    whole_f, whole_n = feat(clips)
    monkeypatch.setattr(df, "H2D_PIECE", 999)
    piece_f, piece_n = feat(clips)
    assert torch.equal(whole_n, piece_n) and torch.equal(whole_f, piece_f)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_features_behind_queued_work_wait_for_their_copy():
    """The waveforms cross on a stream of their own while the current stream is still busy (a
    ~0.1 s sleep kernel queued first): the copy finishes before the sleep does, and the features
    are those of an idle device, to the bit."""
    feat = DeviceFeaturizer(_extractor(), "cuda")
    clips = _clips(4)
    idle_f, idle_n = feat(clips)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # cycles: ~0.1 s at 2 GHz
    slept = torch.cuda.Event()
    slept.record()
    busy_f, busy_n = feat(clips)
    feat._copied.synchronize()
    copied_while_busy = not slept.query()
    torch.cuda.synchronize()
    assert copied_while_busy
    assert torch.equal(idle_n, busy_n) and torch.equal(idle_f, busy_f)


def test_a_dithering_extractor_featurises_on_the_host_with_one_warning(monkeypatch, caplog):
    """``trainer.device_features`` (on by default) with an extractor that dithers: the trainer uses
    the host extractor and says why, instead of failing at start-up."""
    from megatron_grpo.data.device_features import trainer_featurizer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fe = _extractor()
    fe.dither = 0.5
    with caplog.at_level("WARNING", logger="megatron_grpo.data"):
        feat = trainer_featurizer(fe, True)
    assert not isinstance(feat, DeviceFeaturizer)
    assert [r.getMessage() for r in caplog.records] == [
        "trainer.device_features: the feature extractor dithers (dither=0.5, random per call); featurising on "
        "the host instead"]
    with pytest.raises(NotImplementedError, match="dithers"):
        DeviceFeaturizer(fe, "cpu")
