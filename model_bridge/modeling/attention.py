"""Core attention that accepts packed (THD) sequences, for megatron-core's local layer spec.

megatron-core's own ``DotProductAttention`` refuses ``PackedSeqParams(qkv_format="thd")``, and
Transformer Engine (which handles them) is absent on our machines. :class:`PackedCoreAttention`
is a ``core_attention`` submodule with the same constructor and forward signature:

* packed THD (``query [T, np, d]``, ``key/value [T, ng, d]`` and ``cu_seqlens``): on CUDA in
  bf16/fp16 one ``torch.nn.attention.varlen.varlen_attn`` call (flash varlen, native GQA), planned
  once per ``PackedSeqParams`` (:func:`varlen_plan`, cached on it: from the packer's host offsets,
  ``thd.host_offsets``, so no layer reads ``cu_seqlens`` back from the device); otherwise
  (CPU, fp32, or a shape the flash kernel refuses: :func:`flash_refusal`, e.g. a head size that is
  not a multiple of 8) ``scaled_dot_product_attention`` per segment, with one logged line per reason;
* plain SBHD (``[s, b, n, d]``): ``scaled_dot_product_attention`` on the batch.

Causal (the thinker) or not (the audio tower's windows) follows the layer's ``attn_mask_type``.
Tokens outside the segments (trailing padding after ``cu_seqlens[-1]``, or gaps that
``cu_seqlens_*_padded`` leaves after each sample) get zero outputs and no gradient.
:func:`packed_attention` is the same computation as a plain function for modules outside
megatron's spec machinery. Dropout, attention bias and context parallelism are not supported.
"""
from __future__ import annotations

import functools
import inspect
import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .thd import host_offsets, ints_to_device, to_device_async

__all__ = ["PackedCoreAttention", "packed_attention", "dense_attention", "packed_segments", "flash_refusal",
           "flash_refusal_for", "FLASH_MAX_HEAD_DIM", "VarlenPlan", "varlen_plan", "varlen_run"]

_FLASH_DTYPES = (torch.bfloat16, torch.float16)
FLASH_MAX_HEAD_DIM = 256
"""Largest head size the flash varlen kernel takes (flash-attention 2's limit)."""
log = logging.getLogger("model_bridge.attention")
_NOTED: set[str] = set()


def flash_refusal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Optional[str]:
    """Why ``varlen_attn`` (flash) cannot run these ``[T, n, d]`` tensors, or None when it can
    (:func:`flash_refusal_for` of their device, dtype and head sizes)."""
    return flash_refusal_for(query.device.type, query.dtype, query.shape[-1], key.shape[-1], value.shape[-1])


def flash_refusal_for(device_type: str, dtype: torch.dtype, d_q: int, d_k: int, d_v: int) -> Optional[str]:
    """The reason flash varlen cannot run on ``device_type`` in ``dtype`` with these head sizes, or
    None. The reasons are the flash kernel's own checks (it raises ``head_size must be a multiple
    of 8`` for an odd-size audio tower, head size 10), checked here so the caller takes SDPA."""
    if device_type != "cuda":
        return "not on CUDA"
    if dtype not in _FLASH_DTYPES:
        return f"dtype {dtype} (flash runs bfloat16/float16)"
    if d_k != d_q or d_v != d_q:
        return f"query/key/value head sizes differ ({d_q}/{d_k}/{d_v})"
    if d_q % 8:
        return f"head size {d_q} is not a multiple of 8"
    if d_q > FLASH_MAX_HEAD_DIM:
        return f"head size {d_q} exceeds {FLASH_MAX_HEAD_DIM}"
    return None


def note_sdpa_fallback(reason: str) -> None:
    """One log line per distinct reason a flash-capable call (CUDA, bf16/fp16) took SDPA instead."""
    if reason not in _NOTED:
        _NOTED.add(reason)
        log.warning("packed attention: flash varlen_attn cannot run this shape (%s); using SDPA per sample",
                    reason)


@functools.lru_cache(maxsize=None)
def _varlen_params() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _as_list(cu) -> list[int]:
    return [int(x) for x in (cu.tolist() if torch.is_tensor(cu) else cu)]


