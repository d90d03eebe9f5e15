"""The torch backend's router: one fused routing kernel, and the aux loss reuses its expert selection.

Shapes: ``T`` tokens, ``E`` experts, ``k`` experts per token.

megatron's ``TopKRouter.routing`` selects each token's top-k experts
(``topk_routing_with_score_function``) and then, with a load-balancing loss on, selects them a
second time from the softmax scores (``compute_routing_scores_for_aux_loss``: another ``[T, E]``
top-k and a scatter into a new map; ~0.17 ms per layer at 22.8k tokens on an H200). With a softmax
score function, no expert bias, no expert groups and no routing replay, both selections are the
top-k of the same logits (softmax is monotonic), so inside :class:`ReusingTopKRouter`'s routing the
second one reuses the first's ``[T, E]`` routing map and only computes the fp32 softmax scores.
Exact ties at the k-th place are the one difference: megatron's two top-k calls may break them
differently (its aux loss then counts an expert the token was not sent to); here the aux loss
counts the experts the tokens were sent to.

The selection itself, in the same case, is one Triton kernel each way on CUDA
(:func:`~model_bridge.modeling.routing.fused_topk_routing`, ``routing.py``: ~30 us instead of
~0.21 ms of ``torch.topk``, softmax and scatters, forward and backward, per layer at 22.8k tokens
on an H200) when :func:`~model_bridge.modeling.routing.fused_routing_ok` says it computes
megatron's ``topk_routing_with_score_function`` for the call's arguments (megatron-core 0.16 and
0.19: no ``dense_output``, no precomputed indices, no TE fusion, fp32/bf16/fp16 logits,
``E <= 512``; ``MGRPO_TRITON_ROUTING=0`` switches it off). Where the aux loss is the plain
per-micro-batch load-balancing loss (no sequence or global variant, one TP x CP rank, no padding
mask, no token dropping) the same kernels compute it too
(:func:`~model_bridge.modeling.routing.fused_topk_routing_with_aux`), and
:meth:`ReusingTopKRouter._apply_aux_loss` hands it to megatron's tracker and autoscaler
(``attach_and_log_load_balancing_loss``) as megatron's ``_apply_aux_loss`` does. Its ties go to the lowest expert index
(torch.topk's order is unspecified), and it is deterministic, so megatron's deterministic-algorithms
branch (which only builds its dense outputs another way) needs no counterpart. Anything else calls
megatron's functions unchanged.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Optional

import torch

from megatron.core.transformer.moe.router import TopKRouter

from .routing import fused_routing_ok, fused_topk_routing, fused_topk_routing_with_aux

__all__ = ["ReusingTopKRouter", "install_routing_reuse"]

_STATE = threading.local()


def _reusable(kw: dict) -> bool:
    """The routing call selects the plain top-k of the softmax of its logits."""
    return (kw.get("score_function", "softmax") == "softmax" and kw.get("expert_bias") is None
            and not kw.get("num_groups") and not kw.get("group_topk") and kw.get("router_replay") is None
            and not kw.get("fused", False) and kw.get("precomputed_indices") is None
            # megatron >= 0.19: dense outputs are ([T, k] probs, [T, k] indices), not a [T, E] map
            and not kw.get("dense_output", False))


def _wrap_routing(orig):
    @functools.wraps(orig)
    def topk_routing_with_score_function(logits, topk, *args, **kw):
        active = getattr(_STATE, "active", False)
        reusable = active and not args and _reusable(kw)
        coeff = getattr(_STATE, "aux_coeff", None) if reusable else None
        if reusable and fused_routing_ok(logits, topk, **kw):  # one kernel for the whole selection
            if coeff is not None:  # and the load-balancing loss in the same kernels
                T, E = logits.shape
                probs, routing_map, aux, _ = fused_topk_routing_with_aux(
                    logits, topk, E * coeff / (topk * T * T), kw.get("use_pre_softmax", False),
                    kw.get("scaling_factor"))
                _STATE.fused_aux = (logits, aux, T)
            else:
                probs, routing_map = fused_topk_routing(logits, topk, kw.get("use_pre_softmax", False),
                                                        kw.get("scaling_factor"))
        else:
            probs, routing_map = orig(logits, topk, *args, **kw)
        if active:
            _STATE.last = (logits, topk, routing_map) if reusable else None
        return probs, routing_map

    topk_routing_with_score_function._mgrpo_reuse = True
    return topk_routing_with_score_function


def _wrap_aux_scores(orig):
    @functools.wraps(orig)
    def compute_routing_scores_for_aux_loss(logits, topk, score_function, fused=False, padding_mask=None):
        last = getattr(_STATE, "last", None) if getattr(_STATE, "active", False) else None
        _STATE.last = None
        if last is None or last[0] is not logits or last[1] != topk or score_function != "softmax" or fused:
            kw = {} if padding_mask is None else {"padding_mask": padding_mask}  # as megatron's router passes it
            return orig(logits, topk, score_function, fused=fused, **kw)
        routing_map_TE = last[2]
        fused = getattr(_STATE, "fused_aux", None)
        if fused is not None and fused[0] is logits and padding_mask is None:
            # the fused kernels computed the loss from these logits: no scores needed (the
            # router's _apply_aux_loss takes the loss; seq/global aux losses are off, see
            # ReusingTopKRouter._fused_aux_coeff)
            return routing_map_TE, None
        scores_TE = torch.softmax(logits, dim=-1, dtype=torch.float32)  # as megatron computes them
        if padding_mask is not None:  # as megatron 0.16.1 and 0.19.2: True marks padding, counted nowhere
            valid_T1 = (~padding_mask).unsqueeze(-1)
            routing_map_TE, scores_TE = routing_map_TE * valid_T1, scores_TE * valid_T1
        return routing_map_TE, scores_TE

    compute_routing_scores_for_aux_loss._mgrpo_reuse = True
    return compute_routing_scores_for_aux_loss


def install_routing_reuse() -> None:
    """Wrap the two selection functions as megatron's router module sees them (idempotent); the
    wrappers change nothing outside :class:`ReusingTopKRouter`'s routing."""
    import megatron.core.transformer.moe.router as router_mod

    if not getattr(router_mod.topk_routing_with_score_function, "_mgrpo_reuse", False):
        router_mod.topk_routing_with_score_function = _wrap_routing(router_mod.topk_routing_with_score_function)
    if not getattr(router_mod.compute_routing_scores_for_aux_loss, "_mgrpo_reuse", False):
        router_mod.compute_routing_scores_for_aux_loss = _wrap_aux_scores(
            router_mod.compute_routing_scores_for_aux_loss)


