"""Audio for the data layer, the rollout client and the crop tool: 16 kHz float32 mono, checked.

* :func:`probe_audio` reads only the file's header (``soundfile.info``: well under a millisecond
  for wav, flac and mp3) and checks what can be checked without decoding: the file exists, is not
  empty, is not over ``max_bytes``, is a format libsndfile recognises, has samples, is not over
  ``max_seconds`` and has the right sample rate (or may be resampled).  The reader runs it on
  every row.
* :func:`load_audio` decodes the whole clip (soundfile; librosa/audioread as the fallback for a
  format this libsndfile build does not read, e.g. mp3 before libsndfile 1.1; a file in a format
  libsndfile does read but cannot decode is corrupt), averages channels to mono,
  resamples to ``sample_rate`` as librosa does (soxr, high quality) when the file has another rate,
  and checks the decoded result again (an mp3 header's length is an estimate; a truncated file
  decodes to nothing).
* :func:`crop` cuts ``[start_s, end_s)`` out of a waveform (clamped to the clip, validated); the
  ``crop_audio`` tool reuses it.
* :func:`wav_bytes` / :func:`audio_data_url` encode a waveform as a lossless float32 WAV.  The
  rollout client sends prompt and tool audio to vLLM this way, so vLLM decodes exactly the samples
  the trainer later feeds the audio tower (re-sending the original mp3 would let vLLM's decoder,
  which may differ from ours, pick the sample count and so the number of audio tokens).  Size:
  64 KB per second of audio; vLLM refuses clips over ``VLLM_MAX_AUDIO_CLIP_FILESIZE_MB`` (25 MB by
  default, i.e. about 6.8 minutes), so the server must be started with a limit that covers
  ``data.max_audio_seconds``.

Every error is an :class:`AudioError` (a ``ValueError``) whose message names the file, the reason
and a fix; ``kind`` is a short category ("missing audio", "corrupt audio", ...) the reader uses to
summarise skipped rows.
"""
from __future__ import annotations

import base64
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

SAMPLE_RATE = 16_000
"""The rate Qwen3-Omni's Whisper feature extractor needs."""
MiB = 1 << 20

__all__ = ["SAMPLE_RATE", "AudioError", "AudioInfo", "probe_audio", "load_audio", "crop",
           "crop_bounds", "wav_bytes", "audio_data_url", "resolve_audio_path", "is_under"]


class AudioError(ValueError):
    """An audio file that cannot be used; the message names the file, the reason and a fix."""

    def __init__(self, path, reason: str, fix: str, kind: str):
        super().__init__(f"{path}: {reason} — {fix}")
        self.path, self.reason, self.fix, self.kind = path, reason, fix, kind


@dataclass(frozen=True)
class AudioInfo:
    """What the header of an audio file says."""

    path: str
    frames: int
    """Samples per channel (for mp3 libsndfile's header estimate; exact for wav/flac)."""
    sample_rate: int
    channels: int
    format: str
    """libsndfile's container name: 'WAV', 'FLAC', 'MP3', 'OGG', ..."""
    subtype: str
    size_bytes: int

    @property
    def duration(self) -> float:
        """Seconds."""
        return self.frames / self.sample_rate if self.sample_rate else 0.0


def _sec(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".") + " s"