def packed_segments(cu_seqlens, cu_seqlens_padded=None) -> list[tuple[int, int]]:
    """(start, length) of each sample in the packed buffer.

    Without ``cu_seqlens_padded`` sample i occupies ``[cu[i], cu[i+1])``; with it (TE's convention)
    it starts at ``cu_padded[i]`` and keeps its real length ``cu[i+1] - cu[i]``.
    """
    cu = _as_list(cu_seqlens)
    lens = [b - a for a, b in zip(cu, cu[1:])]
    if any(n < 0 for n in lens):
        raise ValueError(f"cu_seqlens {cu} decrease")
    if cu_seqlens_padded is None:
        return list(zip(cu[:-1], lens))
    cp = _as_list(cu_seqlens_padded)
    if len(cp) != len(cu):
        raise ValueError(f"cu_seqlens_padded {cp} and cu_seqlens {cu} have different lengths")
    for i, n in enumerate(lens):
        if cp[i] + n > cp[i + 1]:
            raise ValueError(f"sample {i} of length {n} does not fit its padded slot "
                             f"[{cp[i]}, {cp[i + 1]}) (cu_seqlens {cu}, cu_seqlens_padded {cp})")
    return list(zip(cp[:-1], lens))


def _sdpa(q, k, v, causal: bool, scale: float, mask=None):
    """q [b, np, s, d], k/v [b, ng, s, d] -> [b, np, s, d]."""
    gqa = q.shape[1] != k.shape[1]
    if gqa:
        try:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                                  scale=scale, enable_gqa=True)
        except TypeError:  # torch without enable_gqa: expand the KV heads
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale)


def _varlen(q, k, v, cu: list[int], max_len: int, causal: bool, scale: float):
    """One flash varlen call over contiguous segments ``cu`` (q/k/v [t, n, d] on CUDA)."""
    from torch.nn.attention.varlen import varlen_attn

    cu_t = ints_to_device(cu, q.device)  # pinned, non-blocking: torch.tensor(..., device=cuda) syncs
    return varlen_attn(q, k, v, cu_t, cu_t, max_len, max_len, **varlen_kwargs(q, k, causal, scale))


def varlen_kwargs(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> dict:
    """Keyword arguments of this torch's ``varlen_attn`` for causal or full attention with GQA
    (torch 2.11 has ``window_size`` and no ``is_causal``: causal is the window (-1, 0))."""
    params = _varlen_params()
    kw = {"scale": scale}
    if "window_size" in params:
        kw["window_size"] = (-1, 0) if causal else (-1, -1)
    elif "is_causal" in params:
        kw["is_causal"] = causal
    elif causal:
        raise RuntimeError("this torch's varlen_attn takes neither window_size nor is_causal")
    if "enable_gqa" in params and q.shape[1] != k.shape[1]:
        kw["enable_gqa"] = True
    return kw


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens,
                     *, causal: bool = True, scale: Optional[float] = None, cu_seqlens_padded=None,
                     max_seqlen: Optional[int] = None, backend: str = "auto") -> torch.Tensor:
    """Attention within each packed sample: query [T, np, d], key/value [T, ng, d] -> [T, np, d].

    ``np`` must be a multiple of ``ng`` (GQA). Rows outside every sample are zero. ``backend``:
    ``"auto"`` (flash varlen where :func:`flash_refusal` has no objection, else per-segment SDPA),
    ``"varlen"`` (a ValueError naming the reason where flash cannot run) or ``"sdpa"``.
    """
    T, nq, d = query.shape
    if key.shape[0] != T or value.shape[0] != T:
        raise ValueError(f"query/key/value token counts differ: {query.shape[0]}/{key.shape[0]}/{value.shape[0]}")
    if nq % key.shape[1]:
        raise ValueError(f"{nq} query heads is not a multiple of {key.shape[1]} key/value heads")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    segs = packed_segments(cu_seqlens, cu_seqlens_padded)
    if segs and segs[-1][0] + segs[-1][1] > T:
        raise ValueError(f"packed samples end at {segs[-1][0] + segs[-1][1]} but the buffer holds {T} tokens")
    if backend == "auto":
        why = flash_refusal(query, key, value)
        if why is not None and query.is_cuda and query.dtype in _FLASH_DTYPES:
            note_sdpa_fallback(why)
        backend = "sdpa" if why else "varlen"
    elif backend == "varlen" and flash_refusal(query, key, value):
        raise ValueError(f"packed_attention(backend='varlen'): {flash_refusal(query, key, value)}; "
                         "use backend='auto' (SDPA where flash cannot run) or 'sdpa'")

    if backend == "varlen":
        # contiguous samples from 0 (trailing padding only): run in place; otherwise compact first
        contiguous = all(s == e for (s, _), e in zip(segs, [0] + [s + n for s, n in segs[:-1]]))
        lens = [n for _, n in segs]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        max_len = max(lens, default=0) if max_seqlen is None else int(max_seqlen)
        if contiguous:
            n_real = cu[-1]
            out = _varlen(query[:n_real], key[:n_real], value[:n_real], cu, max_len, causal, scale)
            if n_real < T:
                out = torch.cat([out, out.new_zeros(T - n_real, *out.shape[1:])])
            return out
        idx = torch.cat([torch.arange(s, s + n, device=query.device) for s, n in segs])
        out_c = _varlen(query[idx], key[idx], value[idx], cu, max_len, causal, scale)
        return query.new_zeros(T, nq, value.shape[-1]).index_copy(0, idx, out_c)
    if backend != "sdpa":
        raise ValueError(f"unknown packed attention backend {backend!r} (auto, varlen, sdpa)")

    outs, cursor = [], 0
    for start, n in segs:
        if start > cursor:
            outs.append(query.new_zeros(start - cursor, nq, value.shape[-1]))
        if n:
            q = query[start:start + n].transpose(0, 1).unsqueeze(0)  # [1, np, n, d]
            k = key[start:start + n].transpose(0, 1).unsqueeze(0)
            v = value[start:start + n].transpose(0, 1).unsqueeze(0)
            outs.append(_sdpa(q, k, v, causal, scale)[0].transpose(0, 1))  # [n, np, d]
        cursor = start + n
    if cursor < T:
        outs.append(query.new_zeros(T - cursor, nq, value.shape[-1]))
    return torch.cat(outs, dim=0) if outs else query.new_zeros(T, nq, value.shape[-1])


