"""``mgrpo convert``: HF <-> Megatron dist checkpoint conversion and a logits check against transformers.

Subcommands (``mgrpo convert -h`` for the options)::

    mgrpo convert hf-to-mcore  --hf DIR --out DIR [--tp T --ep E --etp X --pp P --nproc N] [--dtype D]
    mgrpo convert mcore-to-hf  --mcore DIR [--hf-source DIR] --out DIR [--max-shard-size 1GiB]
    mgrpo convert check        --hf DIR [--tp T --ep E --etp X --pp P] [--sample FILE.json]
                               [--dump-logits FILE.pt|FILE.npy] [--dtype D] [--tol X]

The conversion itself is :mod:`model_bridge.convert`, the check :mod:`launch.logits_check`.

* ``hf-to-mcore`` writes a torch_dist checkpoint (``model_bridge.checkpoint``) that loads under any
  TP/EP/PP, plus ``mgrpo_checkpoint.json`` (source, spec fingerprint, layout, versions). One process
  by default; with a layout it spawns its ranks (CPU/gloo: conversion is I/O, the GPUs stay idle),
  each converting only what it owns. Memory stays bounded: the model is never materialised, one
  parameter at a time is read, converted and written.
* ``mcore-to-hf`` streams the dist checkpoint back to HF safetensors shards + index, copies the
  tensors the Megatron model does not hold (``thinker.visual.*``, ``talker.*``, ``code2wav.*``)
  from ``--hf-source`` untouched, and copies config, tokenizer, processor, chat-template and
  generation files. The result loads in transformers and vLLM. ``--mcore`` may also be a training
  checkpoint (``RUN/checkpoints/step_N``: model weights only, in their stored dtype, vocab padding
  dropped), or a run dir or its ``checkpoints/`` (the newest complete checkpoint); ``--hf-source``
  then defaults to the run's ``model.hf_dir``.
* ``check`` builds the Megatron model from the HF checkpoint at a layout (spawning its ranks: gloo
  on CPU, NCCL on GPU), runs one chat sample (text + audio; a built-in one unless ``--sample``),
  compares the logits with transformers' and prints the max abs difference. ``--dump-logits``
  saves the Megatron logits as float32 ``[T, V]`` (vocab padding removed): ``.npy`` -> ``numpy.save``,
  anything else -> ``torch.save`` of a CPU tensor.

All inputs are checked in the calling process before any rank starts; problems raise
``ConfigError`` / ``CheckpointError`` / ``ConvertError`` whose message names the path and the
numbers, and the CLI prints them as ``mgrpo convert: error: ...`` with exit code 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from launch.cli_help import doc_description
from launch.logits_check import check
from model_bridge.convert import DTYPES, ConvertError, hf_to_mcore, mcore_to_hf

__all__ = ["add_convert_parser"]


def _layout_args(s: argparse.ArgumentParser, with_nproc: bool = True) -> None:
    s.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
    s.add_argument("--ep", type=int, default=1, help="expert parallel size (default 1)")
    s.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")
    s.add_argument("--pp", type=int, default=1, help="pipeline parallel size (default 1)")
    if with_nproc:
        s.add_argument("--nproc", type=int, default=None,
                       help="ranks to spawn (default: the smallest world that holds the layout)")


def _write_stats(args, r: dict) -> None:
    if getattr(args, "stats_json", None):
        Path(args.stats_json).write_text(json.dumps(r, indent=2, default=str) + "\n")


def _amount(r: dict) -> str:
    """``"12.3 MiB in 4.5 s (2.7 MiB/s)"`` of a conversion's result."""
    mb = r["bytes"] / 2**20
    return f"{mb:.1f} MiB in {r['seconds']:.1f} s ({_rate(mb, r['seconds'])} MiB/s)"


def _rate(mib: float, seconds: float) -> str:
    """MiB/s for the summary line: whole numbers, one decimal below 10 (a tiny model's 0.5 MiB/s is not 0)."""
    r = mib / max(seconds, 1e-9)
    return f"{r:.0f}" if r >= 10 else f"{r:.1f}"


def _print_error(e: BaseException) -> int:
    print(f"mgrpo convert: error: {e}", file=sys.stderr)
    return 2


def _handled(fn):
    def run(args: argparse.Namespace) -> int:
        from megatron_grpo.notices import quiet_known_notices
        from model_bridge.config import ConfigError
        from model_bridge.io import CheckpointError
        from model_bridge.mappings import MappingError

        quiet_known_notices()
        try:
            return fn(args)
        except (ConfigError, CheckpointError, ConvertError, MappingError, FileNotFoundError) as e:
            return _print_error(e)
        except ValueError as e:  # e.g. the data layer's AudioError
            if type(e).__module__.startswith(("megatron_grpo", "model_bridge")):
                return _print_error(e)
            raise
    return run


@_handled
def _cmd_hf_to_mcore(args) -> int:
    r = hf_to_mcore(args.hf, args.out, tp=args.tp, ep=args.ep, etp=args.etp, pp=args.pp, nproc=args.nproc,
                    dtype=args.dtype, progress=not args.no_progress, in_process=not args.spawn)
    _write_stats(args, r)
    print(f"wrote Megatron dist checkpoint {r['out']} (torch_dist, loadable at any TP/EP/PP; written at "
          f"tp={args.tp} ep={args.ep} pp={args.pp} on {r['world_size']} rank(s)): {_amount(r)}")
    return 0