def probe_audio(path, *, sample_rate: int = SAMPLE_RATE, max_seconds: Optional[float] = None,
                max_bytes: Optional[int] = None, resample: bool = True,
                min_seconds: float = 0.0) -> AudioInfo:
    """Check an audio file from its header (no decode) and return what the header says.

    Raises :class:`AudioError` when the file is missing, empty, over ``max_bytes``, not a format
    libsndfile can open, has no samples, is shorter than ``min_seconds`` or longer than
    ``max_seconds``, or (with ``resample=False``) is not at ``sample_rate``.
    """
    import soundfile as sf

    p = Path(path)
    if not p.is_file():
        raise AudioError(p, "audio file not found", "fix the path or restore the file", "missing audio")
    size = p.stat().st_size
    if size == 0:
        raise AudioError(p, "the audio file is empty (0 bytes)",
                         "re-export the audio or drop the row", "empty audio")
    if max_bytes is not None and size > max_bytes:
        raise AudioError(p, f"the audio file is {size / MiB:.1f} MiB, over data.max_audio_bytes = "
                         f"{max_bytes / MiB:.1f} MiB",
                         "cut the recording into shorter files or raise data.max_audio_bytes",
                         "audio file too large")
    try:
        info = sf.info(str(p))
        frames, sr, ch, fmt, sub = int(info.frames), int(info.samplerate), int(info.channels), \
            str(info.format), str(info.subtype)
    except Exception as e:   # soundfile.LibsndfileError, RuntimeError on old soundfile versions
        frames, sr, ch, fmt, sub = _librosa_probe(p, e)
    out = AudioInfo(str(p), frames, sr, ch, fmt, sub, size)
    _check_lengths(p, frames, sr, max_seconds=max_seconds, min_seconds=min_seconds, decoded=False)
    if sr != sample_rate and not resample:
        raise AudioError(p, f"the audio is sampled at {sr} Hz, the model needs {sample_rate} Hz "
                         "(and data.resample is false)",
                         f"resample the file (e.g. ffmpeg -i IN -ar {sample_rate} -ac 1 OUT.wav) or "
                         "set data.resample=true", "wrong sample rate")
    return out


def _corrupt(p: Path, e: Exception) -> AudioError:
    return AudioError(p, f"cannot decode the audio ({_err_text(e)})",
                      "check that it is a valid wav/mp3/flac file (e.g. `ffprobe FILE`) and re-export it",
                      "corrupt audio")


def _libsndfile_knows(p: Path) -> bool:
    """Whether this libsndfile build reads files of ``p``'s extension (mp3 needs libsndfile >= 1.1)."""
    import soundfile as sf

    ext = p.suffix.lstrip(".").upper()
    return ext in sf.available_formats() or (ext in ("OGA", "OPUS") and "OGG" in sf.available_formats())


def _librosa_call(fn):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # librosa's "PySoundFile failed. Trying audioread" notice
        return fn()


def _librosa_probe(p: Path, first_error: Exception):
    """libsndfile could not open the file.  If it reads this format, the file is damaged; if not
    (an mp3 on an old libsndfile, an m4a), ask librosa's audioread backends.
    -> (frames, sample_rate, channels, format, subtype)."""
    if _libsndfile_knows(p):
        raise _corrupt(p, first_error) from None
    try:
        import librosa

        sr = int(_librosa_call(lambda: librosa.get_samplerate(str(p))))
        dur = float(_librosa_call(lambda: librosa.get_duration(path=str(p))))
        return int(round(dur * sr)), sr, 1, p.suffix.lstrip(".").upper() or "?", "?"
    except Exception:
        raise _corrupt(p, first_error) from None


def _err_text(e: Exception) -> str:
    msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    # soundfile: "Error opening 'x': Format not recognised." -> keep the reason only
    if msg.startswith("Error opening") and ": " in msg:
        msg = msg.split(": ", 1)[1]
    if "does not exist" in msg:   # libsndfile's mp3 path says this about unreadable data
        msg = "unrecognised or damaged audio data"
    return msg.rstrip(".")


def _check_lengths(p, frames: int, sr: int, *, max_seconds, min_seconds, decoded: bool) -> None:
    if frames <= 0 or sr <= 0:
        raise AudioError(p, f"the audio has no samples ({frames} frames{' after decoding' if decoded else ''})",
                         "re-export the audio or drop the row", "empty audio")
    dur = frames / sr
    if max_seconds is not None and dur > max_seconds:
        raise AudioError(p, f"the audio is {_sec(dur)} long, over data.max_audio_seconds = "
                         f"{_sec(max_seconds)}",
                         "cut it into shorter clips or raise data.max_audio_seconds", "audio too long")
    if dur < min_seconds:
        raise AudioError(p, f"the audio is {_sec(dur)} long, shorter than data.min_audio_seconds = "
                         f"{_sec(min_seconds)}", "drop the row or use a longer clip", "audio too short")