@dataclass
class VarlenPlan:
    """What ``varlen_attn`` needs for one packed micro-batch, computed once: from the packer's host
    offsets (``thd.host_offsets``) without a host read, else with one read of ``cu_seqlens``."""

    T: int
    device: torch.device
    cu: torch.Tensor
    """int32 ``[S+1]`` offsets of the (compacted) samples, on ``device``."""
    max_len: int
    n_real: int
    """Tokens inside samples."""
    idx: Optional[torch.Tensor]
    """Rows of the samples in the buffer when they are not contiguous from 0 (gaps), else None."""
    src: tuple
    """Identity of the cu_seqlens tensors the plan was made from (stale-cache check)."""


def varlen_plan(psp, T: int, device: torch.device) -> VarlenPlan:
    """The :class:`VarlenPlan` of ``psp`` (a ``PackedSeqParams``) for a T-token buffer, cached on it, so
    every layer of a micro-batch reuses it. The host copy only plans (lengths, compaction): a CUDA
    graph's stack attaches one segment over its bucket while ``cu_seqlens_q`` holds the replay's real
    offsets, which the kernel reads."""
    src = (id(psp.cu_seqlens_q), id(psp.cu_seqlens_q_padded), id(psp.cu_seqlens_kv))
    plan = getattr(psp, "_mgrpo_varlen_plan", None)
    if plan is not None and plan.T == T and plan.device == device and plan.src == src:
        return plan
    cu_q, cu_kv = psp.cu_seqlens_q, psp.cu_seqlens_kv
    host = host_offsets(psp)  # the packer's host copy (thd.py): then no device read here
    if host is None and cu_kv is not None and cu_kv is not cu_q and not torch.equal(
            torch.as_tensor(cu_q).cpu(), torch.as_tensor(cu_kv).cpu()):
        raise NotImplementedError("PackedCoreAttention needs cu_seqlens_q == cu_seqlens_kv (self-attention)")
    segs = (packed_segments(*host) if host is not None
            else packed_segments(cu_q, getattr(psp, "cu_seqlens_q_padded", None)))
    if segs and segs[-1][0] + segs[-1][1] > T:
        raise ValueError(f"packed samples end at {segs[-1][0] + segs[-1][1]} but the buffer holds {T} tokens")
    lens = [n for _, n in segs]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    contiguous = all(s == e for (s, _), e in zip(segs, cu[:-1]))
    given = getattr(psp, "max_seqlen_q", None)
    max_len = int(given) if given is not None else max(lens, default=0)
    idx = None
    if not contiguous:
        idx = to_device_async(torch.cat([torch.arange(s, s + n) for s, n in segs]), device)
    if (host is not None and tuple(cu) == host[0] and cu_q.dtype == torch.int32 and cu_q.device == device
            and cu_q.dim() == 1):
        cu_dev = cu_q  # the packer's (unpadded) device offsets are these: no second copy to the device
    else:
        cu_dev = ints_to_device(cu, device)
    plan = VarlenPlan(T=T, device=device, cu=cu_dev, max_len=max_len, n_real=cu[-1], idx=idx, src=src)
    try:
        psp._mgrpo_varlen_plan = plan
    except (AttributeError, TypeError):  # a frozen/slotted PackedSeqParams: recompute next time
        pass
    return plan


