"""Training micro-batches: a packed :class:`~megatron_grpo.packing.MicroBatch` plus what the step needs.

Shapes: ``T`` tokens of the micro-batch (padding included), ``A`` audio clips of its samples,
``M`` mel bins, ``F`` mel frames of all its clips concatenated.

A :class:`TrainMicroBatch` holds, on the CPU until :meth:`TrainMicroBatch.to`:

* the packed tokens (``input_ids_T``, ``loss_mask_T``, ``sample_index_T``, ``cu_seqlens_S``,
  MRoPE positions) from the packer;
* per-token float32 ``rollout_logprobs_T`` (vLLM's, token-aligned, 0 off the loss mask),
  ``advantages_T`` (the sample's scalar on its tokens, 0 on padding), and, once computed,
  ``old_logprobs_T`` / ``ref_logprobs_T`` (token-aligned, see ``engine.logprobs``);
* the audio of its samples, in packing order then clip order: ``audio_features [M, F]`` and
  ``audio_feature_lens [A]`` (``None`` when no sample has audio: the thinker then runs its tower on
  a dummy clip, hang invariant 2); a clip that several samples of the rank's step use (a GRPO
  group's recording is one object in each of its generations) is left out of them and named in
  ``clip_use`` instead, so the tower runs once per step on it, not once per sample
  (``model_bridge.modeling.shared_audio``); with ``keep_shared > 0`` (the default) every clip is,
  so the tower runs on batches of several micro-batches' clips.

``build_train_microbatches`` returns a :class:`StepMicroBatches`: everything that can fail on the
input (each sample's lists converted and their lengths checked, the audio featurised and its token
counts checked) happens in the call, and each micro-batch's tensors are assembled when it is first
read, so the device starts on the first micro-batch while the host assembles the next ones; what the
step needs up front (token and loss-token counts, clips) is in its ``infos``
(:class:`MicroBatchInfo`), known without assembling anything.

Features are computed per sample (by default each clip on its own, as vLLM featurised it for the
rollout: ``megatron_grpo.data.features``), so a sample's features never depend on which samples
share its micro-batch, and each clip's token count is checked against the sample's
``audio_token_counts`` here, naming the sample, before anything reaches the model.
"""
from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence, Union

import torch

from megatron_grpo.host_ranges import host_range
from megatron_grpo.packing import (MicroBatch, PackLimits, PackPlan, as_1d, build_microbatch, pack_per_token,
                                   to_device)
from model_bridge.modeling.audio import TOKENS_PER_FULL_CHUNK
from model_bridge.modeling.shared_audio import ClipUse

from .step_audio import Featurizer, featurizer_from_extractor, step_audio

__all__ = ["TrainMicroBatch", "MicroBatchInfo", "StepMicroBatches", "Featurizer", "build_train_microbatches",
           "featurizer_from_extractor", "count_samples", "described", "microbatch_infos", "padding_summary",
           "reset_shared_clips"]

