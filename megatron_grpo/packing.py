"""Pack a step's samples into THD micro-batches, balance them across DP ranks, agree on the count.

Shape legend:
  N  samples of the step, identified by their global id 0..N-1 (the same order on every rank)
  T  tokens of one micro-batch, padding included; T % pad_multiple == 0
  S  segments of one micro-batch: its samples, then one padding segment when T has padding;
     ``cu_seqlens_S`` holds S + 1 offsets

Rules (docs/training.md, "Packing"):

1. A sample is never split: it lies wholly in one micro-batch (GRPO's sequence-mean and the
   sequence-level IS need that, and so does causal attention).
2. Samples go to DP ranks by longest-processing-time (LPT) on token counts (with groups, a sample
   joins a rank holding its group while that rank stays under the mean), then each rank packs its
   own samples first-fit-decreasing (FFD) into micro-batches of at most ``max_tokens_per_microbatch``
   tokens *after* padding (the budget is a multiple of ``pad_multiple``, so rounding up never
   crosses it). A sample longer than the budget is an error, or, with ``allow_oversized``, gets a
   micro-batch of its own (then T = the sample rounded up to ``pad_multiple``).
3. Every rank runs the same number of micro-batches (design invariant 1): :func:`plan_step` pads
   every rank to the largest count with empty micro-batches; a run whose ranks pack independently
   calls :func:`equalize_microbatch_counts` (MAX all-reduce) and :func:`pad_microbatches`. An empty
   micro-batch has ``pad_multiple`` padding tokens, no loss tokens, hence zero loss weight.
4. Padding to a multiple of ``pad_multiple`` (the TP size under sequence parallelism) is one
   trailing segment of ``pad_token_id`` tokens in ``cu_seqlens_S``, so ``cu_seqlens_S[-1] == T``
   always: megatron's THD RoPE then uses its exact per-sample offset mapping
   (``freqs.size(0) == cu_seqlens[-1]``), and no ``cu_seqlens_*_padded`` is needed. The padding
   segment attends only to itself, has loss mask 0 and sample index -1.
5. Positions restart at 0 in every segment (the padding segment too, matching
   ``model_bridge.modeling.mrope.mrope_position_ids``); for text/audio the three MRoPE rows are equal.

Everything is deterministic: ties are broken by sample id and rank.
"""
from __future__ import annotations

import contextvars
import struct
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence, Union

import numpy as np
import torch

__all__ = ["PackLimits", "PackPlan", "MicroBatch", "first_fit_decreasing", "balance_samples",
           "plan_step", "as_1d", "build_microbatch", "build_rank_microbatches", "empty_microbatch",
           "pad_microbatches", "equalize_microbatch_counts", "pack_per_token", "shift_within_samples",
           "next_token_targets", "round_up"]

TokenSeq = Union[torch.Tensor, Sequence[int]]


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= n."""
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class PackLimits:
    """How one step's samples become micro-batches."""

    max_tokens_per_microbatch: int
    """Token budget of one micro-batch, padding included; a multiple of ``pad_multiple``."""
    pad_multiple: int = 1
    """Every micro-batch's T is a multiple of this (the TP size with sequence parallelism)."""
    allow_oversized: bool = False
    """A sample longer than the budget: False raises, True gives it a micro-batch of its own."""
    pad_token_id: int = 0
    """Token id written into padding (never trained on; use the tokenizer's pad id)."""

    def __post_init__(self):
        budget, m = self.max_tokens_per_microbatch, self.pad_multiple
        if int(m) != m or m < 1:
            raise ValueError(f"pad_multiple must be a positive int, got {m!r}")
        if int(budget) != budget or budget < 1:
            raise ValueError(f"max_tokens_per_microbatch must be a positive int, got {budget!r}")
        if budget % m:
            raise ValueError(f"max_tokens_per_microbatch={budget} must be a multiple of pad_multiple={m} "
                             f"(so padding never crosses the budget); use {budget // m * m or m}")
        if int(self.pad_token_id) != self.pad_token_id or self.pad_token_id < 0:
            raise ValueError(f"pad_token_id must be a non-negative int, got {self.pad_token_id!r}")


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    out = [int(n) for n in lengths]
    for i, (n, raw) in enumerate(zip(out, lengths)):
        if n != raw or n < 1:
            raise ValueError(f"sample {i} has length {raw!r}; every sample needs a positive whole number of tokens")
    return out


