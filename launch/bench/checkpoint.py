"""``mgrpo bench checkpoint``: training-checkpoint save and load time and peak host memory on CPU ranks.

1. An HF checkpoint: ``--hf-dir``, or the full-width Qwen3-Omni-layout one of ``mgrpo bench convert``
   generated with ``--layers`` decoder layers (hidden 2048, 128 experts x 768, vocab 152064, full
   audio tower; ``--layers 4`` ~3.1B thinker parameters).
2. ``--ranks`` gloo ranks at ``--save-layout`` build the engine (megatron DDP, distributed Adam,
   ``--dtype`` weights, fp32 main parameters), give Adam its state (zeros, step 0: a checkpoint with
   every moment, without a training step) and time ``save_checkpoint`` then ``load_checkpoint``.
3. ``--load-ranks`` ranks at ``--load-layout`` build the engine again and time ``load_checkpoint`` of
   that checkpoint (a resume at another layout).

The summed RSS of every rank (and this process) is sampled every 50 ms; each phase's peak comes from
the samples between the ranks' marks. Writes ``bench_checkpoint.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import time
from pathlib import Path

from launch.bench._cli import bench_main
from launch.cli_help import doc_description

__all__ = ["run_bench", "add_parser", "parse_layout"]

GB = 1e9


def parse_layout(text: str) -> dict:
    """``"tp=2,ep=2"`` -> ``{"tp": 2, "ep": 2}`` (keys of ``ParallelLayout``; empty: all 1)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, sep, v = part.partition("=")
        if not sep or k not in ("tp", "ep", "etp", "pp") or not v.isdigit() or int(v) < 1:
            raise argparse.ArgumentTypeError(f"layout {text!r}: want comma-separated tp=N, ep=N, etp=N, pp=N")
        out[k] = int(v)
    return out


def _rank(hf_dir: str, run_dir: str, layout: dict, dtype_name: str, save: bool, async_save: bool = False) -> dict:
    """One rank: build, (save,) load; wall-clock marks of every phase."""
    import torch

    from megatron_grpo.engine.checkpoint import init_optimizer_state, load_checkpoint, save_checkpoint
    from megatron_grpo.engine.checkpoint_async import start_checkpoint
    from megatron_grpo.engine.setup import OptimConfig, build_engine
    from model_bridge.config import ParallelLayout
    from model_bridge.parallel import destroy_parallel, init_parallel

    torch.set_num_threads(1)
    marks = {"start": time.time()}
    init_parallel(**layout)
    engine = build_engine(hf_dir, ParallelLayout(**layout), OptimConfig(), dtype=getattr(torch, dtype_name))
    init_optimizer_state(engine.optimizer)
    params = sum(p.numel() for m in engine.modules for p in m.parameters())
    marks["built"] = time.time()
    if save and async_save:  # the step would go on after "save_started"; here it waits for the write
        pending = start_checkpoint(run_dir, 1, engine.model, engine.optimizer, engine.scheduler, {"data": None},
                                   keep_last=None)
        marks["save_started"] = time.time()
        pending.wait()
        marks["saved"] = time.time()
    elif save:
        save_checkpoint(run_dir, 1, engine.model, engine.optimizer, engine.scheduler, {"data": None}, keep_last=None)
        marks["saved"] = time.time()
    load_checkpoint(run_dir, engine.model, engine.optimizer, engine.scheduler)
    marks["loaded"] = time.time()
    destroy_parallel()
    return {"marks": marks, "rank_params": params}


def _phases(results: list, samples: list, wall0: float, phases: list) -> dict:
    """Per phase: the slowest rank's seconds and the peak summed RSS between the marks."""
    out = {}
    for name, a, b in phases:
        start = min(r["marks"][a] for r in results)
        end = max(r["marks"][b] for r in results)
        peak = max((s for t, s, _ in samples if start <= wall0 + t <= end), default=0)
        out[name] = {"seconds": round(max(r["marks"][b] - r["marks"][a] for r in results), 2),
                     "peak_rss_gb": round(peak / GB, 2)}
    return out


def _spawned(ranks: int, *args) -> tuple[list, list, float]:
    import os

    from launch.bench.convert import RssSampler
    from model_bridge.spawn import run_ranks

    sampler = RssSampler(os.getpid())
    wall0 = time.time() - (time.perf_counter() - sampler.t0)
    sampler.start()
    try:
        results = run_ranks(_rank, ranks, *args, timeout=None, env={"CUDA_VISIBLE_DEVICES": ""})
    finally:
        sampler.stop()
    return results, sampler.samples, wall0


