"""Run packed micro-batches through megatron's schedule; no-grad logprobs for the old / reference policy.

``run_schedule`` is the one place that calls megatron-core's ``get_forward_backward_func()``
(no pipelining, or 1F1B under PP) with our forward step: each :class:`TrainMicroBatch`, read when
the schedule asks for it (a ``StepMicroBatches`` assembles it then, while the device still runs the
previous one), is moved to the device and fed to the thinker as ``input_ids [1, T]``, ``position_ids [3, 1, T]``, a THD
``PackedSeqParams`` over its ``cu_seqlens_S`` and its audio (the thinker runs its dummy clip when
there is none). On the last pipeline stage the logits ``[T, 1, Vp/tp]`` go to the given loss
function; under a ``Float16Module`` they stay in bf16 (``fp32_output=False``): the logprob code
upcasts chunk by chunk instead of a float32 ``[T, Vp/tp]`` copy.

With ``fused_lm_head`` the last stage skips the output layer instead
(``OmniThinker.forward(return_hidden=True)``): the loss function gets the final hidden states
``[T, 1, h]`` and, as the keyword ``lm_head_weight``, the output weight shard ``[Vp/tp, h]``, and
``engine.fused_logprobs`` computes the logprobs without materialising the logits or their
gradient (``token_logprobs(..., lm_head_weight=...)``).

``compute_logprobs(model, microbatches, vocab_size=...)`` is the forward-only pass (eval mode,
``torch.no_grad``) that gives the token-aligned logprobs (and entropy) of every micro-batch: the
behaviour policy's before the first update of a step (needed for MIS and for several updates per
rollout batch) or the reference policy's for the KL term. Results exist on the last pipeline stage
only (``None`` on the others), which is where the loss needs them.
"""
from __future__ import annotations

import inspect
from functools import partial
from typing import Callable, Optional, Sequence

import torch

from megatron_grpo.host_ranges import host_range

from .batch import TrainMicroBatch, described, reset_shared_clips
from .logprobs import DEFAULT_CHUNK_TOKENS, token_logprobs

DEFAULT_FUSED_LM_HEAD = True
"""Default of ``fused_lm_head`` here and of ``StepConfig.fused_lm_head``."""

__all__ = ["run_schedule", "compute_logprobs", "fill_old_logprobs", "fill_ref_logprobs", "is_last_stage",
           "model_device"]


def is_last_stage() -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage(ignore_virtual=True)


