"""`mgrpo ... --help`: every subcommand (nested ones too) shows its options' defaults."""
from __future__ import annotations

import argparse

from launch.cli import build_parser


def _all_parsers(parser, path=("mgrpo",)):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _all_parsers(child, path + (name,))


def test_every_subcommand_help_shows_defaults_and_never_a_none():
    helps = {" ".join(path): p.format_help() for path, p in _all_parsers(build_parser())}
    assert {"mgrpo make-tiny", "mgrpo make-data", "mgrpo serve", "mgrpo convert", "mgrpo train",
            "mgrpo bench layers", "mgrpo bench packing", "mgrpo bench sync"} <= set(helps)
    assert "--n N          number of train rows (default: 200)" in helps["mgrpo make-data"]
    assert "(default: 0)" in helps["mgrpo make-data"]  # a falsy default other than None/False still shows
    assert "--tp TP               tensor-parallel size (default: 1)" in helps["mgrpo serve"]
    assert "(default: 1)" in helps["mgrpo bench layers"]
    for name, text in helps.items():
        assert "(default: None)" not in text and "(default: False)" not in text, name
        assert "(default: )" not in text, name  # an empty-string default (e.g. bench train --profile) says nothing