def run_bench(out_dir, *, hf_dir=None, layers: int = 4, audio_layers: int = 8, ranks: int = 1,
              save_layout: dict | None = None, load_ranks: int | None = None, load_layout: dict | None = None,
              dtype: str = "bfloat16", work_dir=None, keep: bool = False, async_save: bool = False) -> dict:
    from launch.bench.convert import _machine, write_checkpoint

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(work_dir) if work_dir else out / "work"
    work.mkdir(parents=True, exist_ok=True)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": _machine(), "command": "mgrpo bench checkpoint " + " ".join(sys.argv[1:]), "dtype": dtype}
    if hf_dir is None:
        hf_dir = work / "hf"
        gen = write_checkpoint(hf_dir, layers=layers, audio_layers=audio_layers, progress=False)
        result["generated_hf"] = {"layers": layers, "audio_layers": audio_layers, "bytes": gen["bytes"]}
    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    save_layout = save_layout or {}
    res, samples, wall0 = _spawned(ranks, str(hf_dir), str(run_dir), save_layout, dtype, True, async_save)
    ckpt = next((run_dir / "checkpoints").glob("step_*"))
    result["params"] = sum(r["rank_params"] for r in res)  # replicated parameters counted once per rank
    result["checkpoint_bytes"] = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    phases = [("build", "start", "built"), ("save", "built", "saved"), ("load_same_layout", "saved", "loaded")]
    if async_save:  # the part of the save that holds the training step up, and the background write
        phases[2:2] = [("save_blocking", "built", "save_started"), ("save_write", "save_started", "saved")]
    result["save"] = {"ranks": ranks, "layout": save_layout, "async": async_save, **_phases(res, samples, wall0, phases)}
    if load_layout is not None:
        n = load_ranks or ranks
        res, samples, wall0 = _spawned(n, str(hf_dir), str(run_dir), load_layout, dtype, False)
        result["load_other_layout"] = {"ranks": n, "layout": load_layout,
                                       **_phases(res, samples, wall0, [("build", "start", "built"),
                                                                       ("load", "built", "loaded")])}
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    (out / "bench_checkpoint.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def _cmd(args: argparse.Namespace) -> int:
    r = run_bench(args.out, hf_dir=args.hf_dir, layers=args.layers, audio_layers=args.audio_layers, ranks=args.ranks,
                  save_layout=args.save_layout, load_ranks=args.load_ranks, load_layout=args.load_layout,
                  dtype=args.dtype, work_dir=args.work_dir, keep=args.keep, async_save=args.async_save)
    print(json.dumps({k: r[k] for k in ("params", "checkpoint_bytes", "save", "load_other_layout") if k in r},
                     indent=1))
    return 0


def add_parser(bsub) -> argparse.ArgumentParser:
    s = bsub.add_parser("checkpoint", help="training checkpoint save/load time and peak host memory (CPU ranks)",
                        description=doc_description(__doc__))
    s.add_argument("--out", default="bench_results/checkpoint", help="results directory (JSON)")
    s.add_argument("--hf-dir", default=None, help="HF checkpoint to build from (default: generate a full-width one)")
    s.add_argument("--layers", type=int, default=4, help="decoder layers of the generated checkpoint (4: ~3.1B)")
    s.add_argument("--audio-layers", type=int, default=8, help="audio encoder layers of the generated checkpoint")
    s.add_argument("--ranks", type=int, default=1, help="ranks that save (and load at the same layout)")
    s.add_argument("--save-layout", type=parse_layout, default={}, help="e.g. tp=2 (default: all 1)")
    s.add_argument("--load-ranks", type=int, default=None, help="ranks of the load at another layout")
    s.add_argument("--load-layout", type=parse_layout, default=None, help="e.g. tp=1,ep=2: also load there")
    s.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="model weights")
    s.add_argument("--work-dir", default=None, help="where the checkpoints go (default OUT/work)")
    s.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    s.add_argument("--async-save", action="store_true",
                   help="save as checkpoint.async_save does: time the blocking part and the background write")
    s.set_defaults(func=_cmd)
    return s


def main(argv=None) -> int:
    """``python -m launch.bench.checkpoint ARGS`` == ``mgrpo bench checkpoint ARGS``."""
    return bench_main("checkpoint", add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
