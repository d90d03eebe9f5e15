"""Read SFT JSONL: conversations with assistant turns (tool calls included) and tool turns whose
audio clips are files or crops of the row's recording.

One row (one JSON object per line; docs/sft.md)::

    {"tools": "<JSON string or list of OpenAI function specs>",
     "audios": ["audio/0001.mp3"],
     "messages": [
       {"role": "user", "content": "<audio>\\nWhen does the beep occur? ..."},
       {"role": "assistant", "content": "<think>...</think>\\n\\n<tool_call>\\n{...}\\n</tool_call>"},
       {"role": "tool", "name": "crop_audio", "content": "Audio from ...:<audio>", "clips": [[10.0, 16.0]]},
       {"role": "assistant", "content": "<think>...</think>\\n\\n[00:12 - 00:14]"}]}

``<audio>`` tags in user messages take the row's ``audios`` in order (as for `mgrpo train`); tags
in a tool message take that message's ``clips`` in order: a path (relative to the JSONL file) or
``[start_sec, end_sec]``, a crop of the row's first recording cut as the ``crop_audio`` tool cuts
it. Assistant messages may carry ``tool_calls`` and ``reasoning_content`` as the chat template
reads them. The conversation ends with an assistant turn. Every other key is kept in ``columns``.

A bad row raises :class:`~megatron_grpo.data.schema.DataError`: ``"FILE line N: FIELD ... — FIX"``.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from megatron_grpo.data.audio import AudioError, crop_bounds, load_audio, probe_audio, resolve_audio_path
from megatron_grpo.data.config import DataConfig
from megatron_grpo.data.reader import PromptDataset, split_audio_tags
from megatron_grpo.data.schema import AUDIO_TAG, ROLES, _type_name, parse_tools, row_error

__all__ = ["SftRow", "read_sft_jsonl", "CROP_MIN_SECONDS"]

CROP_MIN_SECONDS = 0.1
"""Shortest crop a row may ask for (``rollout.crop_min_seconds``' default: what the tool allows)."""


@dataclass(frozen=True)
class SftRow:
    """One validated SFT conversation."""

    prompt_index: int
    """0-based position among the file's rows (the data position refers to it)."""
    messages: list
    """The messages with ``<audio>`` tags as ``{"type": "audio", "audio_index": k}`` parts, ``k``
    counting the conversation's clips in order of appearance (prompt audios, then tool clips)."""
    tools: list
    clips: tuple
    """Every clip of the conversation in order: ``("file", abs_path)`` or ``("crop", start, end)``."""
    audio_paths: tuple
    """The row's ``audios`` (absolute); crops cut ``audio_paths[0]``."""
    columns: dict
    source: str = ""
    line: int = 0

    def load_audios(self, cfg: Optional[DataConfig] = None) -> list[np.ndarray]:
        """The waveforms of :attr:`clips` (float32 mono at ``cfg.sample_rate``), in order."""
        cfg = cfg or DataConfig()
        files: dict[str, np.ndarray] = {}

        def wave(p: str) -> np.ndarray:
            if p not in files:
                try:
                    files[p] = load_audio(p, **cfg.audio_kwargs())
                except AudioError as e:
                    raise row_error(self.source, self.line, f"audio {p!r}: {e.reason}", e.fix, e.kind) from None
            return files[p]

        out = []
        for c in self.clips:
            if c[0] == "file":
                out.append(wave(c[1]))
            else:
                w = wave(self.audio_paths[0])
                i0, i1 = crop_bounds(len(w), cfg.sample_rate, c[1], c[2], min_seconds=CROP_MIN_SECONDS)
                out.append(np.array(w[i0:i1], dtype=np.float32, copy=True))
        return out


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x)


