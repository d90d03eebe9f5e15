"""``python -m launch.bench.KIND ARGS`` == ``mgrpo bench KIND ARGS``: the shared ``main`` of the kinds."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def bench_main(kind: str, add_parser, argv=None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) as ``mgrpo bench KIND ARGS`` with the kind's
    ``add_parser`` and run its command; the exit status."""
    p = argparse.ArgumentParser(prog="mgrpo bench")
    naming_results(kind, add_parser(p.add_subparsers(dest="kind", required=True)))
    args = p.parse_args([kind, *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


RESULT_SUFFIXES = (".json", ".png", ".txt")
"""What a bench writes for the reader under ``--out`` (a generated checkpoint there is not listed)."""


def naming_results(kind: str, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make the kind's command end by naming the result files it wrote under ``--out``."""
    run = parser.get_default("func")

    def run_and_name(args) -> int:
        rc = int(run(args) or 0)
        out = Path(getattr(args, "out", None) or "")
        if rc == 0 and str(out) and out.is_dir():
            files = sorted(f.name for f in out.iterdir() if f.is_file() and f.suffix in RESULT_SUFFIXES)
            if files:
                print(f"[bench {kind}] results in {out}/: {', '.join(files)}", flush=True)
        return rc

    parser.set_defaults(func=run_and_name)
    return parser


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None without matplotlib (the benches then
    write their JSON only)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - no matplotlib: JSON only
        return None
    return plt


def positive_int(text: str) -> int:
    """argparse ``type=`` for a count: the message names the value (argparse adds the flag)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value