@dataclass(frozen=True)
class TrainMicroBatch:
    """One packed micro-batch of one DP rank with everything the forward and the loss need."""

    mb: MicroBatch
    """Packed tokens, mask, sample index, positions, ``cu_seqlens_S``."""
    rollout_logprobs_T: torch.Tensor
    """float32 [T]; the rollout server's logprob of each generated token, 0 elsewhere."""
    advantages_T: torch.Tensor
    """float32 [T]; the sample's advantage on each of its tokens, 0 on padding."""
    audio_features: Optional[torch.Tensor] = None
    """float32 [M, F]; the clips of the samples, in packing order; None without audio."""
    audio_feature_lens: Optional[torch.Tensor] = None
    """int64 [A]; frames of each clip."""
    old_logprobs_T: Optional[torch.Tensor] = None
    """float32 [T]; behaviour-policy logprobs from the trainer (``engine.forward.compute_logprobs``);
    None means on-policy: the step uses its own logprobs, detached."""
    ref_logprobs_T: Optional[torch.Tensor] = None
    """float32 [T]; reference-policy logprobs for the KL term; None without KL."""
    routed_experts_TLK: Optional[torch.Tensor] = None
    """int [T, layers, top_k]; the experts to replay per token and MoE layer (``engine.routes``; -1
    where a token has none); None routes as the router chooses."""
    clip_use: Optional[ClipUse] = None
    """The clips this micro-batch shares with others of its rank's step (a group's recording), run
    through the audio tower once per step (``model_bridge.modeling.shared_audio``); its own clips
    are ``audio_features``. None: every clip is its own."""

    def __post_init__(self):
        T = self.mb.num_tokens
        for name in ("rollout_logprobs_T", "advantages_T", "old_logprobs_T", "ref_logprobs_T"):
            x = getattr(self, name)
            if x is not None and tuple(x.shape) != (T,):
                raise ValueError(f"{name} must be [{T}] like the micro-batch's tokens, got {tuple(x.shape)}")
        r = self.routed_experts_TLK
        if r is not None and (r.dim() != 3 or r.shape[0] != T or r.is_floating_point()):
            raise ValueError(f"routed_experts_TLK must be an int [{T}, layers, top_k], got {r.dtype} {tuple(r.shape)}")
        if (self.audio_features is None) != (self.audio_feature_lens is None):
            raise ValueError("audio_features and audio_feature_lens go together (both or neither)")
        if self.audio_features is not None:
            if self.audio_features.dim() != 2:
                raise ValueError(f"audio_features must be [mel, frames], got {tuple(self.audio_features.shape)}")
            if self.audio_feature_lens.dim() != 1 or self.audio_feature_lens.numel() == 0:
                raise ValueError(f"audio_feature_lens must be a non-empty [A], got "
                                 f"{tuple(self.audio_feature_lens.shape)}")

    # ---- views -------------------------------------------------------------------------------

    @property
    def input_ids_T(self) -> torch.Tensor:
        return self.mb.input_ids_T

    @property
    def loss_mask_T(self) -> torch.Tensor:
        return self.mb.loss_mask_T

    @property
    def sample_index_T(self) -> torch.Tensor:
        return self.mb.sample_index_T

    @property
    def cu_seqlens_S(self) -> torch.Tensor:
        return self.mb.cu_seqlens_S

    @property
    def sample_ids(self) -> tuple[int, ...]:
        return self.mb.sample_ids

    @property
    def num_tokens(self) -> int:
        return self.mb.num_tokens

    @property
    def has_audio(self) -> bool:
        return self.audio_features is not None or self.clip_use is not None

    @property
    def num_clips(self) -> int:
        """Clips in its tokens, shared ones included."""
        if self.clip_use is not None:
            return len(self.clip_use.order)
        return 0 if self.audio_feature_lens is None else int(self.audio_feature_lens.numel())

    @property
    def is_padding(self) -> bool:
        return self.mb.is_padding

    def position_ids(self) -> torch.Tensor:
        """int64 [3, 1, T] MRoPE positions (restarting per segment), the thinker's input layout."""
        return self.mb.position_ids_3T.unsqueeze(1)

    def packed_seq_params(self, device: Union[str, torch.device, None] = None, defer_copy: bool = False):
        """megatron ``PackedSeqParams(qkv_format="thd")`` over ``cu_seqlens_S`` (padding is its own
        trailing segment, so ``cu_seqlens_S[-1] == T`` and no ``*_padded`` offsets are needed).

        From a host micro-batch, with ``device``: the offsets go to ``device`` without a host sync and
        their host copy rides along, so the model plans the pass without reading the device
        (``model_bridge/modeling/thd.py``). ``defer_copy``: the offsets stay on the host for a model that
        moves them itself (``OmniThinker``: its torch backend after layer 0's first GEMM is queued)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.mb.cu_seqlens_S
        if device is not None and cu.device.type == "cpu":
            from model_bridge.modeling.thd import thd_params

            return thd_params(cu.tolist(), device, self.mb.max_seqlen, defer_copy=defer_copy)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               max_seqlen_q=self.mb.max_seqlen, max_seqlen_kv=self.mb.max_seqlen)

    def count_tokens(self, token_id: int) -> int:
        """How many of the micro-batch's tokens are ``token_id`` (read on the host for a host batch)."""
        return int((self.mb.input_ids_T == token_id).sum())

    def with_logprobs(self, old_logprobs_T: Optional[torch.Tensor] = None,
                      ref_logprobs_T: Optional[torch.Tensor] = None) -> "TrainMicroBatch":
        """A copy with old / reference logprobs filled (None keeps the current value)."""
        kw = {}
        if old_logprobs_T is not None:
            kw["old_logprobs_T"] = old_logprobs_T.detach().to(torch.float32)
        if ref_logprobs_T is not None:
            kw["ref_logprobs_T"] = ref_logprobs_T.detach().to(torch.float32)
        return replace(self, **kw)

    def to(self, device: Union[str, torch.device], non_blocking: bool = False) -> "TrainMicroBatch":
        """The same micro-batch with every tensor on ``device``."""
        mv = lambda x: None if x is None else to_device(x, device, non_blocking)  # noqa: E731
        return replace(self, mb=self.mb.to(device, non_blocking=non_blocking),
                       rollout_logprobs_T=mv(self.rollout_logprobs_T), advantages_T=mv(self.advantages_T),
                       audio_features=mv(self.audio_features), audio_feature_lens=mv(self.audio_feature_lens),
                       old_logprobs_T=mv(self.old_logprobs_T), ref_logprobs_T=mv(self.ref_logprobs_T),
                       routed_experts_TLK=mv(self.routed_experts_TLK))


