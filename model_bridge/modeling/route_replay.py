"""Routing replay: the MoE routers route each token to given experts (R3: the rollout server's; R2: the
trainer's own from an earlier pass), and gate them with weights computed from their own logits.

Shapes: ``T`` tokens of the micro-batch, ``N`` tokens a router sees (``T``, or ``T / tp`` under
sequence parallelism), ``L`` MoE layers of the whole model, ``k`` experts per token, ``E`` experts.

A :class:`RouteReplay` holds one micro-batch's routes ``ids_TLK`` (int, ``-1`` where a token has
none: the last token of each sample, padding) and is made current with :func:`replay_scope` around
the model's forward. While current, every megatron ``TopKRouter`` (both backends: the torch
backend's ``ReusingTopKRouter`` and megatron-core's own) routes through :func:`_replayed_routing`:

* the router's layer reads its rows: ``ids_TLK[:, layer_number - 1]`` (``layer_number`` is
  megatron's global 1-based number, so every pipeline stage reads its own layers' rows), and under
  sequence parallelism the slice of the tensor-parallel rank (the router sees ``T / tp`` tokens,
  split like the hidden states);
* a token with a row is sent to exactly those experts; its gate weights are computed from the
  router's own logits as megatron computes them for its own choice (softmax over the ``k``
  selected logits, or with ``moe_router_pre_softmax`` the full softmax's scores at them; then the
  scaling factor), so the router's weights get gradients through the replayed experts' logits;
* a token without a row keeps the router's own top-k (counted: ``replayed_fraction`` < 1).

The routing map and probabilities have megatron's layout, so the token dispatcher (EP all-to-all
included) runs unchanged. Load-balancing loss under replay: megatron's aux loss is computed from
the router's own top-k of its logits (``compute_routing_scores_for_aux_loss``) and its softmax
scores, not from the replayed experts: it keeps balancing the router's own preference, which is
what its gradient can change (the replayed experts are fixed data).

With ``record=True`` (R2) the routers route as usual and :class:`RouteReplay` records every
layer's chosen experts (its own rank's rows) for a later replay of the same micro-batch.

Metrics (:meth:`RouteReplay.counts`, summed over layers and tokens of this rank): ``pairs`` (token
x layer pairs routed), ``rows`` (of them with a recorded row, i.e. replayed) and ``agree`` (of
those, pairs whose own top-k set equals the recorded set, measured on the same logits before the
replay replaces it).

Supported: softmax score function without expert bias or expert groups, no context parallelism
(anything else raises NotImplementedError).
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Optional

import torch

__all__ = ["RouteReplay", "replay_scope", "install_route_replay", "current_replay"]

_LOCAL = threading.local()


class RouteReplay:
    """One micro-batch's routes to replay (``ids_TLK``) or to record (``record=True``)."""

    def __init__(self, ids_TLK: Optional[torch.Tensor] = None, *, record: bool = False,
                 num_tokens: Optional[int] = None, num_layers: Optional[int] = None, topk: Optional[int] = None):
        if record == (ids_TLK is not None):
            raise ValueError("RouteReplay: give ids_TLK to replay, or record=True with the shape to record")
        if record and None in (num_tokens, num_layers, topk):
            raise ValueError("RouteReplay(record=True) needs num_tokens, num_layers and topk")
        if ids_TLK is not None and ids_TLK.dim() != 3:
            raise ValueError(f"routes must be [tokens, layers, top_k], got {tuple(ids_TLK.shape)}")
        self.record = record
        # each row's experts ascending, sorted once for all layers: the agreement check compares
        # them with the router's own (ascending) choice, and the dispatcher takes them as they are
        self.ids_TLK = ids_TLK.sort(dim=-1).values if not record else None
        self._shape = (num_tokens, num_layers, topk) if record else tuple(ids_TLK.shape)
        self._counts: dict[str, torch.Tensor] = {}

    # ---- rows of one router
    def _local_span(self, N: int) -> tuple[int, int]:
        """Which of the micro-batch's ``T`` tokens a router with ``N`` tokens sees."""
        T = self._shape[0]
        if N == T:
            return 0, T
        from megatron.core import parallel_state as ps

        tp = ps.get_tensor_model_parallel_world_size()
        if tp > 1 and N * tp == T:  # sequence parallel: contiguous chunks in rank order
            r = ps.get_tensor_model_parallel_rank()
            return r * N, (r + 1) * N
        raise ValueError(f"routing replay: the router sees {N} tokens but the routes cover {T} "
                         f"(tensor-parallel size {tp}); the routes must be packed like the input ids")

    def _layer(self, layer_number) -> int:
        if layer_number is None:
            raise ValueError("routing replay: a router without layer_number (megatron sets it from its layer)")
        layer = int(layer_number) - 1
        if not 0 <= layer < self._shape[1]:
            raise ValueError(f"routing replay: layer {layer_number} but the routes hold {self._shape[1]} layers")
        return layer

    def rows(self, layer_number, N: int, device) -> torch.Tensor:
        """``[N, k]`` long routes of this router's tokens (-1: none)."""
        lo, hi = self._local_span(N)
        rows = self.ids_TLK[lo:hi, self._layer(layer_number)]
        return rows.to(device=device, dtype=torch.long, non_blocking=True)

    def store(self, layer_number, idx_NK: torch.Tensor) -> None:
        """Record this router's chosen experts (``record=True``)."""
        lo, hi = self._local_span(idx_NK.shape[0])
        if self.ids_TLK is None:
            T, L, k = self._shape
            self.ids_TLK = torch.full((T, L, k), -1, dtype=torch.int16 if idx_NK.device.type == "cpu" else torch.int32,
                                      device=idx_NK.device)
        self.ids_TLK[lo:hi, self._layer(layer_number)] = idx_NK.to(self.ids_TLK.dtype)
        self._add(pairs=idx_NK.shape[0])

    def _add(self, **kw) -> None:
        for name, v in kw.items():
            self._counts[name] = self._counts.get(name, 0) + v

    def counts(self) -> dict[str, float]:
        """``{"pairs", "rows", "agree"}`` summed over this rank's routers so far (one host sync)."""
        return {k: float(v) for k, v in self._counts.items()}

    def recorded(self) -> Optional[torch.Tensor]:
        """The recorded ``[T, L, k]`` routes (``record=True``; -1 where this rank routed nothing)."""
        return self.ids_TLK


