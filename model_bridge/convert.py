"""``mgrpo convert``: HF <-> Megatron dist checkpoint conversion and a logits check against transformers.

Subcommands (``mgrpo convert -h`` for the options)::

    mgrpo convert hf-to-mcore  --hf DIR --out DIR [--tp T --ep E --etp X --pp P --nproc N] [--dtype D]
    mgrpo convert mcore-to-hf  --mcore DIR [--hf-source DIR] --out DIR [--max-shard-size 1GiB]
    mgrpo convert check        --hf DIR [--tp T --ep E --etp X --pp P] [--sample FILE.json]
                               [--dump-logits FILE.pt|FILE.npy] [--dtype D] [--tol X]

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
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Optional

__all__ = ["ConvertError", "hf_to_mcore", "mcore_to_hf", "check", "build_sample", "parse_size",
           "world_size_for", "add_convert_parser", "BUILTIN_SAMPLE"]

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
DTYPES = ("float32", "bfloat16", "float16")
BUILTIN_SAMPLE = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant that listens to audio recordings."},
        {"role": "user", "content": "<audio>\nWhen does the beep occur? Answer as [MM:SS - MM:SS]."},
    ],
    "audios": ["<built-in: 2.3 s of noise with a 1 kHz beep>"],
}


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
        from megatron_grpo.testing.dist import free_port

        env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        if cpu_only:
            env.update(CPU_ONLY)
        os.environ.update(env)
        return [fn(*args, **kwargs)]
    from megatron_grpo.testing.dist import run_ranks

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


# ------------------------------------------------------------------------------------------------
# check: Megatron logits vs transformers on one chat sample
# ------------------------------------------------------------------------------------------------

def _builtin_waveform(sr: int = 16000):
    import numpy as np

    rng = np.random.RandomState(0)
    n = int(2.3 * sr)
    w = 0.05 * rng.randn(n).astype(np.float32)
    t = np.arange(int(0.4 * sr)) / sr
    start = int(1.2 * sr)
    w[start:start + len(t)] += 0.5 * np.sin(2 * np.pi * 1000 * t).astype(np.float32)
    return w


def _hf_messages(messages: list[dict], n_audios: int, where: str) -> list[dict]:
    """Data-format messages (string contents, ``<audio>`` tags in user turns) -> HF content parts."""
    from megatron_grpo.data.schema import AUDIO_TAG

    out, used = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content", ""), str):
            raise ConvertError(f"{where}: messages[{i}] must be an object with a 'role' and a string 'content'")
        text = m.get("content") or ""
        parts = []
        pieces = text.split(AUDIO_TAG)
        if len(pieces) > 1 and m["role"] != "user":
            raise ConvertError(f"{where}: messages[{i}] ({m['role']}) holds {AUDIO_TAG}; only user turns may")
        for j, piece in enumerate(pieces):
            if j:
                parts.append({"type": "audio"})
                used += 1
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({"role": m["role"], "content": parts or [{"type": "text", "text": ""}]})
    if used != n_audios:
        raise ConvertError(f"{where}: the messages hold {used} {AUDIO_TAG} tag(s) but 'audios' lists {n_audios} file(s)")
    return out


def build_sample(hf_dir, sample: Optional[str] = None) -> dict:
    """Tokenise one chat sample with the checkpoint's processor.

    Returns ``{"ids": [T], "features": [mel, F] or None, "feature_lens": [n] or None,
    "hf_inputs": {...transformers thinker kwargs...}, "text": str, "audios": [names]}``.
    """
    import torch
    from transformers import AutoProcessor

    if sample is None:
        spec_sample, where, base = BUILTIN_SAMPLE, "built-in sample", None
        waves = [_builtin_waveform()]
    else:
        p = Path(sample)
        if not p.is_file():
            raise ConvertError(f"--sample {p} does not exist")
        try:
            spec_sample = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConvertError(f"--sample {p} is not valid JSON ({e})") from e
        if not isinstance(spec_sample, dict) or not isinstance(spec_sample.get("messages"), list):
            raise ConvertError(f"--sample {p}: expected {{\"messages\": [...], \"audios\": [paths]}}")
        where, base = str(p), p.parent
        from megatron_grpo.data.audio import load_audio

        audios = spec_sample.get("audios") or []
        if not isinstance(audios, list):
            raise ConvertError(f"--sample {p}: 'audios' must be a list of paths")
        waves = [load_audio(a if Path(a).is_absolute() else base / a) for a in audios]
    conv = _hf_messages(spec_sample["messages"], len(waves), where)
    tools = spec_sample.get("tools")
    if isinstance(tools, str):
        tools = json.loads(tools)
    processor = AutoProcessor.from_pretrained(str(hf_dir))
    kw = {"tools": tools} if tools else {}
    text = processor.apply_chat_template(conv, add_generation_prompt=True, tokenize=False, **kw)
    inputs = processor(text=[text], audio=waves or None, return_tensors="pt", padding=True)
    ids = inputs["input_ids"][0].tolist()
    out = {"ids": ids, "features": None, "feature_lens": None, "text": text,
           "audios": list(spec_sample.get("audios") or []),
           "hf_inputs": {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}}
    if waves:
        feats, mask = inputs["input_features"], inputs["feature_attention_mask"]
        lens = mask.sum(-1).to(torch.long)
        out["features"] = torch.cat([feats[i, :, :int(n)] for i, n in enumerate(lens.tolist())], dim=1).float()
        out["feature_lens"] = lens
        out["hf_inputs"].update(input_features=feats, feature_attention_mask=mask)
    return out


def rank_check(hf_dir: str, tp: int, ep: int, etp: Optional[int], pp: int, dtype: str, ids, features,
               feature_lens):
    """One rank of ``convert check``: build at the layout, load_hf, forward; logits on one rank."""
    import torch

    from model_bridge.checkpoint import forward_logits
    from model_bridge.config import ParallelLayout, read_omni_config
    from model_bridge.load import load_hf
    from model_bridge.modeling import build_thinker
    from model_bridge.parallel import destroy_parallel, init_parallel

    init_parallel(tp=tp, ep=ep, etp=etp, pp=pp)
    try:
        spec = read_omni_config(hf_dir)
        t0 = time.perf_counter()
        model = build_thinker(spec, ParallelLayout(tp=tp, ep=ep, etp=etp, pp=pp), getattr(torch, dtype)).eval()
        if torch.cuda.is_available():
            model.cuda()
        load_hf(model, hf_dir)
        t1 = time.perf_counter()
        logits = forward_logits(model, spec, ids, features, feature_lens)
        return {"logits": logits, "load_s": t1 - t0, "forward_s": time.perf_counter() - t1}
    finally:
        destroy_parallel()


def hf_reference_logits(hf_dir, hf_inputs: dict, dtype: str = "float32"):
    """transformers' thinker logits [T, V] (float32, CPU) for the processor's inputs."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(hf_dir), dtype=getattr(torch, dtype))
    thinker = model.thinker.to(dev).eval()
    with torch.no_grad():
        kw = {k: v.to(dev) for k, v in hf_inputs.items()}
        if "input_features" in kw:
            kw["input_features"] = kw["input_features"].to(getattr(torch, dtype))
        logits = thinker(**kw).logits[0].float().cpu()
    del model, thinker
    return logits


