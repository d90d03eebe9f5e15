"""Tools the policy can call in the multi-turn loop: the registry, hermes-style call parsing, safe
execution, and the built-in ``crop_audio``.

A tool is a name, an OpenAI-style JSON schema of its arguments and a callable (sync or async)
``fn(**arguments, ctx: ToolContext) -> ToolResult | str``.  Calls come from the model's text as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen3's hermes format).

Nothing a tool call does can stop a rollout: malformed JSON, an unknown tool, arguments that do not
fit the schema, a tool that raises or runs past its timeout, a file outside the audio roots: each
becomes a ``ToolResult`` with ``error=True`` whose text ("error: ...") goes into the tool turn, and
the conversation continues (the model may learn from it).

``crop_audio(start_sec, end_sec[, audio_path])`` cuts a segment of the prompt's recording (or of
another file, which must lie under the dataset's audio roots) and returns it as a new audio clip;
seconds are validated and clamped to the recording.  Clips stay in memory (they go into the
trajectory for the trainer's audio tower anyway); nothing is written to disk.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import math
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

__all__ = ["Tool", "ToolCall", "ToolResult", "ToolContext", "ToolRegistry", "ToolRefused",
           "parse_tool_calls", "validate_arguments", "crop_audio", "CROP_AUDIO_SCHEMA",
           "BUILTIN_TOOLS", "format_seconds"]

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
NAME_RE = re.compile(r'"name"\s*:\s*"([^"]+)"')
"""The tool's name in a call body that is not valid JSON."""


class ToolRefused(Exception):
    """A tool refuses the call (e.g. a file outside the audio roots); the message goes to the model."""


@dataclass
class ToolResult:
    """What a tool call gives back: text and/or audio clips for the tool turn."""

    text: str = ""
    audios: list = field(default_factory=list)
    """float32 mono waveforms at the context's sample rate, appended after the text in the tool turn."""
    error: bool = False
    """True when the call failed; ``text`` then starts with "error:"."""


@dataclass
class ToolCall:
    """One parsed ``<tool_call>`` (``error`` set when it could not be parsed)."""

    name: Optional[str]
    arguments: dict
    raw: str
    error: Optional[str] = None


@dataclass
class Tool:
    """A registered tool."""

    name: str
    fn: Callable
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    """JSON schema (object) of the arguments; required keys and basic types are checked."""
    description: str = ""
    timeout_s: Optional[float] = None
    """Per-call timeout; None: the rollout config's tool_timeout_s."""

    def __post_init__(self):
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.\-]*", self.name):
            raise ValueError(f"tool name {self.name!r} must be an identifier-like string")
        if not callable(self.fn):
            raise ValueError(f"tool {self.name!r}: fn must be callable, got {type(self.fn).__name__}")
        if not isinstance(self.parameters, dict) or self.parameters.get("type", "object") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON schema of type 'object'")
        props = self.parameters.get("properties", {})
        if not isinstance(props, dict):
            raise ValueError(f"tool {self.name!r}: parameters.properties must be a mapping")
        req = self.parameters.get("required", [])
        if not isinstance(req, list) or not all(r in props for r in req):
            raise ValueError(f"tool {self.name!r}: parameters.required {req!r} must name properties")
        try:
            sig = inspect.signature(self.fn)
        except (TypeError, ValueError):
            return
        if "ctx" not in sig.parameters and not any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
            raise ValueError(f"tool {self.name!r}: fn must accept a keyword argument `ctx` (the "
                             "ToolContext), e.g. def {0}(start_sec, end_sec, *, ctx)".format(self.name))

    def spec(self) -> dict:
        """The OpenAI function spec (what chat templates render in the system prompt)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass
class ToolContext:
    """What a tool call may use: the prompt's audio, where files may be read, the dataset columns."""

    audios: list
    """The prompt's clips (float32 mono), in order; ``audios[0]`` is "the recording"."""
    audio_paths: Sequence[str] = ()
    """Files the prompt's clips came from (absolute), parallel to ``audios`` (may be empty)."""
    audio_roots: Optional[Sequence[str]] = None
    """Directories files may be read from (``data.audio_roots``); None or empty: no file access
    beyond the prompt's own clips."""
    sample_rate: int = 16000
    columns: dict = field(default_factory=dict)
    """The row's extra columns (``ground_truth``, ``duration_sec``, ...)."""
    config: Any = None
    """The RolloutConfig (crop limits, ...)."""
    state: Any = None
    """The conversation so far (`engine.RolloutState`), read-only by convention."""
    _cache: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def check_path(self, path: str) -> str:
        """``path`` (relative: against the first prompt clip's directory) made absolute; raises
        `ToolRefused` when it is outside every audio root."""
        from megatron_grpo.data.audio import is_under

        if not isinstance(path, str) or not path:
            raise ToolRefused("audio_path must be a non-empty string")
        base = os.path.dirname(self.audio_paths[0]) if self.audio_paths else os.getcwd()
        p = os.path.normpath(os.path.abspath(path if os.path.isabs(path) else os.path.join(base, path)))
        roots = list(self.audio_roots or [])
        if not roots or not is_under(p, roots):
            raise ToolRefused(f"refused: {path!r} lies outside the dataset's audio roots; only the "
                              "recording of this conversation (and files under the audio roots) can be read")
        return p

    def load_audio(self, path: str) -> np.ndarray:
        """Decode a file under the audio roots (cached per conversation)."""
        from megatron_grpo.data.audio import AudioError, load_audio

        p = self.check_path(path)
        with self._lock:
            if p in self._cache:
                return self._cache[p]
        for a, w in zip(self.audio_paths, self.audios):
            if os.path.normpath(os.path.abspath(a)) == p:
                return w
        if not os.path.isfile(p):
            raise ToolRefused(f"no such audio file: {path!r}")
        try:
            w = load_audio(p, sample_rate=self.sample_rate)
        except AudioError as e:
            raise ToolRefused(f"cannot read {path!r}: {e.reason}") from None
        with self._lock:
            self._cache[p] = w
        return w