def first_fit_decreasing(lengths: Sequence[int], capacity: int, *, allow_oversized: bool = False,
                         ids: Optional[Sequence[int]] = None) -> list[list[int]]:
    """Bins of sample ids, first-fit-decreasing: longest first (ties by id), each into the first bin
    with room. ``lengths[k]`` belongs to ``ids[k]`` (default ``k``). A sample over ``capacity`` raises
    ``ValueError`` naming it and the budget, or with ``allow_oversized`` fills a bin alone."""
    ids = list(range(len(lengths))) if ids is None else [int(i) for i in ids]
    if len(ids) != len(lengths):
        raise ValueError(f"{len(ids)} ids for {len(lengths)} lengths")
    order = sorted(range(len(lengths)), key=lambda k: (-lengths[k], ids[k]))
    bins: list[list[int]] = []
    room: list[int] = []
    for k in order:
        n = lengths[k]
        if n > capacity:
            if not allow_oversized:
                raise ValueError(f"sample {ids[k]} has {n} tokens, more than max_tokens_per_microbatch="
                                 f"{capacity}; raise the budget, cap the rollout length, or set "
                                 "allow_oversized=True to give such a sample a micro-batch of its own")
            bins.append([ids[k]])
            room.append(-1)  # closed: nothing joins an oversized sample
            continue
        for b, r in enumerate(room):
            if r >= n:
                bins[b].append(ids[k])
                room[b] = r - n
                break
        else:
            bins.append([ids[k]])
            room.append(capacity - n)
    return bins


def balance_samples(lengths: Sequence[int], dp_size: int, groups: Optional[Sequence] = None) -> list[list[int]]:
    """Sample ids per DP rank, longest-processing-time first: longest sample first (ties by id), each
    to the rank with the fewest tokens so far (ties: fewer samples, then lower rank). The heaviest
    rank exceeds the mean by less than the longest sample.

    ``groups`` (one hashable per sample, e.g. the GRPO group): a sample goes instead to a rank that
    already holds its group when that rank stays at or under the mean with it (the least loaded
    such rank), so a group's shared recording reaches, and runs through the audio tower on, as few
    ranks as the balance allows (``engine.batch``: once per rank and step). The bound above holds."""
    if int(dp_size) != dp_size or dp_size < 1:
        raise ValueError(f"dp_size must be a positive int, got {dp_size!r}")
    if groups is not None and len(groups) != len(lengths):
        raise ValueError(f"{len(groups)} groups for {len(lengths)} samples")
    load, count = [0] * dp_size, [0] * dp_size
    mean = sum(lengths) / dp_size
    held: dict = {}  # group -> ranks holding it
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    for k in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        key = lambda r: (load[r], count[r], r)  # noqa: E731
        r = min(range(dp_size), key=key)
        if groups is not None:
            fits = [q for q in held.get(groups[k], ()) if load[q] + lengths[k] <= mean]
            if fits:
                r = min(fits, key=key)
            held.setdefault(groups[k], set()).add(r)
        ranks[r].append(k)
        load[r] += lengths[k]
        count[r] += 1
    return [sorted(ids) for ids in ranks]