def model_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _as_chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _unwrap(model):
    """The module inside megatron's DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _forward_step(use_fp16_wrapper: bool, fused: bool, loss_for: Callable, data_iterator, model, graphs=None,
                  routes=None):
    """megatron ``forward_step_func``: one micro-batch through this stage (``graphs``: its decoder
    stack through ``engine.graphs.MicroBatchGraphs`` where that applies; its routers replaying or
    recording routes when ``routes``, an ``engine.routes.RouteSink``, says so: such a micro-batch
    runs eagerly, since a captured graph cannot take the replayed routes)."""
    tmb: TrainMicroBatch = next(data_iterator)
    with host_range("forward"):
        return _forward_one(use_fp16_wrapper, fused, loss_for, tmb, model, graphs, routes)


def _forward_one(use_fp16_wrapper: bool, fused: bool, loss_for: Callable, tmb: TrainMicroBatch, model, graphs,
                 routes):
    from model_bridge.modeling.route_replay import replay_scope
    from model_bridge.modeling.thinker import OmniThinker

    dev = model_device()
    t = tmb.to(dev, non_blocking=True)
    if graphs is not None and fused and routes is None:
        out = _graphed_forward(graphs, _unwrap(model), tmb, t)
        if out is not None:
            return out, partial(loss_for, t, lm_head_weight=_unwrap(model).lm_head_weight())
    # built from the host batch: no host sync in the forward, so the host can queue this micro-batch
    # while the GPU still works on the previous one (thd.py)
    thinker = _unwrap(model)
    # an OmniThinker moves the offsets itself: its torch backend after layer 0's qkv GEMM is queued
    kw = dict(packed_seq_params=tmb.packed_seq_params(dev, defer_copy=isinstance(thinker, OmniThinker)),
              audio_features=t.audio_features,
              audio_feature_lens=tmb.audio_feature_lens)  # host lens: the audio tower plans on the host
    if tmb.clip_use is not None:
        kw["clip_use"] = tmb.clip_use
    if getattr(thinker, "pre_process", False) and hasattr(thinker, "spec"):
        kw["audio_token_count"] = tmb.count_tokens(thinker.spec.audio_token_id)
    if use_fp16_wrapper:
        kw["fp32_output"] = False
    if fused:
        kw["return_hidden"] = True
    with replay_scope(routes.for_microbatch(t) if routes is not None else None):
        out = model(t.input_ids_T.unsqueeze(0), t.position_ids(), **kw)
    if fused and is_last_stage():
        return out, partial(loss_for, t, lm_head_weight=_unwrap(model).lm_head_weight())
    return out, partial(loss_for, t)


def _graphed_forward(graphs, thinker, tmb: TrainMicroBatch, t: TrainMicroBatch):
    """Final hidden states ``[T, 1, h]`` with the decoder stack replayed from its CUDA graph
    (``engine.graphs``) and the embedding + audio tower eager, or None (run the micro-batch eagerly).
    The float features go in the model's dtype, as megatron's ``Float16Module`` would pass them."""
    dtype = next(thinker.parameters()).dtype
    feats = None if t.audio_features is None else t.audio_features.to(dtype)
    emb = thinker.embed(t.input_ids_T.unsqueeze(0), feats, tmb.audio_feature_lens,
                        tmb.count_tokens(thinker.spec.audio_token_id), tmb.clip_use)
    return graphs.run(emb, t.position_ids(), tmb.mb.cu_seqlens_S.tolist())


def run_schedule(model, microbatches: Sequence[TrainMicroBatch], loss_for: Callable, *, forward_only: bool,
                 force_all_reduce: bool = False, fused_lm_head: bool = False, graphs=None, routes=None) -> list:
    """megatron's forward(-backward) schedule over ``microbatches``; returns the loss functions'
    second outputs (last pipeline stage; ``[]`` elsewhere).

    ``loss_for(tmb_on_device, output_tensor) -> (loss, data)``: the loss handed to megatron (which
    divides it by the number of micro-batches; DDP then averages over DP) and what to collect.
    With ``fused_lm_head`` (module doc) ``output_tensor`` is the final hidden states and
    ``loss_for`` also gets ``lm_head_weight=``. ``force_all_reduce`` (training only) all-reduces
    the gradients instead of reduce-scattering them, so every DP rank holds the full gradient
    (tests). ``graphs`` (training only): an ``engine.graphs.MicroBatchGraphs`` for the decoder stack.
    ``routes`` (``engine.routes.RouteSink``): replay or record the MoE routes of each micro-batch
    (routing replay).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from .setup import has_float16_wrapper

    from megatron.core.utils import get_model_config

    chunks = _as_chunks(model)
    if len(chunks) != 1:
        raise NotImplementedError("virtual pipeline stages (several model chunks) are not supported")
    if not microbatches:
        return []
    get_model_config(chunks[0]).variable_seq_lengths = True  # packed micro-batches differ in T
    # the shared clips' tower output is of this pass's weights (a prefetch for this training pass stays)
    reset_shared_clips(microbatches, training=not forward_only)
    fb = get_forward_backward_func()
    kw = dict(forward_step_func=partial(_forward_step, has_float16_wrapper(chunks[0]), bool(fused_lm_head), loss_for,
                                        graphs=None if forward_only else graphs, routes=routes),
              data_iterator=iter(microbatches), model=chunks, num_microbatches=len(microbatches),
              seq_length=max(m.num_tokens for m in described(microbatches)), micro_batch_size=1,
              forward_only=forward_only)
    if force_all_reduce:
        if "force_all_reduce" not in inspect.signature(fb).parameters:
            raise NotImplementedError("this megatron-core's schedule has no force_all_reduce")
        kw["force_all_reduce"] = True
    return fb(**kw)