def format_seconds(sec: float) -> str:
    """``65.25`` -> ``"01:05.25"`` (minutes:seconds, hundredths only when not whole)."""
    m, s = divmod(float(sec), 60.0)
    whole = abs(s - round(s)) < 5e-3
    return f"{int(m):02d}:{int(round(s)):02d}" if whole else f"{int(m):02d}:{s:05.2f}"


# ---------------------------------------------------------------------------------------------
# Parsing and validation
# ---------------------------------------------------------------------------------------------

STRAY_CLOSE_ERROR = ("</tool_call> without an opening <tool_call>: write a call as <tool_call>{\"name\": ..., "
                     "\"arguments\": {...}}</tool_call>")


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` in ``text`` (an unclosed last one too), in order.

    A call whose body is not a JSON object ``{"name": str, "arguments": object}`` comes back with
    ``error`` set (and name if it could be read); ``arguments`` may also be a JSON string of an
    object (some models write that). A ``</tool_call>`` with no ``<tool_call>`` in the text is one
    call with an error too: like an unclosed ``<tool_call>``, the model emitted one of the call's
    two special tokens, so the turn was a call attempt, and the error turn lets it try again
    instead of the garbled text becoming the answer.
    """
    text = text or ""
    if "<tool_call>" not in text and "</tool_call>" in text:
        raw = text[:text.index("</tool_call>")].strip()[-200:]
        name = NAME_RE.search(raw)
        return [ToolCall(name.group(1) if name else None, {}, raw, STRAY_CLOSE_ERROR)]
    calls = []
    for m in TOOL_CALL_RE.finditer(text):
        raw = m.group(1).strip()
        closed = bool(m.group(2))
        if not raw:
            calls.append(ToolCall(None, {}, raw, "empty <tool_call>"))
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            why = f"malformed tool call JSON ({e.msg} at char {e.pos})"
            if not closed:
                why += "; the <tool_call> is not closed by </tool_call>"
            name = NAME_RE.search(raw)
            calls.append(ToolCall(name.group(1) if name else None, {}, raw, why))
            continue
        if not isinstance(obj, dict):
            calls.append(ToolCall(None, {}, raw, "a tool call must be a JSON object with \"name\" and "
                                                 "\"arguments\""))
            continue
        name, args = obj.get("name"), obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                calls.append(ToolCall(name if isinstance(name, str) else None, {}, raw,
                                      f"\"arguments\" is a string but not JSON ({e.msg})"))
                continue
        if not isinstance(name, str) or not name:
            calls.append(ToolCall(None, {}, raw, "the tool call has no \"name\""))
        elif not isinstance(args, dict):
            calls.append(ToolCall(name, {}, raw, "\"arguments\" must be a JSON object"))
        else:
            calls.append(ToolCall(name, args, raw))
    return calls


_JSON_TYPES = {"number": (int, float), "integer": (int,), "string": (str,), "boolean": (bool,),
               "object": (dict,), "array": (list,), "null": (type(None),)}


def validate_arguments(schema: dict, args: dict) -> Optional[str]:
    """Why ``args`` do not fit ``schema`` (required keys, basic JSON types, enums), or None."""
    props = schema.get("properties", {}) or {}
    missing = [k for k in schema.get("required", []) if k not in args]
    if missing:
        return f"missing required argument{'s' if len(missing) > 1 else ''}: {', '.join(missing)}"
    if schema.get("additionalProperties") is False:
        extra = [k for k in args if k not in props]
        if extra:
            return f"unknown argument{'s' if len(extra) > 1 else ''}: {', '.join(extra)}"
    for k, v in args.items():
        spec = props.get(k)
        if not isinstance(spec, dict):
            continue
        types = spec.get("type")
        types = [types] if isinstance(types, str) else (types or [])
        if types:
            ok = False
            for t in types:
                py = _JSON_TYPES.get(t)
                if py is None or (isinstance(v, py) and not (t in ("number", "integer") and isinstance(v, bool))):
                    ok = True
                    break
            if ok and isinstance(v, float) and not math.isfinite(v):
                return f"argument {k!r} must be a finite number, got {v!r}"
            if not ok:
                return f"argument {k!r} must be {' or '.join(types)}, got {json.dumps(v)[:60]}"
        if "enum" in spec and v not in spec["enum"]:
            return f"argument {k!r} must be one of {spec['enum']}, got {json.dumps(v)[:60]}"
    return None


# ---------------------------------------------------------------------------------------------
# Registry and execution
# ---------------------------------------------------------------------------------------------

class ToolRegistry:
    """Tools by name; `execute` runs a parsed call and never raises."""

    def __init__(self, tools: Sequence[Tool] = ()):
        self.tools: dict[str, Tool] = {}
        for t in tools:
            self.add(t)

    def add(self, tool: Tool, *, replace: bool = True) -> None:
        if not replace and tool.name in self.tools:
            raise ValueError(f"tool {tool.name!r} is registered twice")
        self.tools[tool.name] = tool

    def select(self, names: Optional[Sequence[str]]) -> "ToolRegistry":
        """A registry with only ``names`` (None: all); an unknown name raises, listing the known."""
        if names is None:
            return ToolRegistry(self.tools.values())
        unknown = [n for n in names if n not in self.tools]
        if unknown:
            raise ValueError(f"rollout.tools names unknown tool(s) {unknown}; registered: "
                             f"{sorted(self.tools)}")
        return ToolRegistry([self.tools[n] for n in names])

    def __contains__(self, name) -> bool:
        return name in self.tools

    def __len__(self) -> int:
        return len(self.tools)

    def specs(self) -> list[dict]:
        return [t.spec() for t in self.tools.values()]

    async def execute(self, call: ToolCall, ctx: ToolContext, *, timeout_s: float = 60.0) -> ToolResult:
        """Run ``call``; every failure becomes an error `ToolResult` (the rollout continues)."""
        if call.error:
            return _error(f"{call.error}. Write a call as <tool_call>\n{{\"name\": <tool-name>, "
                          f"\"arguments\": <args-json-object>}}\n</tool_call>")
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return _error(f"unknown tool {call.name!r}; available tools: {known}")
        why = validate_arguments(tool.parameters, call.arguments)
        if why:
            return _error(f"{tool.name}: {why}")
        limit = tool.timeout_s or timeout_s
        try:
            if inspect.iscoroutinefunction(tool.fn):
                out = await asyncio.wait_for(tool.fn(**call.arguments, ctx=ctx), timeout=limit)
            else:
                out = await asyncio.wait_for(asyncio.to_thread(tool.fn, **call.arguments, ctx=ctx),
                                             timeout=limit)
                if inspect.isawaitable(out):
                    out = await asyncio.wait_for(out, timeout=limit)
        except ToolRefused as e:
            return _error(f"{tool.name}: {e}")
        except asyncio.TimeoutError:
            return _error(f"{tool.name} did not finish within {limit:g} s")
        except TypeError as e:  # arguments the function does not take
            return _error(f"{tool.name}: bad arguments ({e})")
        except Exception as e:
            return _error(f"{tool.name} failed: {type(e).__name__}: {e}")
        return _as_result(tool.name, out)


def _error(text: str) -> ToolResult:
    return ToolResult(text=f"error: {text}", error=True)


def _as_result(name: str, out) -> ToolResult:
    if isinstance(out, ToolResult):
        res = out
    elif isinstance(out, str):
        res = ToolResult(text=out)
    elif isinstance(out, np.ndarray):
        res = ToolResult(audios=[out])
    elif isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], str):
        res = ToolResult(text=out[0], audios=list(out[1]) if isinstance(out[1], (list, tuple)) else [out[1]])
    elif isinstance(out, (dict, list, int, float, bool)) or out is None:
        res = ToolResult(text=json.dumps(out, ensure_ascii=False))
    else:
        return _error(f"{name} returned a {type(out).__name__}; return a ToolResult, str or waveform")
    for i, a in enumerate(res.audios):
        a = np.asarray(a)
        if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.floating) or not np.isfinite(a).all():
            return _error(f"{name} returned audio {i} that is not a non-empty finite mono float waveform")
        res.audios[i] = np.ascontiguousarray(a, dtype=np.float32)
    return res


# ---------------------------------------------------------------------------------------------
# Built-in crop_audio
# ---------------------------------------------------------------------------------------------

CROP_AUDIO_SCHEMA = {
    "type": "object",
    "properties": {
        "start_sec": {"type": "number", "description": "Start of the segment, in seconds from the "
                                                        "start of the recording (0 or more)."},
        "end_sec": {"type": "number", "description": "End of the segment, in seconds from the start "
                                                      "of the recording (greater than start_sec)."},
        "audio_path": {"type": "string", "description": "Optional: another recording under the "
                                                         "dataset's audio roots (default: this one)."},
    },
    "required": ["start_sec", "end_sec"],
}


def crop_audio(start_sec: float, end_sec: float, audio_path: Optional[str] = None, *,
               ctx: ToolContext) -> ToolResult:
    """Cut ``[start_sec, end_sec)`` out of the recording and return it as a new clip.

    Seconds must be finite numbers with start < end; they are clamped to the recording (the
    response says so).  ``rollout.crop_min_seconds`` / ``crop_max_seconds`` bound the clip.
    ``audio_path`` (optional) reads another file, refused unless under the audio roots.
    """
    from megatron_grpo.data.audio import crop_bounds

    if audio_path is not None:
        wave = ctx.load_audio(audio_path)
    else:
        if not ctx.audios:
            raise ToolRefused("this conversation has no recording to crop")
        if ctx.audio_paths:   # the prompt's own file must be under the roots too (when roots are set)
            if ctx.audio_roots:
                ctx.check_path(ctx.audio_paths[0])
        wave = ctx.audios[0]
    cfg = ctx.config
    min_s = float(getattr(cfg, "crop_min_seconds", 0.1) if cfg is not None else 0.1)
    max_s = getattr(cfg, "crop_max_seconds", None) if cfg is not None else None
    sr = ctx.sample_rate
    total = len(wave) / sr
    try:
        i0, i1 = crop_bounds(len(wave), sr, start_sec, end_sec, min_seconds=min_s)
    except ValueError as e:
        raise ToolRefused(f"{e} (the recording is {total:.2f} s long)") from None
    notes = []
    if float(start_sec) < 0:
        notes.append("start clamped to 0")
    if float(end_sec) > total:
        notes.append(f"end clamped to {format_seconds(total)}, the end of the recording")
    if max_s is not None and (i1 - i0) > int(round(max_s * sr)):
        i1 = i0 + int(round(max_s * sr))
        notes.append(f"cut to the longest allowed clip of {max_s:g} s")
    clip = np.array(wave[i0:i1], dtype=np.float32, copy=True)
    text = (f"Audio from {format_seconds(i0 / sr)} to {format_seconds(i1 / sr)} "
            f"({(i1 - i0) / sr:.2f} s) of the recording" + (f" ({'; '.join(notes)})" if notes else "")
            + ":")
    return ToolResult(text=text, audios=[clip])


BUILTIN_TOOLS = {
    "crop_audio": Tool(name="crop_audio", fn=crop_audio, parameters=CROP_AUDIO_SCHEMA,
                       description="Cut the segment between start_sec and end_sec out of the original "
                                   "recording and return it as a new audio clip."),
}
