"""`mgrpo bench checkpoint`: its layout arguments (the bench itself runs by hand: docs/performance.md)."""
from __future__ import annotations

import argparse

import pytest

from launch.bench.checkpoint import parse_layout


def test_layout_argument():
    assert parse_layout("") == {} and parse_layout("tp=2") == {"tp": 2}
    assert parse_layout("tp=1, ep=2,pp=2") == {"tp": 1, "ep": 2, "pp": 2}
    for bad in ("tp2", "dp=2", "tp=0", "tp=x"):
        with pytest.raises(argparse.ArgumentTypeError, match="want comma-separated tp=N, ep=N, etp=N, pp=N"):
            parse_layout(bad)
