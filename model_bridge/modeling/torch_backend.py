"""The ``"torch"`` layer-spec backend: megatron-core on torch-native fast kernels, without TE.

Registered as ``"torch"`` in :mod:`model_bridge.modeling.specs`; ``backend="auto"`` picks it on
CUDA when Transformer Engine does not import (te > torch (CUDA) > local (CPU)). It is megatron's
local spec (same modules, same parameter names outside the experts, the same
:class:`~model_bridge.modeling.attention.PackedCoreAttention`) with three replacements:

* self attention: :class:`TorchSelfAttention`, megatron's ``SelfAttention`` whose packed RoPE skips
  megatron's THD loop (``.tolist()`` plus one ``.item()`` per sample, for q and for k, every layer):
  with per-token rotary angles for all T packed tokens (our MRoPE) and no context parallelism, THD RoPE
  *is* the BSHD RoPE over the buffer, which runs with no host sync; on CUDA it is one fused Triton
  pass each way (:mod:`.rope`; ``MGRPO_TRITON_ROPE=0`` falls back to megatron's unfused BSHD RoPE;
  the q/k RMSNorms are fused into it unless ``MGRPO_TRITON_QK_NORM_ROPE=0``);
* MoE layer: :class:`TorchMoELayer`, megatron's ``MoELayer`` whose all-to-all dispatcher permutes with
  :func:`~model_bridge.modeling.experts.sort_by_expert` (same order as megatron's permute, one argsort
  over ``T * k`` pairs, gathers both ways, fp32 sum over each token's k expert outputs, fused into one
  Triton gather-sum on CUDA) instead of an argsort over ``T * E`` and a bf16 ``scatter_add``, and that
  skips megatron's "permutation 2" chunk sort when it is the identity (one EP and one expert-TP rank:
  otherwise a ``torch.cat`` copy of every routed row, both ways); any configuration that path does not
  cover (capacity factor, padding, fused permute, shared experts) keeps megatron's; its router is a
  :class:`~model_bridge.modeling.router.ReusingTopKRouter` (the aux loss reuses the routing's top-k);
* experts: :class:`~model_bridge.modeling.experts.TorchGroupedMLP` (``grouped_mm``).

With this backend the thinker also switches (same modules, class swapped, CUDA only) its word
embedding to a sorted-segment weight gradient (:mod:`.embedding`) and its hidden-size RMSNorms to
one Triton pass each way (:mod:`.norm`; its bias-dropout-adds take the residual from the norm that
read it, whose backward kernel adds the residual's gradient), and megatron's tensor-parallel region mappings return their
input where their group has one rank (:mod:`.tp_identity`: identities both ways, minus an autograd
function each). Everything else (the EP all-to-all, ETP all-gather /
reduce-scatter, router GEMM, the aux loss's logging and scaling, linears) is megatron's. On CPU or in fp32 the same modules fall back to the reference math
(per-segment SDPA, the grouped_mm CPU kernel or a per-expert loop), which is what the CPU tests
check against the ``"local"`` spec.

Parameter names: as the local spec, except the experts: ``mlp.experts.weight1`` / ``weight2``
(stacked, see experts.py) instead of ``mlp.experts.local_experts.{e}.linear_fc{1,2}.weight``; the
mapping table has rules for both and dist checkpoints are interchangeable.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import os
from typing import Optional

import torch

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from .ep_dispatch import DedupExchange
from .experts import TorchGroupedMLP, grouped_mm_available, with_offsets
from .norm import residual_bda
from .permute import sort_by_expert, topk_indices, unsort_combine
from .router import ReusingTopKRouter, install_routing_reuse
from .rope import defer_qk_norms, deferring_qk_norms, fast_rope_scope, grouped_query_wanted, install_fast_rope
from .specs import _check_config, local_block_spec, register_backend
from .tp_identity import install_tp1_identity_skips

__all__ = ["torch_block_spec", "TorchSelfAttention", "TorchMoELayer", "TorchGroupedMLP"]

# ------------------------------------------------------------------------------------------------
# THD RoPE without host syncs
# ------------------------------------------------------------------------------------------------

class TorchSelfAttention(SelfAttention):
    """megatron ``SelfAttention`` whose packed RoPE runs without host syncs (module docstring); its
    q/k RMSNorms run inside the RoPE kernel (rope.py) unless ``MGRPO_TRITON_QK_NORM_ROPE=0``."""

    def forward(self, *args, **kwargs):
        if not self._defer_norms(args, kwargs):
            with fast_rope_scope():
                return super().forward(*args, **kwargs)
        queue: list = []
        with fast_rope_scope(queue, grouped_query=True), deferring_qk_norms(self, queue):
            return super().forward(*args, **kwargs)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate: bool = False,
                                    split_qkv: bool = True, **kw):
        """megatron's, except that with the q/k norms deferred to the fused kernel the query stays
        as the split leaves it, ``[s, b, groups, hpg * d]`` (a view of the qkv buffer): the RoPE
        kernel reads its heads in place, which saves megatron's reshape copy of the whole query
        (~0.23 ms per layer at 22.8k tokens on an H200) and its saved copy's memory."""
        if (not grouped_query_wanted() or output_gate or not split_qkv or kw
                or self.config.num_query_groups < self.world_size):
            return super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate=output_gate,
                                                       split_qkv=split_qkv, **kw)
        mixed_qkv, split_sizes = super().get_query_key_value_tensors(hidden_states, key_value_states,
                                                                     output_gate=False, split_qkv=False)
        query, key, value = torch.split(mixed_qkv, split_sizes, dim=3)  # [s, b, groups, hpg * d | d | d]
        # the deferred norms: hand their input back and queue themselves (rope.py)
        return self.q_layernorm(query), self.k_layernorm(key), value

    def _defer_norms(self, args, kwargs) -> bool:
        psp = kwargs.get("packed_seq_params")
        hidden = args[0] if args else kwargs.get("hidden_states")
        return (psp is not None and getattr(psp, "qkv_format", None) == "thd"
                and kwargs.get("rotary_pos_emb") is not None and kwargs.get("key_value_states") is None
                and kwargs.get("inference_context") is None and kwargs.get("inference_params") is None
                and self.config.context_parallel_size == 1 and hidden is not None
                and defer_qk_norms(self.q_layernorm, self.k_layernorm, self.hidden_size_per_attention_head,
                                   self.config, hidden.is_cuda))


