"""``mgrpo make-data``: synthetic audio-agent data in the user's JSONL format.

Each row is one recording (16 kHz mono, 10 s to 5 min; mostly mp3, about a quarter wav) with a
quiet background and a few known sound events at known times; the question asks for ONE target
event and the ground truth is its span ``[MM:SS - MM:SS]`` in whole seconds (start floored, end
ceiled).  The other events are distractors of different kinds.  Rows carry the ``crop_audio``
tool spec as a JSON string, as the user's data does, plus debugging columns (``id``,
``duration_sec``, ``event``, ``distractors``).

Same seed -> byte-identical JSONL and audio (libsndfile's mp3 encoder is deterministic on one
machine); train and dev rows use disjoint random streams.  A spoken-word event kind is added
only when asked for (``speech=True``, needs ``espeak-ng``); ``speech=None`` uses espeak-ng when it
is on PATH (data then differs between machines with and without it). The default is off so the
same seed gives the same files everywhere.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import soundfile as sf

from megatron_grpo.data import audio_events as ev
from megatron_grpo.data.schema import AUDIO_TAG, format_span

CROP_AUDIO_TOOL = {
    "type": "function",
    "function": {
        "name": "crop_audio",
        "description": ("Cut the segment between start_sec and end_sec out of the original recording "
                        "and return it as a new audio clip, so you can listen to that part more "
                        "closely. Times are seconds from the start of the original recording."),
        "parameters": {
            "type": "object",
            "properties": {
                "start_sec": {"type": "number",
                              "description": "Start of the segment, in seconds from the start of "
                                             "the recording (0 or more)."},
                "end_sec": {"type": "number",
                            "description": "End of the segment, in seconds from the start of the "
                                           "recording (greater than start_sec, at most the "
                                           "recording's length)."},
            },
            "required": ["start_sec", "end_sec"],
        },
    },
}
TOOLS_JSON = json.dumps([CROP_AUDIO_TOOL], ensure_ascii=False)

_ASK = ("When does {label} occur?", "At what time do you hear {label}?",
        "Find {label} in this recording.", "Where in the recording is {label}?")
_HOW = ("The recording is {mmss} long ({sec} seconds). You can call the crop_audio tool to cut out "
        "a part of the recording and listen to it more closely. Answer with the time span of the "
        "event in the format [MM:SS - MM:SS].")

# duration mixture (seconds): mostly short, some medium, a few long
_DUR_BUCKETS = ((0.80, 10.0, 35.0), (0.15, 35.0, 100.0), (0.05, 100.0, 300.0))
_WAV_MAX_S = 120.0      # long recordings are always mp3 (keeps disk use modest)
_SPLIT_CODE = {"train": 0, "dev": 1}


def _durations(rng: np.random.Generator, n: int) -> np.ndarray:
    p = np.array([b[0] for b in _DUR_BUCKETS])
    bucket = rng.choice(len(_DUR_BUCKETS), size=n, p=p / p.sum())
    lo = np.array([b[1] for b in _DUR_BUCKETS])[bucket]
    hi = np.array([b[2] for b in _DUR_BUCKETS])[bucket]
    d = rng.uniform(lo, hi)
    if n >= 20:   # every realistic dataset holds at least one recording of 4-5 minutes
        d[int(rng.integers(n))] = rng.uniform(240.0, 300.0)
    return np.round(d, 2)


def _formats(rng: np.random.Generator, durations: np.ndarray) -> list[str]:
    """~1/4 wav (at least one wav and one mp3 whenever n >= 2), wav only for recordings <= 2 min."""
    n = len(durations)
    n_wav = n // 4 if n >= 4 else (1 if n >= 2 else 0)
    # eligible (short) rows first in random order, then the long ones shortest first as a fallback
    key = np.where(durations <= _WAV_MAX_S, rng.random(n), 1.0 + durations)
    fmts = ["mp3"] * n
    for i in np.argsort(key, kind="stable")[:n_wav]:
        fmts[int(i)] = "wav"
    return fmts


def _synth_row(rng: np.random.Generator, duration_s: float, kinds: list[ev.Kind],
               target: str | None = None):
    """-> (audio float32, target Event, distractor Events); ``target`` forces the target kind."""
    n = int(round(duration_s * ev.SR))
    pick = int(rng.integers(len(kinds)))
    target_kind = kinds[pick] if target is None else next(k for k in kinds if k.name == target)
    others = [k for k in kinds if k.name != target_kind.name]
    max_distractors = min(5, 1 + int(duration_s // 10))
    n_distr = 0 if rng.random() < 0.15 else int(rng.integers(1, max_distractors + 1))
    chosen = [target_kind] + [others[int(i)] for i in rng.permutation(len(others))[:n_distr]]
    rendered = [ev.render_event(k, rng) for k in chosen]
    while True:   # drop distractors until everything fits (a 10 s file holds the target alone)
        lengths = [len(clip) / ev.SR for clip, _, _ in rendered]
        starts = ev.place_events(rng, duration_s, lengths)
        if starts is not None:
            break
        if len(rendered) == 1:
            raise RuntimeError(f"event of {lengths[0]:.2f} s does not fit into {duration_s:.2f} s")
        rendered.pop()
        chosen.pop()
    audio = ev.background(rng, n)
    events = []
    for kind, (clip, label, params), start in zip(chosen, rendered, starts):
        i0 = int(round(start * ev.SR))
        audio[i0: i0 + len(clip)] += clip
        events.append(ev.Event(kind.name, label, i0 / ev.SR, (i0 + len(clip)) / ev.SR, params))
    np.clip(audio, -1.0, 1.0, out=audio)
    return audio, events[0], events[1:]


def _mmss(sec: float) -> str:
    s = int(round(sec))
    return f"{s // 60:02d}:{s % 60:02d}"


def _write_split(out_dir: Path, split: str, n: int, seed: int, kinds: list[ev.Kind],
                 progress: bool, sft_jsonl: Path | None = None) -> tuple[Path, float]:
    plan_rng = np.random.default_rng(np.random.SeedSequence([seed, _SPLIT_CODE[split], 1 << 20]))
    durations = _durations(plan_rng, n)
    formats = _formats(plan_rng, durations)
    jsonl = out_dir / f"{split}.jsonl"
    total_s = 0.0
    bar = _progress(n, f"make-data {split}", progress)
    sft = open(sft_jsonl, "w", encoding="utf-8", newline="\n") if sft_jsonl else None
    with open(jsonl, "w", encoding="utf-8", newline="\n") as f:
        for i in range(n):
            rng = np.random.default_rng(np.random.SeedSequence([seed, _SPLIT_CODE[split], i]))
            dur = float(durations[i])
            audio, target, distractors = _synth_row(rng, dur, kinds)
            rel = f"audio/{split}_{i:05d}.{formats[i]}"
            if formats[i] == "wav":
                sf.write(out_dir / rel, audio, ev.SR, format="WAV", subtype="PCM_16")
            else:
                sf.write(out_dir / rel, audio, ev.SR, format="MP3")
            ask = _ASK[int(rng.integers(len(_ASK)))].format(label=target.label)
            question = ask[0].upper() + ask[1:] + " " + _HOW.format(mmss=_mmss(dur), sec=int(round(dur)))
            row = {
                "tools": TOOLS_JSON,
                "audios": [rel],
                "messages": [{"role": "user", "content": f"{AUDIO_TAG}\n{question}"}],
                "ground_truth": format_span(target.start_sec, target.end_sec),
                "id": f"{split}_{i:05d}",
                "duration_sec": round(len(audio) / ev.SR, 3),
                "event": target.to_json(),
                "distractors": [d.to_json() for d in distractors],
            }
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            if sft:  # its own random stream: the prompt rows are the same with and without --sft
                from megatron_grpo.data.synth_sft import expert_messages
                expert_rng = np.random.default_rng(np.random.SeedSequence([seed, _SPLIT_CODE[split], i, 2]))
                sft_row = {k: row[k] for k in ("tools", "audios", "ground_truth", "id")}
                sft_row["messages"] = row["messages"] + expert_messages(expert_rng, target, audio)
                sft.write(json.dumps(sft_row, ensure_ascii=False) + "\n")
            total_s += len(audio) / ev.SR
            bar.update(1)
    if sft:
        sft.close()
    bar.close()
    return jsonl, total_s


class _Lines:
    """Fallback progress: one line every ~10% (tqdm unavailable or not a tty)."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.total, self.desc, self.enabled, self.done = total, desc, enabled, 0
        self.every = max(1, math.ceil(total / 10))

    def update(self, k: int) -> None:
        self.done += k
        if self.enabled and (self.done % self.every == 0 or self.done == self.total):
            print(f"[{self.desc}] {self.done}/{self.total} files", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def _progress(total: int, desc: str, enabled: bool):
    if enabled and sys.stderr.isatty():
        try:
            from tqdm import tqdm
            return tqdm(total=total, desc=desc, unit="file")
        except ImportError:
            pass
    return _Lines(total, desc, enabled)


def make_data(out_dir, n: int = 200, n_dev: int = 16, seed: int = 0, *,
              speech: bool | None = False, progress: bool = True, sft: bool = False) -> dict:
    """Write ``out_dir/train.jsonl`` (n rows), ``out_dir/dev.jsonl`` (n_dev rows) and their audio
    under ``out_dir/audio/``.  ``speech``: include spoken-word events (needs ``espeak-ng``);
    None = when ``espeak-ng`` is on PATH; default off (same files on every machine).  ``sft``: also
    ``out_dir/sft.jsonl``, an expert trajectory per train row (``synth_sft``) for `mgrpo sft`.
    Returns a summary dict."""
    if n < 0 or n_dev < 0:
        raise ValueError(f"n and n_dev must be >= 0, got n={n}, n_dev={n_dev}")
    if speech is None:
        speech = ev.espeak_available()
    elif speech and not ev.espeak_available():
        raise RuntimeError("speech=True needs espeak-ng on PATH (apt-get install espeak-ng)")
    out = Path(out_dir)
    (out / "audio").mkdir(parents=True, exist_ok=True)
    kinds = ev.available_kinds(speech)
    sft_jsonl = out / "sft.jsonl" if sft else None
    train_jsonl, train_s = _write_split(out, "train", n, seed, kinds, progress, sft_jsonl)
    dev_jsonl, dev_s = _write_split(out, "dev", n_dev, seed, kinds, progress)
    return {"out_dir": str(out), "train_jsonl": str(train_jsonl), "dev_jsonl": str(dev_jsonl),
            "n_train": n, "n_dev": n_dev, "n_audio": n + n_dev, "audio_seconds": round(train_s + dev_s, 3),
            **({"sft_jsonl": str(sft_jsonl)} if sft else {})}
