"""Row schema of the user's audio-agent JSONL, and the ``[MM:SS - MM:SS]`` span helpers.

One row (one JSON object per line)::

    {"tools": "<JSON string: list of OpenAI-style function specs>",
     "audios": ["audio/0001.mp3"],
     "messages": [{"role": "user", "content": "<audio>\\nWhen does the beep occur? ..."}],
     "ground_truth": "[00:12 - 00:14]"}

``messages`` and ``audios`` are required; ``tools`` (a JSON string of a list, or a list) and
``ground_truth`` are optional; other columns are allowed and ignored here.  Roles are ``system``,
``user``, ``assistant`` or ``tool``; contents are strings.  Every ``<audio>`` tag (only in user
messages) takes the next entry of ``audios`` (so their counts must match); audio paths are
relative to the JSONL file's directory unless absolute.  The audio itself (decodable, length,
size, sample rate) is checked by :mod:`megatron_grpo.data.reader`.

:func:`check_row` raises :class:`DataError` whose message names the file, the line, what is wrong
and how to fix it.  :func:`parse_span` / :func:`format_span` are shared with the rewards.
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

AUDIO_TAG = "<audio>"

# "[MM:SS - MM:SS]"; minutes may have more digits, seconds may carry a fraction, spaces are free.
SPAN_PATTERN = r"\[\s*(\d{1,4}):([0-5]\d(?:\.\d+)?)\s*-\s*(\d{1,4}):([0-5]\d(?:\.\d+)?)\s*\]"
_SPAN_RE = re.compile(SPAN_PATTERN)


class DataError(ValueError):
    """A data row is malformed; the message says which file and line, why, and how to fix it.

    Besides the message it carries its parts: ``path``, ``line`` (1-based line number, or None for
    a whole-file problem), ``kind`` (a short category such as ``"missing audio"`` or ``"malformed
    JSON"``, used to summarise skipped rows), ``reason`` and ``fix``.
    """

    def __init__(self, message: str, *, path: Any = None, line: int | None = None,
                 kind: str = "invalid row", reason: str | None = None, fix: str | None = None):
        super().__init__(message)
        self.path, self.line, self.kind = path, line, kind
        self.reason, self.fix = reason if reason is not None else message, fix


def row_error(path: Any, line_no: int | None, reason: str, fix: str, kind: str) -> DataError:
    """The one message format for a bad row: ``"{path} line {n}: {reason} — {fix}"`` (without the
    line part when ``line_no`` is None)."""
    where = f"{path} line {line_no}" if line_no is not None else f"{path}"
    return DataError(f"{where}: {reason} — {fix}", path=path, line=line_no, kind=kind,
                     reason=reason, fix=fix)


def parse_span(text: str) -> tuple[float, float]:
    """``"[01:05 - 01:20]"`` -> ``(65.0, 80.0)``.  Raises ``ValueError`` on anything else."""
    if not isinstance(text, str):
        raise ValueError(f"time span must be a string like '[01:05 - 01:20]', got {type(text).__name__}")
    m = _SPAN_RE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"not a time span of the form '[MM:SS - MM:SS]': {text!r}")
    start = int(m.group(1)) * 60 + float(m.group(2))
    end = int(m.group(3)) * 60 + float(m.group(4))
    if end < start:
        raise ValueError(f"time span ends before it starts: {text!r}")
    return start, end


def _mmss(sec: int) -> str:
    return f"{sec // 60:02d}:{sec % 60:02d}"


def format_span(start_sec: float, end_sec: float) -> str:
    """``(65, 80)`` -> ``"[01:05 - 01:20]"``; fractional times widen to whole seconds
    (start floored, end ceiled), the rule the ground truth uses."""
    s, e = float(start_sec), float(end_sec)
    if not (math.isfinite(s) and math.isfinite(e)) or s < 0 or e < s:
        raise ValueError(f"need 0 <= start_sec <= end_sec, got ({start_sec}, {end_sec})")
    return f"[{_mmss(math.floor(s))} - {_mmss(math.ceil(e))}]"


def _fail(path: Any, line_no: int, reason: str, fix: str, kind: str = "invalid row") -> DataError:
    return row_error(path, line_no, reason, fix, kind)


def _type_name(v: Any) -> str:
    return {dict: "object", list: "list", str: "string", type(None): "null",
            bool: "boolean", int: "number", float: "number"}.get(type(v), type(v).__name__)


ROLES = ("system", "user", "assistant", "tool")


def _check_tools(tools: Any, path: Any, line_no: int) -> list:
    """-> the tool specs as a list (parsed when given as a JSON string)."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise _fail(path, line_no, f"'tools' is a string but not valid JSON ({e.msg} at char {e.pos})",
                        "write it as json.dumps(list_of_tool_specs)", "tools not JSON") from None
    if not isinstance(tools, list):
        raise _fail(path, line_no, f"'tools' must be a list of tool specs, got {_type_name(tools)}",
                    'use a list such as [{"type": "function", "function": {"name": ...}}]', "bad tools")
    for i, spec in enumerate(tools):
        fn = spec.get("function", spec) if isinstance(spec, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _fail(path, line_no, f"'tools'[{i}] has no function name",
                        'give each spec {"type": "function", "function": {"name": ..., "parameters": ...}}',
                        "bad tools")
    return tools


def parse_tools(tools: Any, *, path: Any = "<row>", line_no: int | None = None) -> list:
    """The row's ``tools`` (a JSON string or a list; absent/None -> ``[]``) as a list of specs,
    validated as :func:`check_row` does."""
    return [] if tools is None else _check_tools(tools, path, line_no)


def check_row(obj: Any, *, path: str | os.PathLike, line_no: int, base_dir: str | os.PathLike) -> None:
    """Validate one parsed row of the user's format; raise :class:`DataError` if it is malformed.

    ``path`` and ``line_no`` only label the message; ``base_dir`` resolves relative audio paths
    (pass the JSONL file's directory).
    """
    if not isinstance(obj, dict):
        raise _fail(path, line_no, f"a row must be a JSON object, got {_type_name(obj)}",
                    'write one object per line: {"messages": [...], "audios": [...], ...}', "not an object")

    if "messages" not in obj:
        raise _fail(path, line_no, "missing 'messages'",
                    'add "messages": [{"role": "user", "content": "<audio>\\n..."}]', "missing key")
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if isinstance(messages, list) else _type_name(messages)
        raise _fail(path, line_no, f"'messages' must be a non-empty list, got {got}",
                    'write "messages": [{"role": "user", "content": "..."}]', "bad messages")
    n_tags = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise _fail(path, line_no, f"messages[{i}] has no 'role'",
                        'each message needs {"role": "user"|"assistant"|"system"|"tool", "content": "..."}',
                        "bad messages")
        if m["role"] not in ROLES:
            raise _fail(path, line_no, f"messages[{i}] has unknown role {m['role']!r}",
                        'use one of "system", "user", "assistant", "tool"', "bad messages")
        if not isinstance(m.get("content"), str):
            raise _fail(path, line_no,
                        f"messages[{i}]['content'] must be a string, got {_type_name(m.get('content'))}",
                        "write the text (with one <audio> tag per audio) as a string", "bad messages")
        k = m["content"].count(AUDIO_TAG)
        if k and m["role"] != "user":
            raise _fail(path, line_no, f"messages[{i}] ({m['role']}) holds an {AUDIO_TAG} tag; audio may "
                        "only be in user messages", f"move the {AUDIO_TAG} tag into a user message",
                        "bad messages")
        n_tags += k

    if "audios" not in obj:
        raise _fail(path, line_no, "missing 'audios'",
                    'add "audios": ["path/to/file.mp3"] with one entry per <audio> tag', "missing key")
    audios = obj["audios"]
    if not isinstance(audios, list) or not all(isinstance(a, str) and a for a in audios):
        raise _fail(path, line_no, f"'audios' must be a list of path strings, got {_type_name(audios)}"
                    + ("" if not isinstance(audios, list) else " with a non-string or empty entry"),
                    'write "audios": ["audio/0001.mp3", ...]', "bad audios")
    if n_tags != len(audios):
        fix = ("add the missing audio path or remove a tag" if n_tags > len(audios)
               else "add an <audio> tag to the message text or remove the extra path")
        raise _fail(path, line_no,
                    f"{n_tags} {AUDIO_TAG} tag{'s' if n_tags != 1 else ''} but {len(audios)} "
                    f"entr{'ies' if len(audios) != 1 else 'y'} in 'audios'", fix,
                    "audio tag count mismatch")
    base = Path(base_dir)
    for a in audios:
        p = Path(a) if os.path.isabs(a) else base / a
        if not p.is_file():
            raise _fail(path, line_no, f"audio file not found: {a!r} (looked at {p})",
                        "fix the path; relative paths are resolved against the JSONL file's directory",
                        "missing audio")

    if "tools" in obj:
        _check_tools(obj["tools"], path, line_no)

    if "ground_truth" in obj:
        gt = obj["ground_truth"]
        try:
            parse_span(gt)
        except ValueError:
            raise _fail(path, line_no, f"'ground_truth' {gt!r} is not a time span",
                        "write it as '[MM:SS - MM:SS]', e.g. '[01:05 - 01:20]', with start <= end",
                        "bad ground_truth") from None