# ------------------------------------------------------------------------------------------------
# MoE layer: sort-based permutation
# ------------------------------------------------------------------------------------------------

class _SortedAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron's all-to-all dispatcher with permutation 1 / unpermutation 1 replaced by
    :func:`sort_by_expert` / :func:`unsort_combine` (same row order; EP/ETP communication unchanged)."""

    def _sorted_ok(self) -> bool:
        return (getattr(self, "shared_experts", None) is None and not getattr(self, "drop_and_pad", False)
                and not self.config.moe_permute_fusion and not getattr(self.config, "moe_router_padding_for_quantization", False)
                and self.config.moe_expert_capacity_factor is None)

    def _dedup_ok(self) -> bool:
        """Expert parallelism without expert-TP: tokens travel once per destination rank
        (:mod:`.ep_dispatch`); ``MGRPO_EP_DEDUP=0`` keeps megatron's one-row-per-expert exchange."""
        return (self.ep_size > 1 and self.tp_size == 1 and self._sorted_ok()
                and os.environ.get("MGRPO_EP_DEDUP", "1") != "0")

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self._dedup = None
        if not self._sorted_ok():
            self._sort_plan = None
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        if self._dedup_ok():
            self._sort_plan = None
            self.hidden_shape = hidden_states.shape
            self._dedup = DedupExchange(self.ep_group, self.num_local_experts, self.config.moe_router_topk)
            return self._dedup.preprocess(hidden_states.view(-1, self.hidden_shape[-1]), routing_map, probs)
        self.hidden_shape = hidden_states.shape
        self.probs = probs
        self.routing_map = routing_map
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        # one rank and grouped GEMM: the counts stay on the device (the experts' offsets are a
        # device cumsum), so the MoE layer makes no host sync; megatron reads them to the host
        self._device_counts = (self.ep_size * self.tp_size == 1 and not getattr(self, "drop_and_pad", False)
                               and grouped_mm_available(hidden_states.device, hidden_states.dtype))
        self.hidden_shape_before_permute = hidden_states.shape
        # the fused routing kernel's ascending experts when the map came from it (routing.py)
        idx = getattr(routing_map, "_mgrpo_topk_idx", None)
        if idx is None or idx.shape != (routing_map.shape[0], self.config.moe_router_topk):
            idx = topk_indices(routing_map, self.config.moe_router_topk)
        tokens, pprobs, plan = sort_by_expert(hidden_states, idx, probs, routing_map)
        if self._device_counts and "counts" in plan:
            # the counting sort counted the rows per expert (and summed them): megatron's
            # preprocess would count them again (routing_map.sum), the experts sum them again
            self.tokens_per_expert = with_offsets(plan["counts"], plan["offsets"])
        else:
            self.tokens_per_expert = self.preprocess(routing_map)
            if not self._device_counts:
                self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_1",
                                                                          self.tokens_per_expert)
        self._sort_plan = plan
        self.reversed_local_input_permutation_mapping = plan["src_rows"]
        return tokens, pprobs

    def _identity_chunks(self) -> bool:
        """One EP rank and one expert-TP rank: megatron's permutation 2 (sort the received chunks by
        local expert) is the identity, but copies every routed row (and back) with ``torch.cat``."""
        return (getattr(self, "_sort_plan", None) is not None and self.ep_size * self.tp_size == 1
                and not getattr(self, "drop_and_pad", False))

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
        if self._identity_chunks():
            # an all-to-all over one rank is the identity; skipping its autograd node keeps the very
            # tensor the sort gathered (whose recipe the experts' recomputation reads)
            if not self._device_counts:
                self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_ep_alltoall", self.tokens_per_expert)
            return permutated_local_input_tokens, permuted_probs
        if getattr(self, "_dedup", None) is None:
            return super().token_dispatch(permutated_local_input_tokens, permuted_probs)
        return self._dedup.send(permutated_local_input_tokens), self._dedup.send(permuted_probs)

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        if getattr(self, "_dedup", None) is not None:
            return self._dedup.expand(global_input_tokens, global_probs)
        if not self._identity_chunks():
            return super().dispatch_postprocess(global_input_tokens, global_probs)
        tokens_per_expert = self.tokens_per_expert
        if not self._device_counts:
            tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_2", tokens_per_expert)
            tokens_per_expert = self._maybe_dtoh_and_synchronize("before_finish", tokens_per_expert)
        self.tokens_per_expert = None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        if getattr(self, "_dedup", None) is not None:
            return self._dedup.reduce_rows(hidden_states)
        if not self._identity_chunks():
            return super().combine_preprocess(hidden_states)
        return hidden_states

    def token_combine(self, hidden_states, *args, **kwargs):
        if self._identity_chunks():  # the return all-to-all over one rank: the identity
            return hidden_states
        if getattr(self, "_dedup", None) is None:
            return super().token_combine(hidden_states, *args, **kwargs)
        return self._dedup.send_back(hidden_states)

    def combine_postprocess(self, permutated_local_input_tokens):
        dedup = getattr(self, "_dedup", None)
        if dedup is not None:
            self._dedup = None
            return dedup.reduce_ranks(permutated_local_input_tokens).view(self.hidden_shape)
        plan = getattr(self, "_sort_plan", None)
        if plan is None:
            return super().combine_postprocess(permutated_local_input_tokens)
        self._sort_plan = None
        return unsort_combine(permutated_local_input_tokens, plan).view(self.hidden_shape)


