"""Benchmarks (``mgrpo bench KIND``): each writes JSON (and a PNG where it helps) under ``--out``.

A kind is a module of this package with ``add_parser(subparsers)``; register it in ``KINDS``. Its
``python -m launch.bench.KIND`` entry is :func:`launch.bench._cli.bench_main`; modules named ``_*`` are
internal (``_layers_*`` and ``_sync_*``: the parts of ``layers`` and ``sync``, which re-export their names).
Kinds: ``audio_front`` (the audio tower's conv front-end, fused Triton passes against unfused,
:mod:`launch.bench.audio_front`), ``checkpoint`` (training-checkpoint save and load time and peak host memory, same and another
layout, CPU ranks, :mod:`launch.bench.checkpoint`), ``convert`` (HF <-> Megatron dist checkpoint conversion throughput and peak RSS on a
full-width Qwen3-Omni-layout checkpoint, :mod:`launch.bench.convert`), ``layers`` (N full-width
thinker layers fwd+bwd: ours vs HF transformers vs megatron's local spec, with the kernel ceiling,
:mod:`launch.bench.layers`), ``packing`` (padding fraction and DP balance of our packer vs padded
batches on the layers bench's length distribution, CPU, :mod:`launch.bench.packing`), ``report`` (`mgrpo
report` on one 512-sample step: page build and Chromium load time, CPU, :mod:`launch.bench.report`), ``routes``
(vLLM time per generated token with and without routed-expert capture for R3,
:mod:`launch.bench.routes`), ``sync`` (weight
sync of the 48-layer thinker, ``export_hf`` -> buckets -> broadcast -> unpack between two GPUs, against
raw NCCL bandwidth; gloo on CPU, :mod:`launch.bench.sync`), ``to_ranks`` (bytes and host memory each
trainer rank receives per step: broadcast vs its own micro-batches, gloo on CPU,
:mod:`launch.bench.to_ranks`), ``train`` (the training phase of ``mgrpo train``, features to optimizer
step, against the layer stack with and without the LM head, and where its time goes,
:mod:`launch.bench.train`).
"""
from __future__ import annotations

import argparse
import importlib

from launch.bench._cli import naming_results
from launch.cli_help import doc_description

__all__ = ["add_bench_parser", "KINDS"]

KINDS = {"audio_front": "launch.bench.audio_front", "checkpoint": "launch.bench.checkpoint", "convert": "launch.bench.convert", "layers": "launch.bench.layers", "packing": "launch.bench.packing",
         "report": "launch.bench.report", "routes": "launch.bench.routes", "sync": "launch.bench.sync",
         "to_ranks": "launch.bench.to_ranks", "train": "launch.bench.train"}
"""bench kind -> module with ``add_parser(subparsers)`` (argparse only; heavy imports when it runs)."""


def add_bench_parser(sub) -> argparse.ArgumentParser:
    """Register ``bench`` and its kinds on an argparse subparsers object."""
    p = sub.add_parser("bench", help="run a benchmark; results (JSON, PNG) go under --out",
                       description=doc_description(__doc__))
    bsub = p.add_subparsers(dest="bench_kind", metavar="{" + ",".join(KINDS) + "}")
    bsub.required = True
    for kind, module in KINDS.items():
        naming_results(kind, importlib.import_module(module).add_parser(bsub))
    return p
