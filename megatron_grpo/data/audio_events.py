"""Synthetic sound events and backgrounds at 16 kHz (vectorised numpy, seeded, deterministic).

Each event kind renders a short mono clip whose first and last samples are the event's true
onset and offset (peak about ``amp``), and names itself in a few interchangeable English phrases
so a question can ask for it.  Kinds are chosen so no two are easily confused: a single high
beep, a single low beep, a noise burst, rising and falling sweeps, a train of rapid pips, a short
melody, knocking, and (only when ``espeak-ng`` is on PATH) a spoken word.

A recording is a quiet background (broadband hiss + low rumble + mains hum) with events added
at non-overlapping times; :func:`place_events` keeps a gap between events so a target's
whole-second answer span never covers another event.
"""
from __future__ import annotations

import io
import math
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from scipy.signal import lfilter, resample_poly

SR = 16_000
MIN_GAP_S = 2.0   # silence (background only) between two events
EDGE_S = 0.5      # keep events this far from the recording's ends


@dataclass
class Event:
    kind: str
    label: str                 # phrase naming the event in a question ("the high-pitched beep")
    start_sec: float
    end_sec: float
    params: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"type": self.kind, "label": self.label, "start_sec": round(self.start_sec, 3),
                "end_sec": round(self.end_sec, 3), **self.params}


def _t(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.float64) / SR


