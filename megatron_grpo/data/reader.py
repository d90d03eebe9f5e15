"""Read the user's JSONL into :class:`PromptRow` objects, and iterate over them in seeded epochs.

Input (docs/data.md): one JSON object per line with ``messages`` (OpenAI-style, string contents,
``<audio>`` tags in user messages), ``audios`` (one wav/mp3/flac path per tag, in order; relative
to the JSONL file or absolute, inside ``data.audio_roots``), optional ``tools`` (a JSON string or a
list) and any extra columns (``ground_truth``, ``id``, ...), which are passed through to rewards.

Reading checks every row (:func:`megatron_grpo.data.schema.check_row`) and every clip's header
(:func:`megatron_grpo.data.audio.probe_audio`; with ``data.audio_check="decode"`` also a full
decode).  A bad row raises :class:`DataError` naming the file, the line, the reason and a fix;
with ``data.skip_bad_rows`` it is skipped and counted instead, and the dataset's
:meth:`PromptDataset.summary` says how many rows were skipped and why.  Blank lines are ignored.
Audio is decoded when it is needed: :meth:`PromptRow.load_audios`.

Message representation.  In ``PromptRow.messages`` a message whose content holds ``<audio>`` tags
gets a list of OpenAI content parts: the text around the tags as ``{"type": "text", "text": ...}``
(verbatim, newlines kept, empty pieces dropped) and each tag as ``{"type": "audio", "audio_index":
i}``, ``i`` indexing ``PromptRow.audio_paths`` (and the list :meth:`PromptRow.load_audios`
returns).  Other messages keep their string content.  Qwen3-Omni's chat template renders an
``{"type": "audio", ...}`` part as ``<|audio_start|><|audio_pad|><|audio_end|>`` in place of the
tag.  :func:`map_audio_parts` turns the parts into what a consumer needs:
:meth:`PromptRow.openai_messages` gives vLLM ``audio_url`` (or ``input_audio``) parts carrying the
decoded waveform as a lossless float32 WAV data URL; :meth:`PromptRow.hf_messages` gives
transformers' ``{"type": "audio", "audio": waveform}``.

Iteration.  :class:`DataIterator` yields batches of ``batch_size`` prompts from an endless stream:
epoch ``e`` visits every row once, in the permutation ``default_rng(SeedSequence([seed, e]))``
(file order when ``shuffle`` is off); a batch that reaches the end of an epoch continues with the
next one.  ``state_dict()`` is the position ``(epoch, index)`` of the next prompt (plus the seed
and a fingerprint of the data); ``load_state_dict`` restores it, so a resumed run sees exactly the
prompts an uninterrupted run would have seen.
"""
from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from megatron_grpo.data.audio import (AudioError, AudioInfo, audio_data_url, load_audio,
                                      probe_audio, resolve_audio_path)
from megatron_grpo.data.config import DataConfig
from megatron_grpo.data.schema import AUDIO_TAG, DataError, check_row, parse_span, parse_tools, row_error

log = logging.getLogger("megatron_grpo.data")

__all__ = ["PromptRow", "PromptDataset", "SkippedRow", "DataIterator", "read_jsonl",
           "split_audio_tags", "map_audio_parts", "RESERVED_KEYS"]

RESERVED_KEYS = ("messages", "audios", "tools")
"""Row keys the reader consumes; every other key is passed through in ``PromptRow.columns``."""
_MAX_LOGGED_SKIPS = 20
_NAMED_SKIPS = 3
"""Bad rows a file without any good row names in its error, line and reason each."""
SPAN_SLACK_S = 1.0
"""How far a ``ground_truth`` span may end past the row's longest recording: spans are written in
whole seconds, and an mp3 header's length is an estimate."""


# ---------------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------------

def split_audio_tags(text: str, first_index: int = 0) -> tuple[list[dict], int]:
    """``"<audio>\\nWhen?"`` -> ``([{"type": "audio", "audio_index": first_index},
    {"type": "text", "text": "\\nWhen?"}], first_index + 1)``: the content parts of ``text`` and
    the next free audio index.  Text pieces are kept verbatim; empty ones are dropped."""
    parts: list[dict] = []
    pieces = text.split(AUDIO_TAG)
    k = first_index
    for j, piece in enumerate(pieces):
        if piece:
            parts.append({"type": "text", "text": piece})
        if j < len(pieces) - 1:
            parts.append({"type": "audio", "audio_index": k})
            k += 1
    return parts, k


def _convert_messages(messages: list[dict]) -> list[dict]:
    out, k = [], 0
    for m in messages:
        m = dict(m)
        if AUDIO_TAG in m["content"]:
            m["content"], k = split_audio_tags(m["content"], k)
        out.append(m)
    return out


