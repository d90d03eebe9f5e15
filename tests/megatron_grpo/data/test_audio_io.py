"""load_audio / probe_audio / crop / wav_bytes: exact errors and exact samples."""
import io

import numpy as np
import pytest
import soundfile as sf

from megatron_grpo.data import audio as A
from megatron_grpo.data.audio import (AudioError, audio_data_url, crop, crop_bounds, is_under, load_audio,
                                      probe_audio, resolve_audio_path, wav_bytes)

SR = 16000


def tone(n, sr=SR, f=440.0):
    return (0.25 * np.sin(2 * np.pi * f * np.arange(n) / sr)).astype(np.float32)


def audio_err(fn, *a, **kw) -> AudioError:
    with pytest.raises(AudioError) as ei:
        fn(*a, **kw)
    assert isinstance(ei.value, ValueError)
    return ei.value


def test_load_formats(tmp_path):
    x = tone(SR + 123)
    sf.write(tmp_path / "a.wav", x, SR, subtype="FLOAT")
    sf.write(tmp_path / "a.flac", x, SR)
    sf.write(tmp_path / "a.mp3", x, SR, format="MP3")
    y = load_audio(tmp_path / "a.wav")
    assert y.dtype == np.float32 and y.flags.c_contiguous and np.array_equal(y, x)
    y = load_audio(tmp_path / "a.flac")
    assert len(y) == len(x) and np.abs(y - x).max() < 1e-4          # 16-bit flac
    y = load_audio(tmp_path / "a.mp3")
    info = probe_audio(tmp_path / "a.mp3")
    assert (info.format, info.sample_rate, info.channels) == ("MP3", SR, 1) and len(y) == info.frames > 0


def test_stereo_is_averaged_and_resampling(tmp_path):
    st = np.stack([tone(8000), np.zeros(8000, np.float32)], axis=1)
    sf.write(tmp_path / "st.wav", st, SR, subtype="FLOAT")
    assert np.allclose(load_audio(tmp_path / "st.wav"), tone(8000) / 2, atol=1e-7)
    sf.write(tmp_path / "hi.wav", tone(44100, 44100), 44100, subtype="FLOAT")
    y = load_audio(tmp_path / "hi.wav")
    assert y.dtype == np.float32 and len(y) == SR
    e = audio_err(load_audio, tmp_path / "hi.wav", resample=False)
    assert e.kind == "wrong sample rate"
    assert str(e) == (f"{tmp_path / 'hi.wav'}: the audio is sampled at 44100 Hz, the model needs 16000 Hz "
                      "(and data.resample is false) — resample the file (e.g. ffmpeg -i IN -ar 16000 -ac 1 "
                      "OUT.wav) or set data.resample=true")


def test_bad_files(tmp_path):
    p = tmp_path / "none.wav"
    assert str(audio_err(load_audio, p)) == f"{p}: audio file not found — fix the path or restore the file"
    (tmp_path / "empty.wav").write_bytes(b"")
    e = audio_err(probe_audio, tmp_path / "empty.wav")
    assert (e.kind, e.reason) == ("empty audio", "the audio file is empty (0 bytes)")
    sf.write(tmp_path / "zero.wav", np.zeros(0, np.float32), SR)
    e = audio_err(load_audio, tmp_path / "zero.wav")
    assert (e.kind, e.reason) == ("empty audio", "the audio has no samples (0 frames)")
    (tmp_path / "bad.mp3").write_bytes(b"\x00garbage" * 100)
    e = audio_err(probe_audio, tmp_path / "bad.mp3")
    assert (e.kind, e.reason) == ("corrupt audio", "cannot decode the audio (unrecognised or damaged audio data)")
    (tmp_path / "bad.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEjunkjunk")
    e = audio_err(load_audio, tmp_path / "bad.wav")
    assert e.reason == "cannot decode the audio (Error in WAV file. No 'data' chunk marker)"
    sf.write(tmp_path / "long.wav", np.zeros(3 * SR, np.float32), SR)
    e = audio_err(load_audio, tmp_path / "long.wav", max_seconds=2.5)
    assert (e.kind, e.reason) == ("audio too long", "the audio is 3 s long, over data.max_audio_seconds = 2.5 s")
    e = audio_err(load_audio, tmp_path / "long.wav", max_bytes=1000)
    assert (e.kind, e.reason) == ("audio file too large",
                                  "the audio file is 0.1 MiB, over data.max_audio_bytes = 0.0 MiB")
    e = audio_err(load_audio, tmp_path / "long.wav", min_seconds=4)
    assert (e.kind, e.reason) == ("audio too short", "the audio is 3 s long, shorter than "
                                  "data.min_audio_seconds = 4 s")
    sf.write(tmp_path / "nan.wav", np.array([0.0, np.nan] * 100, np.float32), SR, subtype="FLOAT")
    assert audio_err(load_audio, tmp_path / "nan.wav").reason == \
        "the audio holds non-finite samples (NaN or inf)"