def check(hf, *, tp: int = 1, ep: int = 1, etp: Optional[int] = None, pp: int = 1, nproc: Optional[int] = None,
          sample: Optional[str] = None, dump_logits: Optional[str] = None, dtype: str = "float32") -> dict:
    """Megatron (at a layout) vs transformers logits on one chat sample. Returns
    {max_abs_diff, tokens, vocab, argmax_agreement, ...}; saves the Megatron logits when asked."""
    import torch

    spec, reader = _hf_input(hf)
    del reader
    if dtype not in DTYPES:
        raise ConvertError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    layout, world = _layout(spec, tp, ep, etp, pp, nproc)
    cuda = torch.cuda.is_available()
    if cuda and torch.cuda.device_count() < world:
        raise ConvertError(f"the layout needs {world} ranks (one GPU each) but {torch.cuda.device_count()} GPU(s) "
                           "are visible")
    if dump_logits:
        dp = Path(dump_logits)
        if not dp.parent.exists():
            raise ConvertError(f"--dump-logits {dp}: directory {dp.parent} does not exist")
    s = build_sample(hf, sample)
    t0 = time.perf_counter()
    results = _run(rank_check, world, str(Path(hf).resolve()), tp, ep, etp, pp, dtype, s["ids"], s["features"],
                   s["feature_lens"], cpu_only=False)
    mcore_s = time.perf_counter() - t0
    ours = next(r["logits"] for r in results if r["logits"] is not None)
    t1 = time.perf_counter()
    theirs = hf_reference_logits(hf, s["hf_inputs"], dtype)
    if tuple(ours.shape) != tuple(theirs.shape):
        raise ConvertError(f"logits shapes differ: megatron {list(ours.shape)}, transformers {list(theirs.shape)}")
    diff = (ours - theirs).abs()
    out = {"max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(),
           "argmax_agreement": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
           "tokens": ours.shape[0], "vocab": ours.shape[1], "audio_clips": len(s["audios"]),
           "audio_tokens": int(sum(1 for i in s["ids"] if i == spec.audio_token_id)),
           "layout": {"tp": tp, "ep": ep, "etp": layout.expert_tp, "pp": pp, "sp": layout.sequence_parallel},
           "world_size": world, "backend": "nccl" if cuda else "gloo", "dtype": dtype,
           "megatron_s": mcore_s, "transformers_s": time.perf_counter() - t1}
    if dump_logits:
        path = Path(dump_logits)
        if path.suffix == ".npy":
            import numpy as np

            np.save(path, ours.numpy().astype(np.float32))
        else:
            torch.save(ours.contiguous(), path)
        out["dumped"] = str(path)
    return out