def load_audio(path, *, sample_rate: int = SAMPLE_RATE, max_seconds: Optional[float] = None,
               max_bytes: Optional[int] = None, resample: bool = True,
               min_seconds: float = 0.0) -> np.ndarray:
    """Decode ``path`` -> float32 mono waveform ``[N]`` at ``sample_rate``.

    Runs :func:`probe_audio`'s checks first, then decodes with soundfile (librosa when libsndfile
    cannot open the file), averages channels, resamples with librosa when the file's rate differs
    (``resample=False`` raises instead), and re-checks the decoded length and that every sample is
    finite.  Raises :class:`AudioError` naming the file and the reason.
    """
    import soundfile as sf

    p = Path(path)
    probe_audio(p, sample_rate=sample_rate, max_seconds=max_seconds, max_bytes=max_bytes,
                resample=resample, min_seconds=min_seconds)
    try:
        y, sr = sf.read(str(p), dtype="float32", always_2d=True)
        y = y.mean(axis=1, dtype=np.float32) if y.shape[1] > 1 else y[:, 0]
    except Exception as e:
        if _libsndfile_knows(p):
            raise _corrupt(p, e) from None
        try:
            import librosa

            y, sr = _librosa_call(lambda: librosa.load(str(p), sr=None, mono=True, dtype=np.float32))
        except Exception:
            raise _corrupt(p, e) from None
    sr = int(sr)
    _check_lengths(p, len(y), sr, max_seconds=max_seconds, min_seconds=min_seconds, decoded=True)
    if not np.isfinite(y).all():
        raise AudioError(p, "the audio holds non-finite samples (NaN or inf)",
                         "re-export the audio", "corrupt audio")
    if sr != sample_rate:
        if not resample:   # probe_audio checked the header; a decoder may still disagree
            raise AudioError(p, f"the audio is sampled at {sr} Hz, the model needs {sample_rate} Hz "
                             "(and data.resample is false)",
                             f"resample the file (e.g. ffmpeg -i IN -ar {sample_rate} -ac 1 OUT.wav) "
                             "or set data.resample=true", "wrong sample rate")
        y = _resample(y, sr, sample_rate)
    return np.ascontiguousarray(y, dtype=np.float32)