@dataclass(frozen=True)
class PackPlan:
    """Which samples each micro-batch of each DP rank holds; every rank has the same count."""

    microbatches: tuple[tuple[tuple[int, ...], ...], ...]
    """``[rank][micro-batch]`` -> sample ids in packing order; ``()`` is an empty padding micro-batch."""
    lengths: tuple[int, ...]
    """Token count of every sample, by global id."""
    pad_multiple: int
    """Each micro-batch's T is its real tokens rounded up to this (an empty one has exactly this)."""

    def __post_init__(self):
        counts = {len(r) for r in self.microbatches}
        if len(counts) > 1:
            raise ValueError(f"ranks have different micro-batch counts {[len(r) for r in self.microbatches]}")
        seen = sorted(i for r in self.microbatches for mb in r for i in mb)
        if seen != list(range(len(self.lengths))):
            raise ValueError("the plan must hold every sample exactly once")

    @property
    def dp_size(self) -> int:
        return len(self.microbatches)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per rank (the same on every rank)."""
        return len(self.microbatches[0]) if self.microbatches else 0

    def microbatch_tokens(self, rank: int) -> list[int]:
        """Padded T of each micro-batch of ``rank``."""
        return [round_up(sum(self.lengths[i] for i in mb), self.pad_multiple) if mb else self.pad_multiple
                for mb in self.microbatches[rank]]

    @property
    def rank_tokens(self) -> list[int]:
        """Real (unpadded) tokens per rank."""
        return [sum(self.lengths[i] for mb in r for i in mb) for r in self.microbatches]

    @property
    def balance(self) -> float:
        """max / mean of the ranks' real tokens (1.0 is perfect; 1.0 for an empty step)."""
        toks = self.rank_tokens
        mean = sum(toks) / len(toks) if toks else 0.0
        return max(toks) / mean if mean > 0 else 1.0

    @property
    def padding_fraction(self) -> float:
        """Padding tokens (rounding + empty micro-batches) over all tokens the step computes."""
        total = sum(sum(self.microbatch_tokens(r)) for r in range(self.dp_size))
        return 1.0 - sum(self.lengths) / total if total else 0.0

    def summary(self) -> dict[str, float]:
        """Numbers for the step log."""
        per_mb = [t for r in range(self.dp_size) for t in self.microbatch_tokens(r)]
        return {"pack/num_microbatches": float(self.num_microbatches),
                "pack/empty_microbatches": float(sum(1 for r in self.microbatches for mb in r if not mb)),
                "pack/balance_max_over_mean": self.balance,
                "pack/padding_fraction": self.padding_fraction,
                "pack/max_microbatch_tokens": float(max(per_mb, default=0))}


def plan_step(lengths: Sequence[int], dp_size: int, config: PackLimits,
              groups: Optional[Sequence] = None) -> PackPlan:
    """Deterministic plan for one step (rules 1-3 of the module doc). Every rank computes the same
    plan from the same ``lengths`` (and ``groups``: keep a group on few ranks, :func:`balance_samples`)
    and takes ``plan.microbatches[its DP rank]``. An empty step gives 0 micro-batches on every rank."""
    lens = _check_lengths(lengths)
    per_rank = []
    for ids in balance_samples(lens, dp_size, groups):
        bins = first_fit_decreasing([lens[i] for i in ids], config.max_tokens_per_microbatch,
                                    allow_oversized=config.allow_oversized, ids=ids)
        # heaviest first, so micro-batch k has a similar size on every rank (ties: smallest id)
        bins.sort(key=lambda b: (-sum(lens[i] for i in b), min(b)))
        per_rank.append([tuple(b) for b in bins])
    count = max((len(r) for r in per_rank), default=0)
    return PackPlan(microbatches=tuple(tuple(r) + ((),) * (count - len(r)) for r in per_rank),
                    lengths=tuple(lens), pad_multiple=config.pad_multiple)


