"""One rank of a :mod:`launch.bench.layers` run (spawned by ``run_ranks``; EP1 or one of N EP ranks)."""
from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path

from launch.bench._layers_ceiling import kernel_ceiling, micro_batch_ceiling
from launch.bench._layers_geometry import (_DTYPES, _base_lengths, geometry, make_batch, omni_config, pack_by_budget,
                                           rank_lengths, useful_flops)
from launch.bench._layers_hf import build_hf, hf_state_as_checkpoint, run_hf
from launch.bench._layers_ours import (OUR_SYSTEMS, build_megatron, graph_stream, probe_losses, qk_norm_rope_env,
                                      run_ours)
from launch.bench._layers_report import _ratios
from launch.bench._layers_timing import _env, _mem_reset


def _summary(name: str, step_s: list[float], tokens: int, flops: int, peak, extra=None, pipelined_s=None) -> dict:
    med = statistics.median(step_s)
    d = {"system": name, "step_s_median": med, "step_s": step_s, "useful_tokens": tokens,
         "tok_per_s": tokens / med, "useful_tflops": flops / med / 1e12, "peak_mem_gib": peak}
    if pipelined_s:  # steps back to back (_layers_timing._time_steps)
        d.update(step_s_pipelined=pipelined_s, tok_per_s_pipelined=tokens / pipelined_s)
    if extra:
        d.update(extra)
    return d


def _logger(tag: str, rank: int):
    """Progress lines from every rank, rank-prefixed and flushed at once (a silent rank is a hang)."""
    prefix = f"[bench layers{' ' + tag if tag else ''} rank {rank}]"

    def log(msg: str) -> None:
        print(f"{prefix} {msg}", flush=True)

    return log


def _pg_timeout_minutes(hang_timeout_s: float) -> int:
    """Process-group (NCCL/gloo) timeout: longer than the watchdog's, so the watchdog names the stuck
    phase first (megatron_grpo/hang)."""
    return int(math.ceil(hang_timeout_s / 60.0)) + 2


def _rank_main(out_dir: str, layers: int, tokens, ep: int, tiny: bool, systems: list[str], warmup: int,
               iters: int, seed: int, device_name: str, mb_tokens: int | None = None, dtype_name: str = "bf16",
               loss_batches: int = 0, hang_timeout_s: float = 300.0, ceiling: bool = True, tag: str = "") -> dict:
    """One rank of one run (``ep`` ranks; rank r on GPU r). Every rank executes the same sequence of
    collective steps whatever its data: nothing below is conditional on the rank except logging
    and the kernel ceiling (which runs only in single-rank runs). Each phase is armed on a
    :class:`megatron_grpo.hang.Watchdog`: a phase that runs past ``hang_timeout_s`` dumps this
    rank's stacks (``hang-rank{R}-step{S}.txt`` under ``out_dir`` and stderr) and exits, and
    ``run_ranks`` then stops the other ranks. ``loss_batches`` > 0 (the EP1 baseline of an EP run):
    also return :func:`probe_losses` on the micro-batches of ranks 0..loss_batches-1."""
    import torch

    from megatron_grpo.hang import Watchdog

    rank = int(os.environ.get("RANK", "0"))
    log = _logger(tag, rank)
    out = Path(out_dir)
    wd = Watchdog(hang_timeout_s, out, rank=rank, first_step_timeout_s=hang_timeout_s)
    phase = iter(range(1000))
    with wd:
        with wd.step(next(phase), what="init_process_group + megatron parallel state"), wd.collective("init"):
            log(f"pid {os.getpid()}: init {'nccl' if device_name == 'cuda' else 'gloo'} process group "
                f"(world {ep}) and megatron parallel state")
            from model_bridge.parallel import init_parallel

            init_parallel(ep=ep, seed=seed, timeout_minutes=_pg_timeout_minutes(hang_timeout_s))
        return _rank_run(out, layers, tokens, ep, tiny, systems, warmup, iters, seed, device_name, mb_tokens,
                         getattr(torch, _DTYPES[dtype_name]), loss_batches, ceiling, log, wd, phase)


