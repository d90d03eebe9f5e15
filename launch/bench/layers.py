"""``mgrpo bench layers``: N full-width Qwen3-Omni thinker layers, fwd+bwd bf16, ours vs HF vs megatron local.

What runs (one process, one GPU; all systems get the same weights and the same tokens):

* **ours**: :func:`model_bridge.modeling.thinker.build_thinker` with the ``"torch"`` layer-spec
  backend (varlen attention without host syncs, grouped-GEMM experts, sort-based token permutation),
  the whole batch packed into one THD micro-batch;
* **ours_mb**: the same, the batch packed into micro-batches of at most ``--mb-tokens`` tokens
  (first-fit decreasing, gradients accumulated): less activation memory for some throughput;
* **ours_rc**, **ours_mb_rc**: ``ours`` / ``ours_mb`` built with ``recompute="experts"`` (the
  experts' sorted input rows and SwiGLU output recomputed in the backward, ``modeling/recompute.py``);
  **ours_full_rc**: ``recompute="full"`` (megatron's full recomputation of every layer);
* **ours_sepqkn**, **ours_mb_sepqkn**: ``ours`` / ``ours_mb`` with the q/k RMSNorms run as separate
  kernels (``MGRPO_TRITON_QK_NORM_ROPE=0`` while they run; every other ``ours*`` fuses them into the
  RoPE kernel, ``modeling/rope.py``);
* **ours_graph**, **ours_mb_graph**: ``ours`` / ``ours_mb`` with the whole step (every
  micro-batch's forward and backward) captured once as one CUDA graph and replayed (CUDA only;
  ``_layers_ours._graph_step``): the same kernels with no host work between them, which the step
  allows because it makes no host sync and has no shape the host must read. What the host's
  Python costs per step is ``ours_mb`` minus ``ours_mb_graph``. ``mgrpo train`` does not capture
  graphs (yet). Checked in the run: the replay's output equals the eager step's bit for bit, and
  its gradients are as close to an eager step's as two eager steps are to each other (JSON
  ``graph_output_equals_eager``, ``graph_grad_rel_diff_vs_eager``, ``eager_grad_rel_diff_run_to_run``);
* **hf_bs1**: transformers' ``Qwen3OmniMoeThinkerTextModel`` (sdpa attention, ``grouped_mm``
  experts), one sample at a time (what users with batch size 1 run), gradients accumulated;
* **hf_bs4**: the same model on right-padded batches of 4 samples (in batch order);
* **mcore_local**: our ``"local"`` backend: megatron-core's local spec (``SequentialMLP``, a
  per-expert loop) with our packed core attention, packed like ours;
* **kernel ceiling**: ``F.grouped_mm`` (both expert GEMMs, forward and backward, with the token
  counts per expert that ours saw in each layer), ``varlen_attn`` (causal GQA, the batch's
  ``cu_seqlens``) and the dense GEMMs (qkv, output projection, router) micro-benchmarked in the
  same run on the same shapes, right after ours. Their summed time is what the layers would take
  if they did nothing but these kernels; ``ours / ceiling`` is ceiling time over our time. A
  stricter ceiling rides along: the same parts back to back in one timed step (no host gaps
  between them), taking turns with our step so that both run in the same GPU state (an H200 at
  its power limit lowers its clocks under back-to-back work); ``ours_vs_kernel_ceiling_back_to_back``;
* **kernel ceiling at the micro-batches** (JSON ``kernel_ceiling_micro_batches``; with a
  micro-batched system): the same parts at each micro-batch's own shapes (its lengths, the expert
  counts it routed), summed over the micro-batches: what these kernels need when the batch is cut
  into ``--mb-tokens`` pieces (every piece writes every expert's weight gradient again).
  ``ours_mb*_vs_kernel_ceiling_at_micro_batches`` is that time over the system's, and
  ``kernel_ceiling_vs_at_micro_batches`` (the whole batch's ceiling over it) the most a
  micro-batched step can reach of the whole batch's ceiling with these kernels.

Geometry: Qwen3-Omni-30B-A3B's thinker (hidden 2048, 32 query / 4 KV heads of 128, 128 experts
top-8 of width 768, vocab 152064, RMSNorm eps 1e-6, interleaved MRoPE) with ``--layers`` layers;
token embedding in front, the final RMSNorm behind (no LM head); the loss is
``sum(final_hidden * R)`` with a fixed random ``R`` over real tokens, the product in bf16 summed in
fp32 (``_layers_timing.bench_loss``, the same for every system).
Router aux loss as in training (megatron: coefficient 0.001).

Batch (``DEFAULT_LENGTHS``, documented): 16 multi-turn audio-agent trajectories of 376-2,814
tokens, 22,800 in all: each is a prompt with a 30-200 s recording (13 audio tokens per second),
one to three ``crop_audio`` tool turns returning 5-30 s clips, and short assistant turns. Token ids
are random (routing is what matters for speed; weights are random N(0, 0.02) with HF's init).
``--tokens T`` rescales the lengths to about T tokens in all; ``--lengths 31500`` replaces the batch
(one 31,500-token trajectory: a 40-minute recording at 13 audio tokens per second and its turns).

Useful FLOPs (fwd+bwd = 3 x forward; padding, recomputation, norms, RoPE, embedding and the
router's softmax not counted), per layer over the real tokens ``T`` and samples of length ``L_i``:

    dense   = 2 T h (q + 2 kv) d  +  2 T (q d) h  +  2 T h E          (qkv, output proj, router)
    experts = 2 T k (h * 2F + F * h)                                   (gate/up and down GEMMs)
    attn    = sum_i 2 q d L_i (L_i + 1)                                (QK^T and PV, causal half)

with h=2048, q=32, kv=4, d=128, E=128, k=8, F=768. TFLOP/s = 3 (dense + experts + attn) N / time.
tok/s counts real tokens only.

Time: ``step ms`` is the median of ``--iters`` steps each timed alone (CUDA events, the host waits
for the GPU after each), so it includes the GPU's idle start while the host runs the step's
prologue (~1.5-2 ms for our thinker: the first kernels are small and megatron's Python is slow
to reach the first GEMM). ``piped ms`` (``step_s_pipelined``) is the mean of ``--iters`` steps run
back to back with no wait between them, as a trainer runs consecutive micro-batches: each step's
prologue overlaps the previous step's tail. Both are in the JSON, with both ratios to the kernel
ceiling (whose micro-benchmarks time each call alone too); the targets are checked on ``step ms``.
Two diagnostics split ``step ms`` (our single-GPU systems; ``_layers_timing.step_diagnostics``):
``GPU-bound`` (``step_s_gpu_bound_median``), each step queued by the host while a sleep kernel
holds the GPU, so the GPU never waits for the host (its kernels and launch gaps only), and ``idle
1st`` (``step_s_after_idle_median``), each step timed alone after 50 ms of GPU idle, so at the
clocks a short burst gets (an H200 at its power limit clocks lower under sustained work). ``step
ms`` minus ``idle 1st`` is the clocks' cost of back-to-back work; ``idle 1st`` minus ``GPU-bound``
the GPU's idle start while the host runs the prologue. Their ratios to the ceiling are in the JSON
(``*_gpu_bound_vs_kernel_ceiling``, ``*_after_idle_vs_kernel_ceiling``), not targets.

Outputs under ``--out``: ``bench_layers.json`` (every number, the environment, the commands),
``bench_layers.png`` (tok/s, TFLOP/s with the ceiling, peak memory), ``bench_layers_profile.txt``
(torch profiler tables of one step of ours, where the time goes, by kernel, host time and input
shapes; ``ours_sepqkn`` and ``ours_mb`` get ``bench_layers_profile_{name}.txt``).

Targets: ours >= 1.8x HF bs1 useful tok/s, >= 85% of the kernel ceiling, peak memory <= HF's.

``--ep N`` > 1 (ours only) runs twice in one invocation: first an **EP1 baseline** (one process
on GPU 0, all experts, rank 0's micro-batch), then **EP-N**: N processes (``run_ranks``, rank r on
GPU r, NCCL; gloo with ``--device cpu``), each holding ``E / N`` experts (megatron's all-to-all
token dispatcher), each with its own micro-batch of the *same size* as the EP1 one (the documented
lengths in a per-rank seeded order, token ids drawn per rank: :func:`rank_lengths`). Reported per
rank: tok/s and useful TFLOP/s per GPU, step time, peak memory, and the ratio to the EP1 baseline
(target: per-GPU tok/s >= ``ep_target(N)`` x EP1: 0.9 at EP2, 0.85 from EP4 on). A numerical check rides along: the
EP1 baseline also evaluates the loss on every EP rank's micro-batch, and each EP rank's loss on its
own micro-batch must equal it (``per_rank[r].loss_rel_diff``, relative to ``sum |out * R|``): the
sharded experts are the same experts. Every rank prints rank-prefixed, flushed progress lines;
each phase (init, build, steps, ...) is armed on a ``megatron_grpo.hang.Watchdog``
(``--hang-timeout``, default 300 s) that dumps the stuck rank's stacks into ``--out`` and ends it,
whereupon ``run_ranks`` stops the others; the process-group timeout is a little longer than that.
Profiles of EP runs go to ``bench_layers_ep{N}_profile_rank{r}.txt`` (one per rank).

``--tiny`` shrinks the geometry so the whole benchmark runs on a CPU (a smoke test of this script:
kernel ceilings and timings are then meaningless); ``--tiny --device cpu --ep 2 --dtype fp32`` is
the EP path on gloo that ``tests/launch/test_bench_layers_ep.py`` checks.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from launch.bench._cli import bench_main
# the pieces (geometry and batch, timing, HF reference, ours, kernel ceiling, the ranks, reporting) live in
# launch.bench._layers_*; the names below stay importable from here
from launch.bench._layers_ceiling import kernel_ceiling  # noqa: F401
from launch.bench._layers_geometry import (_DTYPES, DEFAULT_LENGTHS, FIRST_SPECIAL_TOKEN,  # noqa: F401
                                           TARGET_EP_VS_EP1, TARGET_VS_CEILING, TARGET_VS_HF_BS1, ep_target, geometry,
                                           lengths_for, make_batch, omni_config, pack_by_budget, rank_lengths,
                                           useful_flops)
from launch.bench._layers_hf import build_hf, hf_state_as_checkpoint, run_hf  # noqa: F401
from launch.bench._layers_ours import build_megatron, probe_losses, run_ours  # noqa: F401
from launch.bench._layers_ranks import _rank_main
from launch.bench._layers_report import _merge_ep, _plot, _print_table, _ratios  # noqa: F401
from launch.cli_help import doc_description

__all__ = ["DEFAULT_LENGTHS", "lengths_for", "rank_lengths", "geometry", "useful_flops", "probe_losses", "run_bench",
           "add_parser"]


def run_bench(out_dir, layers: int = 2, tokens: int | None = None, ep: int = 1, tiny: bool = False,
              systems=("ours", "ours_mb", "hf_bs1", "hf_bs4", "mcore_local"), warmup: int = 2, iters: int = 6,
              seed: int = 0, device: str | None = None, mb_tokens: int = 4096, dtype: str = "bf16",
              hang_timeout_s: float = 300.0, timeout_s: float = 1800.0) -> dict:
    """Run the benchmark (module docstring); write ``bench_layers.json`` / ``.png`` under out_dir and
    return the JSON's content. ``--ep N`` > 1: the EP1 baseline (one rank, GPU 0) then the N-rank run."""
    import torch

    from model_bridge.spawn import run_ranks

    if dtype not in _DTYPES:
        raise SystemExit(f"--dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if ep > 1 and device == "cuda" and torch.cuda.device_count() < ep:
        raise SystemExit(f"--ep {ep} needs {ep} GPUs, this machine has {torch.cuda.device_count()}")
    env = {"PYTHONUNBUFFERED": "1"}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo, even on a GPU machine
    elif "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ:
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"  # a timed-out collective aborts its rank
    t0 = time.time()

    def launch(world: int, run_systems, loss_batches: int, ceiling: bool, tag: str) -> list[dict]:
        print(f"[bench layers] starting {world} rank(s) ({tag or 'ep1'}, {device}); progress lines come from every "
              f"rank; a phase longer than {hang_timeout_s:.0f} s dumps stacks under {out} and stops the run",
              flush=True)
        return run_ranks(_rank_main, world, str(out), layers, tokens, world, tiny, list(run_systems), warmup, iters,
                         seed, device, mb_tokens, dtype, loss_batches, hang_timeout_s, ceiling, tag,
                         timeout=timeout_s, env=env)

    if ep == 1:
        res = launch(1, systems, 0, True, "")[0]
    else:
        if [x for x in systems if x != "ours"]:
            print(f"[bench layers] --ep {ep}: only 'ours' runs (EP1 baseline and EP{ep}); ignoring "
                  f"{[x for x in systems if x != 'ours']}", flush=True)
        base = launch(1, ["ours"], ep, False, "ep1")[0]
        res = _merge_ep(base, launch(ep, ["ours"], 0, False, f"ep{ep}"), ep)
    res["wall_s"] = time.time() - t0
    argv = sys.argv[3:] if sys.argv[1:3] == ["bench", "layers"] else sys.argv[1:]
    res["command"] = " ".join(["mgrpo", "bench", "layers", *argv])
    for s in res["systems"].values():
        s.pop("output", None)
    (out / "bench_layers.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    _plot(res, out / "bench_layers.png")
    _print_table(res)
    return res


def _cmd(args: argparse.Namespace) -> int:
    systems = [x for x in args.systems.split(",") if x]
    if args.routing_replay:
        systems += [x for x in ("ours", "ours_replay") if x not in systems]
    from launch.bench._layers_ours import OUR_SYSTEMS
    known = list(dict.fromkeys([*OUR_SYSTEMS, "hf_bs1", "hf_bs4", "mcore_local"]))
    unknown = [x for x in systems if x not in known]
    if unknown:
        print(f"mgrpo bench layers: --systems: unknown {', '.join(unknown)}; choose from {','.join(known)}",
              file=sys.stderr)
        return 2
    if args.lengths and args.tokens:
        print("mgrpo bench layers: give --tokens (rescale the documented batch) or --lengths (the batch "
              "itself), not both", file=sys.stderr)
        return 2
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x] if args.lengths else None
    except ValueError:
        lengths = None
    if args.lengths and (not lengths or min(lengths) < 2):
        print(f"mgrpo bench layers: --lengths {args.lengths!r}: give comma-separated token counts >= 2, e.g. "
              f"--lengths 31500", file=sys.stderr)
        return 2
    run_bench(args.out, layers=args.layers, tokens=lengths or args.tokens, ep=args.ep, tiny=args.tiny, systems=systems,
              warmup=args.warmup, iters=args.iters, seed=args.seed, device=args.device, mb_tokens=args.mb_tokens,
              dtype=args.dtype, hang_timeout_s=args.hang_timeout, timeout_s=args.timeout)
    return 0


def add_parser(bsub) -> argparse.ArgumentParser:
    s = bsub.add_parser("layers", help="N full-width thinker layers fwd+bwd: ours vs HF vs megatron local, "
                                       "with the kernel ceiling", description=doc_description(__doc__))
    s.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    s.add_argument("--tokens", type=int, default=None,
                   help="total tokens of the batch (default: the documented 16-sample batch, 22,800 tokens)")
    s.add_argument("--lengths", default=None,
                   help="comma-separated token counts of the batch's samples, replacing the documented batch "
                        "(e.g. 31500: one 40-minute recording's trajectory)")
    s.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks (> 1: ours only; an EP1 baseline on GPU 0, then N ranks with their "
                        "own micro-batch each: per-GPU throughput, ratio to EP1, per-rank loss check)")
    s.add_argument("--out", default="bench_results/layers", help="results directory (JSON, PNG, profile)")
    s.add_argument("--systems", default="ours,ours_mb,hf_bs1,hf_bs4,mcore_local",
                   help="comma-separated subset of ours,ours_rc,ours_mb,ours_mb_rc,ours_full_rc,ours_sepqkn,"
                        "ours_mb_sepqkn,ours_graph,ours_mb_graph,hf_bs1,hf_bs4,mcore_local (_rc: recompute the "
                        "experts' activations, _full_rc: megatron's full recomputation, _sepqkn: q/k RMSNorms not "
                        "fused into the RoPE, _graph: the whole step replayed as one CUDA graph, GPU only)")
    s.add_argument("--mb-tokens", type=int, default=4096,
                   help="token budget of the micro-batches of ours_mb (same batch, packed into several "
                        "micro-batches with gradient accumulation: memory vs throughput)")
    s.add_argument("--routing-replay", action="store_true",
                   help="also run ours_replay: ours with MoE routing replay of the routes its first step chose "
                        "(ratio ours_replay_vs_ours_step_s; replay_exact checks the routes were used)")
    s.add_argument("--warmup", type=int, default=2, help="untimed steps per system")
    s.add_argument("--iters", type=int, default=6, help="timed steps per system (median reported)")
    s.add_argument("--seed", type=int, default=0, help="seed of the weights, token ids and sample order (default 0)")
    s.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    s.add_argument("--tiny", action="store_true", help="tiny geometry: a CPU smoke test of this script")
    s.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES), help="weights and activations (default bf16)")
    s.add_argument("--hang-timeout", type=float, default=300.0,
                   help="seconds one phase of a rank (init, build, the steps, ...) may take before that rank dumps "
                        "its stacks and the run stops (default 300)")
    s.add_argument("--timeout", type=float, default=1800.0, help="seconds for each launch of ranks (default 1800)")
    s.set_defaults(func=_cmd)
    return s


def main(argv=None) -> int:
    """``python -m launch.bench.layers ARGS`` == ``mgrpo bench layers ARGS``."""
    return bench_main("layers", add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