@dataclass(frozen=True)
class MicroBatch:
    """One packed (THD) micro-batch: its samples back to back, then padding (module doc, rules 4-5)."""

    input_ids_T: torch.Tensor
    """int64 [T] token ids; padding holds ``pad_token_id``."""
    loss_mask_T: torch.Tensor
    """bool [T]; True on the tokens trained on (the sample's own mask), False on padding."""
    sample_index_T: torch.Tensor
    """int64 [T]; global sample id of each token, -1 on padding."""
    position_ids_3T: torch.Tensor
    """int64 [3, T]; MRoPE positions, restarting at 0 in every segment, three equal rows."""
    cu_seqlens_S: torch.Tensor
    """int32 [S + 1]; segment offsets, 0 first and T last; the last segment is the padding if any."""
    max_seqlen: int
    """Longest segment (padding segment included), for varlen attention."""
    sample_ids: tuple[int, ...]
    """Global ids of the samples, in packing order; empty for a padding micro-batch."""
    scored_tokens: Optional[int] = field(default=None, compare=False)
    """Loss-mask tokens that are not a segment's first (those ``engine.logprobs.token_logprobs``
    scores under the loss mask), counted on the host when the micro-batch is built there and
    carried by :meth:`to`, so the device's scoring needs no host read; None where unknown."""

    def __post_init__(self):
        T = self.input_ids_T.shape[0] if self.input_ids_T.dim() == 1 else -1
        if T < 1:
            raise ValueError(f"input_ids_T must be a non-empty [T] tensor, got {tuple(self.input_ids_T.shape)}")
        for name, x, dtype in (("loss_mask_T", self.loss_mask_T, torch.bool),
                               ("sample_index_T", self.sample_index_T, torch.int64)):
            if tuple(x.shape) != (T,) or x.dtype != dtype:
                raise ValueError(f"{name} must be {dtype} [{T}], got {x.dtype} {tuple(x.shape)}")
        if tuple(self.position_ids_3T.shape) != (3, T):
            raise ValueError(f"position_ids_3T must be [3, {T}], got {tuple(self.position_ids_3T.shape)}")
        if self.cu_seqlens_S.dtype != torch.int32 or self.cu_seqlens_S.dim() != 1:
            raise ValueError(f"cu_seqlens_S must be int32 [S+1], got {self.cu_seqlens_S.dtype} "
                             f"{tuple(self.cu_seqlens_S.shape)}")
        if self.cu_seqlens_S.device.type != "cpu":
            return  # content checks only where they cost no device sync
        cu = self.cu_seqlens_S.tolist()
        if _ASSEMBLING.get():  # built consistent by _assemble: its checks would redo its work
            object.__setattr__(self, "scored_tokens", _scored(self.loss_mask_T, cu))
            return
        seg = [b - a for a, b in zip(cu, cu[1:])]
        n = len(self.sample_ids)
        if not cu or cu[0] != 0 or cu[-1] != T or any(s <= 0 for s in seg):
            raise ValueError(f"cu_seqlens_S {cu} must rise strictly from 0 to T={T}")
        if len(seg) not in (n, n + 1) or (n == 0 and len(seg) != 1):
            raise ValueError(f"cu_seqlens_S {cu} has {len(seg)} segments for {n} samples (+1 padding at most)")
        if self.max_seqlen != max(seg):
            raise ValueError(f"max_seqlen={self.max_seqlen} but the longest segment has {max(seg)} tokens")
        ids = torch.tensor(list(self.sample_ids) + [-1] * (len(seg) - n), dtype=torch.int64)
        seg_t = torch.tensor(seg)
        if not torch.equal(self.sample_index_T, ids.repeat_interleave(seg_t)):
            raise ValueError("sample_index_T does not match cu_seqlens_S and sample_ids")
        starts_T = torch.tensor(cu[:-1]).repeat_interleave(seg_t)
        if not torch.equal(self.position_ids_3T, (torch.arange(T) - starts_T).expand(3, T)):
            raise ValueError("position_ids_3T must restart at 0 in every segment, three equal rows")
        if bool(self.loss_mask_T[cu[n]:].any()):
            raise ValueError("padding tokens must have loss mask False")
        object.__setattr__(self, "scored_tokens", _scored(self.loss_mask_T, cu))

    @property
    def num_tokens(self) -> int:
        """T, padding included."""
        return int(self.input_ids_T.shape[0])

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def num_real_tokens(self) -> int:
        """Tokens of the samples (T minus padding)."""
        return int(self.cu_seqlens_S[self.num_samples])

    @property
    def num_padding_tokens(self) -> int:
        return self.num_tokens - self.num_real_tokens

    @property
    def is_padding(self) -> bool:
        """An empty micro-batch added so that every rank runs the same count (zero loss weight)."""
        return not self.sample_ids

    def to(self, device: Union[str, torch.device], non_blocking: bool = False) -> "MicroBatch":
        """The same micro-batch with every tensor on ``device``."""
        mv = lambda x: to_device(x, device, non_blocking)  # noqa: E731
        return replace(self, input_ids_T=mv(self.input_ids_T), loss_mask_T=mv(self.loss_mask_T),
                       sample_index_T=mv(self.sample_index_T), position_ids_3T=mv(self.position_ids_3T),
                       cu_seqlens_S=mv(self.cu_seqlens_S))