def _rank_run(out: Path, layers, tokens, ep, tiny, systems, warmup, iters, seed, device_name, mb_tokens, dtype,
              loss_batches, ceiling, log, wd, phase) -> dict:
    import contextlib

    import torch
    import torch.distributed as dist

    from model_bridge.config import parse_omni_config
    from model_bridge.parallel import destroy_parallel

    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if device_name == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    def armed(what: str):
        stack = contextlib.ExitStack()
        stack.enter_context(wd.step(next(phase), what=what))
        stack.enter_context(wd.collective(what))
        return stack

    g = geometry(layers, tiny)
    base_lengths = _base_lengths(tokens, tiny)
    lengths = rank_lengths(base_lengths, rank, seed)
    cfg = omni_config(g)
    spec = parse_omni_config(cfg, where="bench")
    T = sum(lengths)
    fl = useful_flops(lengths, g)
    ids, probe = make_batch(lengths, g["vocab"], g["hidden"], device, seed + 1 + rank)
    res = {"geometry": g, "lengths": lengths, "tokens": T, "flops": fl, "ep": ep, "rank": rank,
           "local_experts": g["experts"] // ep, "env": _env(device), "systems": {}, "dtype": str(dtype).split(".")[-1]}
    log(f"{layers} layers, {len(lengths)} samples, {T} tokens on this rank, ep={ep} ({g['experts'] // ep} of "
        f"{g['experts']} experts here), {fl['total_fwd_bwd'] / 1e12:.2f} useful TFLOP per step, "
        f"device {res['env'].get('gpu', device)}")

    # one set of weights: an HF model (its own init, same seed on every rank), copied into the megatron models
    with armed("build HF weights"):
        t0 = time.perf_counter()
        _mem_reset(device)
        hf, impl = build_hf(cfg, device, dtype, seed)
        res["hf_impl"] = impl
        tensors = hf_state_as_checkpoint(hf, g["hidden"], g["ffn"])
        norm_w = hf.norm.weight.detach().clone().requires_grad_()
        log(f"HF model built ({impl}) in {time.perf_counter() - t0:.1f} s")
    hf_out = None
    if ep == 1:
        for name, bs in (("hf_bs1", 1), ("hf_bs4", 4)):
            if name not in systems:
                continue
            with armed(f"{name} steps"):
                _mem_reset(device)
                r = run_hf(hf, ids, probe, device, bs, warmup, iters, keep_output=(bs == 1))
            if bs == 1:
                hf_out = r["output"].cpu()  # kept for the correctness check, off the GPU (not in ours' peak)
            res["systems"][name] = _summary(name, r["step_s"], T, fl["total_fwd_bwd"], r["peak_gib"],
                                            {"padded_tokens": r["padded_tokens"], "memory_trace": r.get("memory_trace"),
                                             **impl}, pipelined_s=r.get("step_s_pipelined"))
            s = res["systems"][name]
            log(f"{name}: {s['tok_per_s']:.0f} tok/s, {s['useful_tflops']:.1f} TFLOP/s, peak {s['peak_mem_gib']}")
            del r  # its GPU output must not count in the next system's peak
    del hf
    counts = None
    for name, (backend, mb, recompute, qk_norm_rope, graph) in OUR_SYSTEMS.items():
        if name not in systems or (ep > 1 and name != "ours"):
            continue
        if graph and device.type != "cuda":
            log(f"{name}: skipped (a CUDA graph needs a GPU)")
            continue
        budget = mb_tokens if mb else None
        groups = pack_by_budget(lengths, budget)
        stream = contextlib.ExitStack()  # a graph system's model lives on its own stream (graph_stream)
        if graph:
            stream.enter_context(graph_stream(device))
        with armed(f"build {name}"):
            _mem_reset(device)
            model = build_megatron(spec, ep, backend, dtype, device, tensors, recompute=recompute)
            log(f"{name}: megatron model built ({backend} backend)")
        n_it = iters if backend == "torch" else max(2, iters // 3)
        profile = None
        if name == "ours":
            profile = out / (f"bench_layers_ep{ep}_profile_rank{rank}.txt" if ep > 1 else "bench_layers_profile.txt")
        elif name in ("ours_mb", "ours_sepqkn"):
            profile = out / f"bench_layers_profile_{name}.txt"
        # the first micro-batched system without recomputation records its micro-batches' expert counts
        mb_counts = (mb and recompute == "none" and ceiling and dist.get_world_size() == 1
                     and "kernel_ceiling_micro_batches" not in res)
        with armed(f"{name}: first step, {warmup} warm-up and {n_it} timed fwd+bwd steps"
                   + (", profile" if profile is not None and device.type == "cuda" else "")), \
                qk_norm_rope_env(qk_norm_rope):
            r = run_ours(model, spec, ids, probe, norm_w, device, warmup if backend == "torch" else 1, n_it,
                         profile_path=profile, capture_counts=(name == "ours" or mb_counts), groups=groups,
                         barrier=dist.barrier if ep > 1 else None, keep_step=(name == "ours"),
                         diagnose=(ep == 1 and backend == "torch"), graph=graph, replay=(name == "ours_replay"))
        paired = r.pop("step", None)
        if name == "ours" and ceiling and dist.get_world_size() == 1 and device.type == "cuda":
            # right after ours (its step takes turns with the ceiling step: the same GPU state)
            with armed("kernel ceiling, taking turns with ours' step"):
                ceil = kernel_ceiling(g, lengths, r["expert_counts"], device, dtype, paired_step=paired,
                                      warmup=warmup, iters=n_it)
            res["kernel_ceiling"] = ceil
            res["kernel_ceiling"]["useful_tflops"] = fl["total_fwd_bwd"] / ceil["total_s"] / 1e12
            res["kernel_ceiling"]["tok_per_s"] = T / ceil["total_s"]
            log(f"kernel ceiling: {ceil['total_s'] * 1e3:.1f} ms per step (its parts benchmarked alone); "
                f"the parts back to back {ceil['back_to_back_s_median'] * 1e3:.1f} ms, ours taking turns with "
                f"them {ceil['paired_step_s_median'] * 1e3:.1f} ms")
        del paired
        if mb_counts:
            with armed(f"kernel ceiling at the {len(groups)} micro-batches' shapes"):
                res["kernel_ceiling_micro_batches"] = mbc = micro_batch_ceiling(g, lengths, groups, r["expert_counts"],
                                                                                device, dtype)
            if "total_s" in mbc:
                log(f"kernel ceiling at the shapes of {len(groups)} micro-batches of <= {budget} tokens: "
                    f"{mbc['total_s'] * 1e3:.1f} ms per step (its parts benchmarked alone)")
        peak = r["peak_gib"]
        extra = {"backend": backend, "recompute": recompute, "qk_norm_rope_fused": qk_norm_rope,
                 "micro_batch_tokens": r["micro_batch_tokens"],
                 "memory_trace": r.get("memory_trace"),
                 "host_issue_s_median": statistics.median(r["host_issue_s"])}
        for key in ("step_s_gpu_bound", "step_s_after_idle"):  # where the step's time goes (step_diagnostics)
            if r.get(key):
                extra[f"{key}_median"] = statistics.median(r[key])
        for key in ("graph_output_equals_eager", "graph_grad_rel_diff_vs_eager", "eager_grad_rel_diff_run_to_run",
                    "replay_exact"):
            if key in r:  # the graph's replay checked against the eager step (_layers_ours._graph_step)
                extra[key] = r[key]
        if hf_out is not None:
            ref = hf_out.float()
            extra["rel_diff_vs_hf_bs1"] = ((r["output"].cpu().float() - ref).norm() / ref.norm()).item()
        if r.get("host_syncs") is not None:
            extra["host_syncs_per_step"] = r["host_syncs"]
        if name == "ours":
            counts = r["expert_counts"]
            extra["expert_tokens_per_layer_min_max"] = [[min(c), max(c)] for c in counts]
            if ep > 1:
                extra["local_experts"] = g["experts"] // ep
            if ep > 1 or loss_batches:
                # EP-N: this rank's micro-batch; the EP1 baseline: the micro-batch of each EP-N rank
                batches = [(ids, probe)] + [make_batch(rank_lengths(base_lengths, b, seed), g["vocab"], g["hidden"],
                                                       device, seed + 1 + b) for b in range(1, loss_batches)]
                with armed(f"probe losses on {len(batches)} micro-batch(es)"):
                    res["losses"] = [probe_losses(model, spec, bi, bp, norm_w, device) for bi, bp in batches]
                log(f"probe losses {[x['loss'] for x in res['losses']]}")
        res["systems"][name] = _summary(name, r["step_s"], T, fl["total_fwd_bwd"], peak, extra,
                                        pipelined_s=r.get("step_s_pipelined"))
        s = res["systems"][name]
        log(f"{name}: {s['tok_per_s']:.0f} tok/s, {s['useful_tflops']:.1f} TFLOP/s, step "
            f"{s['step_s_median'] * 1e3:.1f} ms (host done issuing after {extra['host_issue_s_median'] * 1e3:.1f} ms), "
            f"peak {peak} GiB, micro-batches {r['micro_batch_tokens']}, "
            f"rel diff vs HF {extra.get('rel_diff_vs_hf_bs1')}"
            + (f", GPU-bound step {extra['step_s_gpu_bound_median'] * 1e3:.1f} ms" if extra.get("step_s_gpu_bound_median") else "")
            + (f", after idle {extra['step_s_after_idle_median'] * 1e3:.1f} ms" if extra.get("step_s_after_idle_median") else "")
            + (f", host syncs/step {extra['host_syncs_per_step']['total']}" if extra.get("host_syncs_per_step") else ""))
        del model, r
        stream.close()
    _mem_reset(device)
    if ceiling and counts and dist.get_world_size() == 1 and device.type != "cuda":
        res["kernel_ceiling"] = kernel_ceiling(g, lengths, counts, device, dtype)  # says why there is none
    res["ratios"] = _ratios(res)
    with armed("destroy process group"):
        if dist.get_world_size() > 1:
            dist.barrier()
        destroy_parallel()
    log("done")
    return res