# ------------------------------------------------------------------------------------------------
# argparse
# ------------------------------------------------------------------------------------------------

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
    mb = r["bytes"] / 2**20
    print(f"wrote Megatron dist checkpoint {r['out']} (torch_dist, loadable at any TP/EP/PP; written at "
          f"tp={args.tp} ep={args.ep} pp={args.pp} on {r['world_size']} rank(s)): {mb:.1f} MiB in "
          f"{r['seconds']:.1f} s ({_rate(mb, r['seconds'])} MiB/s)")
    return 0


@_handled
def _cmd_mcore_to_hf(args) -> int:
    r = mcore_to_hf(args.mcore, args.hf_source, args.out, max_shard_size=args.max_shard_size,
                    progress=not args.no_progress, in_process=not args.spawn, notify=lambda m: print(m, flush=True))
    _write_stats(args, r)
    mb = r["bytes"] / 2**20
    print(f"wrote HF checkpoint {r['out']}: {r['n_model_tensors']} converted + {r['n_passthrough']} pass-through "
          f"tensors, {mb:.1f} MiB in {r['seconds']:.1f} s ({_rate(mb, r['seconds'])} MiB/s); copied "
          f"{', '.join(r['side_files'])}")
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
                       description=__doc__.split("\n\n")[0])
    csub = p.add_subparsers(dest="convert_command", metavar="{hf-to-mcore,mcore-to-hf,check}")
    csub.required = True

    s = csub.add_parser("hf-to-mcore", help="HF checkpoint -> Megatron dist checkpoint (torch_dist, any layout)")
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

    s = csub.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF checkpoint (transformers/vLLM)")
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

    s = csub.add_parser("check", help="Megatron logits at a layout vs transformers on one chat sample")
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