def _logprob_loss(vocab_size: int, chunk_size: int, with_entropy: bool, only_loss_tokens: bool,
                  tmb: TrainMicroBatch, output: torch.Tensor, lm_head_weight: Optional[torch.Tensor] = None):
    lp_T, ent_T = token_logprobs(output, tmb.input_ids_T, tmb.cu_seqlens_S, vocab_size=vocab_size,
                                 token_mask_T=tmb.loss_mask_T if only_loss_tokens else None,
                                 chunk_size=chunk_size, with_entropy=with_entropy, lm_head_weight=lm_head_weight,
                                 num_scored=tmb.mb.scored_tokens if only_loss_tokens else None)
    data = {"logprobs_T": lp_T.detach().cpu()}
    if ent_T is not None:
        data["entropy_T"] = ent_T.detach().cpu()
    return torch.zeros((), device=output.device, dtype=torch.float32), data


@torch.no_grad()
def compute_logprobs(model, microbatches: Sequence[TrainMicroBatch], *, vocab_size: int,
                     with_entropy: bool = False, chunk_size: int = DEFAULT_CHUNK_TOKENS,
                     only_loss_tokens: bool = True, fused_lm_head: bool = DEFAULT_FUSED_LM_HEAD,
                     routes=None) -> list[Optional[dict]]:
    """Per micro-batch ``{"logprobs_T": float32 [T] (CPU), "entropy_T": ...}`` on the last pipeline
    stage, ``None`` on the others. Token-aligned (``engine.logprobs``); with ``only_loss_tokens``
    only the loss-mask tokens are scored (others 0). Collective over the model-parallel and
    pipeline groups: every rank of the model calls it with its own (equally many) micro-batches.
    The model is put in eval mode for the pass and restored afterwards. ``fused_lm_head``: the
    output layer fused into the logprobs (module doc), same values without the logits.
    """
    chunks = _as_chunks(model)
    modes = [m.training for m in chunks]
    for m in chunks:
        m.eval()
    try:
        data = run_schedule(chunks, microbatches,
                            partial(_logprob_loss, vocab_size, chunk_size, with_entropy, only_loss_tokens),
                            forward_only=True, fused_lm_head=fused_lm_head, routes=routes)
    finally:
        for m, mode in zip(chunks, modes):
            m.train(mode)
    if not is_last_stage():
        return [None] * len(microbatches)
    if len(data) != len(microbatches):
        raise RuntimeError(f"the schedule returned {len(data)} results for {len(microbatches)} micro-batches")
    return list(data)


def fill_old_logprobs(model, microbatches: Sequence[TrainMicroBatch], *, vocab_size: int,
                      chunk_size: int = DEFAULT_CHUNK_TOKENS, fused_lm_head: bool = DEFAULT_FUSED_LM_HEAD,
                      routes=None) -> list[TrainMicroBatch]:
    """``microbatches`` with ``old_logprobs_T`` from ``model`` (the current policy, before updating).
    Off the last pipeline stage they come back unchanged (the loss runs on the last stage).
    ``routes`` (``engine.routes.RouteSink``): a "record" sink makes every rank's micro-batches
    carry the routes its routers chose in this pass (R2: ``routed_experts_TLK``)."""
    res = compute_logprobs(model, microbatches, vocab_size=vocab_size, chunk_size=chunk_size,
                           fused_lm_head=fused_lm_head, routes=routes)
    out = [m if r is None else m.with_logprobs(old_logprobs_T=r["logprobs_T"]) for m, r in zip(microbatches, res)]
    if routes is not None and routes.mode == "record":
        from dataclasses import replace

        out = [replace(m, routed_experts_TLK=r) for m, r in zip(out, routes.recorded())]
    return out


def fill_ref_logprobs(ref_model, microbatches: Sequence[TrainMicroBatch], *, vocab_size: int,
                      chunk_size: int = DEFAULT_CHUNK_TOKENS, fused_lm_head: bool = DEFAULT_FUSED_LM_HEAD
                      ) -> list[TrainMicroBatch]:
    """``microbatches`` with ``ref_logprobs_T`` from the frozen reference ``ref_model``."""
    res = compute_logprobs(ref_model, microbatches, vocab_size=vocab_size, chunk_size=chunk_size,
                           fused_lm_head=fused_lm_head)
    return [m if r is None else m.with_logprobs(ref_logprobs_T=r["logprobs_T"]) for m, r in zip(microbatches, res)]