@_handled
def _cmd_mcore_to_hf(args) -> int:
    r = mcore_to_hf(args.mcore, args.hf_source, args.out, max_shard_size=args.max_shard_size,
                    progress=not args.no_progress, in_process=not args.spawn, notify=lambda m: print(m, flush=True))
    _write_stats(args, r)
    print(f"wrote HF checkpoint {r['out']}: {r['n_model_tensors']} converted + {r['n_passthrough']} pass-through "
          f"tensors, {_amount(r)}; copied {', '.join(r['side_files'])}")
    return 0


@_handled
def _cmd_check(args) -> int:
    r = check(args.hf, tp=args.tp, ep=args.ep, etp=args.etp, pp=args.pp, nproc=args.nproc, sample=args.sample,
              dump_logits=args.dump_logits, dtype=args.dtype)
    _write_stats(args, r)
    lay = r["layout"]
    print(f"layout tp={lay['tp']}{'+sp' if lay['sp'] else ''} ep={lay['ep']} etp={lay['etp']} pp={lay['pp']} "
          f"(world {r['world_size']}, {r['backend']}, {r['dtype']}); sample: {r['tokens']} tokens, "
          f"{r['audio_clips']} audio clip(s) ({r['audio_tokens']} audio tokens)")
    print(f"max |logit diff| megatron vs transformers: {r['max_abs_diff']:.3e} "
          f"(mean {r['mean_abs_diff']:.3e}, argmax agreement {100 * r['argmax_agreement']:.1f}%)")
    if r.get("dumped"):
        print(f"megatron logits float32 [{r['tokens']}, {r['vocab']}] saved to {r['dumped']}")
    tol = args.tol if args.tol is not None else (1e-4 if args.dtype == "float32" else None)
    if tol is not None and not r["max_abs_diff"] <= tol:
        print(f"mgrpo convert check: FAILED, max |logit diff| {r['max_abs_diff']:.3e} > tolerance {tol:g}",
              file=sys.stderr)
        return 1
    return 0


def add_convert_parser(sub) -> argparse.ArgumentParser:
    """Register ``convert`` (hf-to-mcore, mcore-to-hf, check) on an argparse subparsers object."""
    p = sub.add_parser("convert", help="convert between HF safetensors and Megatron dist checkpoints; "
                                       "check logits against transformers",
                       description=doc_description(__doc__))
    csub = p.add_subparsers(dest="convert_command", metavar="{hf-to-mcore,mcore-to-hf,check}")
    csub.required = True

    s = csub.add_parser("hf-to-mcore", help="HF checkpoint -> Megatron dist checkpoint (torch_dist, any layout)",
                        description="Convert an HF Qwen3-Omni checkpoint into a Megatron dist checkpoint "
                                    "(torch_dist) that loads under any TP/EP/PP.")
    s.add_argument("--hf", required=True, help="HF Qwen3-Omni checkpoint directory")
    s.add_argument("--out", required=True, help="output directory (new or empty)")
    _layout_args(s)
    s.add_argument("--dtype", default="auto", choices=("auto",) + DTYPES,
                   help="dtype of the stored tensors (default: the source's)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.add_argument("--spawn", action="store_true",
                   help="run a single-rank conversion in a spawned process instead of this one")
    s.add_argument("--stats-json", default=None, help="also write timings and sizes as JSON to this file")
    s.set_defaults(func=_cmd_hf_to_mcore)

    s = csub.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF checkpoint (transformers/vLLM)",
                        description="Convert a Megatron dist checkpoint, a training checkpoint or a run's newest "
                                    "one into an HF checkpoint that loads in transformers and vLLM.")
    s.add_argument("--mcore", required=True,
                   help="Megatron dist checkpoint directory, or a training checkpoint (RUN/checkpoints/step_N), or a "
                        "run directory or its checkpoints/ (the newest complete checkpoint is exported)")
    s.add_argument("--hf-source", default=None,
                   help="the HF checkpoint it came from: config, tokenizer and the tensors Megatron does not "
                        "hold (visual, talker, code2wav) are copied from it (default: a training run's "
                        "model.hf_dir, or the hf_source a dist checkpoint records)")
    s.add_argument("--out", required=True, help="output directory (new or empty)")
    s.add_argument("--max-shard-size", default="4GiB",
                   help="largest safetensors shard (default 4GiB; shards are streamed, so memory does not grow "
                        "with it)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.add_argument("--spawn", action="store_true",
                   help="run a single-rank conversion in a spawned process instead of this one")
    s.add_argument("--stats-json", default=None, help="also write timings and sizes as JSON to this file")
    s.set_defaults(func=_cmd_mcore_to_hf)

    s = csub.add_parser("check", help="Megatron logits at a layout vs transformers on one chat sample",
                        description="Build the Megatron model from an HF checkpoint at a layout, run one chat "
                                    "sample and compare its logits with transformers'.")
    s.add_argument("--hf", required=True, help="HF Qwen3-Omni checkpoint directory")
    _layout_args(s)
    s.add_argument("--sample", default=None,
                   help='JSON {"messages": [...], "audios": [paths]} in the data format (<audio> tags in user '
                        "turns; paths relative to the file); default: a built-in text + audio sample")
    s.add_argument("--dump-logits", default=None,
                   help="save the Megatron logits, float32 [T, V] without vocab padding: FILE.npy -> numpy.save, "
                        "other names -> torch.save")
    s.add_argument("--dtype", default="float32", choices=DTYPES, help="compute dtype of both models (default float32)")
    s.add_argument("--tol", type=float, default=None,
                   help="exit 1 when the max abs diff exceeds this (default 1e-4 in float32, none otherwise)")
    s.add_argument("--stats-json", default=None, help="also write the result as JSON to this file")
    s.set_defaults(func=_cmd_check)
    return p
