"""HF <-> Megatron dist checkpoint conversion (``mgrpo convert hf-to-mcore / mcore-to-hf``; the
command line is ``launch/convert_cli.py``).

* :func:`hf_to_mcore` writes a torch_dist checkpoint (``model_bridge.checkpoint``) that loads under any
  TP/EP/PP, plus ``mgrpo_checkpoint.json`` (source, spec fingerprint, layout, versions). One process
  by default; with a layout it spawns its ranks (CPU/gloo: conversion is I/O, the GPUs stay idle),
  each converting only what it owns. Memory stays bounded: the model is never materialised, one
  parameter at a time is read, converted and written.
* :func:`mcore_to_hf` streams the dist checkpoint back to HF safetensors shards + index, copies the
  tensors the Megatron model does not hold (``thinker.visual.*``, ``talker.*``, ``code2wav.*``)
  from ``hf_source`` untouched, and copies config, tokenizer, processor, chat-template and
  generation files. The result loads in transformers and vLLM. The input may also be a training
  checkpoint (``RUN/checkpoints/step_N``: model weights only, in their stored dtype, vocab padding
  dropped), or a run dir or its ``checkpoints/`` (the newest complete checkpoint); ``hf_source``
  then defaults to the run's ``model.hf_dir``.

All inputs are checked in the calling process before any rank starts; problems raise
``ConfigError`` / ``CheckpointError`` / ``ConvertError`` whose message names the path and the numbers.
"""
from __future__ import annotations

import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

__all__ = ["ConvertError", "hf_to_mcore", "mcore_to_hf", "parse_size", "world_size_for", "DTYPES"]

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
DTYPES = ("float32", "bfloat16", "float16")


class ConvertError(ValueError):
    """A conversion request that cannot be served; the message says why and what to do."""


# ------------------------------------------------------------------------------------------------
# shared checks
# ------------------------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """``"1GiB"``, ``"500MB"``, ``"4G"``, ``"123"`` -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ConvertError(f"cannot parse size {text!r} (examples: 500MB, 1GiB, 2G)")
    n, unit, binary = float(m.group(1)), m.group(2).lower(), m.group(3)
    base = 1024 if binary or unit == "" else 1000
    size = int(n * base ** " kmgt".index(unit or " "))
    if size <= 0:
        raise ConvertError(f"size {text!r} must be > 0")
    return size


def world_size_for(tp: int = 1, ep: int = 1, etp: Optional[int] = None, pp: int = 1) -> int:
    """Smallest world that holds a layout: pp stages of lcm(tp, ep * etp) ranks."""
    etp = tp if etp is None else etp
    return pp * math.lcm(tp, ep * etp)


def _layout(spec, tp, ep, etp, pp, nproc):
    """(ParallelLayout, world size) after every check; ConfigError naming the numbers."""
    from model_bridge.config import ConfigError, ParallelLayout, check_layout
    from model_bridge.parallel import check_parallel_sizes

    layout = ParallelLayout(tp=tp, ep=ep, etp=etp, pp=pp)
    world = nproc or world_size_for(tp, ep, etp, pp)
    check_layout(spec, layout, world)
    try:
        check_parallel_sizes(world, tp=tp, ep=ep, etp=etp, pp=pp)
    except ValueError as e:
        raise ConfigError(f"parallel sizes do not fit {world} process(es): {e}") from e
    return layout, world


def _hf_input(hf_dir, what: str = "--hf"):
    """(spec, reader) of an HF Qwen3-Omni checkpoint dir; clear errors for wrong paths/models."""
    from model_bridge.config import read_omni_config
    from model_bridge.io import SafetensorsReader

    d = Path(hf_dir)
    if not d.exists():
        raise ConvertError(f"{what} {d} does not exist")
    if not d.is_dir():
        raise ConvertError(f"{what} {d} is not a directory (expected an HF checkpoint directory)")
    if (d / "metadata.json").is_file() and (d / ".metadata").is_file() and not (d / "config.json").is_file():
        raise ConvertError(f"{what} {d} is a Megatron dist checkpoint, not an HF checkpoint (use it as --mcore)")
    spec = read_omni_config(d)
    return spec, SafetensorsReader(d)


def _new_out_dir(out, what: str = "--out") -> Path:
    d = Path(out)
    if d.exists() and not d.is_dir():
        raise ConvertError(f"{what} {d} exists and is not a directory")
    if d.is_dir() and any(d.iterdir()):
        raise ConvertError(f"{what} {d} is not empty: give a new or empty directory")
    return d


def _clear(d: Path) -> None:
    """Empty an output directory this command found new or empty (after a failure)."""
    if d.is_dir():
        for f in d.iterdir():
            if f.is_dir() and not f.is_symlink():
                shutil.rmtree(f, ignore_errors=True)
            else:
                f.unlink(missing_ok=True)


def _run(fn, world: int, *args, cpu_only: bool = True, in_process: bool = False, timeout: float = 24 * 3600,
         **kwargs):
    """Run ``fn`` on ``world`` spawned ranks (``run_ranks``), or with ``in_process`` and one rank,
    in this process (a throwaway CLI process: saves an interpreter start and megatron's import;
    it leaves torch.distributed initialised and megatron's CPU patches applied)."""
    if in_process and world == 1:
        from model_bridge.spawn import free_port

        env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        if cpu_only:
            env.update(CPU_ONLY)
        os.environ.update(env)
        return [fn(*args, **kwargs)]
    from model_bridge.spawn import run_ranks

    return run_ranks(fn, world, *args, timeout=timeout, env=CPU_ONLY if cpu_only else None, **kwargs)