def to_device(x: torch.Tensor, device: Union[str, torch.device], non_blocking: bool = False) -> torch.Tensor:
    """``x.to(device)``; ``non_blocking`` host -> GPU copies go through pinned memory, so that the
    host does not wait for the GPU's queue (a copy from pageable memory does)."""
    if non_blocking:
        from model_bridge.modeling.thd import to_device_async

        return to_device_async(x, device)
    return x.to(device)


_NP_DTYPES = {torch.int64: np.int64, torch.bool: np.bool_, torch.float32: np.float32}


def _from_list(x: list, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """A list of Python numbers as a 1-D host tensor of ``dtype`` through one C-level pass
    (``struct.pack_into`` / ``bytearray``): 2-6x faster than numpy's per-element conversion on
    the rollout's lists, which is most of the packer's host time (a 64-sample step holds
    ~190,000 tokens, each with an id, a mask bit and a logprob). None where the values do not
    fit that pass (a float among ids, a mask value outside 0-255): the caller then converts them
    through numpy, which gives the error or the cast."""
    if dtype not in (torch.bool, torch.int64, torch.float32):
        return None
    if not x:  # torch.frombuffer refuses an empty buffer
        return torch.zeros(0, dtype=dtype)
    try:
        if dtype == torch.bool:
            return torch.frombuffer(bytearray(x), dtype=torch.uint8).bool()
        buf = bytearray(8 * len(x))  # writable, so torch.frombuffer does not warn
        fmt = "q" if dtype == torch.int64 else "d"  # doubles: Python floats as they are, then rounded once
        struct.pack_into(f"<{len(x)}{fmt}", buf, 0, *x)
        t = torch.frombuffer(buf, dtype=torch.int64 if fmt == "q" else torch.float64)
        return t if fmt == "q" else t.to(torch.float32)
    except (TypeError, ValueError, OverflowError, struct.error):
        return None


def as_1d(x: TokenSeq, dtype: torch.dtype, what: str = "values") -> torch.Tensor:
    """A sample's per-token values (tensor, array or list) as a 1-D host tensor of ``dtype``; a list
    goes through :func:`_from_list` (or numpy, ~2.5x faster than ``torch.tensor`` on the
    rollout's lists, where that cannot take it)."""
    if torch.is_tensor(x):
        t = x.detach().to("cpu")
    elif isinstance(x, list) and (t := _from_list(x, dtype)) is not None:
        pass
    elif dtype in _NP_DTYPES:
        t = torch.from_numpy(np.asarray(x, dtype=_NP_DTYPES[dtype]))
    else:
        t = torch.tensor(list(x))
    if t.dim() != 1:
        raise ValueError(f"{what} must be 1-D, got shape {tuple(t.shape)}")
    return t.to(dtype)


def build_microbatch(sample_ids: Sequence[int], input_ids_by_sample: Sequence[TokenSeq],
                     loss_mask_by_sample: Sequence[TokenSeq], config: PackLimits) -> MicroBatch:
    """Pack the samples ``sample_ids`` (in this order) into one micro-batch on the CPU.

    ``input_ids_by_sample[i]`` / ``loss_mask_by_sample[i]`` are sample i's tokens and mask ([L_i]
    each; the mask says which tokens are trained on, usually the generated ones). No ids -> an empty
    padding micro-batch. The budget is not checked here (:func:`plan_step` does it).
    """
    sample_ids = tuple(int(i) for i in sample_ids)
    if not sample_ids:
        return empty_microbatch(config)
    ids, masks = [], []
    for i in sample_ids:
        tok = as_1d(input_ids_by_sample[i], torch.int64, f"input ids of sample {i}")
        msk = as_1d(loss_mask_by_sample[i], torch.bool, f"loss mask of sample {i}")
        if tok.numel() == 0 or tok.shape != msk.shape:
            raise ValueError(f"sample {i}: {tok.numel()} token ids and {msk.numel()} mask entries "
                             "(need the same positive number)")
        ids.append(tok)
        masks.append(msk)
    seg = [t.numel() for t in ids]
    real = sum(seg)
    T = round_up(real, config.pad_multiple)
    if T > real:
        seg.append(T - real)
        ids.append(torch.full((T - real,), config.pad_token_id, dtype=torch.int64))
        masks.append(torch.zeros(T - real, dtype=torch.bool))
    return _assemble(torch.cat(ids), torch.cat(masks), seg, sample_ids)


_ASSEMBLING = contextvars.ContextVar("mgrpo_packing_assembling", default=False)
"""True while :func:`_assemble` constructs a :class:`MicroBatch`: its offsets, sample index and
positions are derived from one list of segment lengths, so ``__post_init__`` keeps the shape and
dtype checks and skips the content checks, which would rebuild them (a third of the packer's host
time on a 64-sample step). Padding tokens get mask False from :func:`build_microbatch`."""


def _scored(loss_mask_T: torch.Tensor, cu: list[int]) -> int:
    """Loss-mask tokens that do not start a segment (``MicroBatch.scored_tokens``)."""
    return int(loss_mask_T.sum()) - int(loss_mask_T[cu[:-1]].sum())


def _assemble(input_ids_T: torch.Tensor, loss_mask_T: torch.Tensor, seg: list[int],
              sample_ids: tuple[int, ...]) -> MicroBatch:
    seg_t = torch.tensor(seg, dtype=torch.int64)
    cu_S = torch.zeros(len(seg) + 1, dtype=torch.int64)
    cu_S[1:] = torch.cumsum(seg_t, 0)
    T = int(cu_S[-1])
    sid = torch.tensor(list(sample_ids) + [-1] * (len(seg) - len(sample_ids)), dtype=torch.int64)
    pos_T = torch.arange(T) - cu_S[:-1].repeat_interleave(seg_t)
    token = _ASSEMBLING.set(True)
    try:
        return MicroBatch(input_ids_T=input_ids_T, loss_mask_T=loss_mask_T,
                          sample_index_T=sid.repeat_interleave(seg_t),
                          position_ids_3T=pos_T.expand(3, T).contiguous(), cu_seqlens_S=cu_S.to(torch.int32),
                          max_seqlen=max(seg), sample_ids=sample_ids)
    finally:
        _ASSEMBLING.reset(token)


def empty_microbatch(config: PackLimits) -> MicroBatch:
    """A padding micro-batch: ``pad_multiple`` pad tokens in one segment, no loss tokens."""
    T = config.pad_multiple
    return _assemble(torch.full((T,), config.pad_token_id, dtype=torch.int64),
                     torch.zeros(T, dtype=torch.bool), [T], ())


def build_rank_microbatches(plan: PackPlan, rank: int, input_ids_by_sample: Sequence[TokenSeq],
                            loss_mask_by_sample: Sequence[TokenSeq], config: PackLimits) -> list[MicroBatch]:
    """The micro-batches of DP ``rank`` in ``plan`` (``plan.num_microbatches`` of them)."""
    if not 0 <= rank < plan.dp_size:
        raise ValueError(f"rank {rank} is outside the plan's {plan.dp_size} DP ranks")
    if config.pad_multiple != plan.pad_multiple:
        raise ValueError(f"config.pad_multiple={config.pad_multiple} but the plan used {plan.pad_multiple}")
    return [build_microbatch(mb, input_ids_by_sample, loss_mask_by_sample, config)
            for mb in plan.microbatches[rank]]


def pad_microbatches(microbatches: Sequence[MicroBatch], count: int, config: PackLimits) -> list[MicroBatch]:
    """``microbatches`` followed by empty ones up to ``count`` (from :func:`equalize_microbatch_counts`)."""
    if count < len(microbatches):
        raise ValueError(f"cannot pad {len(microbatches)} micro-batches down to {count}; the agreed count "
                         "must be the MAX over ranks")
    return list(microbatches) + [empty_microbatch(config) for _ in range(count - len(microbatches))]


def equalize_microbatch_counts(local_count: int, group=None) -> int:
    """The micro-batch count every rank of ``group`` must run: MAX all-reduce of ``local_count``.

    Collective: every rank of ``group`` (default: the world) must call it. Uses a CPU tensor on
    gloo groups and a CUDA tensor on NCCL ones. Without an initialised process group (one process)
    it returns ``local_count``.
    """
    if int(local_count) != local_count or local_count < 0:
        raise ValueError(f"local_count must be a non-negative int, got {local_count!r}")
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return int(local_count)
    backend = str(dist.get_backend(group)).lower()
    on_gpu = "nccl" in backend and "gloo" not in backend
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    t = torch.tensor([int(local_count)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def pack_per_token(mb: MicroBatch, values_by_sample: Sequence[torch.Tensor], fill: float = 0.0) -> torch.Tensor:
    """``[T]`` tensor laying out per-token values (e.g. rollout logprobs) like ``mb``'s tokens:
    ``values_by_sample[i]`` ([L_i]) for each of its samples in order, then ``fill`` on padding."""
    parts = []
    cu = mb.cu_seqlens_S.tolist()
    for k, i in enumerate(mb.sample_ids):
        v = values_by_sample[i]
        v = v if torch.is_tensor(v) else torch.tensor(v)
        if v.dim() != 1 or v.numel() != cu[k + 1] - cu[k]:
            raise ValueError(f"sample {i}: {tuple(v.shape)} values for {cu[k + 1] - cu[k]} tokens")
        parts.append(v)
    dtype = parts[0].dtype if parts else torch.float32
    parts.append(torch.full((mb.num_padding_tokens,), fill, dtype=dtype))
    return torch.cat([p.to(dtype=dtype, device="cpu") for p in parts])


def shift_within_samples(values_T: torch.Tensor, cu_seqlens_S: torch.Tensor, fill=0) -> torch.Tensor:
    """``out[t] = values_T[t + 1]`` when t + 1 is in t's segment, else ``fill`` (each segment's last
    token, padding included). Turns per-token labels into per-position targets for next-token logits."""
    T = values_T.shape[0]
    out = torch.cat([values_T[1:], values_T.new_full((1,), fill)])
    last = cu_seqlens_S[1:].to(torch.int64) - 1
    out[last[last < T]] = fill
    return out


def next_token_targets(mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels_T, label_mask_T)`` aligned to the logits: position t predicts ``input_ids_T[t+1]``
    and is trained iff that token is a loss token of the same sample."""
    return (shift_within_samples(mb.input_ids_T, mb.cu_seqlens_S, 0),
            shift_within_samples(mb.loss_mask_T, mb.cu_seqlens_S, False))
