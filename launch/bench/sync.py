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

``--ep N`` (N > 1; :mod:`launch.bench._sync_ep`): the trainer as an EP-N job, N + 1 processes. Trainer
rank r (``cuda:r``) is rank r of a megatron job of its own (world N: EP = N, TP = ETP = PP = 1; dense
weights replicated, experts [r E/N, (r+1) E/N)); the receiver (``cuda:N``) is in no megatron group.
Every process fills its parameters from one deterministic HF-space source (each HF tensor
N(0, 0.02), generated from ``--seed`` and its name, loaded through the mapping table), so the EP
ranks hold exactly their shares of one set of weights. The data plane is one stateless (N + 1)-rank
process group (``weight_sync.direct.p2p_group``: NCCL on CUDA, gloo on CPU) carrying only
point-to-point sends from trainers to the receiver. Two modes, same run, same bytes:

* **direct** (:mod:`megatron_grpo.weight_sync.direct`): each EP rank streams its OWN ``export_hf``
  tensors (its experts; EP rank 0 also every non-expert tensor, which under EP only data-parallel
  rank 0 yields) in packed buckets straight to the receiver, all ranks at once, up to ``--buffers``
  buckets in flight per sender. The receiver is handed every sender's bucket plan before timing (each
  rank's ``export_plan`` of its meta model, cut like ``iter_buckets``; the control store stands in for
  HTTP) and receives in one global order (bucket k of every sender in rank order, then bucket k + 1),
  rebuilding the HF-named tensors with ``unpack_bucket``;
