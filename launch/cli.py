"""`mgrpo`: the single command-line entry point and its registry of subcommands.

`python -m launch.cli ARGS` is `mgrpo ARGS`. Each subcommand's parser lives in its own module
(`launch/*_cli.py`, `launch/bench`, `launch/slurm`), whose heavy imports happen only when it runs,
so `mgrpo --help` stays fast and a missing optional dependency only affects the subcommand that
needs it.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import warnings

from launch.cli_help import file_in_the_way, show_defaults
from megatron_grpo import __version__


_FALLBACK_NOTES = ("Transformer Engine and Apex are not installed", "Apex is not installed")
"""Starts of megatron-core's import-time UserWarnings that it runs its torch implementations
(multi-tensor ops, optimizers, norms): every process of a run printed them, ~10 lines, and they
say nothing the run's own log does not (the layer-spec backend it chose). Silenced in this
process and, through PYTHONWARNINGS, in the ranks and servers it starts."""


def _quiet_fallback_notes() -> None:
    for note in _FALLBACK_NOTES:
        warnings.filterwarnings("ignore", message=re.escape(note), category=UserWarning)
    ours = ",".join(f"ignore:{note}:UserWarning" for note in _FALLBACK_NOTES)
    if ours not in os.environ.get("PYTHONWARNINGS", ""):  # the user's own filters stay, ours take precedence
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), ours]))


def _die(message: str) -> None:
    """A one-line usage error: the message on stderr, exit status 2 (as argparse's own errors)."""
    print(message, file=sys.stderr)
    raise SystemExit(2)


def _refuse_nonempty(cmd: str, out: str, force: bool) -> None:
    """`--out` must be new or empty (or --force): writing into a real checkpoint or dataset
    directory would leave a mix of its files and ours."""
    from pathlib import Path

    d = Path(out)
    p = file_in_the_way(d)  # it would fail midway even with --force
    if p is not None:
        _die(f"mgrpo {cmd}: --out {d} is a file, not a directory: pass a directory" if p == d else
             f"mgrpo {cmd}: --out {d}: {p} is a file, not a directory: pass a directory")
    if d.is_dir() and any(d.iterdir()) and not force:
        _die(f"mgrpo {cmd}: --out {d} exists and is not empty: choose a new directory, or pass "
             "--force to write into it (files of the same name are replaced, others stay)")


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    from model_bridge.tiny import make_tiny

    _refuse_nonempty("make-tiny", args.out, args.force)
    out = make_tiny(args.out, preset=args.preset, seed=args.seed, with_talker=args.with_talker)
    print(f"tiny Qwen3-Omni checkpoint ({args.preset}, seed {args.seed}) written to {out}")
    return 0


def _cmd_make_data(args: argparse.Namespace) -> int:
    from megatron_grpo.data.synth import make_data

    _refuse_nonempty("make-data", args.out, args.force)
    if args.n < 0 or args.n_dev < 0:
        _die(f"mgrpo make-data: --n and --n-dev must be >= 0, got {args.n} and {args.n_dev}")
    try:
        summary = make_data(args.out, n=args.n, n_dev=args.n_dev, seed=args.seed, speech=args.speech, sft=args.sft)
    except RuntimeError as e:  # --speech without espeak-ng
        _die(f"mgrpo make-data: {e}")
    print(f"synthetic audio-agent data written to {summary['out_dir']}: "
          f"{summary['n_train']} train rows ({summary['train_jsonl']}), "
          f"{summary['n_dev']} dev rows ({summary['dev_jsonl']}), "
          f"{summary['n_audio']} audio files, {summary['audio_seconds'] / 60:.1f} min of audio"
          + (f"; expert trajectories for `mgrpo sft` in {summary['sft_jsonl']}" if args.sft else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mgrpo",
        description="Full-parameter GRPO of Qwen3-Omni MoE on Megatron-Core with vLLM rollouts.")
    p.add_argument("--version", action="version", version=f"mgrpo {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    h = "write a tiny random Qwen3-Omni-MoE checkpoint in the released model's on-disk layout"
    s = sub.add_parser("make-tiny", help=h, description=h[0].upper() + h[1:] + " (what `mgrpo train` "
                       "builds into $MGRPO_CACHE when model.hf_dir is unset).")
    s.add_argument("--out", required=True, help="output directory")
    s.add_argument("--preset", choices=["tiny", "small"], default="tiny",
                   help="model size (tiny: CPU tests; small: a little wider/deeper)")
    s.add_argument("--seed", type=int, default=0, help="weights seed (same seed -> identical bytes)")
    s.add_argument("--with-talker", action="store_true",
                   help="also write talker.* and code2wav.* tensors (for pass-through tests)")
    s.add_argument("--force", action="store_true", help="write into a non-empty --out")
    s.set_defaults(func=_cmd_make_tiny)

    h = "write synthetic audio-agent data (audio + JSONL) in the user's format"
    s = sub.add_parser("make-data", help=h, description=h[0].upper() + h[1:] + ": OUT/train.jsonl, "
                       "OUT/dev.jsonl and OUT/audio/ (docs/data.md describes the format).")
    s.add_argument("--out", required=True, help="output directory")
    s.add_argument("--n", type=int, default=200, help="number of train rows")
    s.add_argument("--n-dev", type=int, default=16, help="number of dev rows")
    s.add_argument("--seed", type=int, default=0, help="seed (same seed -> identical files)")
    s.add_argument("--speech", action="store_true",
                   help="add spoken-word events (needs espeak-ng on PATH)")
    s.add_argument("--sft", action="store_true",
                   help="also write OUT/sft.jsonl: an expert crop_audio trajectory per train row (for `mgrpo sft`)")
    s.add_argument("--force", action="store_true", help="write into a non-empty --out")
    s.set_defaults(func=_cmd_make_data)

    from launch.serve_cli import add_serve_parser  # argparse only: vLLM loads in `run_serve`

    add_serve_parser(sub)

    from launch.convert_cli import add_convert_parser  # argparse only: torch/megatron load when it runs

    add_convert_parser(sub)

    from launch.train_cli import add_train_parser

    add_train_parser(sub)

    from launch.sft_cli import add_sft_parser

    add_sft_parser(sub)

    from launch.bench import add_bench_parser

    add_bench_parser(sub)

    from launch.slurm.cli import add_launch_parser  # argparse only: the config loads when it runs

    add_launch_parser(sub)

    from launch.report.cli import add_report_parser  # argparse only: the report loads when it runs

    add_report_parser(sub)
    show_defaults(p)
    return p


def _deepest_parser(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.ArgumentParser:
    """The (sub)parser of the command line's innermost subcommand, so an error shows its usage."""
    for token in (sys.argv[1:] if argv is None else argv):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if subs and token in subs[0].choices:
            parser = subs[0].choices[token]
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # subcommands that wrap another program (serve -> vLLM) take the arguments they do not know
    args, extra = parser.parse_known_args(argv)
    if extra and isinstance(getattr(args, "overrides", None), list):
        # KEY=VALUE overrides may come after an option (`mgrpo train --nproc 1 parallel.tp=1`)
        def is_override(a: str) -> bool:  # KEY=VALUE, not an --option=value
            return "=" in a and not a.startswith("-")

        args.overrides += [a for a in extra if is_override(a)]
        extra = [a for a in extra if not is_override(a)]
    if extra:
        if not getattr(args, "accepts_extra_args", False):
            _deepest_parser(parser, argv).error(f"unrecognized arguments: {' '.join(extra)}")
        args.extra_args = extra
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    _quiet_fallback_notes()
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback per process (what runs stops in `finally`)
        words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")][:1]
        print(f"\nmgrpo {' '.join(words)}: interrupted (Ctrl-C)".rstrip(), file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
