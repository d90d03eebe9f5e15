"""``data.*``: where the prompts and their audio come from and what audio is accepted."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal, Optional

MiB = 1 << 20
MODEL_MAX_AUDIO_SECONDS = 2400.0
"""Qwen3-Omni's audio limit: recordings up to 40 minutes."""

__all__ = ["DataConfig"]


@dataclass
class DataConfig:
    """The data section of the run config (docs/data.md).  Checked on construction."""

    train_jsonl: Optional[str] = None
    """The training prompts: one JSON object per line (``messages`` with ``<audio>`` tags,
    ``audios``, optional ``tools`` and extra columns such as ``ground_truth``). Unset: the embedded
    synthetic audio-agent data (built into $MGRPO_CACHE; `mgrpo train` names the file it trains on)."""
    dev_jsonl: Optional[str] = None
    """Optional held-out prompts in the same format (evaluation only)."""
    max_audio_seconds: float = MODEL_MAX_AUDIO_SECONDS
    """Longest clip accepted, in seconds; a longer one is a bad row.  Default: the model's limit,
    40 minutes for Qwen3-Omni.  The local vLLM server's decode limit
    (``VLLM_MAX_AUDIO_DECODE_DURATION_S``, 600 s in vLLM) is raised to the data's longest clip."""
    min_audio_seconds: float = 0.1
    """Shortest clip accepted, in seconds (0.1 s = 10 mel frames = 2 audio tokens; a clip of 160
    samples or fewer cannot even be featurised on its own)."""
    max_audio_bytes: int = 200 * MiB
    """Largest audio file accepted, in bytes (checked before decoding)."""
    sample_rate: int = 16000
    """Rate the model's feature extractor needs; every clip is delivered at this rate."""
    resample: bool = True
    """Resample clips at another rate with librosa (soxr, high quality).  False: such a clip is a
    bad row with a clear error."""
    skip_bad_rows: bool = False
    """False: the first bad row stops the run with the full message (file, line, reason, fix).
    True: bad rows are skipped, counted and reported ("skipped 3 of 200 rows: 2 missing audio,
    1 malformed JSON"); a file with no good row is still an error."""
    audio_check: Literal["header", "decode"] = "header"
    """How much of each clip the reader checks up front.  "header": the file's header only
    (exists, size, format, length, sample rate; well under a millisecond per file, even for mp3);
    clips are decoded when first needed.  "decode": also decode every clip once while reading
    (catches damaged payloads behind a good header; about 10-50 ms per minute of mp3)."""
    audio_roots: Optional[list[str]] = None
    """Directories audio may be read from; an ``audios`` entry (or a tool's file) outside all of
    them is refused.  Unset (None): the directories holding ``train_jsonl`` and ``dev_jsonl``
    (see ``allowed_audio_roots``).  Set it (e.g. ``["/data/audio"]``) when rows use absolute paths
    elsewhere; ``["/"]`` allows any path."""
    shuffle: bool = True
    """Visit the prompts in a new seeded permutation every epoch (False: file order)."""
    seed: int = 0
    """Seed of the epoch permutations: epoch e uses ``SeedSequence([seed, e])``."""

    def __post_init__(self):
        for name in ("train_jsonl", "dev_jsonl"):
            v = getattr(self, name)
            if v is not None:
                if not isinstance(v, (str, os.PathLike)) or not os.fspath(v):
                    raise ValueError(f"data.{name} must be a path to a .jsonl file, got {v!r}")
                setattr(self, name, os.fspath(v))
        for name in ("max_audio_seconds", "min_audio_seconds"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v == v or v < 0:
                raise ValueError(f"data.{name} must be a number of seconds >= 0, got {v!r}")
        if self.max_audio_seconds <= 0:
            raise ValueError(f"data.max_audio_seconds must be > 0, got {self.max_audio_seconds!r}")
        if self.min_audio_seconds > self.max_audio_seconds:
            raise ValueError(f"data.min_audio_seconds ({self.min_audio_seconds}) must not exceed "
                             f"data.max_audio_seconds ({self.max_audio_seconds})")
        if isinstance(self.max_audio_bytes, bool) or not isinstance(self.max_audio_bytes, int) \
                or self.max_audio_bytes <= 0:
            raise ValueError(f"data.max_audio_bytes must be a positive int (bytes), got {self.max_audio_bytes!r}")
        if isinstance(self.sample_rate, bool) or not isinstance(self.sample_rate, int) or self.sample_rate <= 0:
            raise ValueError(f"data.sample_rate must be a positive int (Hz), got {self.sample_rate!r}")
        for name in ("resample", "skip_bad_rows", "shuffle"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"data.{name} must be true or false, got {getattr(self, name)!r}")
        if self.audio_check not in ("header", "decode"):
            raise ValueError(f"data.audio_check must be 'header' or 'decode', got {self.audio_check!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"data.seed must be an int >= 0, got {self.seed!r}")
        if self.audio_roots is not None:
            if isinstance(self.audio_roots, (str, os.PathLike)):
                raise ValueError(f"data.audio_roots must be a list of directories, got the single "
                                 f"string {self.audio_roots!r}; write [{os.fspath(self.audio_roots)!r}]")
            roots = list(self.audio_roots)
            if not roots:
                raise ValueError("data.audio_roots is empty: name at least one directory "
                                 "(['/'] allows any path), or leave it unset for the dataset's directory")
            for r in roots:
                if not isinstance(r, (str, os.PathLike)) or not os.fspath(r):
                    raise ValueError(f"data.audio_roots entries must be directory paths, got {r!r}")
            self.audio_roots = _norm_dirs(roots)

    @property
    def allowed_audio_roots(self) -> tuple[str, ...]:
        """The directories audio may be read from (absolute, normalised): ``audio_roots`` when set,
        else the directories of ``train_jsonl`` and ``dev_jsonl`` (empty when neither is set)."""
        if self.audio_roots is not None:
            return tuple(self.audio_roots)
        return tuple(_norm_dirs([os.path.dirname(os.path.abspath(p))
                                 for p in (self.train_jsonl, self.dev_jsonl) if p]))

    def audio_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`megatron_grpo.data.audio.load_audio` / ``probe_audio``."""
        return dict(sample_rate=self.sample_rate, max_seconds=self.max_audio_seconds,
                    max_bytes=self.max_audio_bytes, resample=self.resample,
                    min_seconds=self.min_audio_seconds)


def _norm_dirs(dirs) -> list[str]:
    out: list[str] = []
    for r in dirs:
        r = os.path.normpath(os.path.abspath(os.fspath(r)))
        if r not in out:
            out.append(r)
    return out