* **gather** (today's product path): ``weight_sync.gather.export_to_rank0`` streams every rank's
  tensors to rank 0 over the trainers' own group, and rank 0 sends that single-rank-ordered stream in
  buckets to the receiver over the data-plane group (its plan from ``gather.export_order``, before timing).

Also timed: **raw_direct** (every sender its direct bucket sizes at once, from a preallocated buffer:
the ceiling of direct) and **raw_single** (all of those buckets from rank 0 alone: the ceiling of
gather's last leg). A pass is timed from the first process's start (all N + 1 start after a barrier)
to the last one's end; GB/s = payload / seconds (medians of ``--iters`` after ``--warmup``). One more
serial pass per mode (each phase finished and synchronised) gives the phases of every process: direct
senders ``export`` / ``pack`` / ``send``; gather rank 0 ``gather`` (waiting on ``export_to_rank0``: its
own export plus the other ranks' buckets) / ``pack`` / ``send``, other ranks
``export_and_send_to_rank0``; the receiver ``receive`` / ``unpack``. The check (one more untimed pass
of each mode): every tensor the receiver rebuilt has the name, dtype, shape and bytes (checksums as
above) its sender exported, and the receiver's tensors of both modes equal a single-rank ``export_hf``
of the same weights (the receiver builds the EP1 model from the same source after the runs; gather
also in the single-rank order).

Why ``--ep N`` cannot hang: all N + 1 processes run one sequence of phases (``_sync_ep._body``, the
same code on every process) separated by barriers of the control store, and inside a phase the only
blocking operations are (a) the trainers' own megatron collectives (``init_parallel``,
``export_order``, ``export_to_rank0``: gather.py's argument; the receiver takes no part in them),
(b) data-plane sends / receives, in the one order of ``weight_sync.direct`` (its argument: each
sender's ops are a subsequence of the receiver's, direct's export makes no collective, so by
induction over that order every op completes), and (c) store reads of keys that another process sets
unconditionally earlier in the same or a previous phase. In gather mode rank 0 interleaves its sends
to the receiver with ``export_to_rank0``'s operations on the trainers' group: the receiver waits only on
rank 0's sends, in rank 0's order, and does nothing else, so each send of rank 0 completes once posted
and rank 0 never waits on the other trainers through the receiver. Should a process stall anyway
(e.g. a peer died), each phase is armed on a :class:`megatron_grpo.guard.Watchdog`: past
``--hang-timeout`` (default 300 s) the process dumps its stacks (``hang-rank{R}-step{S}.txt`` under
``--out``) and exits, and the other processes are stopped; the process groups time out after that
plus 120 s, the whole run after ``--timeout``. On CUDA ``--ep N`` needs N + 1 GPUs (NCCL cannot put
two ranks of one group on one GPU): ``--ep 4`` runs on 5 of an 8-GPU host, ``--ep 2`` on 3 of a
4-GPU host.

Outputs under ``--out``: ``bench_sync.json`` (every number, the environment, the tensor and bucket
counts) and ``bench_sync.png`` (``--ep N``: ``bench_sync_ep{N}.json`` and ``bench_sync_ep{N}.png``).
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
              plot: bool = True, ep: int = 1, hang_timeout_s: float = 300.0) -> dict:
    """Run the benchmark (module docstring); returns the trainer's results and writes them under out_dir.
    ``keep_tensors`` (tests, tiny sizes) also returns every sent and received tensor on the CPU (``ep`` > 1:
    the receiver's tensors of each mode and the single-rank reference export's). ``ep`` > 1: the EP run
    (module docstring, "--ep N"), ``hang_timeout_s`` its per-phase watchdog limit."""
    import torch

    from model_bridge.spawn import run_ranks
    from megatron_grpo.weight_sync.buckets import CPU_BUCKET_BYTES, GPU_BUCKET_BYTES

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if ep < 1:
        raise SystemExit(f"--ep must be >= 1, got {ep}")
    if ep > 1:
        return _run_bench_ep(out, ep, dict(
            layers=layers, audio_layers=audio_layers, bucket_mb=bucket_mb, dtype=dtype, iters=iters, warmup=warmup,
            device=device, transport=transport, buffers=buffers, tiny=tiny, experts=experts, backend=backend,
            seed=seed, keep_tensors=keep_tensors, quiet=quiet, timeout_s=timeout_s, hang_timeout_s=hang_timeout_s),
            plot)
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


def _run_bench_ep(out: Path, ep: int, opts: dict, plot: bool) -> dict:
    """``--ep N``: N trainer processes (EP = N) + one receiver, modes direct and gather (module docstring)."""
    import torch

    from launch.bench._sync_ep import run_bench_ep
    from launch.bench._sync_report import _plot_ep, _print_summary_ep
    from megatron_grpo.weight_sync.buckets import CPU_BUCKET_BYTES, GPU_BUCKET_BYTES

    device = opts["device"]
    if device == "cuda" and torch.cuda.device_count() < ep + 1:
        raise SystemExit(f"bench sync --ep {ep} on CUDA needs {ep + 1} GPUs (trainer ranks on cuda:0..{ep - 1}, the "
                         f"receiver on cuda:{ep}); this machine has {torch.cuda.device_count()}. Use --device cpu "
                         "for the gloo path.")
    if opts["transport"] not in (None, "pg"):
        raise SystemExit(f"--ep {ep} sends over its own {ep + 1}-rank process group (--transport pg: NCCL on CUDA, "
                         f"gloo on CPU); --transport {opts['transport']} is the one-sender product transport")
    experts = opts["experts"] or sync_config(1, 0, opts["tiny"])["thinker_config"]["text_config"]["num_experts"]
    if experts % ep:
        raise SystemExit(f"--ep {ep} must divide the number of experts ({experts})")
    if opts["bucket_mb"] is None:
        opts["bucket_mb"] = (GPU_BUCKET_BYTES if device == "cuda" else CPU_BUCKET_BYTES) // 2**20
    opts.update(transport="pg", bucket_mb=float(opts["bucket_mb"]), ep=ep, out=str(out))
    t0 = time.time()
    res, values = run_bench_ep(opts, opts["timeout_s"])
    res["wall_s"] = time.time() - t0
    res["processes"] = [{k: v for k, v in x.items() if k != "tensors"} for x in values]
    argv = sys.argv[3:] if sys.argv[1:3] == ["bench", "sync"] else sys.argv[1:]
    res["command"] = " ".join(["mgrpo", "bench", "sync", *argv])
    (out / f"bench_sync_ep{ep}.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    if plot:
        _plot_ep(res, out / f"bench_sync_ep{ep}.png")
    if not opts["quiet"]:
        _print_summary_ep(res)
    if opts["keep_tensors"]:
        res["tensors"] = values[ep]["tensors"]
    return res


def _cmd(args: argparse.Namespace) -> int:
    res = run_bench(args.out, layers=args.layers, audio_layers=args.audio_layers, bucket_mb=args.bucket_mb,
                    dtype=args.dtype, iters=args.iters, warmup=args.warmup, device=args.device,
                    transport=args.transport, buffers=args.buffers, tiny=args.tiny, experts=args.experts,
                    backend=args.backend, seed=args.seed, timeout_s=args.timeout, ep=args.ep,
                    hang_timeout_s=args.hang_timeout)
    return 0 if res["check"]["ok"] else 1


def add_parser(bsub) -> argparse.ArgumentParser:
    s = bsub.add_parser("sync", help="weight sync (export_hf -> buckets -> broadcast -> unpack) of the 30B "
                                     "thinker between two GPUs, against raw NCCL bandwidth",
                        description=__doc__.split("\n\n")[0])
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
    s.add_argument("--ep", type=int, default=1,
                   help="expert parallelism of the trainer (default 1: one trainer process); N > 1: N trainer "
                        "processes (cuda:0..N-1) + a receiver (cuda:N), modes direct (each EP rank sends its own "
                        "tensors) and gather (export_to_rank0, then rank 0 sends)")
    s.add_argument("--hang-timeout", type=float, default=300.0,
                   help="with --ep > 1: a phase of one process running longer dumps its stacks into --out and "
                        "ends the run (default 300 s)")
    s.add_argument("--timeout", type=float, default=1800, help="seconds before the processes are killed")
    s.set_defaults(func=_cmd)
    return s


def main(argv=None) -> int:
    """``python -m launch.bench.sync ARGS`` == ``mgrpo bench sync ARGS``."""
    return bench_main("sync", add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