class _Row:
    """Checks one parsed row; each failure names the file, the line and the field."""

    def __init__(self, path: str, line: int, base_dir: Path, cfg: DataConfig, roots):
        self.path, self.line, self.base_dir, self.cfg, self.roots = path, line, base_dir, cfg, roots
        self.durations: dict[str, float] = {}

    def fail(self, reason: str, fix: str, kind: str = "invalid row"):
        return row_error(self.path, self.line, reason, fix, kind)

    def audio(self, entry: Any, field: str) -> str:
        if not isinstance(entry, str) or not entry:
            raise self.fail(f"{field} must be an audio path string, got {json.dumps(entry)}",
                            "write a path relative to the JSONL file (or absolute)", "bad audios")
        try:
            p = resolve_audio_path(entry, self.base_dir, self.roots)
            info = probe_audio(p, **self.cfg.audio_kwargs())
        except AudioError as e:
            raise self.fail(f"{field} {entry!r}: {e.reason}", e.fix, e.kind) from None
        self.durations[str(p)] = info.duration
        return str(p)

    def crop(self, c: Any, field: str, recording: Optional[str]) -> tuple:
        if not (isinstance(c, list) and len(c) == 2 and all(_is_num(x) for x in c)):
            raise self.fail(f"{field} must be a path or [start_sec, end_sec], got {json.dumps(c)}",
                            "write a crop of the recording as two numbers of seconds, e.g. [10.0, 16.0]", "bad clips")
        if recording is None:
            raise self.fail(f"{field} crops the recording but the row has no 'audios'",
                            'add "audios": ["path/to/recording"] or give the clip as a path', "bad clips")
        sr = self.cfg.sample_rate
        n = int(round(self.durations[recording] * sr))
        try:
            crop_bounds(n, sr, c[0], c[1], min_seconds=CROP_MIN_SECONDS)
        except ValueError as e:
            raise self.fail(f"{field} {json.dumps(c)}: {e}",
                            "crop inside the recording, start < end", "bad clips") from None
        return ("crop", float(c[0]), float(c[1]))

    def check(self, obj: Any, prompt_index: int) -> SftRow:
        if not isinstance(obj, dict):
            raise self.fail("a row must be a JSON object", 'write {"messages": [...], "audios": [...]}', "not an object")
        msgs = obj.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise self.fail("'messages' must be a non-empty list", 'write "messages": [{"role": "user", ...}, '
                            '{"role": "assistant", ...}]', "bad messages")
        audios = obj.get("audios", [])
        if not isinstance(audios, list):
            raise self.fail("'audios' must be a list of paths", 'write "audios": ["audio/0001.mp3"]', "bad audios")
        paths = [self.audio(a, f"audios[{i}]") for i, a in enumerate(audios)]
        tools = parse_tools(obj.get("tools"), path=self.path, line_no=self.line)
        out, clips, n_user_tags = [], [], 0
        for i, m in enumerate(msgs):
            f = f"messages[{i}]"
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise self.fail(f"{f} needs a 'role' of {', '.join(ROLES)}", 'write {"role": "assistant", '
                                '"content": "..."}', "bad messages")
            role, content = m["role"], m.get("content")
            if content is None and role == "assistant" and m.get("tool_calls"):
                content = ""  # OpenAI's form of a reply that only calls tools
            if not isinstance(content, str):
                raise self.fail(f"{f}.content must be a string, got {_type_name(content)}",
                                "write the text (with <audio> tags for clips) as a string", "bad messages")
            tags = content.count(AUDIO_TAG)
            m = dict(m, content=content)
            if role == "user":
                if n_user_tags + tags > len(paths):
                    raise self.fail(f"{f} has more {AUDIO_TAG} tags than 'audios' has entries ({len(paths)})",
                                    "add the audio path or remove the tag", "audio tag count mismatch")
                clips += [("file", p) for p in paths[n_user_tags:n_user_tags + tags]]
                n_user_tags += tags
            elif role == "tool":
                given = m.pop("clips", [])
                if not isinstance(given, list) or len(given) != tags:
                    got = len(given) if isinstance(given, list) else json.dumps(given)
                    raise self.fail(f"{f}.clips has {got} entries for {tags} {AUDIO_TAG} tags in its content",
                                    "give one clip (a path or [start_sec, end_sec]) per tag", "bad clips")
                rec = paths[0] if paths else None
                clips += [("file", self.audio(c, f"{f}.clips[{j}]")) if isinstance(c, str)
                          else self.crop(c, f"{f}.clips[{j}]", rec) for j, c in enumerate(given)]
            elif tags:
                raise self.fail(f"{f} ({role}) holds an {AUDIO_TAG} tag", "audio goes into user or tool "
                                "messages", "bad messages")
            if role == "assistant" and "tool_calls" in m and not isinstance(m["tool_calls"], list):
                raise self.fail(f"{f}.tool_calls must be a list", 'write [{"type": "function", "function": '
                                '{"name": ..., "arguments": {...}}}]', "bad messages")
            if tags:
                m["content"], _ = split_audio_tags(content, len(clips) - tags)
            out.append(m)
        if n_user_tags != len(paths):
            raise self.fail(f"{n_user_tags} {AUDIO_TAG} tags in user messages but {len(paths)} entries in 'audios'",
                            "add an <audio> tag or remove the extra path", "audio tag count mismatch")
        if not any(m["role"] == "assistant" for m in out):
            raise self.fail("messages has no assistant turn: nothing to train on",
                            "add the assistant's reply (SFT trains on assistant turns only)", "no assistant turn")
        if out[-1]["role"] != "assistant":
            raise self.fail(f"messages[{len(out) - 1}] ({out[-1]['role']}) comes after the last assistant turn",
                            "end the conversation with an assistant turn", "bad messages")
        columns = {k: v for k, v in obj.items() if k not in ("messages", "audios", "tools")}
        return SftRow(prompt_index=prompt_index, messages=out, tools=tools, clips=tuple(clips),
                      audio_paths=tuple(paths), columns=columns, source=self.path, line=self.line)


def read_sft_jsonl(path, cfg: Optional[DataConfig] = None) -> PromptDataset:
    """Every row of the SFT file ``path`` (checked, audio headers probed) as a dataset of
    :class:`SftRow` (``megatron_grpo.data.reader.DataIterator`` iterates it)."""
    cfg = cfg or DataConfig()
    p = Path(path)
    if not p.is_file():
        raise row_error(path, None, "the SFT data file does not exist", "pass an existing JSONL (sft.data)",
                        "missing file")
    raw = p.read_bytes()
    base = p.resolve().parent
    roots = tuple(cfg.audio_roots) if cfg.audio_roots is not None else (str(base),)
    rows, h = [], hashlib.sha256(raw)
    for line_no, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise row_error(str(path), line_no, f"not valid JSON ({e})", "write each row as one JSON object "
                            "on a single line", "malformed JSON") from None
        rows.append(_Row(str(path), line_no, base, cfg, roots).check(obj, len(rows)))
    if not rows:
        raise row_error(str(path), None, "no rows", "write one conversation per line", "empty file")
    return PromptDataset(path=str(path), rows=rows, num_lines=len(rows), fingerprint=h.hexdigest())
