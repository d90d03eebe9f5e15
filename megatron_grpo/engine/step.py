"""One GRPO training step: megatron's schedule over the packed micro-batches, then a guarded update.

``train_step(engine, microbatches, config)`` on every rank, with this rank's
:class:`~megatron_grpo.engine.batch.TrainMicroBatch` es (the same count on every rank, hang
invariant 1; ``build_train_microbatches``' ``StepMicroBatches``, whose counts steps 1-3 read from
its ``infos`` and whose micro-batches the schedule assembles one by one as it reads them, or a
list), does:

1. **Agree** (one all-reduce over the world): every rank has the same number of micro-batches and
   none found a local problem (e.g. a KL term without reference logprobs); otherwise every rank
   raises, naming the counts / the failing rank. (The full schedule comparison and the watchdog
   are ``megatron_grpo.hang``'s.)
2. **Old logprobs for MIS**: masked IS must know which tokens it rejects before the normalisers
   are counted, so with ``importance.mode == "mis"`` and a micro-batch without ``old_logprobs_T``
   (on the last stage, where they live) a forward-only pass fills them all first
   (``engine.forward.fill_old_logprobs``); the decision travels in step 1's all-reduce, so every
   pipeline stage runs that pass.
3. **Global normalisers** (last pipeline stage, all-reduced SUM over DP, then shared over PP):
   ``global_num_tokens`` = loss tokens kept by IS, ``global_num_samples`` = samples with at least
   one kept loss token, over all micro-batches of all DP ranks. A step with none raises on every
   rank.
4. **Forward/backward** with ``get_forward_backward_func()`` (TP/SP, EP alltoall, PP 1F1B, DP).
   Per micro-batch, the loss is ``megatron_grpo.algo.losses.policy_loss`` of the token-aligned
   logprobs (``engine.logprobs``, vocab-parallel, chunked; with ``fused_lm_head`` the output layer
   is fused into them, ``engine.fused_logprobs``, so no logits exist) with TIS/MIS weights from
   ``megatron_grpo.algo.importance`` between the behaviour policy (``old_logprobs_T``, or the
   step's own logprobs detached when absent: on-policy) and the rollout logprobs.

   Loss scaling: each micro-batch's loss is its exact *share* of the step loss (global
   normalisers), so the step loss is the SUM over micro-batches and DP ranks. megatron divides a
   returned loss by the number of micro-batches ``M`` and its DDP averages gradients over the DP
   group (``1/dp``); the loss handed to megatron is therefore ``share * M * dp``, and the reduced
   gradient is exactly the gradient of the step loss.

   MoE load-balancing loss: megatron's router adds it through ``MoEAuxLossAutoScaler``, whose
   gradient scale the schedule sets to ``1/M`` (then DDP's ``1/dp``): the gradient holds
   ``moe_aux_loss_coeff * mean over micro-batches and DP ranks of each micro-batch's aux loss``,
   megatron's usual semantics. The aux loss sees the padding tokens of a micro-batch too.
5. **Update** (``optimizer_update``): megatron's ``prepare_grads`` (fp16: unscale + inf check), the
   global grad norm (identical on all ranks), a world all-reduce of the "non-finite" flag; a bad
   step skips the update (no optimizer or LR-schedule step), is reported (``skipped = 1``) and after
   ``max_consecutive_skips`` bad steps in a row raises :class:`NonFiniteGradError` on every rank;
   a good one clips to ``clip_grad`` by the global norm, steps Adam and the LR schedule.
   ``train_step`` queues this right behind the backward and reads the step's metrics back from the
   device afterwards, while the optimizer's kernels run.

Returned metrics (Python floats, identical on every rank): the loss metrics of
``algo.losses`` (``loss``, ``pg_loss``, ``clip_frac*``, ``ratio_*``, ``entropy``, ``kl``...) and of
``algo.importance`` (``mismatch_kl_k1/k3``, ``is_ratio_*``, ``is_truncated_frac`` /
``is_masked_frac``), reduced over micro-batches and DP ranks; ``grad_norm`` (before clipping),
``lr`` (of this update), ``skipped``, ``consecutive_skips``, ``num_microbatches``,
``total_skips``, ``global_num_tokens``, ``global_num_samples``, ``loss_tokens`` (before MIS),
``samples``, ``tokens_total``, ``tokens_real``, ``padding_fraction`` (padding over all computed
tokens of the step, empty micro-batches included), ``empty_microbatches``, ``audio_clips``, and
``moe_load_balancing_loss`` (mean over layers and micro-batches, when the aux loss is on).
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_grpo.algo.importance import ISConfig, importance_weights
from megatron_grpo.algo.losses import LossConfig, metric_reduce_op, policy_loss, reduce_metrics
from megatron_grpo.algo.segments import packed_segment_ids
from megatron_grpo.algo.sft import sft_loss
from megatron_grpo.host_ranges import host_range

from .batch import MicroBatchInfo, TrainMicroBatch, count_samples, microbatch_infos
from .forward import DEFAULT_FUSED_LM_HEAD, fill_old_logprobs, is_last_stage, model_device, run_schedule
from .logprobs import DEFAULT_CHUNK_TOKENS, token_logprobs
from .nonfinite import NonFiniteGradError, NonFiniteSkips, log_nonfinite
from .routes import RouteSink, replay_metrics

__all__ = ["StepConfig", "NonFiniteGradError", "NonFiniteSkips", "forward_backward", "optimizer_update",
           "train_step", "StepError", "audio_prefetch_tower"]


class StepError(RuntimeError):
    """The ranks cannot run this step (count mismatch, a rank's bad input); raised on every rank."""


@dataclass(frozen=True)
class StepConfig:
    """What one training step computes (the optimizer's settings are ``setup.OptimConfig``)."""

    loss: LossConfig = field(default_factory=LossConfig)
    """Policy loss variant and coefficients (``algo.losses``)."""
    importance: ISConfig = field(default_factory=ISConfig)
    """Rollout correction between the rollout server's and the trainer's behaviour logprobs."""
    max_consecutive_skips: int = 3
    """Raise NonFiniteGradError after this many updates in a row skipped for non-finite grads."""
    logprob_chunk_size: int = DEFAULT_CHUNK_TOKENS
    """Tokens per chunk of the vocab-parallel log-softmax (bounds its float32 memory)."""
    compute_entropy: bool = True
    """Compute per-token entropy for the metrics (always on when ``loss.entropy_coef > 0``)."""
    fused_lm_head: bool = DEFAULT_FUSED_LM_HEAD
    """Fuse the output layer into the chunked logprobs (``engine.fused_logprobs``): the logits
    ``[T, Vp/tp]`` and their gradient are never materialised."""
    routing_replay: Optional[str] = None
    """MoE routing replay in the training forward (``engine.routes``): "r3" replays each micro-batch's
    ``routed_experts_TLK`` (the rollout server's routes), "r2" the routes the old-policy logprob pass
    of the step chose (that pass then always runs); None routes as the router chooses."""
    objective: str = "grpo"
    """"grpo": the policy loss of ``loss`` with the ``importance`` correction; "sft": the token-mean
    NLL of the loss-mask tokens (``algo.sft``; advantages, rollout logprobs and IS are unused)."""

    def __post_init__(self):
        if self.objective not in ("grpo", "sft"):
            raise ValueError(f"StepConfig.objective must be 'grpo' or 'sft', got {self.objective!r}")
        if self.routing_replay not in (None, "r2", "r3"):
            raise ValueError(f"StepConfig.routing_replay must be None, 'r2' or 'r3', got {self.routing_replay!r}")
        if int(self.max_consecutive_skips) != self.max_consecutive_skips or self.max_consecutive_skips < 1:
            raise ValueError("StepConfig.max_consecutive_skips must be an int >= 1, got "
                             f"{self.max_consecutive_skips!r}")
        if int(self.logprob_chunk_size) != self.logprob_chunk_size or self.logprob_chunk_size < 1:
            raise ValueError(f"StepConfig.logprob_chunk_size must be an int >= 1, got {self.logprob_chunk_size!r}")

    @property
    def with_entropy(self) -> bool:
        return self.compute_entropy or self.loss.entropy_coef > 0


# --------------------------------------------------------------------------------------------
# collectives
# --------------------------------------------------------------------------------------------


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _peers() -> bool:
    """Other ranks to agree with (one rank alone makes no collective and reads nothing back)."""
    return _dist() and dist.get_world_size() > 1


def _coll_device() -> torch.device:
    return model_device() if _dist() and dist.get_backend() == "nccl" else torch.device("cpu")


def _agree(local_error: Optional[str], num_microbatches: int, flag: bool = False) -> bool:
    """World all-reduce: same micro-batch count everywhere and no rank with a local error (else
    every rank raises StepError). Returns ``flag`` OR-ed over all ranks."""
    if not _peers():
        if local_error:
            raise StepError(local_error)
        return flag
    world, rank = dist.get_world_size(), dist.get_rank()
    t = torch.tensor([1 if local_error else 0, num_microbatches, -num_microbatches, int(flag)], dtype=torch.int64,
                     device=_coll_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    failed, hi, lo = int(t[0]), int(t[1]), -int(t[2])
    if not failed and hi == lo:
        return bool(int(t[3]))
    counts = [None] * world
    dist.all_gather_object(counts, (num_microbatches, local_error))
    if hi != lo:
        per = {r: c[0] for r, c in enumerate(counts)}
        raise StepError(f"ranks disagree on the number of micro-batches of this step ({per}); every rank must run "
                        "the same count (pack with packing.plan_step, or equalize_microbatch_counts + "
                        "pad_microbatches)")
    bad = [(r, c[1]) for r, c in enumerate(counts) if c[1]]
    if local_error:
        raise StepError(f"rank {rank}: {local_error}")
    raise StepError(f"rank {bad[0][0]} cannot run this step ({len(bad)} rank(s) failed): {bad[0][1]}")


def _reduce_last_stage_dp_then_share(values: torch.Tensor) -> torch.Tensor:
    """SUM over the DP group on the last pipeline stage, then the same values on every stage."""
    from megatron.core import parallel_state as ps

    if not _dist() or (ps.get_data_parallel_world_size() == 1 and ps.get_pipeline_model_parallel_world_size() == 1):
        return values  # one stage, one DP rank: nothing to reduce (and no device round trip)
    values = values.to(_coll_device())
    if is_last_stage():
        dist.all_reduce(values, group=ps.get_data_parallel_group())
    else:
        values.zero_()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(values, group=ps.get_pipeline_model_parallel_group())
    return values.cpu()


def _reduce_metrics_dp_pp(local: dict[str, torch.Tensor]) -> dict[str, float]:
    """Metrics of the last stage reduced over DP by their op, then broadcast to all stages."""
    from megatron.core import parallel_state as ps

    out: dict[str, float] = {}
    if is_last_stage():
        keys = sorted(local)
        dev = _coll_device()
        names, vecs = [], []
        for op_name, op in (("sum", "SUM"), ("max", "MAX"), ("min", "MIN")):
            ks = [k for k in keys if metric_reduce_op(k) == op_name]
            if not ks:
                continue
            vec = torch.stack([local[k].detach().to(torch.float64).reshape(()) for k in ks]).to(dev)
            if _dist() and ps.get_data_parallel_world_size() > 1:
                dist.all_reduce(vec, op=getattr(dist.ReduceOp, op), group=ps.get_data_parallel_group())
            names += ks
            vecs.append(vec)
        if vecs:  # one device-to-host read for all of them
            out.update(zip(names, torch.cat(vecs).cpu().tolist()))
    if _dist() and ps.get_pipeline_model_parallel_world_size() > 1:
        box = [out]
        src = ps.get_pipeline_model_parallel_last_rank()
        kw = {"device": _coll_device()} if _coll_device().type == "cuda" else {}
        dist.broadcast_object_list(box, src=src, group=ps.get_pipeline_model_parallel_group(), **kw)
        out = box[0]
    return out


# --------------------------------------------------------------------------------------------
# the step
# --------------------------------------------------------------------------------------------


def _validate(engine, infos: Sequence[MicroBatchInfo], config: StepConfig) -> Optional[str]:
    """A local problem that would make only this rank fail inside the schedule (message), or None."""
    layout = engine.layout
    for k, m in enumerate(infos):
        if layout.sequence_parallel and m.num_tokens % layout.tp:
            return (f"micro-batch {k} has {m.num_tokens} tokens, not a multiple of tp={layout.tp} (sequence "
                    f"parallelism): pack with PackLimits(pad_multiple={layout.tp})")
        if is_last_stage() and config.loss.kl_coef > 0 and not m.has_ref_logprobs:
            return (f"micro-batch {k} has no ref_logprobs_T but loss.kl_coef={config.loss.kl_coef} > 0: fill them "
                    "with engine.forward.fill_ref_logprobs(ref_model, microbatches, ...)")
    return None


def _uses_mis(config: StepConfig) -> bool:
    return config.importance.mode == "mis" and config.objective == "grpo"


def _kept_by_mis(microbatches: Sequence[TrainMicroBatch], config: StepConfig) -> tuple[int, int]:
    """Loss tokens and samples that masked IS does not reject (it needs every micro-batch's old
    logprobs, so the micro-batches are all assembled by now)."""
    tokens = samples = 0
    for m in microbatches:
        keep_T = importance_weights(m.old_logprobs_T, m.rollout_logprobs_T, m.loss_mask_T.to(torch.bool),
                                    m.sample_index_T, config=config.importance).keep_mask_T
        tokens += int(keep_T.sum())
        samples += count_samples(keep_T, m.sample_index_T)
    return tokens, samples


def audio_prefetch_tower(engine, config: StepConfig):
    """The audio tower that ``build_train_microbatches(audio_tower=...)`` may run ahead of this
    config's step (``shared_audio.ClipUse.prefetch``), or None: only where the step's first pass is
    the training pass (no old-logprob pass: not MIS, not R2), on the stage that holds the tower,
    and where running it early cannot reorder a collective (a tower without TP collectives, no
    parameter all-gather overlapped with the forward: the prefetch runs before the ranks agree)."""
    from .setup import unwrapped

    if config.routing_replay == "r2" or (config.objective == "grpo" and config.importance.mode == "mis"):
        return None
    if engine.optim.overlap_param_gather:
        return None
    tower = getattr(unwrapped(engine.model[0]), "audio_tower", None)
    if tower is None or (tower.tensor_parallel and engine.layout.tp > 1):
        return None
    return tower


@host_range("loss")
def _loss_for(vocab_size: int, config: StepConfig, norms: dict, scale: float, logprobs_out: Optional[dict],
              tmb: TrainMicroBatch, output: torch.Tensor, lm_head_weight: Optional[torch.Tensor] = None):
    """The loss megatron backpropagates for one micro-batch (``share * M * dp``) and its metrics.
    ``output``: the logits, or the final hidden states with ``lm_head_weight`` (fused path).
    ``logprobs_out``: when a dict, each sample's behaviour logprobs (float32 [L_i], CPU) go into it
    by global sample id (:func:`train_step`)."""
    mask_T = tmb.loss_mask_T.to(torch.bool)
    lp_T, ent_T = token_logprobs(output, tmb.input_ids_T, tmb.cu_seqlens_S, vocab_size=vocab_size,
                                 token_mask_T=mask_T, chunk_size=config.logprob_chunk_size,
                                 with_entropy=config.with_entropy, lm_head_weight=lm_head_weight,
                                 num_scored=tmb.mb.scored_tokens)
    if config.objective == "sft":
        loss, metrics = sft_loss(lp_T, mask_T, global_num_tokens=norms["tokens"], entropy_T=ent_T)
        return loss * scale, metrics
    old_T = tmb.old_logprobs_T if tmb.old_logprobs_T is not None else lp_T.detach()
    if logprobs_out is not None:
        _keep_sample_logprobs(logprobs_out, tmb, old_T)
    segments = packed_segment_ids(tmb.cu_seqlens_S, tmb.num_tokens)  # per-sample sums without a host sync
    isr = importance_weights(old_T, tmb.rollout_logprobs_T, mask_T, tmb.sample_index_T, config=config.importance,
                             global_num_tokens=norms["loss_tokens"], global_num_samples=norms["loss_samples"],
                             segments=segments)
    loss, metrics = policy_loss(lp_T, old_T, tmb.advantages_T, isr.keep_mask_T, tmb.sample_index_T,
                                config=config.loss, global_num_tokens=norms["tokens"],
                                global_num_samples=norms["samples"], ref_logprobs_T=tmb.ref_logprobs_T,
                                is_weights_T=isr.weights_T, entropy_T=ent_T, segments=segments)
    metrics.update(isr.metrics)
    return loss * scale, metrics


def _keep_sample_logprobs(out: dict, tmb: TrainMicroBatch, logprobs_T: torch.Tensor) -> None:
    """``out[sample id] = `` the sample's slice of ``logprobs_T`` (token-aligned, float32, CPU)."""
    cu = tmb.cu_seqlens_S.tolist()
    lp_T = logprobs_T.detach().to(torch.float32).cpu()
    for k, sid in enumerate(tmb.sample_ids):
        out[int(sid)] = lp_T[cu[k]:cu[k + 1]].clone()


def _moe_aux_metric(num_microbatches: int) -> dict[str, float]:
    """megatron's MoE aux-loss tracker, reduced across ranks its own way, then cleared."""
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:  # pragma: no cover
        return {}
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    out = {}
    if "load_balancing_loss" in tracker and _dist():
        moe_utils.reduce_aux_losses_tracker_across_ranks(["load_balancing_loss"])
        values = tracker["load_balancing_loss"]["values"]
        out["moe_load_balancing_loss"] = float(values.float().mean()) / max(1, num_microbatches)
    moe_utils.clear_aux_losses_tracker()
    return out


_STEP_COUNTS = ("kept_tokens", "kept_samples", "loss_tokens", "loss_samples", "tokens_total", "tokens_real",
                "audio_clips", "samples", "empty_microbatches")
"""What :func:`forward_backward` counts over the step's micro-batches, summed over DP in one all-reduce:
tokens and samples kept by the IS correction (the loss normalisers), tokens and samples under the
loss mask, all / non-padding tokens, audio clips, samples, empty (padding) micro-batches."""


def forward_backward(engine, microbatches: Sequence[TrainMicroBatch], config: StepConfig, *,
                     force_all_reduce: bool = False, logprobs_out: Optional[dict] = None) -> dict[str, float]:
    """Steps 1-4 of the module doc: gradients of the step loss end up reduced in the DDP buffers
    (``param.main_grad``; with the distributed optimizer each DP rank holds its shard reduced, or
    everything with ``force_all_reduce``). Does not zero the grads first (``train_step`` does).
    Returns the step's metrics."""
    return _run_backward(engine, microbatches, config, force_all_reduce=force_all_reduce,
                         logprobs_out=logprobs_out)()


def _run_backward(engine, microbatches: Sequence[TrainMicroBatch], config: StepConfig, *,
                  force_all_reduce: bool = False, logprobs_out: Optional[dict] = None) -> Callable[[], dict[str, float]]:
    """:func:`forward_backward` up to the schedule's last launch; the returned call reads and reduces
    the metrics (host reads of the device: call it once the next device work is queued)."""
    from megatron.core import parallel_state as ps

    if not isinstance(microbatches, SequenceABC):  # an iterator: its items are read more than once below
        microbatches = list(microbatches)
    infos = microbatch_infos(microbatches)  # a StepMicroBatches assembles each one when the schedule reads it
    M = len(infos)
    # MIS needs the behaviour logprobs before counting; only the last stage holds them, so every
    # rank learns from the same all-reduce whether the extra forward pass runs (else PP would hang)
    missing_old = _uses_mis(config) and is_last_stage() and any(not m.has_old_logprobs for m in infos)
    need_old = _agree(_validate(engine, infos, config), M, missing_old) or config.routing_replay == "r2"
    if M == 0:
        raise StepError("this step has no micro-batches on any rank: nothing to train")
    if need_old:
        record = RouteSink("record", engine.spec.text.num_layers, engine.spec.text.topk) \
            if config.routing_replay == "r2" else None
        microbatches = fill_old_logprobs(engine.model, microbatches, vocab_size=engine.spec.text.vocab_size,
                                         chunk_size=config.logprob_chunk_size, fused_lm_head=config.fused_lm_head,
                                         routes=record)
    routes = RouteSink("replay") if config.routing_replay else None

    with host_range("step_counts"):
        # global normalisers and step counts (the last stage counts; every stage learns them)
        mine = dict.fromkeys(_STEP_COUNTS, 0.0)
        if is_last_stage():
            loss_tokens, loss_samples = sum(m.loss_tokens for m in infos), sum(m.loss_samples for m in infos)
            kept_tokens, kept_samples = _kept_by_mis(microbatches, config) if _uses_mis(config) else \
                (loss_tokens, loss_samples)
            mine.update(
                kept_tokens=float(kept_tokens), kept_samples=float(kept_samples), loss_tokens=float(loss_tokens),
                loss_samples=float(loss_samples), tokens_total=float(sum(m.num_tokens for m in infos)),
                tokens_real=float(sum(m.num_real_tokens for m in infos)),
                audio_clips=float(sum(m.num_clips for m in infos)), samples=float(sum(m.num_samples for m in infos)),
                empty_microbatches=float(sum(1 for m in infos if m.is_padding)))
        reduced = _reduce_last_stage_dp_then_share(torch.tensor([mine[k] for k in _STEP_COUNTS], dtype=torch.float64))
        counts = {k: float(v) for k, v in zip(_STEP_COUNTS, reduced.tolist())}
        norms = {"tokens": counts["kept_tokens"], "samples": counts["kept_samples"], "loss_tokens": counts["loss_tokens"],
                 "loss_samples": counts["loss_samples"]}
        if norms["tokens"] <= 0 or norms["samples"] <= 0:
            raise StepError(f"no loss token in this step on any rank (loss tokens {int(counts['loss_tokens'])}, kept by "
                            f"IS {int(counts['kept_tokens'])}): nothing to train")

    dp = ps.get_data_parallel_world_size(with_context_parallel=True)
    scale = float(M * dp)
    try:
        from megatron.core.transformer.moe import moe_utils

        moe_utils.clear_aux_losses_tracker()
    except ImportError:  # pragma: no cover
        pass
    with host_range("schedule"):
        collected = run_schedule(engine.model, microbatches,
                                 partial(_loss_for, engine.spec.text.vocab_size, config, norms, scale, logprobs_out),
                                 forward_only=False, force_all_reduce=force_all_reduce,
                                 fused_lm_head=config.fused_lm_head, graphs=engine.graphs, routes=routes)

    def finish() -> dict[str, float]:
        with host_range("metrics"):
            local = reduce_metrics(collected) if collected else {}
            metrics = _reduce_metrics_dp_pp(local)
        if routes is not None:
            metrics.update(replay_metrics(routes))
        metrics.update(_moe_aux_metric(M))
        total, real = counts["tokens_total"], counts["tokens_real"]
        metrics.update(num_microbatches=float(M), global_num_tokens=norms["tokens"],
                       global_num_samples=norms["samples"], loss_tokens=norms["loss_tokens"], tokens_total=total,
                       tokens_real=real, padding_fraction=1.0 - real / total if total > 0 else 0.0,
                       audio_clips=counts["audio_clips"], samples=counts["samples"],
                       empty_microbatches=counts["empty_microbatches"])
        return metrics

    return finish


def _clip(optimizer, grad_norm: float) -> None:
    """Clip every sub-optimizer's grads by the global norm (what megatron's ChainedOptimizer.step
    does); a sub-optimizer with the fused AdamW step applies the coefficient in that step
    (``fused_adamw.clip_in_step``)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    from .fused_adamw import clip_in_step

    has_decoupled = "use_decoupled_grad" in inspect.signature(clip_grad_by_total_norm_fp32).parameters
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False):
            continue
        if opt.config.clip_grad <= 0.0 or clip_in_step(opt, opt.config.clip_grad, grad_norm):
            continue
        params = opt.get_parameters()
        if not params:
            continue
        kw = {}
        if has_decoupled:
            kw["use_decoupled_grad"] = bool(getattr(opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8",
                                                    False))
        clip_grad_by_total_norm_fp32(params, max_norm=opt.config.clip_grad, total_norm=grad_norm, **kw)


def _current_lr(optimizer) -> float:
    groups = optimizer.param_groups
    return float(groups[0]["lr"]) if groups else float("nan")


def optimizer_update(engine, skips: Optional[NonFiniteSkips] = None, step: Optional[int] = None) -> dict[str, float]:
    """Step 5 of the module doc. Collective (every rank). Returns ``grad_norm``, ``lr``, ``skipped``,
    ``consecutive_skips``; raises NonFiniteGradError after too many skips in a row."""
    opt = engine.optimizer
    with host_range("optimizer/prepare_grads"):
        found_inf = bool(opt.prepare_grads())
    with host_range("optimizer/grad_norm"):
        grad_norm = opt.get_grad_norm()
    grad_norm = float("nan") if grad_norm is None else float(grad_norm)
    bad = found_inf or not math.isfinite(grad_norm)
    if _peers():
        flag = torch.tensor([1 if bad else 0], dtype=torch.int32, device=_coll_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        bad = bool(int(flag.item()))
    lr = _current_lr(opt)
    if skips is None:
        if engine.nonfinite is None:
            engine.nonfinite = NonFiniteSkips()
        skips = engine.nonfinite
    if not bad:
        if engine.optim.clip_grad > 0:
            with host_range("optimizer/clip"):
                _clip(opt, grad_norm)
        with host_range("optimizer/step"):
            opt.step_with_ready_grads()
        with host_range("optimizer/scheduler"):
            engine.scheduler.step(1)
    names = log_nonfinite(engine.model, grad_norm, step, dist.get_rank() if _dist() else None) if bad else None
    skips.record(bad, grad_norm, step, names)
    return {"grad_norm": grad_norm, "lr": lr, "skipped": float(bad), "consecutive_skips": float(skips.consecutive),
            "total_skips": float(skips.total)}


def train_step(engine, microbatches: Sequence[TrainMicroBatch], config: StepConfig, *,
               skips: Optional[NonFiniteSkips] = None, step: Optional[int] = None,
               logprobs_out: Optional[dict] = None) -> dict[str, float]:
    """Zero the grads, :func:`forward_backward`, :func:`optimizer_update`; the merged metrics.

    ``logprobs_out`` (a dict): filled on the last pipeline stage with the trainer's behaviour
    logprobs of each of this rank's samples, ``{global sample id: float32 [L_i]}`` (token-aligned
    like ``Trajectory.rollout_logprobs_T``, 0 off the loss mask), the ones the rollout correction
    compares with vLLM's; a copy to the CPU per micro-batch, so ask only on steps that keep them."""
    with host_range("zero_grad"):
        for m in engine.model:
            m.zero_grad_buffer()
        engine.optimizer.zero_grad()
    if skips is None:
        skips = engine.nonfinite
        if skips is None or skips.max_consecutive != config.max_consecutive_skips:
            skips = engine.nonfinite = NonFiniteSkips(config.max_consecutive_skips)
    finish = _run_backward(engine, microbatches, config, logprobs_out=logprobs_out)
    # the optimizer's gradient work is queued right behind the backward, and the metrics' host reads
    # run while the device steps the optimizer (read first, the device would idle through them)
    update = optimizer_update(engine, skips, step)
    metrics = finish()
    metrics.update(update)
    return metrics
