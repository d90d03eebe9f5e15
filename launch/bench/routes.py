"""Routed-expert capture (R3) cost on a vLLM server: time per generated token with and without
``--enable-return-routed-experts`` (on CPU our worker extension's capture, `megatron_grpo.rollout.vllm_routes`).

Both servers serve the same checkpoint with the same arguments and run at once; each gets a warm-up
request, then ``--requests`` requests each, alternating between them one at a time (so both see the
same machine load), of a ``--prompt``-token prompt generating exactly ``--tokens`` tokens
(``ignore_eos``), the R3 server returning their routes. Written to ``--out/routes.json``: seconds
per generated token of every request, their medians and the overhead per generated token.

    mgrpo bench routes --model DIR [--requests 8] [--prompt 256] [--tokens 64] [--out bench_results/routes]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from launch.cli_help import doc_description
from model_bridge.spawn import environ_set


async def _one(client, url: str, routes: bool, i: int, prompt: int, tokens: int) -> float:
    """Seconds of one request (distinct prompt: no prefix-cache hits) generating exactly ``tokens``."""
    ids = [10 + (7 * i + j) % 400 for j in range(prompt)]
    t0 = time.perf_counter()
    r = await client.generate(ids, [], max_tokens=tokens, temperature=1.0, seed=i, prefer=url,
                              extra_sampling_params={"ignore_eos": True, "min_tokens": tokens},
                              routed_experts_prompt_start=0 if routes else None)
    secs = time.perf_counter() - t0
    if r.url != url or len(r.token_ids) != tokens:
        raise RuntimeError(f"request {i} went to {r.url} with {len(r.token_ids)} tokens, wanted {url} with {tokens}")
    if routes and (r.routed_experts is None or r.routed_experts.shape[0] != prompt + tokens - 1):
        raise RuntimeError(f"the R3 server returned routes {getattr(r.routed_experts, 'shape', None)}")
    return secs


def run_bench(model: str, out_dir, requests: int = 8, prompt: int = 256, tokens: int = 64, dtype: str = "auto",
              swap_cores: bool = False) -> dict:
    """Both servers up at once, requests alternating between them (the same machine load for
    both); the medians of seconds per generated token."""
    import statistics

    from megatron_grpo.rollout.client import RolloutClient
    from megatron_grpo.rollout.config import RolloutConfig
    from megatron_grpo.rollout.server import ServerSpec, VLLMServer

    with contextlib.ExitStack() as stack:
        urls = {}
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        for i, routes in enumerate((False, True)):
            spec = ServerSpec(model=model, served_model_name="bench", dtype=dtype, return_routed_experts=routes)
            log = Path(tempfile.gettempdir()) / f"mgrpo-bench-routes-{spec.port}.log"
            # vLLM's CPU worker binds its threads to core 0 by default: both servers would share it
            # and time each other's requests; on a CPU machine each gets a core of its own
            bind = {"VLLM_CPU_OMP_THREADS_BIND": str(cores[(i + swap_cores) % len(cores)])} \
                if cores and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ else {}
            with environ_set(bind):
                urls[routes] = stack.enter_context(VLLMServer(spec, log).start(timeout=1800)).url

        async def go():
            times = {False: [], True: []}
            cfg = RolloutConfig(server_urls=list(urls.values()), max_retries=0, affinity_slack=10**6)
            async with RolloutClient(cfg) as c:
                for routes, url in urls.items():
                    await _one(c, url, routes, 10_000, prompt, tokens)  # warm-up
                for i in range(requests):
                    for routes, url in urls.items():
                        times[routes].append(await _one(c, url, routes, 2 * i + routes, prompt, tokens) / tokens)
            return times
        times = asyncio.run(go())
    base, r3 = statistics.median(times[False]), statistics.median(times[True])
    res = {"model": model, "dtype": dtype, "requests": requests, "prompt_tokens": prompt, "swap_cores": swap_cores,
           "generated_per_request": tokens, "s_per_generated_token": {"without": times[False], "with_routes": times[True]},
           "median_s_per_generated_token": {"without": base, "with_routes": r3},
           "overhead_ms_per_generated_token": 1e3 * (r3 - base), "overhead_fraction": r3 / base - 1.0,
           "note": "per generated token, the request's prompt prefill included; requests alternate between the servers"}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "routes.json").write_text(json.dumps(res, indent=1))
    return res


def _cmd(args) -> int:
    res = run_bench(args.model, args.out, args.requests, args.prompt, args.tokens, args.dtype, args.swap_cores)
    print(json.dumps({k: v for k, v in res.items() if k != "s_per_generated_token"}, indent=1))
    return 0


def add_parser(bsub) -> argparse.ArgumentParser:
    s = bsub.add_parser("routes", help="R3 route capture: vLLM time per generated token with vs without it",
                        description=doc_description(__doc__))
    s.add_argument("--model", required=True, help="HF checkpoint directory (an MoE model)")
    s.add_argument("--requests", type=int, default=8, help="timed requests per server")
    s.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    s.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    s.add_argument("--dtype", default="auto", help="vLLM --dtype")
    s.add_argument("--swap-cores", action="store_true",
                   help="the R3 server on the first core, the other on the second (run once each way: the "
                        "mean of the two overheads cancels the cores' difference)")
    s.add_argument("--out", default="bench_results/routes", help="results directory (JSON)")
    s.set_defaults(func=_cmd)
    return s


def main(argv=None) -> int:
    from launch.bench._cli import bench_main

    return bench_main("routes", add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
