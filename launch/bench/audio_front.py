"""``mgrpo bench audio_front``: the audio tower's conv front-end alone, fused against unfused.

``fused``: the first conv + bias + GELU in one Triton pass from the mel image and each 480-channel
conv's bias + GELU in one pass (``model_bridge/modeling/audio_conv_fused.py``); ``unfused``: the
first conv as a GEMM with the bias in its epilogue, cuDNN's conv with its bias, ``F.gelu``
(``MGRPO_TRITON_AUDIO_CONV=0``). Both run side by side in one process, rounds alternating.

One step is what the trainer runs for a group's shared recordings: a pass without autograd, a pass
with it, and the backward of ``sum(out^2)`` (model_bridge/modeling/shared_audio.py), over
``--chunks`` 100-frame chunks of ``--mels`` bins in parts of ``--part`` chunks (the tower's
``conv_chunksize``), ``--channels`` channels. The JSON gives each path's median step time, its peak
memory above the inputs (CUDA), and the largest difference between the two paths' outputs and
weight gradients relative to their magnitude.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from launch.cli_help import doc_description
from launch.bench._cli import positive_int

__all__ = ["run_bench", "add_parser", "main"]


def run_bench(out_dir, chunks: int = 3850, part: int = 500, channels: int = 480, mels: int = 128,
              iters: int = 3, device: str | None = None, seed: int = 0) -> dict:
    import torch

    from model_bridge.modeling.audio_conv import conv_front_end
    from model_bridge.modeling.audio_conv_fused import fused_conv_available

    from ._layers_timing import _env
    from ._train_systems import _sync

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(seed)
    # chunks as the tower lays them out: a transposed view of [K, frames, bins]
    x = torch.randn(chunks, 100, mels, generator=g).to(dev, dtype).transpose(1, 2).unsqueeze(1)
    params = [((torch.randn(channels, 1 if i == 0 else channels, 3, 3, generator=g) * (0.3 if i == 0 else 0.02))
               .to(dev, dtype).requires_grad_(),
               (torch.randn(channels, generator=g) * 0.1).to(dev, dtype).requires_grad_()) for i in range(3)]
    flat = [t for p in params for t in p]
    paths = {"unfused": lambda xs, ps: conv_front_end(xs, ps, fused=False)}
    if fused_conv_available(x):
        paths["fused"] = lambda xs, ps: conv_front_end(xs, ps, fused=True)

    def step(fn):
        with torch.no_grad():
            for p in x.split(part):
                fn(p, params)
        out = torch.cat([fn(p, params) for p in x.split(part)])
        grads = torch.autograd.grad(out.float().square().sum(), flat)
        return out.detach(), grads

    results = {n: step(fn) for n, fn in paths.items()}  # warm-up (Triton compiles), kept to compare
    times = {n: [] for n in paths}
    peaks = {n: 0 for n in paths}
    for _ in range(iters):
        for n, fn in paths.items():
            _sync(dev)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
                base = torch.cuda.memory_allocated(dev)
            t0 = time.perf_counter()
            step(fn)
            _sync(dev)
            times[n].append(time.perf_counter() - t0)
            if dev.type == "cuda":
                peaks[n] = max(peaks[n], torch.cuda.max_memory_allocated(dev) - base)
    res = {"env": _env(dev), "device": str(dev), "dtype": str(dtype).split(".")[-1], "chunks": chunks,
           "part": part, "channels": channels, "mels": mels, "iters": iters, "fused_available": "fused" in paths,
           "paths": {n: {"step_s": v, "step_s_median": statistics.median(v),
                         "peak_gib": peaks[n] / 2**30 if dev.type == "cuda" else None} for n, v in times.items()}}
    if "fused" in paths:
        (a, ga), (b, gb) = results["unfused"], results["fused"]

        def rel(u, v):
            return float((u.float() - v.float()).abs().max() / u.float().abs().max().clamp_min(1e-30))

        res["max_rel_diff"] = {"output": rel(a, b), "grads": max(rel(u, v) for u, v in zip(ga, gb))}
        res["fused_vs_unfused_time"] = res["paths"]["fused"]["step_s_median"] / res["paths"]["unfused"]["step_s_median"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    argv = sys.argv[3:] if sys.argv[1:3] == ["bench", "audio_front"] else sys.argv[1:]
    res["command"] = " ".join(["mgrpo", "bench", "audio_front", *argv])
    (out / "bench_audio_front.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    for n, p in res["paths"].items():
        peak = "" if p["peak_gib"] is None else f", peak {p['peak_gib']:.1f} GiB"
        print(f"  {n:8s} {1e3 * p['step_s_median']:9.1f} ms{peak}")
    if "fused_vs_unfused_time" in res:
        print(f"  fused / unfused time {res['fused_vs_unfused_time']:.3f}; max relative difference {res['max_rel_diff']}")
    else:
        print("  fused: not available here (needs CUDA and Triton)")
    return res


def _cmd(args) -> int:
    run_bench(args.out, chunks=args.chunks, part=args.part, channels=args.channels, mels=args.mels,
              iters=args.iters, device=args.device, seed=args.seed)
    return 0


def add_parser(bsub) -> argparse.ArgumentParser:
    s = bsub.add_parser("audio_front", help="the audio tower's conv front-end, fused Triton passes vs unfused",
                        description=doc_description(__doc__))
    s.add_argument("--chunks", type=positive_int, default=3850, help="100-frame chunks per step (default 3850: "
                                                                 "bench train's distinct audio at 64 samples)")
    s.add_argument("--part", type=positive_int, default=500, help="chunks per call (the tower's conv_chunksize, 500)")
    s.add_argument("--channels", type=positive_int, default=480, help="conv channels (default 480, Qwen3-Omni's)")
    s.add_argument("--mels", type=positive_int, default=128, help="mel bins (default 128)")
    s.add_argument("--iters", type=positive_int, default=3, help="timed rounds per path, medians reported (default 3)")
    s.add_argument("--seed", type=int, default=0, help="seed of the inputs and weights")
    s.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    s.add_argument("--out", default="bench_results/audio_front", help="results directory (JSON)")
    s.set_defaults(func=_cmd)
    return s


def main(argv=None) -> int:
    """``python -m launch.bench.audio_front ARGS`` == ``mgrpo bench audio_front ARGS``."""
    from ._cli import bench_main

    return bench_main("audio_front", add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
