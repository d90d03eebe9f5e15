"""The audio tower once per clip of a pass, however many samples use the clip.

A GRPO group's generations share their prompt's recording: one clip object in ``G`` samples, in one
or several micro-batches of a rank. Each sample's copy of the recording used to go through the
tower forward and backward, ``G`` times the same work. :class:`SharedClips` holds the clips that
one rank's pass uses more than once; each is computed as follows:

* batches: the clips are cut, in first-use order, into batches of at most ``max_frames`` frames
  (a longer clip is a batch of its own); the tower runs on a whole batch in one call, so a pass
  launches its kernels once per batch instead of once per clip;
* forward: the tower once per batch at the first micro-batch that uses one of its clips
  (:meth:`SharedClips.embeddings`); every use takes rows of that result. While the batches whose
  activations are kept hold at most ``keep_frames`` frames, the batch runs with autograd and its
  graph is *kept*; otherwise it runs without autograd;
* backward: the uses' gradients accumulate into a float32 leaf per clip (``autograd`` sums a leaf's
  gradient over uses) until the batch's *last user*, the last micro-batch that uses any clip of the
  batch. There :class:`_RecomputeTower` adds the leaves' gradients to its own and back-propagates
  the sum through the batch's kept graph, or, for a batch run without autograd, through the tower
  run again with autograd on the batch (the same call as the first pass, so the same values:
  activation recomputation, as megatron's ``CheckpointFunction``). So the tower's parameters get
  their gradient once per batch, inside a micro-batch's backward (megatron's DDP sees them as any
  micro-batch's gradient).

Cost per clip used ``k`` times, instead of ``k`` forwards and backwards (about ``3k``
forward-units): kept, one forward and one backward (3 units); recomputed, two forwards and one
backward (4 units), so a recomputed clip belongs here only with ``k >= 2``. A kept clip used once
costs what it costs in its micro-batch's own tower call, and the tower runs once per batch instead
of once per micro-batch: ``engine.step_audio`` then pools every clip of a rank's step here (the batches
of the clips one micro-batch alone uses are freed before the next batch runs, so they are always
kept: ``always_keep``). Memory: the kept batches' activations
from their first to their last user (at most ``keep_frames`` frames of audio), and one recomputed
batch's activations at a time in a backward (``max_frames``: the callers pass a micro-batch's token
budget in frames, so no more than a micro-batch's own audio), plus the clips' embeddings and their
gradient (``[tokens, out]`` each). The gradient is the eager one up to the order of a sum.

Schedules run every micro-batch's backward in forward order (megatron's no-pipelining and 1F1B
schedules), so a batch's last user's backward comes after every earlier user's;
:meth:`SharedClips.begin_pass` before each pass (the weights may have changed) drops the cached
embeddings and kept graphs, except what :meth:`ClipUse.prefetch` computed for the pass with autograd
that comes next.

Prefetch: the first micro-batch's batches can run before the pass starts (``ClipUse.prefetch``, the
same calls in the same order as its forward makes them), so the device works on the tower while the
host still packs the step's tokens. The tower must then make no collective (a replicated tower, or
TP 1): the prefetch runs before the ranks have agreed on the step.

Shape legend: ``M`` mel bins, ``F`` frames, ``N`` audio tokens (tower output rows), ``O`` the
tower's output width.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["SharedClips", "ClipUse", "frame_batches"]


def frame_batches(clips: Sequence[int], lens: Sequence[int], max_frames: Optional[int]) -> list[list[int]]:
    """``clips`` (indices into ``lens``, frames per clip) in their order, cut greedily into batches
    of at most ``max_frames`` frames (None: one batch); a clip longer than that is a batch alone."""
    batches: list[list[int]] = []
    frames = 0
    for c in clips:
        if batches and (max_frames is None or frames + lens[c] <= max_frames):
            batches[-1].append(c)
            frames += lens[c]
        else:
            batches.append([c])
            frames = lens[c]
    return batches


class SharedClips:
    """Clips (host features ``[M, F_c]`` each) that several samples of one pass use (module doc),
    cut into batches of at most ``max_frames`` frames (None: one batch) or into ``batches`` as
    given; a pass with autograd keeps the first pass's graph of the batches in ``always_keep`` and of
    the others while those hold at most ``keep_frames`` frames."""

    def __init__(self, features_MF: Sequence[Optional[torch.Tensor]], max_frames: Optional[int] = None,
                 keep_frames: int = 0, batches: Optional[Sequence[Sequence[int]]] = None,
                 always_keep: Sequence[int] = (), lens: Optional[Sequence[int]] = None):
        """``lens``: each clip's frame count, when the features are not all there yet (None entries,
        each given by :meth:`set_features` before a batch that holds it runs)."""
        if not features_MF:
            raise ValueError("SharedClips needs at least one clip")
        if keep_frames < 0:
            raise ValueError(f"keep_frames must be >= 0 (0: recompute every batch), got {keep_frames}")
        self.features_MF = [None] * len(features_MF)
        self.lens = [int(n) for n in lens] if lens is not None else [int(f.shape[-1]) for f in features_MF]
        if len(self.lens) != len(self.features_MF):
            raise ValueError(f"SharedClips got {len(self.lens)} frame counts for {len(features_MF)} clips")
        for c, f in enumerate(features_MF):
            if f is not None:
                self.set_features(c, f)
        self.keep_frames = int(keep_frames)
        self.batches: list[tuple[int, ...]] = []
        if batches is not None:
            self.batches = [tuple(int(c) for c in b) for b in batches]
            if sorted(c for b in self.batches for c in b) != list(range(len(self))) or not all(self.batches):
                raise ValueError(f"SharedClips batches {self.batches} must hold each of the {len(self)} clips once")
        else:
            self.batches = [tuple(b) for b in frame_batches(range(len(self.lens)), self.lens, max_frames)]
        self.always_keep = frozenset(int(b) for b in always_keep)
        self.batch_of = {c: b for b, clips in enumerate(self.batches) for c in clips}
        self.batch_frames = [sum(self.lens[c] for c in clips) for clips in self.batches]
        self._leaf: dict[int, torch.Tensor] = {}  # clip -> [N_c, O] float32, grad accumulates over uses
        self._kept: dict[int, list[torch.Tensor]] = {}  # batch -> its tower outputs with their graph
        self.kept_batches = 0
        """Batches of the last pass whose first pass was kept for the backward (the rest recomputed)."""
        self.prefetched = False
        """Batches ran ahead of the next pass with autograd (:meth:`ClipUse.prefetch`)."""

    def __len__(self) -> int:
        return len(self.features_MF)

    def set_features(self, c: int, features_MF: torch.Tensor) -> None:
        """Clip ``c``'s features ``[M, F_c]``, of the frame count it was planned with."""
        if features_MF.shape[-1] != self.lens[c]:
            raise ValueError(f"shared clip {c} was planned with {self.lens[c]} frames but its features have "
                             f"{features_MF.shape[-1]}")
        self.features_MF[c] = features_MF

    def reset(self) -> None:
        """Forget the embeddings and kept graphs (a new pass: the weights may have changed)."""
        self._leaf, self._kept, self.kept_batches, self.prefetched = {}, {}, 0, False

    def begin_pass(self, training: bool) -> None:
        """Before a pass over the micro-batches: a prefetch is this pass's first tower calls when
        the pass has autograd (``training``); anything else is forgotten (:meth:`reset`)."""
        if self.prefetched and training:
            self.prefetched = False
        else:
            self.reset()

    def _run(self, tower, b: int) -> list[torch.Tensor]:
        """The tower on batch ``b``: ``[N_c, O]`` per clip (the same call in the first pass and the
        recomputation, so both give the same values)."""
        from .audio import audio_output_lengths

        p = tower.conv2d1.weight
        clips = self.batches[b]
        missing = [c for c in clips if self.features_MF[c] is None]
        if missing:
            raise RuntimeError(f"shared clip(s) {missing} of batch {b} have no features yet (set_features)")
        feats = torch.cat([self.features_MF[c] for c in clips], dim=1) if len(clips) > 1 else self.features_MF[clips[0]]
        lens = [self.lens[c] for c in clips]
        out_NO = tower(feats.to(p.device, p.dtype, non_blocking=True), torch.tensor(lens))
        return list(out_NO.split([int(audio_output_lengths(n, tower.audio.n_window)) for n in lens]))

    def _leaves(self, tower, wanted: Sequence[int]) -> list[torch.Tensor]:
        """The tower outputs of clips ``wanted``; a batch runs at the first use of one of its clips in
        the pass (so a kept graph lives from its batch's first user to its last)."""
        for b in sorted({self.batch_of[c] for c in wanted if c not in self._leaf}):
            live = sum(self.batch_frames[k] for k in self._kept if k not in self.always_keep)
            keep = torch.is_grad_enabled() and (
                b in self.always_keep or live + self.batch_frames[b] <= self.keep_frames)
            with torch.set_grad_enabled(keep):  # without: no activations are kept
                outs = self._run(tower, b)
            if keep:
                self._kept[b] = outs
                self.kept_batches += 1
            for c, out in zip(self.batches[b], outs):
                # float32 leaves: the uses' gradients add up as in the fp32 grad buffers
                self._leaf[c] = out.detach().float().requires_grad_(True)
        return [self._leaf[c] for c in wanted]

    def embeddings(self, tower, wanted: Sequence[int]) -> list[torch.Tensor]:
        """The tower's output ``[N_c, O]`` for clips ``wanted`` (indices into this object): rows of the
        cached leaves, whose gradient accumulates until their batch's last user back-propagates."""
        return self._leaves(tower, wanted)

    def last_use(self, tower, wanted: Sequence[int], batches: Sequence[int]) -> list[torch.Tensor]:
        """As :meth:`embeddings` for clips ``wanted``, in the micro-batch that is the last user of
        ``batches`` (which hold every clip of ``wanted``): its backward sends the gradient of every
        use of those batches' clips (earlier ones from the leaves) through the tower."""
        if not torch.is_grad_enabled():
            return self.embeddings(tower, wanted)
        self._leaves(tower, wanted)
        anchor = next(p for p in tower.parameters() if p.requires_grad)
        return list(_RecomputeTower.apply(self, tower, tuple(int(c) for c in wanted),
                                          tuple(int(b) for b in batches), anchor))

    def _backward(self, tower, wanted: Sequence[int], batches: Sequence[int],
                  grads: Sequence[Optional[torch.Tensor]]) -> None:
        """Gradient of every use of the clips of ``batches`` through the tower (the kept graph or a
        recomputation), one batch at a time."""
        mine = dict(zip(wanted, grads))
        for b in batches:
            totals = []
            for c in self.batches[b]:
                leaf, g = self._leaf[c], mine.get(c)
                totals.append(leaf.grad if g is None else (g if leaf.grad is None else g + leaf.grad))
                leaf.grad = None
            outs = self._kept.pop(b, None)
            if all(t is None for t in totals):
                continue  # no use reached the loss
            if outs is None:
                with torch.enable_grad():
                    outs = self._run(tower, b)
            torch.autograd.backward([o for o, t in zip(outs, totals) if t is not None],
                                    [t.to(o.dtype) for o, t in zip(outs, totals) if t is not None])


