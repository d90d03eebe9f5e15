"""``mgrpo bench sync``: weight sync of the full Qwen3-Omni-30B-A3B thinker, trainer GPU -> receiver GPU.

What runs (two processes; on CUDA the trainer on ``cuda:0``, the receiver on ``cuda:1``):

* **trainer**: our thinker (megatron-core, ``--backend`` layer spec, default ``"torch"``: grouped
  experts as training runs it on the GPU machine) with the release's geometry and ``--layers``
  decoder layers (default 48: hidden 2048, 32/4 heads of 128, 128 experts x 768, vocab 152064) and
  ``--audio-layers`` audio-tower layers (default 32, full width), built on the meta device, then
  materialised with ``to_empty`` on the trainer's device and filled with random N(0, 0.02) values
  (``--dtype``, default bf16). It runs the real weight-sync stream:
  ``iter_buckets(export_hf(model), bucket_bytes)`` -> ``pack_bucket`` (one uint8 buffer per bucket,
  on the trainer's device) -> one broadcast per bucket;
* **receiver**: allocates each bucket's buffer from its metadata (``packed_layout``), receives the
  broadcast and rebuilds the HF-named tensors with ``unpack_bucket`` (views: the ``(name, tensor)``
  pairs vLLM's ``model.load_weights`` is handed). Nothing else is done with them in the timed runs.

Transports (``--transport``): ``pg`` (default on CUDA) is a two-rank torch process group of its own
(NCCL on CUDA, gloo on CPU) carrying the packed buckets, with up to ``--buffers`` buckets in flight
(the next bucket is exported and packed while the previous one is on the wire); ``gloo`` (default on
CPU) is the product's CPU transport itself: :class:`megatron_grpo.weight_sync.gloo.GlooTransport` on
the trainer and ``join_gloo_group`` + ``recv_bucket`` (what our vLLM-side engine calls) on the
receiver, one bucket at a time. In production the GPU path is vLLM's NCCL engine driven by
:class:`~megatron_grpo.weight_sync.nccl.NcclTransport`; vLLM is not installed on the GPU machine, so
``pg`` moves the same bytes with our bucket format over plain NCCL. The bucket metadata (names,
dtypes, shapes; HTTP in production, concurrent with the bytes) is sent to the receiver once, before
timing, from ``export_plan`` of the meta model; the trainer checks that every exported bucket matches it.

Measured in the same run, same process pair, same bytes (payload = the tensors' bytes, GB = 1e9 B):

* **raw**: one broadcast of the payload's byte count (the transport's bandwidth ceiling);
* **raw_bucketed**: broadcasts of the same bucket sizes back to back from a preallocated buffer
  (the per-collective overhead of bucketing, no export or packing);
* **pipelined** (the headline): the whole stream as described, timed from the trainer's first
  ``export_hf`` step to the receiver's last unpacked bucket (both processes start after a barrier;
  their monotonic clocks are the host's);
* **serial**: the same with a device synchronisation after every phase of every bucket, for the
  per-phase breakdown: trainer ``export`` (``export_hf`` + bucketing), ``pack``, ``broadcast``;
  receiver ``receive`` (allocate + broadcast) and ``unpack``. With the ``gloo`` transport
  ``recv_bucket`` does receive and unpack in one call (reported as ``receive``).

Each is run ``--warmup`` + ``--iters`` times (medians reported). A last, untimed pass checks the
result: every tensor the receiver rebuilt must have the name, shape and dtype ``export_hf`` yielded
and the same bytes (two integer checksums of the raw bytes per tensor, on the device).

Targets: the 30B thinker's ~61 GB in <= 0.5 s, and >= 75% of the raw broadcast bandwidth.

Outputs under ``--out``: ``bench_sync.json`` (every number, the environment, the tensor and bucket
counts) and ``bench_sync.png``.
``--tiny`` shrinks the widths (hidden 64, 8 experts, ...) so the
whole benchmark runs on a CPU in seconds (with ``--layers 48 --experts 128`` it keeps the release's
18,900 tensors: the per-tensor host overhead without the bytes).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from launch.bench._cli import bench_main
# the pieces (shared plumbing and checks, transports, raw bandwidth, trainer, receiver, reporting) live in
# launch.bench._sync_*; the names below stay importable from here
from launch.bench._sync_common import (_DIGEST_CHUNK, GB, TARGET_GB, TARGET_SECONDS,  # noqa: F401
                                       TARGET_VS_RAW, _checkpoint_layout, _Ctrl, sync_config, tensor_digest)
from launch.bench._sync_receiver import _receiver
from launch.bench._sync_report import _plot, _print_summary
from launch.bench._sync_trainer import _trainer
from launch.cli_help import doc_description

__all__ = ["sync_config", "tensor_digest", "run_bench", "add_parser", "TARGET_SECONDS", "TARGET_VS_RAW"]


def _rank_main(opts: dict):
    rank = int(os.environ["RANK"])
    ctrl_port = int(os.environ["MASTER_PORT"])
    ctrl = _Ctrl(ctrl_port, rank, opts["timeout_s"])
    out = (_trainer if rank == 0 else _receiver)(opts, ctrl)
    # the trainer hosts the store: it leaves only once the receiver is done with it
    if rank == 0:
        ctrl.get("receiver_done")
    else:
        ctrl.put("receiver_done", True)
    return out


def run_bench(out_dir, layers: int = 48, audio_layers: int = 32, bucket_mb: int | None = None, dtype: str = "bf16",
              iters: int = 3, warmup: int = 1, device: str | None = None, transport: str | None = None,
              buffers: int = 2, tiny: bool = False, experts: int | None = None, backend: str = "torch",
              seed: int = 0, keep_tensors: bool = False, quiet: bool = False, timeout_s: float = 1800,
              plot: bool = True) -> dict:
    """Run the benchmark (module docstring); returns the trainer's results and writes them under out_dir.
    ``keep_tensors`` (tests, tiny sizes) also returns every sent and received tensor on the CPU."""
    import torch

    from model_bridge.spawn import run_ranks
    from megatron_grpo.weight_sync.buckets import CPU_BUCKET_BYTES, GPU_BUCKET_BYTES

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(f"bench sync on CUDA needs 2 GPUs (trainer cuda:0, receiver cuda:1); this machine has "
                         f"{torch.cuda.device_count()}. Use --device cpu for the gloo path.")
    transport = transport or ("pg" if device == "cuda" else "gloo")
    if transport == "gloo" and device == "cuda":
        raise SystemExit("--transport gloo is the product's CPU transport: use it with --device cpu")
    if bucket_mb is None:
        bucket_mb = (GPU_BUCKET_BYTES if device == "cuda" else CPU_BUCKET_BYTES) // 2**20
    opts = dict(layers=layers, audio_layers=audio_layers, bucket_mb=float(bucket_mb), dtype=dtype, iters=iters,
                warmup=warmup, device=device, transport=transport, buffers=buffers, tiny=tiny, experts=experts,
                backend=backend, seed=seed, keep_tensors=keep_tensors, quiet=quiet, timeout_s=timeout_s)
    env = {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else None
    t0 = time.time()
    values = run_ranks(_rank_main, 2, opts, timeout=timeout_s, env=env)
    res, rx = values
    res["receiver"] = rx
    res["wall_s"] = time.time() - t0
    argv = sys.argv[3:] if sys.argv[1:3] == ["bench", "sync"] else sys.argv[1:]
    res["command"] = " ".join(["mgrpo", "bench", "sync", *argv])
    tensors = res.pop("tensors", None)
    (out / "bench_sync.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    if plot:
        _plot(res, out / "bench_sync.png")
    if not quiet:
        _print_summary(res)
    if tensors is not None:
        res["tensors"] = tensors
    return res


def _cmd(args: argparse.Namespace) -> int:
    if args.senders is not None:  # the multi-source data plane and the push-time model (sync_scale.py)
        from launch.bench.sync_scale import bench_senders

        if args.senders < 1:
            raise SystemExit(f"--senders must be >= 1, got {args.senders}")
        bench_senders(args.out, args.senders, args.payload_mb, args.bucket_mb or 16, args.iters, args.warmup,
                      args.timeout)
        return 0
    res = run_bench(args.out, layers=args.layers, audio_layers=args.audio_layers, bucket_mb=args.bucket_mb,
                    dtype=args.dtype, iters=args.iters, warmup=args.warmup, device=args.device,
                    transport=args.transport, buffers=args.buffers, tiny=args.tiny, experts=args.experts,
                    backend=args.backend, seed=args.seed, timeout_s=args.timeout)
    return 0 if res["check"]["ok"] else 1


def add_parser(bsub) -> argparse.ArgumentParser:
    s = bsub.add_parser("sync", help="weight sync (export_hf -> buckets -> broadcast -> unpack) of the 30B "
                                     "thinker between two GPUs, against raw NCCL bandwidth",
                        description=doc_description(__doc__))
    s.add_argument("--layers", type=int, default=48, help="decoder layers (default 48, the release's)")
    s.add_argument("--audio-layers", type=int, default=32,
                   help="audio-tower layers (default 32, the release's; 0: no audio tower)")
    s.add_argument("--out", default="bench_results/sync", help="results directory (JSON, PNG)")
    s.add_argument("--bucket-mb", type=float, default=None,
                   help="bucket size in MiB (default: the product's, 512 on GPU, 64 on CPU)")
    s.add_argument("--dtype", default="bf16", help="model (and pushed) dtype: bf16, fp16 or fp32")
    s.add_argument("--iters", type=int, default=3, help="timed runs of each kind (median reported)")
    s.add_argument("--warmup", type=int, default=1, help="untimed runs before them")
    s.add_argument("--device", default=None, choices=["cuda", "cpu"],
                   help="cuda (default when available: needs 2 GPUs) or cpu (gloo between two processes)")
    s.add_argument("--transport", default=None, choices=["pg", "gloo"],
                   help="pg: a two-rank torch process group, NCCL on CUDA (default there); gloo: the product's "
                        "CPU transport, GlooTransport + recv_bucket (default on CPU)")
    s.add_argument("--buffers", type=int, default=2, help="buckets in flight at once with --transport pg")
    s.add_argument("--tiny", action="store_true", help="tiny widths (a CPU run of the whole benchmark in seconds)")
    s.add_argument("--experts", type=int, default=None, help="experts per layer (default: the geometry's)")
    s.add_argument("--backend", default="torch",
                   help="layer-spec backend of the model (default torch: grouped experts)")
    s.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    s.add_argument("--timeout", type=float, default=1800, help="seconds before the processes are killed")
    s.add_argument("--senders", type=int, default=None,
                   help="instead: N gloo sender processes into one receiver as a multi-source push runs them "
                        "(against 1 sender), plus the 30B recipe's push-time model at 1-8 trainer nodes "
                        "(launch/bench/sync_scale.py; writes bench_sync_senders.json)")
    s.add_argument("--payload-mb", type=float, default=256, help="with --senders: MiB pushed per run (default 256)")
    s.set_defaults(func=_cmd)
    return s


def main(argv=None) -> int:
    """``python -m launch.bench.sync ARGS`` == ``mgrpo bench sync ARGS``."""
    return bench_main("sync", add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
