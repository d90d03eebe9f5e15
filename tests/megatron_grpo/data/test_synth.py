"""Synthetic audio-agent data: schema, decodability, event placement and energy, determinism."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from megatron_grpo.data import audio_events as ev
from megatron_grpo.data import synth
from megatron_grpo.data.schema import check_row, parse_span
from megatron_grpo.data.synth import make_data

N, N_DEV = 6, 2


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth_a")
    summary = make_data(out, n=N, n_dev=N_DEV, seed=0, speech=False, progress=False)
    return out, summary


def _rows(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _all_rows(out):
    return [(name, r) for name in ("train.jsonl", "dev.jsonl") for r in _rows(out / name)]


def _frame_rms(x, frame_s=0.05):
    k = int(ev.SR * frame_s)
    m = len(x) // k
    return np.sqrt((x[: m * k].reshape(m, k).astype(np.float64) ** 2).mean(axis=1))


def _event_vs_background(x, events, target):
    """(max 50 ms frame RMS inside the target, RMS over its whole-second answer span,
    median frame RMS away from all events)."""
    f = _frame_rms(x)
    t0 = np.arange(len(f)) * 0.05
    away = np.ones(len(f), bool)
    for e in events:
        away &= ~((t0 + 0.05 > e["start_sec"] - 0.1) & (t0 < e["end_sec"] + 0.1))
    bg = float(np.median(f[away]))
    inside = f[(t0 >= target["start_sec"] - 0.025) & (t0 + 0.05 <= target["end_sec"] + 0.025)]
    s, e = parse_span(target["span"]) if "span" in target else (target["start_sec"], target["end_sec"])
    seg = x[int(s * ev.SR): int(math.ceil(e * ev.SR))].astype(np.float64)
    return float(inside.max()), float(np.sqrt((seg ** 2).mean())), bg


def test_summary_and_files(data):
    out, s = data
    assert s == {"out_dir": str(out), "train_jsonl": str(out / "train.jsonl"),
                 "dev_jsonl": str(out / "dev.jsonl"), "n_train": N, "n_dev": N_DEV,
                 "n_audio": N + N_DEV, "audio_seconds": s["audio_seconds"]}
    assert len(_rows(out / "train.jsonl")) == N and len(_rows(out / "dev.jsonl")) == N_DEV
    audios = [r["audios"][0] for _, r in _all_rows(out)]
    assert len(set(audios)) == N + N_DEV                       # dev audio differs from train audio
    assert sorted(p.name for p in (out / "audio").iterdir()) == sorted(Path(a).name for a in audios)
    exts = {Path(a).suffix for a in audios}
    assert exts == {".mp3", ".wav"}
    total = sum(sf.info(str(out / a)).duration for a in audios)
    assert abs(total - s["audio_seconds"]) < 0.5


def test_rows_pass_schema_and_format(data):
    out, _ = data
    for name, r in _all_rows(out):
        check_row(r, path=name, line_no=1, base_dir=out)
        assert list(r)[:4] == ["tools", "audios", "messages", "ground_truth"]
        assert len(r["audios"]) == 1 and not Path(r["audios"][0]).is_absolute()
        content = r["messages"][0]["content"]
        assert r["messages"][0]["role"] == "user" and content.startswith("<audio>\n")
        assert "[MM:SS - MM:SS]" in content and "crop_audio" in content
        assert r["event"]["label"] in content


def test_tools_string_declares_crop_audio(data):
    out, _ = data
    for _, r in _all_rows(out):
        assert isinstance(r["tools"], str)
        tools = json.loads(r["tools"])
        (spec,) = [t for t in tools if t["function"]["name"] == "crop_audio"]
        assert spec["type"] == "function" and spec["function"]["description"]
        params = spec["function"]["parameters"]
        assert params["type"] == "object"
        assert sorted(params["required"]) == ["end_sec", "start_sec"]
        for key in ("start_sec", "end_sec"):
            assert params["properties"][key]["type"] == "number"
            assert params["properties"][key]["description"]


def test_audio_decodes_with_soundfile_and_librosa(data):
    import librosa

    out, _ = data
    for _, r in _all_rows(out):
        path = str(out / r["audios"][0])
        x, sr = sf.read(path, dtype="float32")
        assert sr == 16000 and x.ndim == 1
        assert 10.0 <= len(x) / sr <= 300.0
        assert abs(len(x) / sr - r["duration_sec"]) < 0.05
        y, sr2 = librosa.load(path, sr=None, mono=False)
        assert sr2 == 16000 and y.ndim == 1 and abs(len(y) - len(x)) <= 2000
        assert np.sqrt(np.mean(x ** 2)) > 1e-4                  # background: never silent


def test_ground_truth_inside_audio_and_covers_event(data):
    out, _ = data
    for _, r in _all_rows(out):
        s, e = parse_span(r["ground_truth"])
        assert s == int(s) and e == int(e) and 0 <= s < e <= r["duration_sec"]
        ev_ = r["event"]
        assert s == math.floor(ev_["start_sec"]) and e == math.ceil(ev_["end_sec"])
        for d in r["distractors"]:                               # the answer span holds the target only
            assert d["type"] != ev_["type"]
            assert d["end_sec"] <= s or d["start_sec"] >= e


def test_target_event_is_audible_in_files(data):
    out, _ = data
    for _, r in _all_rows(out):
        x, _sr = sf.read(str(out / r["audios"][0]), dtype="float32")
        target = dict(r["event"], span=r["ground_truth"])
        peak, span_rms, bg = _event_vs_background(x, [r["event"]] + r["distractors"], target)
        assert peak > 4 * bg, (r["id"], r["event"], peak, bg)
        assert span_rms > 2 * bg, (r["id"], r["event"], span_rms, bg)


@pytest.mark.parametrize("kind", [k.name for k in ev.available_kinds(speech=False)])
def test_every_kind_is_audible_and_placed(kind):
    kinds = ev.available_kinds(speech=False)
    for i in range(3):
        rng = np.random.default_rng([7, i])
        dur = [10.0, 45.0, 120.0][i]
        x, target, distractors = synth._synth_row(rng, dur, kinds, target=kind)
        assert target.kind == kind and len(x) == int(dur * ev.SR)
        events = sorted([target] + distractors, key=lambda e: e.start_sec)
        assert events[0].start_sec >= ev.EDGE_S and events[-1].end_sec <= math.floor(dur) - ev.EDGE_S
        for a, b in zip(events, events[1:]):
            assert b.start_sec - a.end_sec >= ev.MIN_GAP_S - 1e-6
        tj = target.to_json()
        peak, span_rms, bg = _event_vs_background(x, [e.to_json() for e in events], tj)
        assert peak > 4 * bg and span_rms > 2 * bg, (kind, peak, span_rms, bg)


def test_beep_band_energy(data):
    """For tone targets, the energy at the beep frequency inside the event dwarfs the rest."""
    kinds = ev.available_kinds(speech=False)
    x, target, _ = synth._synth_row(np.random.default_rng(3), 30.0, kinds, target="high_beep")
    f = target.params["freq_hz"]
    i0, i1 = int(target.start_sec * ev.SR), int(target.end_sec * ev.SR)
    seg = x[i0:i1]
    spec = np.abs(np.fft.rfft(seg * np.hanning(len(seg))))
    freqs = np.fft.rfftfreq(len(seg), 1 / ev.SR)
    assert abs(freqs[spec.argmax()] - f) < 5.0
    quiet = x[:i0] if i0 > ev.SR else x[i1:]
    qspec = np.abs(np.fft.rfft(quiet[: len(seg)] * np.hanning(len(seg))))
    band = np.abs(freqs - f) < 20
    assert spec[band].max() > 30 * qspec[band].max()


def test_same_seed_identical_bytes(data, tmp_path):
    out, _ = data
    again = tmp_path / "b"
    make_data(again, n=N, n_dev=N_DEV, seed=0, speech=False, progress=False)
    for name in ("train.jsonl", "dev.jsonl"):
        assert (out / name).read_bytes() == (again / name).read_bytes()
    for p in sorted((out / "audio").iterdir()):                 # mp3 encoding is byte-deterministic
        assert p.read_bytes() == (again / "audio" / p.name).read_bytes(), p.name


def test_different_seed_differs(data, tmp_path):
    out, _ = data
    other = tmp_path / "c"
    make_data(other, n=2, n_dev=1, seed=1, speech=False, progress=False)
    a, b = _rows(out / "train.jsonl")[:2], _rows(other / "train.jsonl")
    assert [r["ground_truth"] for r in a] != [r["ground_truth"] for r in b]
    assert [r["event"] for r in a] != [r["event"] for r in b]
    xa, _ = sf.read(str(out / a[0]["audios"][0]))
    xb, _ = sf.read(str(other / b[0]["audios"][0]))
    assert len(xa) != len(xb) or not np.array_equal(xa, xb)


def test_format_mix():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 4, 7, 200):
        d = synth._durations(rng, n)
        assert ((d >= 10) & (d <= 300)).all()
        fmts = synth._formats(rng, d)
        n_wav = fmts.count("wav")
        assert n_wav == (n // 4 if n >= 4 else min(n - 1, 1))
        if n >= 2:
            assert "mp3" in fmts and "wav" in fmts
    d = synth._durations(np.random.default_rng(1), 2000)
    assert np.mean(d <= 60) > 0.75 and (d > 200).any()        # mostly short, a few long
    assert synth._durations(np.random.default_rng(2), 20).max() >= 240


def test_speech_needs_espeak(monkeypatch, tmp_path):
    monkeypatch.setattr(ev, "espeak_available", lambda: False)
    with pytest.raises(RuntimeError, match="espeak-ng"):
        make_data(tmp_path, n=1, n_dev=0, speech=True, progress=False)
    assert all(not k.needs_speech for k in ev.available_kinds(speech=False))


@pytest.mark.skipif(not ev.espeak_available(), reason="espeak-ng not installed (optional)")
def test_speech_event_when_espeak_present():
    kinds = ev.available_kinds(speech=True)
    runs = [synth._synth_row(np.random.default_rng(5), 20.0, kinds, target="speech") for _ in range(2)]
    (x, target, distractors), (x2, _, _) = runs
    assert np.array_equal(x, x2)
    assert target.params["word"] in target.label and 0.2 < target.end_sec - target.start_sec < 3.0
    peak, span_rms, bg = _event_vs_background(x, [target.to_json()] + [d.to_json() for d in distractors],
                                              target.to_json())
    assert peak > 4 * bg and span_rms > 2 * bg


def test_cli_make_data(tmp_path, capsys):
    from launch.cli import main

    assert main(["make-data", "--out", str(tmp_path / "d"), "--n", "1", "--n-dev", "1", "--seed", "3"]) == 0
    assert "1 train rows" in capsys.readouterr().out
    for argv, message in (
            (["--out", str(tmp_path / "d")], f"mgrpo make-data: --out {tmp_path / 'd'} exists and is not empty: "
             "choose a new directory, or pass --force to write into it (files of the same name are replaced, "
             "others stay)"),
            (["--out", str(tmp_path / "e"), "--n", "-5"], "mgrpo make-data: --n and --n-dev must be >= 0, got -5 and 16")):
        with pytest.raises(SystemExit) as e:
            main(["make-data", *argv])
        assert e.value.code == 2 and capsys.readouterr().err.strip() == message
    for name in ("train.jsonl", "dev.jsonl"):
        (row,) = _rows(tmp_path / "d" / name)
        check_row(row, path=name, line_no=1, base_dir=tmp_path / "d")