class _RecomputeTower(torch.autograd.Function):
    """Forward: the cached embeddings of ``wanted`` (copies, so this node owns them). Backward: their
    gradient plus the earlier uses' of every clip of ``batches`` through the tower (kept or recomputed);
    ``anchor`` (a tower parameter) only puts the node in the graph and gets no gradient from it."""

    @staticmethod
    def forward(ctx, shared: SharedClips, tower, wanted: tuple, batches: tuple, anchor):
        ctx.shared, ctx.tower, ctx.wanted, ctx.batches = shared, tower, wanted, batches
        return tuple(shared._leaf[c].detach().clone() for c in wanted)

    @staticmethod
    def backward(ctx, *grads):
        ctx.shared._backward(ctx.tower, ctx.wanted, ctx.batches, grads)
        return None, None, None, None, None


@dataclass(frozen=True)
class ClipUse:
    """How one micro-batch gets its audio rows: its own clips (through the tower as usual) and the
    shared ones, interleaved in the order the clips appear in its tokens."""

    shared: SharedClips
    order: tuple[int, ...]
    """Per clip of the micro-batch in token order: ``j >= 0`` its own clip ``j`` (in
    ``audio_features``), ``-1 - c`` shared clip ``c``."""
    last: tuple[int, ...] = ()
    """Batches of ``shared`` (``SharedClips.batches``) whose last user this micro-batch is: their
    recomputation runs in its backward."""

    def __post_init__(self):
        bad = [c for c in self.order if c < -len(self.shared)]
        if bad:
            raise ValueError(f"ClipUse.order names shared clip(s) {[-1 - c for c in bad]} of {len(self.shared)}")
        unused = [b for b in self.last if not any(self.shared.batch_of[-1 - c] == b for c in self.order if c < 0)]
        if unused:
            raise ValueError(f"ClipUse.last names shared batch(es) {unused} that this micro-batch does not use")

    @property
    def num_own(self) -> int:
        return sum(1 for c in self.order if c >= 0)

    def _split(self) -> tuple[list[int], list[int]]:
        """This micro-batch's shared clips: those of batches it is not the last user of, and the rest."""
        wanted = sorted({-1 - c for c in self.order if c < 0})
        last = set(self.last)
        return ([c for c in wanted if self.shared.batch_of[c] not in last],
                [c for c in wanted if self.shared.batch_of[c] in last])

    def prefetch(self, tower) -> None:
        """Run the tower now on the batches this micro-batch's forward would run first, with
        autograd, in the order :meth:`rows` runs them (same keep decisions, same values); the next
        pass with autograd (:meth:`SharedClips.begin_pass`) takes them. For the first micro-batch
        of a pass, before the pass begins; the tower must make no collective (module doc)."""
        self.shared.reset()
        with torch.enable_grad():
            for clips in self._split():
                self.shared._leaves(tower, clips)
        self.shared.prefetched = True

    def rows(self, tower, own_NO: Optional[torch.Tensor], own_tokens: Sequence[int]) -> torch.Tensor:
        """The micro-batch's audio rows ``[N, O]`` in token order from its own clips' tower output
        ``own_NO`` (rows of each own clip: ``own_tokens``) and the shared clips' embeddings."""
        own = list(own_NO.split(list(own_tokens))) if own_NO is not None else []
        if len(own) != self.num_own:
            raise ValueError(f"the micro-batch has {self.num_own} own clip(s) but the tower got {len(own)}")
        early, late = self._split()
        got = dict(zip(early, self.shared.embeddings(tower, early)))
        got.update(zip(late, self.shared.last_use(tower, late, self.last)))
        dtype = own[0].dtype if own else next(iter(got.values())).dtype
        return torch.cat([own[c] if c >= 0 else got[-1 - c].to(dtype) for c in self.order], dim=0)
