"""Routing replay in the training step (``rollout.routing_replay``): routes packed like the input ids,
one :class:`~model_bridge.modeling.route_replay.RouteReplay` per micro-batch forward, and the metrics.

Shapes: ``T`` tokens of a micro-batch, ``L`` MoE layers of the model, ``k`` experts per token.

* ``r3``: the rollout server's routes (``Trajectory.routed_experts``, ``[L_i - 1, L, k]`` per
  sample: the experts vLLM used at every position but the last) are packed like the input ids
  into ``TrainMicroBatch.routed_experts_TLK`` (``-1`` at each sample's last token and on padding,
  and for a sample without routes) and replayed in the training forward.
* ``r2``: the trainer's own routes from the old-policy logprob pass of the step (recorded there)
  are replayed in its training forward; no server support needed.

Every rank builds the full ``[T, L, k]``; each router reads its own layer (pipeline stages read
their own layers) and, under sequence parallelism, its tensor-parallel rank's token slice.

Metrics (per step, summed over every rank's routers): ``router/replayed_fraction`` = token-layer
pairs routed by a recorded row / all pairs; ``router/agreement`` = of the replayed pairs, the share
whose router's own top-k set equals the recorded one (measured on the same logits, before the
replay overrides it). ``mismatch_kl_k1/k3`` (``algo.importance``) then measure rollout vs trainer
with the replay on.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

__all__ = ["REPLAY_MODES", "pack_routes", "RouteSink", "replay_metrics"]

REPLAY_MODES = ("r2", "r3")


def pack_routes(mb, trajectories: Sequence) -> Optional[torch.Tensor]:
    """int16 ``[T, L, k]`` routes of micro-batch ``mb``'s tokens (module doc), None when none of its
    samples has routes. Routes of another shape than the first sample's are an error naming both."""
    have = [trajectories[i].routed_experts for i in mb.sample_ids if trajectories[i].routed_experts is not None]
    if not have:
        return None
    L, k = np.asarray(have[0]).shape[1:]
    cu = mb.cu_seqlens_S.tolist()
    out = torch.full((mb.num_tokens, L, k), -1, dtype=torch.int16)
    for j, i in enumerate(mb.sample_ids):
        r = trajectories[i].routed_experts
        if r is None:
            continue
        r = np.asarray(r)
        n = cu[j + 1] - cu[j]
        if r.shape != (n - 1, L, k):
            raise ValueError(f"sample {i} (prompt {trajectories[i].prompt_index}): routed_experts of shape "
                             f"{r.shape}, expected {(n - 1, L, k)} for its {n} tokens")
        out[cu[j]:cu[j] + n - 1] = torch.from_numpy(r.astype(np.int16))
    return out


class RouteSink:
    """What the forward steps of one schedule hand back: one ``RouteReplay`` per micro-batch run."""

    def __init__(self, mode: Optional[str], num_layers: int = 0, topk: int = 0):
        """``mode``: "replay" (each micro-batch's ``routed_experts_TLK``), "record" (R2's old pass),
        or None (route as usual)."""
        if mode not in (None, "replay", "record"):
            raise ValueError(f"RouteSink mode must be 'replay', 'record' or None, got {mode!r}")
        self.mode, self.num_layers, self.topk = mode, num_layers, topk
        self.replays: list = []

    def for_microbatch(self, tmb):
        """The ``RouteReplay`` for this micro-batch's forward (None: route as usual)."""
        from model_bridge.modeling.route_replay import RouteReplay

        rp = None
        if self.mode == "replay" and tmb.routed_experts_TLK is not None:
            rp = RouteReplay(tmb.routed_experts_TLK)
        elif self.mode == "record":
            rp = RouteReplay(record=True, num_tokens=tmb.num_tokens, num_layers=self.num_layers, topk=self.topk)
        self.replays.append(rp)
        return rp

    def recorded(self) -> list[Optional[torch.Tensor]]:
        """Per micro-batch (schedule order) the recorded ``[T, L, k]`` routes, on the host."""
        return [None if rp is None or rp.recorded() is None else rp.recorded().cpu() for rp in self.replays]

    def counts(self) -> torch.Tensor:
        """float64 ``[pairs, rows, agree]`` of this rank's routers over the schedule."""
        c = torch.zeros(3, dtype=torch.float64)
        for rp in self.replays:
            if rp is not None:
                got = rp.counts()
                c += torch.tensor([got.get("pairs", 0.0), got.get("rows", 0.0), got.get("agree", 0.0)],
                                  dtype=torch.float64)
        return c


def replay_metrics(sink: RouteSink) -> dict[str, float]:
    """``router/replayed_fraction`` and ``router/agreement`` summed over all ranks (a collective:
    every rank calls it). Under TP without SP every TP rank counts the same tokens: the ratios are
    unchanged."""
    import torch.distributed as dist

    c = sink.counts()
    if dist.is_initialized():
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        t = c.to(dev)
        dist.all_reduce(t)
        c = t.cpu()
    pairs, rows, agree = (float(x) for x in c)
    return {"router/replayed_fraction": rows / pairs if pairs else 0.0,
            "router/agreement": agree / rows if rows else 0.0}
