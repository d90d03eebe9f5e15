"""Clips as WAV files beside the pages, each written once: named by a hash of its samples, so the
prompt recording a group shares, or a clip that recurs in later steps (or in a report built again
into the same --out), is one file written once."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

AUDIO_DIR = "audio"


class ClipWriter:
    """``path_of(clip)`` -> the clip's WAV path relative to the report dir (16-bit PCM, 16 kHz)."""

    def __init__(self, out_dir: Path, sampling_rate: int = 16000):
        self.out = Path(out_dir)
        self.rate = int(sampling_rate)
        (self.out / AUDIO_DIR).mkdir(parents=True, exist_ok=True)
        self.written = 0

    def add(self, clip) -> tuple[str, float]:
        """(relative path, seconds) of ``clip`` (a float32 tensor or array), written if new."""
        a = np.ascontiguousarray(np.asarray(clip, dtype=np.float32).reshape(-1))
        name = f"{AUDIO_DIR}/{hashlib.sha1(a.tobytes()).hexdigest()[:20]}.wav"
        path = self.out / name
        if not path.is_file():
            import soundfile as sf

            tmp = path.with_name(f".{path.name}.tmp")
            sf.write(str(tmp), np.clip(a, -1.0, 1.0), self.rate, subtype="PCM_16", format="WAV")
            tmp.replace(path)
            self.written += 1
        return name, a.size / self.rate