# ------------------------------------------------------------------------------------------------
# hf-to-mcore / mcore-to-hf
# ------------------------------------------------------------------------------------------------

def hf_to_mcore(hf, out, *, tp: int = 1, ep: int = 1, etp: Optional[int] = None, pp: int = 1,
                nproc: Optional[int] = None, dtype: Optional[str] = None, progress: bool = True,
                in_process: bool = False) -> dict:
    """HF checkpoint dir -> torch_dist checkpoint dir (written at the given layout, loadable at any).
    Returns {seconds, bytes, per-rank stats}. ``in_process``: see ``_run``."""
    from model_bridge.checkpoint import rank_hf_to_mcore

    spec, reader = _hf_input(hf)
    if dtype is not None and dtype != "auto" and dtype not in DTYPES:
        raise ConvertError(f"--dtype {dtype!r}: choose one of auto, {', '.join(DTYPES)}")
    layout, world = _layout(spec, tp, ep, etp, pp, nproc)
    out = _new_out_dir(out)
    del reader
    t0 = time.perf_counter()
    try:
        stats = _run(rank_hf_to_mcore, world, str(Path(hf).resolve()), str(out.resolve()), tp, ep, etp, pp,
                     None if dtype in (None, "auto") else dtype, progress, in_process=in_process)
    except BaseException:
        _clear(out)  # it was new or empty: leave no half-written checkpoint behind
        raise
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "bytes": sum(s["bytes"] for s in stats), "world_size": world,
            "layout": {"tp": tp, "ep": ep, "etp": layout.expert_tp, "pp": pp}, "ranks": stats, "out": str(out)}


def copy_hf_side_files(src, dst) -> list[str]:
    """Copy config, tokenizer, processor, chat template, generation config (every top-level file
    that is not a weight shard or the index, and not hidden) from ``src`` to ``dst``."""
    from model_bridge.io import INDEX_NAME

    copied = []
    for f in sorted(Path(src).iterdir()):
        if (not f.is_file() or f.name.startswith(".") or f.name == INDEX_NAME
                or f.name.endswith((".safetensors", ".bin", ".pt", ".pth"))):
            continue
        shutil.copy2(f, Path(dst) / f.name)
        copied.append(f.name)
    return copied


def mcore_to_hf(mcore, hf_source, out, *, max_shard_size: str | int = "4GiB", progress: bool = True,
                group_size: str | int = "128MiB", in_process: bool = False,
                notify: Optional[Callable[[str], None]] = None) -> dict:
    """torch_dist checkpoint dir -> HF checkpoint dir (shards + index + side files, pass-through
    tensors copied from ``hf_source``). Returns {seconds, bytes, ...}. Shards are written as the
    tensors arrive (no buffering), so ``max_shard_size`` does not affect memory.

    ``mcore`` may also be a training checkpoint (``RUN/checkpoints/step_<8-digit step>``), a run dir or
    its ``checkpoints/`` (the newest complete checkpoint); then ``hf_source`` None means the run's
    ``model.hf_dir`` (its config.json). ``notify`` gets a line for each such choice (also in the
    result's ``notes``)."""
    from model_bridge.checkpoint import check_dist_checkpoint, rank_mcore_to_hf
    from model_bridge.dist_ckpt.meta import is_training_checkpoint, resolve_mcore_input, training_run_hf_dir

    notes: list[str] = []

    def note(msg: str) -> None:
        notes.append(msg)
        if notify is not None:
            notify(msg)

    ckpt, picked = resolve_mcore_input(mcore)
    if picked:
        note(picked)
    meta = check_dist_checkpoint(ckpt, None, allow_training=True)
    if hf_source is None:
        if is_training_checkpoint(meta):
            hf_source = training_run_hf_dir(ckpt)
            if hf_source is None:
                raise ConvertError(f"--hf-source not given and {ckpt} is not inside a run directory whose config.json "
                                   "names model.hf_dir: give the HF checkpoint the run started from")
            note(f"--hf-source not given: using the run's model.hf_dir, {hf_source}")
        elif meta.get("hf_source"):
            hf_source = meta["hf_source"]
            note(f"--hf-source not given: using the HF checkpoint it was converted from, {hf_source}")
        else:
            raise ConvertError("--hf-source is required: the HF checkpoint the dist checkpoint was converted from")
    spec, reader = _hf_input(hf_source, "--hf-source")
    del reader
    check_dist_checkpoint(ckpt, spec, allow_training=True)
    out = _new_out_dir(out)
    max_shard = parse_size(max_shard_size) if isinstance(max_shard_size, str) else int(max_shard_size)
    group = parse_size(group_size) if isinstance(group_size, str) else int(group_size)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        stats = _run(rank_mcore_to_hf, 1, str(Path(ckpt).resolve()), str(Path(hf_source).resolve()),
                     str(out.resolve()), max_shard, group, progress, in_process=in_process)[0]
    except BaseException:
        _clear(out)
        raise
    files = copy_hf_side_files(hf_source, out)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "bytes": stats["total_size"], "side_files": files, "out": str(out),
            "mcore": str(ckpt), "hf_source": str(hf_source), "notes": notes, **stats}
