"""`mgrpo report RUN_DIR [--steps A:B] [--out DIR]` (argparse only here: the rest loads when it runs)."""
from __future__ import annotations

import argparse
import sys


def add_report_parser(sub) -> None:
    h = "write a run's recorded trajectories as static web pages (turns, clips, rewards, logprob mismatch)"
    s = sub.add_parser("report", help=h, description=h[0].upper() + h[1:] + ": an index with the reward, KL "
                       "and step-time curves and a page per recorded step, audio beside them; open "
                       "OUT/index.html from the file system, no server needed (docs/training.md, 'Read a run').")
    s.add_argument("run_dir", metavar="RUN_DIR", help="trainer.run_dir of a `mgrpo train` run (or a rollout.record_dir)")
    s.add_argument("--steps", help="recorded steps to render: N, A:B (B included), A: or :B (default: all)")
    s.add_argument("--out", help="output directory (default: RUN_DIR/report)")
    s.add_argument("--tokenizer", help="tokenizer dir (default: the recording's model dir)")
    s.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    from .load import ReportError
    from .render import build_report

    try:
        r = build_report(args.run_dir, out=args.out, steps=args.steps, tokenizer=args.tokenizer)
    except ReportError as e:
        print(f"mgrpo report: {e}", file=sys.stderr)
        return 2
    steps = r["steps"]
    print(f"mgrpo report: {len(steps)} step page{'s' if len(steps) != 1 else ''} ({steps[0]}..{steps[-1]}) and "
          f"{r['clips_written']} new audio clips in {r['seconds']:.1f} s; open file://{r['index'].resolve()}")
    return 0