def current_replay() -> Optional[RouteReplay]:
    return getattr(_LOCAL, "replay", None)


@contextlib.contextmanager
def replay_scope(replay: Optional[RouteReplay]):
    """Make ``replay`` current for the routers run inside (None: route as usual)."""
    if replay is not None:
        install_route_replay()
    prev = getattr(_LOCAL, "replay", None)
    _LOCAL.replay = replay
    try:
        yield replay
    finally:
        _LOCAL.replay = prev


def _check_supported(args, kw) -> None:
    if args or kw.get("score_function", "softmax") != "softmax" or kw.get("expert_bias") is not None \
            or kw.get("num_groups") or kw.get("group_topk"):
        raise NotImplementedError("routing replay supports softmax top-k routing without expert bias or "
                                  "expert groups (the Qwen3-Omni router); this router uses another")


def _replayed_routing(rp: RouteReplay, layer_number, own_out, logits_NE: torch.Tensor, topk: int, kw: dict):
    """megatron's ``topk_routing_with_score_function`` with the experts of ``rp``'s rows (module doc).
    ``own_out`` is the router's own routing of the same logits (the fused kernel where it applies):
    tokens without a row keep it, and the load-balancing loss counts it (module doc)."""
    pre_softmax = kw.get("use_pre_softmax", False)
    with torch.no_grad():
        own_NK = _chosen(own_out, kw, topk)
        if getattr(own_NK, "_mgrpo_ascending", False) is False:
            own_NK = own_NK.sort(dim=1).values
    rep_NK = rp.rows(layer_number, logits_NE.shape[0], logits_NE.device)
    if rep_NK.shape[1] != topk:
        raise ValueError(f"routing replay: routes hold {rep_NK.shape[1]} experts per token, the router picks {topk}")
    has_N = rep_NK[:, 0] >= 0  # a row is all experts or all -1 (ascending: -1 comes first)
    idx_NK = torch.where(has_N[:, None], rep_NK, own_NK)  # ascending either way
    if pre_softmax:
        scores_NE = torch.softmax(logits_NE, dim=-1, dtype=torch.float32).type_as(logits_NE)
        probs_NK = scores_NE.gather(1, idx_NK)
    else:
        probs_NK = torch.softmax(logits_NE.gather(1, idx_NK), dim=-1, dtype=torch.float32).type_as(logits_NE)
    scaling = kw.get("scaling_factor")
    if scaling:
        probs_NK = probs_NK * scaling
    with torch.no_grad():
        rp._add(pairs=logits_NE.shape[0], rows=has_N.sum(), agree=((own_NK == rep_NK).all(dim=1) & has_N).sum())
    if kw.get("dense_output", False):  # megatron >= 0.19: ([N, k] probs, [N, k] indices)
        return probs_NK, idx_NK
    routing_probs_NE = torch.zeros_like(logits_NE).scatter(1, idx_NK, probs_NK)
    routing_map_NE = torch.zeros_like(logits_NE, dtype=torch.bool).scatter_(1, idx_NK, True)
    # the experts, ascending, ride on the map to the torch backend's dispatcher (as the fused
    # routing kernel's do, routing.py), which would otherwise recover them from the map
    routing_map_NE._mgrpo_topk_idx = idx_NK
    return routing_probs_NE, routing_map_NE