@dataclass(frozen=True)
class MicroBatchInfo:
    """What a step needs to know of a micro-batch before any micro-batch runs (the ranks' agreement,
    the loss's normalisers, the schedule's length, the shared clips), known without assembling it."""

    num_tokens: int
    """T, padding included."""
    num_real_tokens: int
    """Tokens of its samples."""
    sample_ids: tuple[int, ...]
    """Global ids of its samples, in packing order."""
    loss_tokens: int
    """Tokens under the loss mask."""
    loss_samples: int
    """Samples with at least one token under the loss mask."""
    num_clips: int
    """Audio clips in its tokens, shared ones included (``TrainMicroBatch.num_clips``)."""
    clip_use: Optional[ClipUse] = None
    """``TrainMicroBatch.clip_use``."""
    has_old_logprobs: bool = False
    """Whether it carries ``old_logprobs_T``."""
    has_ref_logprobs: bool = False
    """Whether it carries ``ref_logprobs_T``."""

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def is_padding(self) -> bool:
        return not self.sample_ids

    @classmethod
    def of(cls, tmb: TrainMicroBatch) -> "MicroBatchInfo":
        """The info of an assembled micro-batch (reads its mask: a device sync for a device one)."""
        mask_T = tmb.loss_mask_T.to(torch.bool)
        return cls(num_tokens=tmb.num_tokens, num_real_tokens=tmb.mb.num_real_tokens, sample_ids=tmb.sample_ids,
                   loss_tokens=int(mask_T.sum()), loss_samples=count_samples(mask_T, tmb.sample_index_T),
                   num_clips=tmb.num_clips, clip_use=tmb.clip_use, has_old_logprobs=tmb.old_logprobs_T is not None,
                   has_ref_logprobs=tmb.ref_logprobs_T is not None)


class StepMicroBatches(SequenceABC):
    """One rank's micro-batches of a step (what :func:`build_train_microbatches` returns): each is
    assembled the first time it is read and kept, so a schedule that reads them one by one has the
    host assemble micro-batch k+1 while the device runs micro-batch k. ``infos`` holds their
    :class:`MicroBatchInfo` from the start."""

    def __init__(self, infos: Sequence[MicroBatchInfo], assemble: Callable[[int], TrainMicroBatch]):
        self.infos = tuple(infos)
        self._assemble = assemble
        self._made: dict[int, TrainMicroBatch] = {}

    def __len__(self) -> int:
        return len(self.infos)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(len(self)))]
        k = range(len(self.infos))[k]  # negative indices; IndexError past the end ends iteration
        made = self._made.get(k)
        if made is None:
            made = self._made[k] = self._assemble(k)
            info = self.infos[k]
            if (made.num_tokens, made.sample_ids) != (info.num_tokens, info.sample_ids):
                raise RuntimeError(f"micro-batch {k} was assembled with {made.num_tokens} tokens of samples "
                                   f"{made.sample_ids}, its info says {info.num_tokens} of {info.sample_ids}")
        return made

    @property
    def assembled(self) -> int:
        """How many of them have been assembled so far."""
        return len(self._made)


def count_samples(keep_T: torch.Tensor, sample_index_T: torch.Tensor) -> int:
    """Samples with at least one token where ``keep_T`` (bool [T]) is True (padding, index -1, aside)."""
    return int(torch.unique(sample_index_T[keep_T & (sample_index_T >= 0)]).numel())


def described(microbatches: Sequence[TrainMicroBatch]) -> Sequence:
    """What to read ``num_tokens``, ``num_clips`` or ``clip_use`` from without assembling anything:
    a :class:`StepMicroBatches`' ``infos``, else the micro-batches themselves."""
    return getattr(microbatches, "infos", microbatches)


def microbatch_infos(microbatches: Sequence[TrainMicroBatch]) -> tuple[MicroBatchInfo, ...]:
    """The :class:`MicroBatchInfo` of each micro-batch: a :class:`StepMicroBatches`' own (nothing is
    assembled), else read from the micro-batches."""
    infos = getattr(microbatches, "infos", None)
    return tuple(infos) if infos is not None else tuple(MicroBatchInfo.of(m) for m in microbatches)