def map_audio_parts(messages: Sequence[dict], fn: Callable[[int], dict]) -> list[dict]:
    """A copy of ``messages`` where every ``{"type": "audio", "audio_index": i}`` part is replaced
    by ``fn(i)``; everything else is copied unchanged."""
    def part(p):
        if isinstance(p, dict) and p.get("type") == "audio" and "audio_index" in p:
            return fn(int(p["audio_index"]))
        return dict(p) if isinstance(p, dict) else p

    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), list):
            m["content"] = [part(p) for p in m["content"]]
        out.append(m)
    return out


# ---------------------------------------------------------------------------------------------
# Rows and datasets
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PromptRow:
    """One prompt of the dataset, validated."""

    prompt_index: int
    """0-based position among the dataset's good rows (file order); the data position, rollout
    grouping and :class:`~megatron_grpo.trajectory.Trajectory.prompt_index` refer to it."""
    messages: list
    """OpenAI chat messages; ``<audio>`` tags became ``{"type": "audio", "audio_index": i}``
    content parts (see the module docstring)."""
    tools: list
    """Tool specs (OpenAI function format), parsed; ``[]`` when the row has none."""
    audio_paths: tuple
    """Absolute, normalised paths of the row's clips, in tag order (``audio_index`` order)."""
    columns: dict
    """Every other column of the row (``ground_truth``, ``id``, ...), unchanged."""
    source: str = ""
    """The JSONL file the row came from (as given to :func:`read_jsonl`)."""
    line: int = 0
    """1-based line number in ``source``."""
    audio_info: tuple[AudioInfo, ...] = ()
    """:class:`~megatron_grpo.data.audio.AudioInfo` of each clip (from its header)."""
    audio_entries: tuple = ()
    """The ``audios`` entries as written in the row (error messages quote them)."""

    @property
    def num_audios(self) -> int:
        return len(self.audio_paths)

    @property
    def where(self) -> str:
        return f"{self.source} line {self.line}"

    def load_audios(self, cfg: Optional[DataConfig] = None) -> list[np.ndarray]:
        """Decode every clip -> float32 mono waveforms at ``cfg.sample_rate`` (16 kHz), in
        ``audio_index`` order.  A failure raises :class:`DataError` naming this row."""
        return [self.load_audio(i, cfg) for i in range(len(self.audio_paths))]

    def load_audio(self, i: int, cfg: Optional[DataConfig] = None) -> np.ndarray:
        cfg = cfg or DataConfig()
        try:
            return load_audio(self.audio_paths[i], **cfg.audio_kwargs())
        except AudioError as e:
            entry = self.audio_entries[i] if i < len(self.audio_entries) else self.audio_paths[i]
            raise _audio_row_error(self.source, self.line, entry, e) from None

    def openai_messages(self, waveforms: Sequence[np.ndarray], *, sample_rate: int = 16000,
                        part: str = "audio_url") -> list[dict]:
        """Messages for vLLM's chat API: audio parts become ``{"type": "audio_url", "audio_url":
        {"url": "data:audio/wav;base64,..."}}`` (``part="input_audio"``: ``{"type":
        "input_audio", "input_audio": {"data": <base64>, "format": "wav"}}``) holding
        ``waveforms[i]`` as a float32 WAV, so vLLM decodes exactly these samples."""
        if len(waveforms) != len(self.audio_paths):
            raise ValueError(f"{self.where}: {len(waveforms)} waveforms for {len(self.audio_paths)} clips")
        return map_audio_parts(self.messages, lambda i: _vllm_audio_part(waveforms[i], sample_rate, part))

    def hf_messages(self, waveforms: Sequence[np.ndarray]) -> list[dict]:
        """Messages for transformers' ``processor.apply_chat_template``: audio parts become
        ``{"type": "audio", "audio": waveforms[i]}``."""
        return map_audio_parts(self.messages, lambda i: {"type": "audio", "audio": waveforms[i]})


def _vllm_audio_part(w: np.ndarray, sr: int, part: str) -> dict:
    url = audio_data_url(w, sr)
    if part == "audio_url":
        return {"type": "audio_url", "audio_url": {"url": url}}
    if part == "input_audio":
        return {"type": "input_audio", "input_audio": {"data": url.split(",", 1)[1], "format": "wav"}}
    raise ValueError(f"part must be 'audio_url' or 'input_audio', got {part!r}")


@dataclass(frozen=True)
class SkippedRow:
    """A bad row that ``skip_bad_rows`` skipped."""

    line: int
    kind: str
    message: str
    reason: str = ""
    """The message's reason alone (no file, line or fix)."""