def varlen_run(q, k, v, plan: VarlenPlan, causal: bool, scale: float) -> torch.Tensor:
    """One flash ``varlen_attn`` call over ``plan``'s samples (q ``[T, np, d]``, k/v ``[T, ng, d]`` on
    CUDA); rows outside the samples are zero."""
    from torch.nn.attention.varlen import varlen_attn

    kw = varlen_kwargs(q, k, causal, scale)
    T = q.shape[0]
    if plan.idx is None:
        n = plan.n_real
        if n == T:  # no trailing padding: no slices (each one's backward zero-fills and copies its input's size)
            return varlen_attn(q, k, v, plan.cu, plan.cu, plan.max_len, plan.max_len, **kw)
        out = varlen_attn(q[:n], k[:n], v[:n], plan.cu, plan.cu, plan.max_len, plan.max_len, **kw)
        if n < T:
            out = torch.cat([out, out.new_zeros(T - n, *out.shape[1:])])
        return out
    out_c = varlen_attn(q[plan.idx], k[plan.idx], v[plan.idx], plan.cu, plan.cu, plan.max_len, plan.max_len, **kw)
    return q.new_zeros(T, q.shape[1], v.shape[-1]).index_copy(0, plan.idx, out_c)



def dense_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, causal: bool = True,
                    scale: Optional[float] = None, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SBHD attention: query [s, b, np, d], key/value [s, b, ng, d] -> [s, b, np, d].

    ``attention_mask`` uses megatron's convention (True = masked out), broadcastable to
    [b, np, s, s]; with ``causal`` it is combined with the causal mask.
    """
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, n, s, d]
    mask = None
    if attention_mask is not None:
        mask = ~attention_mask.bool()
        if causal:
            sq, sk = q.shape[2], k.shape[2]
            mask = mask & torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
    out = _sdpa(q, k, v, causal, scale, mask)
    return out.permute(2, 0, 1, 3)  # [s, b, np, d]


def _megatron_module():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class PackedCoreAttention(_megatron_module()):
    """megatron ``core_attention`` for the local spec that also takes THD packed sequences.

    Constructor and forward follow megatron's ``DotProductAttention`` (0.16 and 0.19). Output is
    ``[T, np*d]`` for THD (megatron's attention reshapes it to [T, 1, h]) and ``[s, b, np*d]`` for SBHD.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, **unused):
        super().__init__(config=config)
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.utils import divide

        if getattr(config, "context_parallel_size", 1) != 1:
            raise NotImplementedError("PackedCoreAttention does not support context parallelism")
        p = config.attention_dropout if attention_dropout is None else attention_dropout
        if p:
            raise NotImplementedError(f"PackedCoreAttention does not implement attention dropout (got {p})")
        if pg_collection is not None and getattr(pg_collection, "tp", None) is not None:
            tp = pg_collection.tp.size()
        else:
            from megatron.core import parallel_state

            tp = parallel_state.get_tensor_model_parallel_world_size()
        self.layer_number = layer_number
        self.attention_type = attention_type
        self.attn_mask_type = attn_mask_type
        self.num_heads = divide(config.num_attention_heads, tp)
        self.num_groups = divide(config.num_query_groups or config.num_attention_heads, tp)
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self._causal_types = {AttnMaskType.causal, getattr(AttnMaskType, "padding_causal", AttnMaskType.causal)}

    def _is_causal(self, attn_mask_type) -> bool:
        return (attn_mask_type if attn_mask_type is not None else self.attn_mask_type) in self._causal_types

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **unused) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("PackedCoreAttention does not support attention_bias")
        causal = self._is_causal(attn_mask_type)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            if query.dim() == 4:  # [T, 1, n, d] if the caller did not squeeze the batch dim
                query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
            if flash_refusal(query, key, value) is None:  # one plan per micro-batch, shared by its layers
                plan = varlen_plan(packed_seq_params, query.shape[0], query.device)
                out = varlen_run(query, key, value, plan, causal, self.softmax_scale)
                return out.reshape(out.shape[0], -1)
            cu_q, cu_kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
            if cu_kv is not None and cu_kv is not cu_q and not torch.equal(torch.as_tensor(cu_q).cpu(),
                                                                           torch.as_tensor(cu_kv).cpu()):
                raise NotImplementedError("PackedCoreAttention needs cu_seqlens_q == cu_seqlens_kv (self-attention)")
            out = packed_attention(query, key, value, cu_q, causal=causal, scale=self.softmax_scale,
                                   cu_seqlens_padded=getattr(packed_seq_params, "cu_seqlens_q_padded", None),
                                   max_seqlen=getattr(packed_seq_params, "max_seqlen_q", None))
            return out.reshape(out.shape[0], -1)
        out = dense_attention(query, key, value, causal=causal, scale=self.softmax_scale,
                              attention_mask=None if causal and attention_mask is None else attention_mask)
        return out.reshape(out.shape[0], out.shape[1], -1)