def _chosen(out, kw, topk: int) -> torch.Tensor:
    """The ``[N, k]`` experts a routing output selected."""
    if kw.get("dense_output", False):
        return out[1]
    map_NE = out[1]
    idx = getattr(map_NE, "_mgrpo_topk_idx", None)  # ascending (routing.py)
    if idx is not None:
        idx._mgrpo_ascending = True
        return idx
    return torch.topk(map_NE.to(torch.float16), k=topk, dim=1).indices


def _wrap_routing(inner):
    @functools.wraps(inner)
    def topk_routing_with_score_function(logits, topk, *args, **kw):
        rp = getattr(_LOCAL, "replay", None)
        layer = getattr(_LOCAL, "layer_number", None)
        if rp is None or layer is None:
            return inner(logits, topk, *args, **kw)
        _check_supported(args, kw)
        if rp.record:
            out = inner(logits, topk, *args, **kw)
            with torch.no_grad():
                rp.store(layer, _chosen(out, kw, topk))
            return out
        # the router's own routing first (one fused kernel where it applies, with the aux loss),
        # then the replayed experts' gate weights from the same logits
        return _replayed_routing(rp, layer, inner(logits, topk, *args, **kw), logits, topk, kw)

    topk_routing_with_score_function._mgrpo_replay = True
    return topk_routing_with_score_function


def _wrap_forward(orig):
    @functools.wraps(orig)
    def forward(self, *args, **kwargs):
        prev = getattr(_LOCAL, "layer_number", None)
        _LOCAL.layer_number = self.layer_number
        try:
            return orig(self, *args, **kwargs)
        finally:
            _LOCAL.layer_number = prev

    forward._mgrpo_replay = True
    return forward


def install_route_replay() -> None:
    """Route megatron's routers through the replay (idempotent; inert while no replay is current).
    The replay wrapper sits outside the torch backend's routing reuse (router.py), so a current
    replay is never bypassed by its fused kernel."""
    import megatron.core.transformer.moe.router as router_mod
    from megatron.core.transformer.moe.router import TopKRouter

    from .router import install_routing_reuse

    install_routing_reuse()
    if not getattr(router_mod.topk_routing_with_score_function, "_mgrpo_replay", False):
        router_mod.topk_routing_with_score_function = _wrap_routing(router_mod.topk_routing_with_score_function)
    if not getattr(TopKRouter.forward, "_mgrpo_replay", False):
        TopKRouter.forward = _wrap_forward(TopKRouter.forward)
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized() and ps.get_context_parallel_world_size() > 1:
        raise NotImplementedError("routing replay under context parallelism (the routes are not split "
                                  "like CP's load-balanced chunks yet)")