@dataclass
class PromptDataset(Sequence):
    """The good rows of one JSONL file (a ``Sequence`` of :class:`PromptRow`)."""

    path: str
    rows: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    """:class:`SkippedRow` of every bad row (only with ``skip_bad_rows``)."""
    num_lines: int = 0
    """Non-blank lines of the file (good + skipped rows)."""
    fingerprint: str = ""
    """sha256 of the file's bytes and of the kept line numbers (resume checks it)."""

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def __iter__(self) -> Iterator[PromptRow]:
        return iter(self.rows)

    def skip_counts(self) -> dict[str, int]:
        """kind -> number of skipped rows, most frequent first (ties by name)."""
        c = collections.Counter(s.kind for s in self.skipped)
        return dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))

    def summary(self) -> str:
        """``"skipped 3 of 200 rows: 2 missing audio, 1 malformed JSON"`` or
        ``"read 200 rows, none skipped"``."""
        if not self.skipped:
            return f"read {len(self.rows)} rows, none skipped"
        reasons = ", ".join(f"{n} {k}" for k, n in self.skip_counts().items())
        return f"skipped {len(self.skipped)} of {self.num_lines} rows: {reasons}"


def _audio_row_error(path, line_no: int, entry, e: AudioError) -> DataError:
    return row_error(path, line_no, f"audio {os.fspath(entry)!r}: {e.reason}", e.fix, e.kind)


