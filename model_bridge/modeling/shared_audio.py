"""The audio tower once per clip of a pass, however many samples use the clip.

A GRPO group's generations share their prompt's recording: one clip object in ``G`` samples, in one
or several micro-batches of a rank. Each sample's copy of the recording used to go through the
tower forward and backward, ``G`` times the same work. :class:`SharedClips` holds the clips that
one rank's pass uses more than once; each is computed as follows:

* forward: the tower once per clip, without autograd, at the first micro-batch that uses it
  (:meth:`SharedClips.embeddings`); every use takes rows of that result;
* backward: the micro-batches before the clip's *last user* accumulate their gradients into a leaf
  (``autograd`` sums a leaf's gradient over uses); the last user's rows come from
  :class:`_RecomputeTower`, whose backward adds that leaf's gradient to its own, runs the tower
  again with autograd on each clip and back-propagates the sum (activation recomputation, as
  megatron's ``CheckpointFunction``), so the tower's parameters get their gradient once, inside
  the last user's backward (megatron's DDP sees them as any micro-batch's gradient).

Cost per clip used ``k`` times: two forwards and one backward instead of ``k`` forwards and
backwards (about 4 forward-units instead of ``3k``), so only clips with ``k >= 2`` belong here;
memory: one clip's activations at a time, plus the clips' embeddings and their gradient
(``[tokens, out]`` each). The gradient is the eager one up to the order of a sum (exact math).

Schedules run every micro-batch's backward in forward order (megatron's no-pipelining and 1F1B
schedules), so the last user's backward comes after every earlier user's; :meth:`reset` before
each pass (the weights may have changed) drops the cached embeddings.

Shape legend: ``M`` mel bins, ``F`` frames, ``N`` audio tokens (tower output rows), ``O`` the
tower's output width.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["SharedClips", "ClipUse"]


class SharedClips:
    """Clips (host features ``[M, F_c]`` each) that several samples of one pass use (module doc)."""

    def __init__(self, features_MF: Sequence[torch.Tensor]):
        if not features_MF:
            raise ValueError("SharedClips needs at least one clip")
        self.features_MF = list(features_MF)
        self.lens = [int(f.shape[-1]) for f in self.features_MF]
        self._leaf: Optional[list[torch.Tensor]] = None  # [N_c, O] per clip, grad accumulates over uses

    def __len__(self) -> int:
        return len(self.features_MF)

    def reset(self) -> None:
        """Forget the embeddings (a new pass: the weights may have changed)."""
        self._leaf = None

    def _run(self, tower, c: int) -> torch.Tensor:
        """The tower on clip ``c`` alone: ``[N_c, O]`` (the same shapes in the first pass and the
        recomputation, so both give the same values)."""
        p = tower.conv2d1.weight
        return tower(self.features_MF[c].to(p.device, p.dtype, non_blocking=True), torch.tensor([self.lens[c]]))

    def _leaves(self, tower) -> list[torch.Tensor]:
        """Every clip's tower output, computed at the first use of the pass."""
        if self._leaf is None:
            with torch.no_grad():  # no activations are kept
                # float32 leaves: the uses' gradients add up as in the fp32 grad buffers
                self._leaf = [self._run(tower, c).float().requires_grad_(True) for c in range(len(self))]
        return self._leaf

    def embeddings(self, tower, wanted: Sequence[int]) -> list[torch.Tensor]:
        """The tower's output ``[N_c, O]`` for clips ``wanted`` (indices into this object): rows of the
        cached leaves, whose gradient accumulates until the last user recomputes."""
        leaves = self._leaves(tower)
        return [leaves[c] for c in wanted]

    def last_use(self, tower, wanted: Sequence[int]) -> list[torch.Tensor]:
        """As :meth:`embeddings`, in the micro-batch that uses these clips last: its backward sends the
        gradient of every use (earlier ones from the leaves) through the recomputed tower."""
        if not torch.is_grad_enabled():
            return self.embeddings(tower, wanted)
        self._leaves(tower)
        anchor = next(p for p in tower.parameters() if p.requires_grad)
        outs = _RecomputeTower.apply(self, tower, tuple(int(c) for c in wanted), anchor)
        return list(outs)

    def _backward(self, tower, wanted: Sequence[int], grads: Sequence[Optional[torch.Tensor]]) -> None:
        """Gradient of every use of ``wanted`` through the tower, one clip at a time."""
        for c, g in zip(wanted, grads):
            leaf = self._leaf[c]
            total = leaf.grad if g is None else (g if leaf.grad is None else g + leaf.grad)
            leaf.grad = None
            if total is None:
                continue  # no use reached the loss
            with torch.enable_grad():
                out_NO = self._run(tower, c)
            torch.autograd.backward(out_NO, total.to(out_NO.dtype))


class _RecomputeTower(torch.autograd.Function):
    """Forward: the cached embeddings of ``wanted`` (copies, so this node owns them). Backward: their
    gradient plus the earlier uses' through the recomputed tower; ``anchor`` (a tower parameter)
    only puts the node in the graph and gets no gradient from it."""

    @staticmethod
    def forward(ctx, shared: SharedClips, tower, wanted: tuple, anchor):
        ctx.shared, ctx.tower, ctx.wanted = shared, tower, wanted
        return tuple(shared._leaf[c].detach().clone() for c in wanted)

    @staticmethod
    def backward(ctx, *grads):
        ctx.shared._backward(ctx.tower, ctx.wanted, grads)
        return None, None, None, None


@dataclass(frozen=True)
class ClipUse:
    """How one micro-batch gets its audio rows: its own clips (through the tower as usual) and the
    shared ones, interleaved in the order the clips appear in its tokens."""

    shared: SharedClips
    order: tuple[int, ...]
    """Per clip of the micro-batch in token order: ``j >= 0`` its own clip ``j`` (in
    ``audio_features``), ``-1 - c`` shared clip ``c``."""
    last: tuple[int, ...] = ()
    """Shared clips whose last user this micro-batch is."""

    def __post_init__(self):
        bad = [c for c in self.order if c < -len(self.shared)]
        if bad:
            raise ValueError(f"ClipUse.order names shared clip(s) {[-1 - c for c in bad]} of {len(self.shared)}")

    @property
    def num_own(self) -> int:
        return sum(1 for c in self.order if c >= 0)

    def rows(self, tower, own_NO: Optional[torch.Tensor], own_tokens: Sequence[int]) -> torch.Tensor:
        """The micro-batch's audio rows ``[N, O]`` in token order from its own clips' tower output
        ``own_NO`` (rows of each own clip: ``own_tokens``) and the shared clips' embeddings."""
        own = list(own_NO.split(list(own_tokens))) if own_NO is not None else []
        if len(own) != self.num_own:
            raise ValueError(f"the micro-batch has {self.num_own} own clip(s) but the tower got {len(own)}")
        wanted = sorted({-1 - c for c in self.order if c < 0})
        last = set(self.last)
        early = [c for c in wanted if c not in last]
        late = [c for c in wanted if c in last]
        got = dict(zip(early, self.shared.embeddings(tower, early)))
        got.update(zip(late, self.shared.last_use(tower, late)))
        dtype = own[0].dtype if own else next(iter(got.values())).dtype
        return torch.cat([own[c] if c >= 0 else got[-1 - c].to(dtype) for c in self.order], dim=0)