def _resample(y: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """librosa's ``resample(res_type="soxr_hq")``, calling soxr (its backend) directly when it is
    importable: identical samples without librosa's ~2 s import."""
    try:
        import soxr

        return soxr.resample(y, orig_sr, target_sr, quality="soxr_hq")
    except ImportError:
        import librosa

        return librosa.resample(y, orig_sr=orig_sr, target_sr=target_sr, res_type="soxr_hq")


def crop_bounds(num_samples: int, sr: int, start_s: float, end_s: float, *,
                min_seconds: float = 0.0) -> tuple[int, int]:
    """Sample indices ``(i0, i1)`` of ``[start_s, end_s)`` clamped to a clip of ``num_samples``.

    Raises ``ValueError`` (a message meant for the model calling the tool as much as for a person)
    when a bound is not a finite number, ``start_s >= end_s``, the span lies wholly outside the
    clip, or what is left is shorter than ``min_seconds`` (and at least one sample).
    """
    for name, v in (("start_sec", start_s), ("end_sec", end_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
                or not math.isfinite(float(v)):
            raise ValueError(f"{name} must be a finite number of seconds, got {v!r}")
    start_s, end_s = float(start_s), float(end_s)
    if sr <= 0 or num_samples <= 0:
        raise ValueError(f"cannot crop an empty recording ({num_samples} samples at {sr} Hz)")
    total = num_samples / sr
    if start_s >= end_s:
        raise ValueError(f"start_sec ({start_s:g}) must be less than end_sec ({end_s:g})")
    if start_s >= total:
        raise ValueError(f"start_sec ({start_s:g}) is at or past the end of the recording "
                         f"({total:.2f} s long)")
    if end_s <= 0:
        raise ValueError(f"end_sec ({end_s:g}) is at or before the start of the recording (0 s)")
    i0 = min(num_samples, max(0, int(round(max(start_s, 0.0) * sr))))
    i1 = min(num_samples, max(0, int(round(min(end_s, total) * sr))))
    need = max(1, int(math.ceil(min_seconds * sr)))
    if i1 - i0 < need:
        raise ValueError(f"the segment [{start_s:g}, {end_s:g}] s holds {(i1 - i0) / sr:.3f} s of "
                         f"audio; crop at least {max(min_seconds, 1 / sr):g} s")
    return i0, i1


def crop(waveform: np.ndarray, sr: int, start_s: float, end_s: float, *,
         min_seconds: float = 0.0) -> np.ndarray:
    """``waveform[start_s * sr : end_s * sr]`` (rounded to the nearest sample, clamped to the
    clip) as a new float32 array.  See :func:`crop_bounds` for the checks."""
    w = np.asarray(waveform)
    if w.ndim != 1:
        raise ValueError(f"crop needs a mono waveform [N], got shape {tuple(w.shape)}")
    i0, i1 = crop_bounds(len(w), sr, start_s, end_s, min_seconds=min_seconds)
    return np.array(w[i0:i1], dtype=np.float32, copy=True)


def wav_bytes(waveform: np.ndarray, sample_rate: int = SAMPLE_RATE) -> bytes:
    """A lossless float32 mono WAV (IEEE float, little-endian) of ``waveform``: soundfile reads
    back the identical samples, and the same samples always give the same bytes (libsndfile's own
    writer adds a PEAK chunk with a timestamp, which would defeat caches keyed on the bytes)."""
    w = np.asarray(waveform, dtype=np.float32)
    if w.ndim != 1:
        raise ValueError(f"wav_bytes needs a mono waveform [N], got shape {tuple(w.shape)}")
    data = w.astype("<f4", copy=False).tobytes()
    sr = int(sample_rate)
    fmt = struct.pack("<HHIIHHH", 3, 1, sr, sr * 4, 4, 32, 0)        # WAVE_FORMAT_IEEE_FLOAT, cbSize 0
    fact = struct.pack("<I", len(w))
    body = (b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"fact" + struct.pack("<I", 4) + fact
            + b"data" + struct.pack("<I", len(data)) + data)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def audio_data_url(waveform: np.ndarray, sample_rate: int = SAMPLE_RATE) -> str:
    """``data:audio/wav;base64,...`` of :func:`wav_bytes` (vLLM's ``audio_url`` accepts it)."""
    return "data:audio/wav;base64," + base64.b64encode(wav_bytes(waveform, sample_rate)).decode("ascii")


def is_under(path, roots: Iterable) -> bool:
    """Whether ``path`` lies inside one of ``roots``, compared lexically after making both absolute
    and normalising ``..`` (so ``a/../../x`` cannot escape; symlinks inside a root are trusted)."""
    p = os.path.normpath(os.path.abspath(os.fspath(path)))
    for r in roots:
        r = os.path.normpath(os.path.abspath(os.fspath(r)))
        if p == r or p.startswith(r.rstrip(os.sep) + os.sep):
            return True
    return False


def resolve_audio_path(entry: str, base_dir, roots: Optional[Sequence] = None) -> Path:
    """An ``audios`` entry -> absolute normalised path (relative entries against ``base_dir``).

    With ``roots`` (``data.audio_roots``), a path outside every root raises :class:`AudioError`
    (kind "audio outside audio_roots")."""
    raw = Path(entry) if os.path.isabs(entry) else Path(base_dir) / entry
    p = Path(os.path.normpath(os.path.abspath(raw)))
    if roots is not None and not is_under(p, roots):
        shown = ", ".join(str(r) for r in roots) or "(none)"
        raise AudioError(p, f"the audio lies outside data.audio_roots ({shown})",
                         "move it under one of them or add its directory to data.audio_roots",
                         "audio outside audio_roots")
    return p