def _parse_line(raw: bytes, line_no: int, path: str, base_dir: Path, cfg: DataConfig,
                roots: Sequence[str], prompt_index: int) -> Optional[PromptRow]:
    """One line -> PromptRow (None for a blank line); DataError when it is bad."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise row_error(path, line_no, f"the line is not valid UTF-8 (byte 0x{raw[e.start]:02x} at "
                        f"column {e.start + 1})",
                        "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 IN > OUT)", "not UTF-8") from None
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise row_error(path, line_no, f"not valid JSON ({e.msg} at column {e.colno})",
                        "write each row as one complete JSON object on a single line",
                        "malformed JSON") from None
    check_row(obj, path=path, line_no=line_no, base_dir=base_dir)
    tools = parse_tools(obj.get("tools"), path=path, line_no=line_no)
    paths, infos = [], []
    for entry in obj["audios"]:
        try:
            p = resolve_audio_path(entry, base_dir, roots)
            infos.append(probe_audio(p, **cfg.audio_kwargs()))
            if cfg.audio_check == "decode":
                load_audio(p, **cfg.audio_kwargs())
        except AudioError as e:
            raise _audio_row_error(path, line_no, entry, e) from None
        paths.append(str(p))
    if "ground_truth" in obj and infos:  # its format is checked by check_row
        end, longest = parse_span(obj["ground_truth"])[1], max(i.duration for i in infos)
        if end > longest + SPAN_SLACK_S:
            raise row_error(path, line_no, f"'ground_truth' {obj['ground_truth']!r} ends at {end:g} s, after the "
                            f"recording ends ({longest:.1f} s)",
                            "fix the span, or the audio file the row names", "bad ground_truth")
    columns = {k: v for k, v in obj.items() if k not in RESERVED_KEYS}
    return PromptRow(prompt_index=prompt_index, messages=_convert_messages(obj["messages"]),
                     tools=tools, audio_paths=tuple(paths), columns=columns, source=path,
                     line=line_no, audio_info=tuple(infos), audio_entries=tuple(obj["audios"]))


def read_jsonl(path, cfg: Optional[DataConfig] = None, *, log_skips: bool = True) -> PromptDataset:
    """Read and check every row of ``path``.

    ``cfg`` (default ``DataConfig()``): audio limits, ``skip_bad_rows``, ``audio_check`` and
    ``allowed_audio_roots`` (when that is empty, i.e. neither ``audio_roots`` nor
    ``train_jsonl``/``dev_jsonl`` is set, the directory of ``path`` is the root).  Raises :class:`DataError` on the first bad row, or, with
    ``skip_bad_rows``, only when no row is good; skipped rows are logged (warning; not with
    ``log_skips=False``: a check before the run, which reads the file again) and counted in the
    returned dataset."""
    cfg = cfg or DataConfig()
    spath = os.fspath(path)
    p = Path(spath)
    if not p.is_file():
        raise DataError(f"{spath}: file not found — check the path (data.train_jsonl / data.dev_jsonl)",
                        path=spath, kind="missing file", reason="file not found")
    roots = cfg.allowed_audio_roots or (os.path.dirname(os.path.abspath(spath)),)
    data = p.read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    base_dir = Path(os.path.dirname(os.path.abspath(spath)))
    ds = PromptDataset(path=spath)
    h = hashlib.sha256(data)
    for line_no, raw in enumerate(data.split(b"\n"), start=1):
        raw = raw.rstrip(b"\r")
        if not raw.strip():
            continue
        ds.num_lines += 1
        try:
            row = _parse_line(raw, line_no, spath, base_dir, cfg, roots, len(ds.rows))
        except DataError as e:
            if not cfg.skip_bad_rows:
                raise
            ds.skipped.append(SkippedRow(line_no, e.kind, str(e), e.reason))
            if log_skips and len(ds.skipped) <= _MAX_LOGGED_SKIPS:
                log.warning("skipping bad row: %s", e)
            continue
        if row is not None:
            ds.rows.append(row)
            h.update(line_no.to_bytes(8, "little"))
    ds.fingerprint = h.hexdigest()
    if ds.num_lines == 0:
        raise DataError(f"{spath}: the file has no rows — write one JSON object per line",
                        path=spath, kind="empty file", reason="the file has no rows")
    if not ds.rows:  # the rows themselves, as the check before a run logs none
        named = "; ".join(f"line {s.line}: {s.reason}" for s in ds.skipped[:_NAMED_SKIPS])
        more = len(ds.skipped) - _NAMED_SKIPS
        raise DataError(f"{spath}: no usable rows ({ds.summary()}): {named}"
                        + (f"; and {more} more" if more > 0 else "")
                        + " — fix these rows (data.skip_bad_rows=false stops at the first one and says how)",
                        path=spath, kind="no usable rows", reason=ds.summary())
    if ds.skipped and log_skips:
        more = len(ds.skipped) - _MAX_LOGGED_SKIPS
        log.warning("%s: %s%s", spath, ds.summary(),
                    f" ({more} more skipped rows not logged one by one)" if more > 0 else "")
    return ds


# ---------------------------------------------------------------------------------------------
# Iteration
# ---------------------------------------------------------------------------------------------

class DataIterator:
    """Endless, seeded, resumable stream of prompt batches over a :class:`PromptDataset`."""

    def __init__(self, dataset: PromptDataset, batch_size: int, *, shuffle: bool = True, seed: int = 0):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if len(dataset) == 0:
            raise ValueError(f"{dataset.path}: cannot iterate over a dataset without rows")
        self.dataset, self.batch_size = dataset, batch_size
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.epoch, self.index = 0, 0
        self._order_epoch, self._order = -1, np.arange(0)

    @classmethod
    def from_config(cls, dataset: PromptDataset, cfg: DataConfig, batch_size: int) -> "DataIterator":
        return cls(dataset, batch_size, shuffle=cfg.shuffle, seed=cfg.seed)

    def order(self, epoch: int) -> np.ndarray:
        """Row indices in the order epoch ``epoch`` visits them."""
        if epoch != self._order_epoch:
            n = len(self.dataset)
            self._order = (np.random.default_rng(np.random.SeedSequence([self.seed, epoch])).permutation(n)
                           if self.shuffle else np.arange(n))
            self._order_epoch = epoch
        return self._order

    def next_batch(self) -> list[PromptRow]:
        """The next ``batch_size`` prompts (crossing into the next epoch when one ends)."""
        out = []
        while len(out) < self.batch_size:
            order = self.order(self.epoch)
            take = min(self.batch_size - len(out), len(order) - self.index)
            out.extend(self.dataset.rows[int(i)] for i in order[self.index:self.index + take])
            self.index += take
            if self.index == len(order):
                self.epoch, self.index = self.epoch + 1, 0
        return out

    def __iter__(self) -> "DataIterator":
        return self

    def __next__(self) -> list[PromptRow]:
        return self.next_batch()

    @property
    def consumed(self) -> int:
        """Prompts handed out so far."""
        return self.epoch * len(self.dataset) + self.index

    def state_dict(self) -> dict[str, Any]:
        """The position of the next prompt, and what it is only valid for."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "shuffle": self.shuffle,
                "num_rows": len(self.dataset), "fingerprint": self.dataset.fingerprint}

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Continue at a saved position.  ``strict`` (default) refuses a position saved for other
        data (rows, file contents) or another seed/shuffle setting, since it would not resume the
        same stream; ``strict=False`` takes the position anyway (clamped to the data)."""
        problems = []
        for key, mine in (("num_rows", len(self.dataset)), ("fingerprint", self.dataset.fingerprint),
                          ("seed", self.seed), ("shuffle", self.shuffle)):
            if key in state and state[key] != mine:
                problems.append(f"{key} {state[key]!r} (now {mine!r})")
        if problems and strict:
            raise ValueError(f"{self.dataset.path}: the saved data position does not fit this data: "
                             f"saved with {', '.join(problems)} — restore the original file/settings, or "
                             "load with strict=False to continue at the saved position anyway")
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or index < 0:
            raise ValueError(f"bad data position epoch={epoch}, index={index}")
        if index >= len(self.dataset):
            if strict:
                raise ValueError(f"data position index {index} is past the {len(self.dataset)} rows")
            epoch, index = epoch + 1, 0
        self.epoch, self.index = epoch, index
