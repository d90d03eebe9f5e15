"""Routed-expert capture (R3) cost on a vLLM server: time per generated token with and without
``--enable-return-routed-experts`` (on CPU our worker extension's capture, `megatron_grpo.rollout.vllm_routes`).

Both servers serve the same checkpoint with the same arguments, one after the other; each gets a
warm-up request, then ``--requests`` sequential requests of a ``--prompt``-token prompt generating
exactly ``--tokens`` tokens (``ignore_eos``), the R3 server returning their routes. Written to
``--out/routes.json``: seconds per generated token of each and the overhead per generated token.

    mgrpo bench routes --model DIR [--requests 8] [--prompt 256] [--tokens 64] [--out bench_results/routes]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path


def _time_server(model: str, routes: bool, requests: int, prompt: int, tokens: int, dtype: str) -> dict:
    from megatron_grpo.rollout.client import RolloutClient
    from megatron_grpo.rollout.config import RolloutConfig
    from megatron_grpo.rollout.server import ServerSpec, VLLMServer

    spec = ServerSpec(model=model, served_model_name="bench", dtype=dtype, return_routed_experts=routes)
    log = Path(tempfile.gettempdir()) / f"mgrpo-bench-routes-{spec.port}.log"
    with VLLMServer(spec, log).start(timeout=1800) as server:
        async def go():
            async with RolloutClient(RolloutConfig(server_urls=[server.url], max_retries=0)) as c:
                async def one(i):
                    ids = [10 + (7 * i + j) % 400 for j in range(prompt)]  # distinct prompts: no cache hits
                    r = await c.generate(ids, [], max_tokens=tokens, temperature=1.0, seed=i,
                                         extra_sampling_params={"ignore_eos": True, "min_tokens": tokens},
                                         routed_experts_prompt_start=0 if routes else None)
                    if routes and (r.routed_experts is None or r.routed_experts.shape[0] != prompt + tokens - 1):
                        raise RuntimeError(f"R3 server returned routes {getattr(r.routed_experts, 'shape', None)}")
                    return len(r.token_ids)
                await one(10_000)  # warm-up
                t0 = time.perf_counter()
                n = sum([await one(i) for i in range(requests)])
                return time.perf_counter() - t0, n
        secs, n = asyncio.run(go())
    return {"routes": routes, "seconds": secs, "generated_tokens": n, "s_per_token": secs / n}


def run_bench(model: str, out_dir, requests: int = 8, prompt: int = 256, tokens: int = 64, dtype: str = "auto") -> dict:
    runs = [_time_server(model, r, requests, prompt, tokens, dtype) for r in (False, True)]
    base, r3 = runs
    res = {"model": model, "requests": requests, "prompt_tokens": prompt, "generated_per_request": tokens,
           "runs": runs, "overhead_ms_per_generated_token": 1e3 * (r3["s_per_token"] - base["s_per_token"]),
           "overhead_fraction": r3["s_per_token"] / base["s_per_token"] - 1.0,
           "note": "per generated token, prompt prefill included (one prefill per request)"}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "routes.json").write_text(json.dumps(res, indent=1))
    return res


def _cmd(args) -> int:
    res = run_bench(args.model, args.out, args.requests, args.prompt, args.tokens, args.dtype)
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))
    return 0


def add_parser(bsub) -> argparse.ArgumentParser:
    s = bsub.add_parser("routes", help="R3 route capture: vLLM time per generated token with vs without it",
                        description=__doc__.split("\n\n")[0])
    s.add_argument("--model", required=True, help="HF checkpoint directory (an MoE model)")
    s.add_argument("--requests", type=int, default=8, help="timed requests per server")
    s.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    s.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    s.add_argument("--dtype", default="auto", help="vLLM --dtype")
    s.add_argument("--out", default="bench_results/routes", help="results directory (JSON)")
    s.set_defaults(func=_cmd)
    return s


def main(argv=None) -> int:
    from launch.bench._cli import bench_main

    return bench_main("routes", add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