def _ramp(x: np.ndarray, ms: float = 10.0) -> np.ndarray:
    """Raised-cosine fade in/out (no clicks); the clip keeps its length."""
    k = min(int(SR * ms / 1000), len(x) // 2)
    if k > 0:
        w = 0.5 - 0.5 * np.cos(np.pi * np.arange(k) / k)
        x[:k] *= w
        x[-k:] *= w[::-1]
    return x


def _n(seconds: float) -> int:
    return max(1, int(round(seconds * SR)))


# ---- event renderers: rng -> (clip with peak ~1, params for the row's "event" column) ----------

def _tone(rng, lo_hz, hi_hz):
    f = float(rng.uniform(lo_hz, hi_hz))
    n = _n(rng.uniform(0.3, 2.0))
    return _ramp(np.sin(2 * np.pi * f * _t(n))), {"freq_hz": round(f, 1)}


def _high_beep(rng):
    return _tone(rng, 1800.0, 3500.0)


def _low_beep(rng):
    return _tone(rng, 250.0, 500.0)


def _noise_burst(rng):
    n = _n(rng.uniform(0.4, 3.0))
    return _ramp(np.clip(0.35 * rng.standard_normal(n), -1.0, 1.0)), {}


def _sweep(f0: float, f1: float, n: int) -> np.ndarray:
    """Exponential sweep f0 -> f1 over n samples (phase is the integral of the frequency)."""
    dur = n / SR
    k = math.log(f1 / f0)
    phase = 2 * np.pi * f0 * dur / k * (np.exp(k * _t(n) / dur) - 1.0)
    return np.sin(phase)


def _rising_chirp(rng):
    f0, f1 = float(rng.uniform(200, 600)), float(rng.uniform(2000, 5000))
    n = _n(rng.uniform(0.6, 3.0))
    return _ramp(_sweep(f0, f1, n)), {"f0_hz": round(f0, 1), "f1_hz": round(f1, 1)}


def _falling_chirp(rng):
    f0, f1 = float(rng.uniform(2000, 5000)), float(rng.uniform(200, 600))
    n = _n(rng.uniform(0.6, 3.0))
    return _ramp(_sweep(f0, f1, n)), {"f0_hz": round(f0, 1), "f1_hz": round(f1, 1)}


def _beep_train(rng):
    f = float(rng.uniform(700, 1400))
    count = int(rng.integers(3, 9))
    on, off = _n(rng.uniform(0.06, 0.12)), _n(rng.uniform(0.06, 0.15))
    pip = _ramp(np.sin(2 * np.pi * f * _t(on)), ms=5.0)
    x = np.zeros(count * (on + off) - off)
    for i in range(count):
        x[i * (on + off): i * (on + off) + on] = pip
    return x, {"freq_hz": round(f, 1), "count": count}


_PENTATONIC = 440.0 * 2.0 ** (np.array([0, 2, 4, 7, 9, 12, 14, 16]) / 12.0)


def _melody(rng):
    count = int(rng.integers(4, 9))
    note_n = _n(rng.uniform(0.15, 0.35))
    freqs = _PENTATONIC[rng.integers(0, len(_PENTATONIC), count)]
    t = _t(note_n)[None, :]
    f = freqs[:, None]
    notes = (np.sin(2 * np.pi * f * t) + 0.4 * np.sin(4 * np.pi * f * t) + 0.2 * np.sin(6 * np.pi * f * t))
    notes *= np.exp(-3.0 * t / (note_n / SR))           # plucked decay within each note
    k = int(SR * 0.005)
    notes[:, :k] *= np.linspace(0.0, 1.0, k)             # 5 ms attack, no click
    notes[:, -k:] *= np.linspace(1.0, 0.0, k)
    x = notes.reshape(-1)
    return x / np.abs(x).max(), {"notes": count}


def _knocks(rng):
    count = int(rng.integers(2, 6))
    spacing = _n(rng.uniform(0.2, 0.45))
    f = float(rng.uniform(120, 250))
    knock_n = _n(0.15)
    t = _t(knock_n)
    env = np.exp(-t / 0.025)
    knock = env * (np.sin(2 * np.pi * f * t) + 0.5 * np.clip(0.35 * rng.standard_normal(knock_n), -1, 1))
    knock /= np.abs(knock).max()
    x = np.zeros((count - 1) * spacing + knock_n)
    for i in range(count):
        x[i * spacing: i * spacing + knock_n] += knock
    return x, {"count": count, "freq_hz": round(f, 1)}


SPEECH_WORDS = ("apple", "seven", "hello", "yellow", "river", "window", "banana", "thunder",
                "purple", "morning", "guitar", "elephant", "orange", "pencil", "rocket", "silver")
_SPEECH_VOICES = ("en", "en-us", "en+m3", "en+f2", "en-us+f3", "en+m5")


def espeak_available() -> bool:
    return shutil.which("espeak-ng") is not None


def _speech(rng):
    """A spoken word via espeak-ng (only used when it is installed), trimmed to the voiced part."""
    import soundfile as sf

    word = SPEECH_WORDS[int(rng.integers(len(SPEECH_WORDS)))]
    voice = _SPEECH_VOICES[int(rng.integers(len(_SPEECH_VOICES)))]
    speed = int(rng.integers(130, 191))
    wav = subprocess.run(["espeak-ng", "--stdout", "-v", voice, "-s", str(speed), word],
                         check=True, capture_output=True).stdout
    x, sr = sf.read(io.BytesIO(wav), dtype="float64")
    if x.ndim > 1:
        x = x.mean(axis=1)
    if sr != SR:
        g = math.gcd(SR, sr)
        x = resample_poly(x, SR // g, sr // g)
    loud = np.flatnonzero(np.abs(x) > 0.02 * np.abs(x).max())
    x = x[loud[0]: loud[-1] + 1]
    return _ramp(x / np.abs(x).max(), ms=5.0), {"word": word, "voice": voice, "wpm": speed}


@dataclass(frozen=True)
class Kind:
    name: str
    labels: tuple[str, ...]
    render: Callable[[np.random.Generator], tuple[np.ndarray, dict]]
    needs_speech: bool = False


KINDS: tuple[Kind, ...] = (
    Kind("high_beep", ("the high-pitched beep", "the high beep", "the short high tone"), _high_beep),
    Kind("low_beep", ("the low-pitched beep", "the low beep", "the short low tone"), _low_beep),
    Kind("noise_burst", ("the burst of noise", "the short hiss of white noise", "the noise burst"),
         _noise_burst),
    Kind("rising_chirp", ("the rising sweep", "the upward chirp (a tone gliding up in pitch)",
                          "the rising chirp"), _rising_chirp),
    Kind("falling_chirp", ("the falling sweep", "the downward chirp (a tone gliding down in pitch)",
                           "the falling chirp"), _falling_chirp),
    Kind("beep_train", ("the series of rapid beeps", "the quick beep-beep-beep sequence",
                        "the string of short pips"), _beep_train),
    Kind("melody", ("the short melody", "the little tune", "the short run of musical notes"), _melody),
    Kind("knocks", ("the knocking", "the series of knocks", "the sound of knocking"), _knocks),
    Kind("speech", ("the voice saying \"{word}\"", "the spoken word \"{word}\"",
                    "the word \"{word}\" being spoken"), _speech, needs_speech=True),
)


def available_kinds(speech: bool) -> list[Kind]:
    return [k for k in KINDS if speech or not k.needs_speech]


def render_event(kind: Kind, rng: np.random.Generator) -> tuple[np.ndarray, str, dict]:
    """-> (clip with peak ``amp``, label phrase, params incl. ``amp``)."""
    clip, params = kind.render(rng)
    amp = float(rng.uniform(0.15, 0.45))
    label = kind.labels[int(rng.integers(len(kind.labels)))].format(**params)
    return (amp * clip).astype(np.float32), label, {**params, "amp": round(amp, 3)}


def background(rng: np.random.Generator, n: int) -> np.ndarray:
    """Quiet, never-silent bed: white hiss + brownish rumble + 50/60 Hz hum with harmonics
    (overall RMS about 0.002-0.008, i.e. 30-45 dB under the events)."""
    a_hiss, a_rumble, a_hum = (float(a) for a in rng.uniform(0.001, 0.004, 3))
    p = float(rng.uniform(0.95, 0.995))
    mains = 50 if rng.random() < 0.5 else 60
    rumble = lfilter([1.0 - p], [1.0, -p], rng.standard_normal(n, dtype=np.float32)).astype(np.float32)
    rumble *= a_rumble / max(float(np.sqrt(np.mean(rumble ** 2))), 1e-9)
    # hum: 50 and 60 Hz both repeat exactly every 1600 samples at 16 kHz, so tile one block
    w = (2 * np.pi * mains / SR) * np.arange(1600)
    hum = (a_hum * (np.sin(w) + 0.5 * np.sin(2 * w) + 0.25 * np.sin(3 * w))).astype(np.float32)
    out = rng.standard_normal(n, dtype=np.float32)
    out *= a_hiss
    out += rumble
    out += np.resize(hum, n)
    return out


def place_events(rng: np.random.Generator, duration_s: float, lengths_s: list[float]) -> list[float] | None:
    """Random non-overlapping start times (same order as ``lengths_s``) inside
    [EDGE_S, floor(duration) - EDGE_S] with at least MIN_GAP_S between events; None if they don't fit."""
    lo, hi = EDGE_S, math.floor(duration_s) - EDGE_S
    order = rng.permutation(len(lengths_s))
    need = sum(lengths_s) + MIN_GAP_S * (len(lengths_s) - 1)
    slack = (hi - lo) - need
    if slack < 0:
        return None
    cuts = np.sort(rng.uniform(0.0, slack, len(lengths_s)))
    starts = [0.0] * len(lengths_s)
    cursor = lo
    for slot, i in enumerate(order):
        starts[i] = cursor + float(cuts[slot]) - (float(cuts[slot - 1]) if slot else 0.0)
        cursor = starts[i] + lengths_s[i] + MIN_GAP_S
    return starts
