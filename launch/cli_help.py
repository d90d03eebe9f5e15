"""The help formatter every `mgrpo` parser uses, descriptions from module docstrings, and the
check of an output path (a leaf: the standard library only, so any CLI module can import it)."""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Optional

__all__ = ["DefaultsHelpFormatter", "doc_description", "show_defaults", "file_in_the_way"]


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """argparse's help, with an option's default in its help line where the help does not already
    say it (a None, False or empty-string default says nothing)."""

    def _get_help_string(self, action):
        text = action.help or ""
        silent = action.default is None or action.default is False or action.default == "" or \
            action.default == argparse.SUPPRESS  # not 0
        if "default" not in text and not silent and action.option_strings:
            text += " (default: %(default)s)"
        return text


def doc_description(doc: str, paragraphs: tuple[int, ...] = (0,)) -> str:
    """A parser's description from a module docstring: the given paragraphs (default the first)
    as one paragraph for the formatter to wrap, with reST's ``x`` and :role:`x` written `x`."""
    blocks = doc.split("\n\n")
    text = " ".join(" ".join(blocks[i] for i in paragraphs).split())
    return re.sub(r"``(.+?)``", r"`\1`", re.sub(r":[\w:.]+:`", "`", text))


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every subcommand's parser (nested ones too) left with argparse's plain formatter gets
    :class:`DefaultsHelpFormatter`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                if child.formatter_class is argparse.HelpFormatter:
                    child.formatter_class = DefaultsHelpFormatter
                show_defaults(child)


def file_in_the_way(out) -> Optional[Path]:
    """The file that keeps directory ``out`` from being made or written into: ``out`` itself, or the
    nearest existing path above it when that is a file; None when nothing is in the way."""
    d = Path(out)
    for p in (d, *d.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None
