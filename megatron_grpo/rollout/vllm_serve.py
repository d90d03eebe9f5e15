"""``python -m megatron_grpo.rollout.vllm_serve <vllm serve arguments>``: vLLM's OpenAI server with
our server-side patches applied first.

Used instead of ``python -m vllm.entrypoints.openai.api_server`` (same arguments) where the server's
own processes need a patch: today routed-expert capture on CPU (`vllm_routes.allow_cpu_route_capture`).
The patch is applied on import, because vLLM's engine-core process is spawned: it re-imports this
module (as ``__mp_main__``) and re-checks the config there. The worker-side patches come with the
worker extension.
"""
from __future__ import annotations

from megatron_grpo.rollout.vllm_routes import allow_cpu_route_capture

allow_cpu_route_capture()


def main() -> None:
    from vllm.entrypoints.launchers.api_server.entry import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