@contextlib.contextmanager
def _reuse_scope(aux_coeff: Optional[float]):
    prev = getattr(_STATE, "active", False)
    _STATE.active, _STATE.last, _STATE.aux_coeff, _STATE.fused_aux = True, None, aux_coeff, None
    try:
        yield
    finally:
        _STATE.active, _STATE.last, _STATE.aux_coeff, _STATE.fused_aux = prev, None, None, None


class ReusingTopKRouter(TopKRouter):
    """megatron ``TopKRouter`` whose aux loss reuses the routing's expert selection (module docstring)."""

    def routing(self, logits, *args, **kwargs):
        # the wrappers are installed once, with the torch backend's spec (torch_block_spec)
        with _reuse_scope(self._fused_aux_coeff(args, kwargs)):
            return super().routing(logits, *args, **kwargs)

    def _fused_aux_coeff(self, args, kwargs) -> Optional[float]:
        """The load-balancing loss's coefficient when the fused routing kernels may compute it
        (:func:`~model_bridge.modeling.routing.fused_topk_routing_with_aux`), else None: the plain
        per-micro-batch aux loss only (no sequence or global variant), one tensor- and
        context-parallel rank (its token counts are then this rank's), no padding mask, no token
        dropping, training with gradients on (when megatron computes the loss at all)."""
        if args or kwargs.get("padding_mask") is not None or not (self.training and torch.is_grad_enabled()):
            return None
        if self.config.moe_expert_capacity_factor is not None or self.tp_cp_group.size() != 1:
            return None
        if self.get_aux_loss_coeff("seq_aux_loss") or self.get_aux_loss_coeff("global_aux_loss"):
            return None
        coeff = self.get_aux_loss_coeff("aux_loss")
        return float(coeff) if coeff else None

    def _apply_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask: bool = False):
        fused = getattr(_STATE, "fused_aux", None) if getattr(_STATE, "active", False) else None
        if fused is None or scores_for_aux_loss is not None or with_padding_mask:
            return super()._apply_aux_loss(probs, scores_for_aux_loss, routing_map, with_padding_mask)
        _STATE.fused_aux = None
        _, aux_loss, T = fused
        # megatron's own ending of _apply_aux_loss (0.16 and 0.19): log it, attach its gradient
        return self.attach_and_log_load_balancing_loss(probs, self.get_aux_loss_coeff("aux_loss"), aux_loss,
                                                       "load_balancing_loss", self.tp_cp_group, valid_token_count=T)
