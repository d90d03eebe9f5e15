"""Typed config trees: dataclasses <- YAML + dotted CLI overrides, with errors that name the key.

A config tree is a dataclass whose fields are scalars, lists, dicts or further dataclasses; each
field carries its documentation as a string literal right below it (read here with `ast`, so
docs/configuration.md is generated from the same text). Checks live in each `__post_init__`.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

import yaml


class ConfigKeyError(ValueError):
    """A config key that does not exist or a value of the wrong type; the message names the key."""


def _is_dataclass_type(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML value to the annotated type (only the conversions a user would expect)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigKeyError as e:
                errors.append(str(e))
        if len(errors) == 1:  # Optional[X]: X's own message says more than the Union
            raise ConfigKeyError(errors[0])
        raise ConfigKeyError(f"{key}: {value!r} fits none of {tp}")
    if _is_dataclass_type(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigKeyError(f"{key}: expected a mapping for section {tp.__name__}, got {value!r}")
        return from_dict(tp, value, prefix=key)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            hint = f" (one item: [{value}])" if isinstance(value, (str, int, float)) else ""
            raise ConfigKeyError(f"{key}: expected a list, got {value!r}{hint}")
        args = typing.get_args(tp)
        inner = args[0] if args else Any
        items = [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigKeyError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigKeyError(f"{key}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigKeyError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigKeyError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads "1e-6" as a string
            except ValueError:
                pass
        raise ConfigKeyError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, Path)):
            return str(value)
        raise ConfigKeyError(f"{key}: expected a string, got {value!r}")
    return value


def from_dict(cls, data: dict, prefix: str = ""):
    """Build dataclass `cls` from a nested dict; unknown keys raise ConfigKeyError naming them."""
    if not isinstance(data, dict):
        raise ConfigKeyError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = _hints(cls)
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in fields:
            close = difflib.get_close_matches(str(k), list(fields), n=1)
            hint = f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)" if close else ""
            raise ConfigKeyError(f"unknown config key '{key}'{hint}; valid keys here: {sorted(fields)}")
        kwargs[k] = _coerce(v, hints[k], key)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigKeyError):
            raise
        raise ConfigKeyError(f"{prefix or 'config'}: {e}") from e


def to_dict(obj) -> Any:
    """Plain nested dict/list form of a config tree (YAML-serialisable)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested dict, in place."""
    for item in overrides:
        if "=" not in item:
            raise ConfigKeyError(f"override {item!r} is not of the form dotted.key=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigKeyError(f"override {item!r} has an empty key part")
        node = data
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigKeyError(f"override {item!r}: '{p}' is a value, not a section")
            node = nxt
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    return data


def load_config(cls, path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict | None = None):
    """base dict <- YAML file <- dotted overrides, then typed and checked as `cls`."""
    data = to_dict(base) if dataclasses.is_dataclass(base) else dict(base or {})
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigKeyError(f"config file {p} not found")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:  # one line naming the file and the place, not PyYAML's traceback
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ConfigKeyError(f"config file {p} is not valid YAML{where}: "
                                 f"{getattr(e, 'problem', None) or e}") from None
        if not isinstance(loaded, dict):
            raise ConfigKeyError(f"config file {p} must hold a mapping at the top level")
        _deep_update(data, loaded)
    apply_overrides(data, list(overrides or []))
    return from_dict(cls, data)


def _deep_update(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_update(dst[k], v)
        else:
            dst[k] = v


def field_docs(cls) -> dict[str, str]:
    """{field name: docstring} from the string literals placed right after each field."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for a, b in zip(body, body[1:]):
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and \
                    isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str):
                docs[a.target.id] = " ".join(b.value.value.split())
    return docs


def render_markdown(cls, title: str) -> str:
    """docs/configuration.md text for a config tree: one table per section."""
    out = [f"# {title}", "", "Generated from the config dataclasses' field docstrings "
           "(`python -m megatron_grpo.config --docs`). Set a key in YAML or as `dotted.key=value` "
           "on the command line.", ""]

    def section(klass, prefix: str, obj):
        docs = field_docs(klass)
        hints = _hints(klass)
        rows, subs = [], []
        for f in dataclasses.fields(klass):
            if not f.init:
                continue
            key = f"{prefix}{f.name}"
            if _is_dataclass_type(hints[f.name]):
                subs.append((hints[f.name], key + ".", getattr(obj, f.name)))
                continue
            default = getattr(obj, f.name)
            shown = yaml.safe_dump(to_dict(default), default_flow_style=True).strip()
            shown = shown.removesuffix("...").strip()  # YAML's document-end marker for scalars
            rows.append(f"| `{key}` | `{shown}` | "
                        f"{docs.get(f.name, '').replace('|', '/')} |")
        if rows:
            out.extend([f"## `{prefix.rstrip('.') or 'top level'}` ({klass.__name__})", "",
                        " ".join((inspect.getdoc(klass) or "").split("\n\n")[0].split()), "",
                        "| key | default | meaning |", "| --- | --- | --- |", *rows, ""])
        for sub in subs:
            section(*sub)

    section(cls, "", cls())
    return "\n".join(out)