def reset_shared_clips(microbatches: Sequence["TrainMicroBatch"], training: bool = False) -> None:
    """Before a pass over ``microbatches``: drop the shared clips' cached tower output (the weights
    may have changed since the last one), but for a pass with autograd (``training``) the batches
    ``build_train_microbatches(audio_tower=...)`` ran ahead for it (``SharedClips.begin_pass``)."""
    for shared in {id(m.clip_use.shared): m.clip_use.shared for m in described(microbatches) if m.clip_use}.values():
        shared.begin_pass(training)


def build_train_microbatches(trajectories: Sequence, plan: PackPlan, dp_rank: int, config: PackLimits, *,
                             advantages_N: Optional[torch.Tensor] = None, featurize: Optional[Featurizer] = None,
                             feature_extractor=None, n_window: int = 50,
                             ref_logprobs_by_sample: Optional[Sequence[torch.Tensor]] = None,
                             routes: bool = False, share_clips: bool = True,
                             keep_shared: float = 0.5, audio_tower=None) -> StepMicroBatches:
    """The micro-batches of DP rank ``dp_rank`` under ``plan``, a :class:`StepMicroBatches`: the
    input is converted, checked and featurised in this call; each :class:`TrainMicroBatch` is
    assembled when first read (R3's ``routes``: all of them in this call, which checks their shapes).

    ``trajectories[i]`` is global sample i (``megatron_grpo.trajectory.Trajectory``; the same list
    and order on every rank, as ``plan`` was made from their lengths). ``advantages_N`` (float
    ``[N]``) defaults to each trajectory's ``advantage``. Audio features come from ``featurize``
    or from ``feature_extractor`` (:func:`featurizer_from_extractor`); ``n_window`` is the audio
    config's (for the token-count check). ``ref_logprobs_by_sample`` (token-aligned ``[L_i]``
    each) fills ``ref_logprobs_T``. ``routes``: pack the trajectories' ``routed_experts`` into
    ``routed_experts_TLK`` (R3, ``engine.routes.pack_routes``). ``share_clips``: a clip object that
    several samples of this rank use (a group's recording) goes through the audio tower once per
    pass (``TrainMicroBatch.clip_use``); False: once per use. ``keep_shared > 0`` pools every clip
    (own ones too) in the step's :class:`SharedClips`, so the tower runs once per batch of
    micro-batches instead of once per micro-batch, and keeps the first pass's activations for the
    backward: always for the batches of clips that one micro-batch alone uses (of at most
    ``keep_shared`` micro-batch budgets of audio frames, ``keep_frames``, each;
    :func:`_pooled_batches`), and for the batches of clips that several use while those hold at
    most ``keep_frames``; the rest is recomputed. 0: only the clips used more than once are
    shared, all recomputed.

    ``audio_tower`` (the model's tower on this rank, making no collective; only when the next pass
    over these micro-batches is the training pass: ``engine.step.audio_prefetch_tower``): the first
    micro-batch's batches of shared clips go through it as soon as they are featurised, so the
    device runs them while the host packs the tokens (``ClipUse.prefetch``).
    """
    if keep_shared < 0:
        raise ValueError(f"keep_shared must be >= 0 (0: recompute every shared clip), got {keep_shared}")
    n = len(trajectories)
    mine = [i for mb in plan.microbatches[dp_rank] for i in mb]  # only these are read: the others may be
    if len(plan.lengths) != n or any(len(trajectories[i].input_ids_T) != plan.lengths[i] for i in mine):
        raise ValueError(f"the plan was made for {len(plan.lengths)} samples with other lengths than these "
                         f"{n} trajectories")  # placeholders (run/to_ranks.py: Elsewhere)
    if featurize is None and feature_extractor is not None:
        featurize = featurizer_from_extractor(feature_extractor)
    if advantages_N is None:
        advantages_N = torch.zeros(n, dtype=torch.float32)
        advantages_N[mine] = torch.tensor([float(trajectories[i].advantage) for i in mine], dtype=torch.float32)
    advantages_N = torch.as_tensor(advantages_N, dtype=torch.float32).reshape(-1)
    if advantages_N.shape[0] != n:
        raise ValueError(f"advantages_N has {advantages_N.shape[0]} values for {n} samples")
    if ref_logprobs_by_sample is not None and len(ref_logprobs_by_sample) != n:
        raise ValueError(f"ref_logprobs_by_sample has {len(ref_logprobs_by_sample)} entries for {n} samples")
    # the audio first (it needs only the plan's sample ids): a device featurizer's copy and kernels,
    # and a prefetched tower batch, then run while the host packs the tokens
    mb_ids = [tuple(int(i) for i in ids) for ids in plan.microbatches[dp_rank]]
    per_mb, uses = step_audio(trajectories, mb_ids, featurize, n_window, share_clips, keep_shared,
                               config.max_tokens_per_microbatch * 2 * n_window // TOKENS_PER_FULL_CHUNK, audio_tower)
    with host_range("pack"):  # every check on the input here, before any micro-batch runs (hang invariant)
        tokens = {i: _sample_tokens(i, trajectories[i]) for i in mine}  # (ids, mask, rollout logprobs)
        refs = None if ref_logprobs_by_sample is None else \
            {i: _per_token(ref_logprobs_by_sample[i], len(tokens[i][0]), f"reference logprobs of sample {i}")
             for i in mine}
        loss = {i: int(tokens[i][1].sum()) for i in mine}
        infos = [MicroBatchInfo(num_tokens=t, num_real_tokens=sum(plan.lengths[i] for i in ids),
                                sample_ids=ids, loss_tokens=sum(loss[i] for i in ids),
                                loss_samples=sum(1 for i in ids if loss[i]), num_clips=len(order), clip_use=use,
                                has_ref_logprobs=refs is not None)
                 for ids, t, (_, _, order), use in zip(mb_ids, plan.microbatch_tokens(dp_rank), per_mb, uses)]

    from megatron_grpo.engine.routes import pack_routes

    @host_range("pack")
    def assemble(k: int) -> TrainMicroBatch:
        mine_k = {i: tokens.pop(i) for i in mb_ids[k]}  # a sample is in one micro-batch: its parts go with it
        mb = build_microbatch(mb_ids[k], {i: t[0] for i, t in mine_k.items()}, {i: t[1] for i, t in mine_k.items()},
                              config)
        sid = mb.sample_index_T
        adv_T = torch.where(sid >= 0, advantages_N[sid.clamp(min=0)], torch.zeros(sid.shape, dtype=torch.float32))
        feats, lens, _ = per_mb[k]
        return TrainMicroBatch(
            mb=mb, rollout_logprobs_T=pack_per_token(mb, {i: t[2] for i, t in mine_k.items()}), advantages_T=adv_T,
            audio_features=torch.cat(feats, dim=1) if feats else None,
            audio_feature_lens=torch.cat(lens) if lens else None,
            ref_logprobs_T=None if refs is None else pack_per_token(mb, refs),
            routed_experts_TLK=pack_routes(mb, trajectories) if routes else None, clip_use=uses[k])

    out = StepMicroBatches(infos, assemble)
    if routes:
        out[:]  # the routes' shapes are checked against their samples here, before any micro-batch runs
    return out


def _per_token(values, num_tokens: int, what: str) -> torch.Tensor:
    """One sample's per-token float values as a float32 host tensor of ``num_tokens`` (``what`` names them)."""
    t = as_1d(values, torch.float32, what)
    if t.numel() != num_tokens:
        raise ValueError(f"{what}: {t.numel()} values for {num_tokens} tokens")
    return t


def _sample_tokens(i: int, traj) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample i's token ids (int64), loss mask (bool) and rollout logprobs (float32) as host
    tensors, checked to have one entry per token."""
    ids = as_1d(traj.input_ids_T, torch.int64, f"input ids of sample {i}")
    mask = as_1d(traj.loss_mask_T, torch.bool, f"loss mask of sample {i}")
    if ids.numel() == 0 or ids.shape != mask.shape:
        raise ValueError(f"sample {i}: {ids.numel()} token ids and {mask.numel()} mask entries "
                         "(need the same positive number)")
    return ids, mask, _per_token(traj.rollout_logprobs_T, ids.numel(), f"rollout logprobs of sample {i}")


def padding_summary(microbatches: Sequence[TrainMicroBatch]) -> dict[str, float]:
    """Local counts for the step log: tokens computed, real tokens, loss tokens, samples, clips."""
    infos = microbatch_infos(microbatches)
    return {"tokens_total": float(sum(m.num_tokens for m in infos)),
            "tokens_real": float(sum(m.num_real_tokens for m in infos)),
            "tokens_loss": float(sum(m.loss_tokens for m in infos)),
            "samples": float(sum(m.num_samples for m in infos)),
            "audio_clips": float(sum(m.num_clips for m in infos))}
