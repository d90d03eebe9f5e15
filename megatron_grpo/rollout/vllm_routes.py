"""Routed-expert capture (R3) on vLLM CPU servers, returned through vLLM's own response path.

vLLM 0.32 returns the experts its MoE layers chose (``--enable-return-routed-experts``: the
``routed_experts`` field of a response, base64 ``.npy`` of shape ``(num_tokens - 1, layers,
top_k)`` from ``routed_experts_prompt_start`` on) only from its V2 model runner, which needs Triton;
its config check refuses CPU servers. The capture itself is generic: the MoE routers call a
capture hook with the chosen ids (``BaseRouter.select_experts``, before EPLB mapping), and the
scheduler, the output processor and the HTTP layers carry the rows to the client. What the CPU
(V1) model runner lacks is the worker-side glue, which this module adds:

* :func:`allow_cpu_route_capture` (API-server process, `vllm_serve`): lets the flag pass vLLM's
  config check on CPU platforms; every other condition of that check still applies (MoE model,
  generate runner, prefix caching on, no PP).
* :func:`patch_cpu_runner` (worker processes, imported by `vllm_ext`): the CPU model runner builds
  vLLM's own ``AuxOutputWorkerConnector`` after its KV cache, hands it each step's scheduler
  metadata before the forward, snapshots the captured rows after it, and attaches the
  per-request rows to the step's ``ModelRunnerOutput`` (``aux_output_connector_output``), as the
  V2 runner does. Prefix-cached prompt tokens keep their rows: the connector stores full blocks
  under the KV cache's block hashes and reads cached prefixes back from there.

Cost: one ``[tokens, top_k]`` int copy per MoE layer per step plus a per-step numpy copy of
``[tokens, layers, top_k]`` (measured per generated token in docs/rollout.md).

:class:`RouteRecorder` is a diagnostic: it records the ``topk_ids`` the CPU expert kernel itself
received, with the positions each step computed, so a test can check the returned rows against
the ids the layers actually used by another path than the capture's.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np

__all__ = ["allow_cpu_route_capture", "patch_cpu_runner", "RouteRecorder", "RECORDER"]


# ============================================================================ API-server process
def allow_cpu_route_capture() -> None:
    """Let ``--enable-return-routed-experts`` pass vLLM's config check on a CPU platform (idempotent).

    vLLM's check requires the V2 model runner for in-tree platforms (only it has the worker glue);
    `patch_cpu_runner` gives the CPU runner that glue, so the check runs with the platform seen
    as one that brings its own runner, which skips exactly that condition."""
    from vllm.config.vllm import VllmConfig
    from vllm.platforms import current_platform

    orig = VllmConfig._verify_aux_output_compatibility
    if getattr(orig, "_mgrpo_patched", False) or not current_platform.is_cpu():
        return

    @functools.wraps(orig)
    def _verify(self):
        had = "is_out_of_tree" in vars(current_platform)
        prev = vars(current_platform).get("is_out_of_tree")
        current_platform.is_out_of_tree = lambda: True
        try:
            return orig(self)
        finally:
            if had:
                current_platform.is_out_of_tree = prev
            else:
                del current_platform.is_out_of_tree

    _verify._mgrpo_patched = True
    VllmConfig._verify_aux_output_compatibility = _verify


# ============================================================================ worker processes
def _routes_on(runner) -> bool:
    cfg = getattr(runner.vllm_config, "aux_output_config", None)
    return bool(cfg is not None and cfg.enabled)


def _batch_view(runner, num_reqs: int) -> SimpleNamespace:
    """The fields of the V2 runner's input batch that ``AuxOutputWorkerConnector.prepare_output``
    reads, from the V1 runner's persistent batch (copied: the runner reuses those buffers)."""
    return SimpleNamespace(
        req_ids=list(runner.input_batch.req_ids[:num_reqs]),
        query_start_loc_np=np.array(runner.query_start_loc.np[: num_reqs + 1], copy=True),
        num_computed_tokens_np=np.array(runner.input_batch.num_computed_tokens_cpu[:num_reqs], copy=True))


