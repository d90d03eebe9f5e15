"""Long recordings: the pre-flight sizes the local vLLM server from the data (prompt tokens by the
processor's rule), refuses rows that cannot fit one line each before anything starts, and 20- and
40-minute seed-format recordings train end to end (tiny model, real vLLM CPU server)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

REPO = Path(__file__).resolve().parents[3]
CACHE = Path(os.environ.get("MGRPO_TEST_CACHE", REPO / ".cache" / "tests"))  # as tests/conftest.py
SR = 16000
EVENT = (825.0, 1045.0)  # 13:45 - 17:25, where the user's agent crops


def long_recording(minutes: int) -> Path:
    """A seed-format mp3 of `minutes` minutes (background noise, beeping in EVENT), made once and
    cached across runs."""
    from megatron_grpo.data import audio_events as ev

    path = CACHE / "long_audio" / f"rec_{minutes}min.mp3"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(minutes)
        audio = ev.background(rng, int(minutes * 60 * SR))
        s0, s1 = int(EVENT[0] * SR), int(EVENT[1] * SR)
        t = np.arange(s1 - s0) / SR
        audio[s0:s1] += (0.2 * np.sin(2 * np.pi * 880 * t) * (np.sin(2 * np.pi * 2 * t) > 0)).astype(audio.dtype)
        tmp = path.with_suffix(".tmp.mp3")
        sf.write(tmp, audio.astype(np.float32), SR, format="MP3")
        tmp.replace(path)
    return path


def seed_rows(out: Path, recordings: list[Path]) -> Path:
    """train.jsonl in the seed format (as `mgrpo make-data` writes it), one row per recording."""
    from megatron_grpo.data.schema import format_span
    from megatron_grpo.data.synth import CROP_AUDIO_TOOL

    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, rec in enumerate(recordings):
        link = out / rec.name
        if not link.exists():
            link.symlink_to(rec)
        seconds = sf.info(str(rec)).duration
        minutes = round(seconds / 60)
        # the event where the user's agent crops; a shorter recording gets one in its second quarter
        span = EVENT if EVENT[1] <= seconds else (seconds / 4, seconds / 2)
        lines.append(json.dumps({
            "tools": json.dumps([CROP_AUDIO_TOOL]), "audios": [rec.name], "id": f"long{i}",
            "messages": [{"role": "user", "content": f"<audio>\nWhen does the beeping happen? The recording is "
                                                     f"{minutes}:00 long. Answer with [MM:SS - MM:SS]."}],
            "ground_truth": format_span(*span)}))
    (out / "train.jsonl").write_text("\n".join(lines) + "\n")
    return out / "train.jsonl"


def _mgrpo(*args, timeout=1800):
    env = dict(os.environ, MGRPO_CACHE=str(CACHE / "embedded"), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_prompt_tokens_follow_the_processors_rule(tiny_ckpt, tmp_path):
    """The pre-flight's count == the rollout engine's count from the decoded clip (+ the margin)."""
    from transformers import AutoTokenizer

    from megatron_grpo.data.config import DataConfig
    from megatron_grpo.data.features import audio_token_counts
    from megatron_grpo.data.reader import read_jsonl
    from megatron_grpo.rollout.render import ToolTurnRenderer, template_messages
    from megatron_grpo.run.sizing import MP3_MARGIN_TOKENS, prompt_tokens

    wav = tmp_path / "a.wav"
    sf.write(wav, np.zeros(int(61.37 * SR), dtype=np.float32), SR)
    rows = read_jsonl(seed_rows(tmp_path, [wav]), DataConfig())
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    renderer = ToolTurnRenderer(tok)
    row = rows[0]
    text_ids = tok.encode(renderer.render(template_messages(row.messages), row.tools, True), add_special_tokens=False)
    audio = audio_token_counts(row.load_audios())[0]
    assert prompt_tokens(row, tok, renderer, sample_rate=SR, n_window=50) == \
        len(text_ids) - 1 + audio + MP3_MARGIN_TOKENS


def test_max_audio_seconds_defaults_to_the_models_40_minutes():
    from megatron_grpo.data.config import DataConfig
    from megatron_grpo.rollout.server import audio_limits_env

    assert DataConfig().max_audio_seconds == 2400.0
    assert audio_limits_env(None) == {"VLLM_MAX_AUDIO_CLIP_FILESIZE_MB": "64"}
    env = audio_limits_env(2400.0)  # a 40-minute clip as float32 WAV is 146.5 MiB
    assert env == {"VLLM_MAX_AUDIO_CLIP_FILESIZE_MB": "148", "VLLM_MAX_AUDIO_DECODE_DURATION_S": "2401",
                   "VLLM_MAX_AUDIO_DECODE_BYTES": str(2401 * 48000 * 4)}


@pytest.mark.cold_start
def test_rows_that_cannot_fit_are_refused_before_start_up_one_line_each(mgrpo_inproc, tiny_ckpt, tmp_path):
    """With serve.max_model_len=8192 neither a 20-minute recording (~16k prompt tokens) nor a
    40-minute one fits: one line per row, exit 2, no rank and no server started."""
    from transformers import AutoTokenizer

    from megatron_grpo.data.config import DataConfig
    from megatron_grpo.data.reader import read_jsonl
    from megatron_grpo.rollout.render import ToolTurnRenderer
    from megatron_grpo.run.sizing import prompt_tokens

    jsonl = seed_rows(tmp_path / "data", [long_recording(20), long_recording(40)])
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)  # the embedded job's checkpoint is the same tiny
    n20, n40 = (prompt_tokens(row, tok, ToolTurnRenderer(tok), sample_rate=SR, n_window=50)
                for row in read_jsonl(jsonl, DataConfig()))
    assert 15_600 < n20 < 16_200 and 31_200 < n40 < 31_800, (n20, n40)
    run = tmp_path / "run"
    r = mgrpo_inproc("train", f"data.train_jsonl={jsonl}", "serve.max_model_len=8192", f"trainer.run_dir={run}")
    assert r.returncode == 2, r.stderr[-3000:]
    fix = "raise serve.max_model_len (the model allows 32768) or set it to auto"
    assert r.stderr.strip().splitlines()[-2:] == [
        f"mgrpo train: data error: {jsonl} line 1: the prompt needs {n20} tokens (20.0 min of audio), no room to "
        f"generate within serve.max_model_len=8192: {fix}",
        f"mgrpo train: data error: {jsonl} line 2: the prompt needs {n40} tokens (40.0 min of audio), no room to "
        f"generate within serve.max_model_len=8192: {fix}"]
    assert "vllm" not in (r.stdout + r.stderr).lower() and not run.exists()
    # rollout.max_total_tokens is a limit too
    r = mgrpo_inproc("train", f"data.train_jsonl={jsonl}", "rollout.max_total_tokens=20000", f"trainer.run_dir={run}")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        f"mgrpo train: data error: {jsonl} line 2: the prompt needs {n40} tokens (40.0 min of audio), no room to "
        "generate within rollout.max_total_tokens=20000: raise rollout.max_total_tokens (the model allows 32768) "
        "or unset it")


@pytest.mark.slow
@pytest.mark.cold_start
def test_20_and_40_minute_recordings_train(tmp_path):
    """Seed-format rows with a 20- and a 40-minute mp3, the data and server settings at their
    defaults (data.max_audio_seconds the model's 40 minutes, serve.max_model_len auto): 3 steps of
    one prompt in file order (20, 40, then 20 minutes again), kept cheap with one rank, one
    generation and short turns (CPU: ~1-2 min per step)."""
    import re

    jsonl = seed_rows(tmp_path / "data", [long_recording(20), long_recording(40)])
    run = tmp_path / "run"
    r = _mgrpo("train", f"data.train_jsonl={jsonl}", "data.shuffle=false", "trainer.steps=3",
               "trainer.prompts_per_step=1", "rollout.num_generations=1", "rollout.max_new_tokens=32",
               "rollout.max_turns=2", "parallel.nproc=1", "parallel.tp=1", "checkpoint.every=0",
               "checkpoint.at_end=false", "logging.progress=false", f"trainer.run_dir={run}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"[train] data: {jsonl} (2 rows)\n" in r.stdout  # the user's file, named
    sized = re.search(r"serve\.max_model_len=auto: (\d+) tokens \(longest prompt (\d+) \+ 2 turns of 32\); "
                      r"audio decode limit (\d+) s", r.stdout)
    assert sized, r.stdout[-3000:]
    size, longest, audio_s = map(int, sized.groups())
    assert 31_200 < longest and longest + 64 <= size < longest + 64 + 256 and size <= 32768
    assert audio_s >= 2400
    m = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in m] == [1, 2, 3]
    tokens = [x["tokens_total"] for x in m]
    assert 15_600 < tokens[0] < 17_000 and 31_200 < tokens[1] < 33_000 and 15_600 < tokens[2] < 17_000, tokens
