"""Clips as WAV files beside the pages, each written once: named by a hash of its samples, so the
prompt recording a group shares, or a clip that recurs in later steps (or in a report built again
into the same --out), is one file written once."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

AUDIO_DIR = "audio"


class ClipWriter:
    """``add(clip)`` -> the clip's WAV path relative to the report dir (16-bit PCM) and its seconds;
    the files are written by two threads while the pages are built (``close`` waits for them)."""

    def __init__(self, out_dir: Path, sampling_rate: int = 16000):
        from concurrent.futures import ThreadPoolExecutor

        self.out = Path(out_dir)
        self.rate = int(sampling_rate)
        (self.out / AUDIO_DIR).mkdir(parents=True, exist_ok=True)
        self.written = 0
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="wav")
        self.pending: dict[str, object] = {}

    def add(self, clip) -> tuple[str, float]:
        a = np.ascontiguousarray(np.asarray(clip, dtype=np.float32).reshape(-1))
        name = f"{AUDIO_DIR}/{hashlib.sha1(a.tobytes()).hexdigest()[:20]}.wav"
        if name not in self.pending and not (self.out / name).is_file():
            self.pending[name] = self.pool.submit(self._write, self.out / name, a)
            self.written += 1
        return name, a.size / self.rate

    def _write(self, path: Path, a: np.ndarray) -> None:
        import soundfile as sf

        tmp = path.with_name(f".{path.name}.tmp")
        sf.write(str(tmp), np.clip(a, -1.0, 1.0), self.rate, subtype="PCM_16", format="WAV")
        tmp.replace(path)

    def close(self) -> None:
        """Wait for every write; the first failure raises."""
        self.pool.shutdown(wait=True)
        for f in self.pending.values():
            f.result()
        self.pending.clear()