class TorchMoELayer(MoELayer):
    """megatron ``MoELayer`` whose all-to-all dispatcher permutes by sorting (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if type(self.token_dispatcher) is MoEAlltoAllTokenDispatcher:
            # same object and state, two methods overridden (its constructor differs across versions)
            self.token_dispatcher.__class__ = _SortedAlltoAllTokenDispatcher
        if type(self.router) is TopKRouter:  # the aux loss reuses the routing's top-k (router.py)
            self.router.__class__ = ReusingTopKRouter


# ------------------------------------------------------------------------------------------------
# the spec
# ------------------------------------------------------------------------------------------------

def _torch_moe(mlp):
    """The MoE mlp spec (ModuleSpec in megatron-core 0.16, functools.partial in 0.19) with our
    layer and experts; anything else unchanged."""
    if isinstance(mlp, functools.partial):
        if not (isinstance(mlp.func, type) and issubclass(mlp.func, MoELayer)):
            return mlp
        kw = dict(mlp.keywords)
        kw["submodules"] = dataclasses.replace(kw["submodules"], experts=TorchGroupedMLP)
        return functools.partial(TorchMoELayer, *mlp.args, **kw)
    module = getattr(mlp, "module", None)
    if isinstance(module, type) and issubclass(module, MoELayer):
        mlp = copy.copy(mlp)
        mlp.module = TorchMoELayer
        mlp.submodules = dataclasses.replace(mlp.submodules, experts=TorchGroupedMLP)
    return mlp


def _is_torch_moe(mlp) -> bool:
    if isinstance(mlp, functools.partial):
        return mlp.func is TorchMoELayer and mlp.keywords["submodules"].experts is TorchGroupedMLP
    return getattr(mlp, "module", None) is TorchMoELayer and mlp.submodules.experts is TorchGroupedMLP


def torch_block_spec(config, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None):
    """The ``"torch"`` backend's decoder block spec (module docstring)."""
    _check_config(config)
    if getattr(config, "moe_grouped_gemm", False):  # the local spec refuses it; our experts are grouped
        config = copy.copy(config)
        config.moe_grouped_gemm = False
    block = local_block_spec(config, vp_stage=vp_stage, pp_rank=pp_rank)  # a deep copy: ours to edit
    for layer in block.layer_specs:
        sa = layer.submodules.self_attention
        if sa.module is SelfAttention:
            sa.module = TorchSelfAttention
        layer.submodules.mlp = _torch_moe(layer.submodules.mlp)
        for bda in ("self_attn_bda", "mlp_bda"):  # the residual's gradient joins the norm's backward (norm.py)
            if getattr(layer.submodules, bda) is get_bias_dropout_add:
                setattr(layer.submodules, bda, residual_bda)
        if getattr(config, "num_moe_experts", None) and not _is_torch_moe(layer.submodules.mlp):
            raise RuntimeError(f"torch backend: could not put TorchMoELayer/TorchGroupedMLP into this megatron-core's "
                               f"MoE spec {layer.submodules.mlp!r}")
    install_fast_rope()
    install_routing_reuse()
    install_tp1_identity_skips()
    return block


register_backend("torch", torch_block_spec)