def test_librosa_fallback_for_formats_libsndfile_lacks(tmp_path, monkeypatch):
    x = tone(5000)
    sf.write(tmp_path / "a.mp3", x, SR, format="MP3")
    ref = load_audio(tmp_path / "a.mp3")

    def no_read(*a, **k):
        raise RuntimeError("Error opening 'a.mp3': Format not recognised.")

    monkeypatch.setattr(sf, "read", no_read)
    assert isinstance(audio_err(load_audio, tmp_path / "a.mp3"), AudioError)   # libsndfile knows mp3
    monkeypatch.setattr(A, "_libsndfile_knows", lambda p: False)
    assert np.allclose(load_audio(tmp_path / "a.mp3"), ref, atol=1e-6)         # librosa decoded it


def test_crop():
    w = np.arange(10 * SR, dtype=np.float32)
    assert np.array_equal(crop(w, SR, 1.0, 2.5), w[SR:int(2.5 * SR)])
    assert np.array_equal(crop(w, SR, -3, 0.5), w[:SR // 2])                   # clamped at 0
    assert np.array_equal(crop(w, SR, 9.5, 99), w[int(9.5 * SR):])            # clamped at the end
    c = crop(w, SR, 0, 1)
    c[0] = 123
    assert w[0] == 0                                                            # a copy
    assert crop_bounds(len(w), SR, 1.00003, 2) == (SR, 2 * SR)                  # nearest sample
    for (s, e), msg in [((5, 5), "start_sec (5) must be less than end_sec (5)"),
                        ((6, 2), "start_sec (6) must be less than end_sec (2)"),
                        ((10, 12), "start_sec (10) is at or past the end of the recording (10.00 s long)"),
                        ((-5, 0), "end_sec (0) is at or before the start of the recording (0 s)"),
                        ((float("nan"), 2), "start_sec must be a finite number of seconds, got nan"),
                        ((1, "2"), "end_sec must be a finite number of seconds, got '2'"),
                        ((True, 2), "start_sec must be a finite number of seconds, got True")]:
        with pytest.raises(ValueError) as ei:
            crop(w, SR, s, e)
        assert str(ei.value) == msg
    with pytest.raises(ValueError, match=r"the segment \[1, 1.05\] s holds 0.050 s of audio; crop at least 0.1 s"):
        crop(w, SR, 1, 1.05, min_seconds=0.1)
    with pytest.raises(ValueError, match=r"crop needs a mono waveform \[N\], got shape \(2, 3\)"):
        crop(np.zeros((2, 3)), SR, 0, 1)


def test_wav_bytes_exact_and_deterministic():
    x = np.random.default_rng(0).standard_normal(12345).astype(np.float32)
    b = wav_bytes(x)
    assert b == wav_bytes(x.copy())
    y, sr = sf.read(io.BytesIO(b), dtype="float32")
    assert sr == SR and np.array_equal(y, x)
    url = audio_data_url(x)
    assert url.startswith("data:audio/wav;base64,UklGR")


def test_roots(tmp_path):
    root = tmp_path / "data"
    assert is_under(root / "a" / "b.wav", [root]) and is_under(root, [root])
    assert not is_under(tmp_path / "database" / "x.wav", [root])                # prefix is not a parent
    assert resolve_audio_path("a/../b.wav", root, [root]) == root / "b.wav"
    e = audio_err(resolve_audio_path, "../../etc/passwd", root, [root])
    assert e.kind == "audio outside audio_roots"
    assert e.reason == f"the audio lies outside data.audio_roots ({root})"
    assert resolve_audio_path("/x/y.wav", root, ["/"]) == __import__("pathlib").Path("/x/y.wav")