def patch_cpu_runner() -> None:
    """Give vLLM's CPU model runner the routed-experts worker glue of the V2 runner (idempotent;
    inactive unless the server runs with ``--enable-return-routed-experts``)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner, "_mgrpo_routes", False):
        return
    init_kv, execute, sample = (CPUModelRunner.initialize_kv_cache, CPUModelRunner.execute_model,
                                CPUModelRunner.sample_tokens)

    @functools.wraps(init_kv)
    def initialize_kv_cache(self, kv_cache_config, *a, **kw):
        out = init_kv(self, kv_cache_config, *a, **kw)
        if _routes_on(self) and getattr(self, "_mgrpo_aux", None) is None:
            from vllm.distributed.aux_output_connector.worker import get_aux_output_connector

            self._mgrpo_aux = get_aux_output_connector(self.get_model(), self.vllm_config, kv_cache_config)
        return out

    @functools.wraps(execute)
    def execute_model(self, scheduler_output, *a, **kw):
        conn = getattr(self, "_mgrpo_aux", None)
        RECORDER.begin_step()
        if conn is not None:
            conn.begin_step(getattr(scheduler_output, "aux_output_connector_metadata", None))
        self._mgrpo_pending = None
        out = execute(self, scheduler_output, *a, **kw)
        if out is None and self.execute_model_state is not None:  # a forward ran; sampling follows
            view = _batch_view(self, self.input_batch.num_reqs)
            RECORDER.end_step(view)
            if conn is not None:
                self._mgrpo_pending = conn.prepare_output(view)
        return out

    @functools.wraps(sample)
    def sample_tokens(self, *a, **kw):
        out = sample(self, *a, **kw)
        pending, self._mgrpo_pending = getattr(self, "_mgrpo_pending", None), None
        if pending is not None:
            # the CPU runner samples synchronously (vLLM switches async scheduling off on CPU);
            # a request that sampled nothing is mid-prefill: its rows are staged, none emitted
            index = out.req_id_to_index
            num_sampled = np.array([len(out.sampled_token_ids[index[r]]) if r in index else 0
                                    for r in pending.request_ids], dtype=np.int64)
            pending.enqueue_cpu_copy(num_sampled, np.zeros_like(num_sampled))
            out.aux_output_connector_output = pending.process_output()
        return out

    CPUModelRunner.initialize_kv_cache = initialize_kv_cache
    CPUModelRunner.execute_model = execute_model
    CPUModelRunner.sample_tokens = sample_tokens
    CPUModelRunner._mgrpo_routes = True


# ============================================================================ diagnostic recorder
class RouteRecorder:
    """Records, while on, every forward step's computed positions per request and the ``topk_ids``
    each CPU expert-kernel call received (one call per MoE layer, in layer order)."""

    def __init__(self):
        self.on = False
        self.steps: list[dict[str, Any]] = []

    def start(self) -> None:
        self.on, self.steps = True, []
        _patch_expert_kernel()

    def stop(self) -> list[dict[str, Any]]:
        self.on = False
        steps, self.steps = self.steps, []
        return steps

    def begin_step(self) -> None:
        if self.on:
            self.steps.append({"ids": []})

    def end_step(self, view: SimpleNamespace) -> None:
        """The step's batch: request ids, positions computed before it, row offsets."""
        if self.on and self.steps:
            self.steps[-1].update(req_ids=list(view.req_ids), starts=view.num_computed_tokens_np.tolist(),
                                  qsl=view.query_start_loc_np.tolist())

    def record(self, topk_ids) -> None:
        if self.on and self.steps:
            self.steps[-1]["ids"].append(topk_ids.detach().to("cpu").numpy().astype(np.int64).tolist())


RECORDER = RouteRecorder()


def _patch_expert_kernel() -> None:
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    orig = CPUUnquantizedExperts.apply
    if getattr(orig, "_mgrpo_recorded", False):
        return

    @functools.wraps(orig)
    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, *a, **kw):
        RECORDER.record(topk_ids)
        return orig(self, output, hidden_states, w1, w2, topk_weights, topk_ids, *a, **kw)

    apply._mgrpo_recorded = True
    CPUUnquantizedExperts.apply = apply


def recorded_rows(steps: list[dict[str, Any]]) -> dict[str, dict[int, list]]:
    """``{request id: {position: [layers][top_k] ids}}`` from a recorder's steps."""
    out: dict[str, dict[int, list]] = {}
    for step in steps:
        if "req_ids" not in step:
            continue  # no forward ran
        layers = step["ids"]
        for rid, start, lo, hi in zip(step["req_ids"], step["starts"], step["qsl"][:-1], step["qsl"][1:]):
            pos = out.setdefault(rid, {})
            for j in range(hi - lo):
                pos[start + j] = [layer[lo + j] for layer in layers]
    return out
