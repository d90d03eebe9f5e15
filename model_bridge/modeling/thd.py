"""Packed (THD) micro-batch parameters that carry their host-side offsets.

megatron's ``PackedSeqParams`` holds ``cu_seqlens`` as device tensors. Planning a packed forward
(where the samples lie, the varlen kernel's offsets, the trailing padding) needs them as Python
ints, and reading a device tensor on the host is a device sync: the host waits until the GPU has
finished everything queued, so it cannot queue the next micro-batch while the GPU works on this
one. Whoever packs the micro-batch already has the offsets on the host: :func:`thd_params`
builds the ``PackedSeqParams`` with a copy of them attached (and copies the device tensor with a
pinned, non-blocking copy, which does not sync either); the model reads :func:`host_offsets`
instead of the device tensor. ``PackedSeqParams`` built elsewhere still work (with the sync).

``thd_params(..., defer_copy=True)`` leaves the offsets on the host (a CPU tensor, marked with the
device they are for): no copy at all in the step's prologue, where the GPU waits for the host.
The thinker then moves them (:func:`offsets_to_device`) unless its layer spec takes host offsets
(the torch backend's attention copies them itself, after layer 0's qkv GEMM is queued).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["thd_params", "host_offsets", "attach_host_offsets", "to_device_async", "ints_to_device",
           "offsets_to_device"]

_ATTR = "_mgrpo_host_offsets"
_FOR_DEVICE = "_mgrpo_offsets_for"


def to_device_async(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device`` without a host sync: a pinned host copy, then a non-blocking copy (a
    copy from pageable memory waits for the whole stream). CPU targets get ``t`` as is."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def ints_to_device(values: Sequence[int], device: torch.device | str, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Host ints as a tensor on ``device`` without a host sync: built straight into pinned memory
    (one host op fewer than :func:`to_device_async` of a pageable tensor: at the start of a step,
    where each op costs the host 30-80 us on an H200 machine, that is measurable), then copied
    non-blocking."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def attach_host_offsets(psp, cu: Sequence[int], cu_padded: Optional[Sequence[int]] = None):
    """Record the host copy of ``psp``'s q (= kv) offsets on it; returns ``psp``."""
    try:
        setattr(psp, _ATTR, (tuple(int(x) for x in cu), None if cu_padded is None else tuple(int(x) for x in cu_padded)))
    except (AttributeError, TypeError):  # a frozen/slotted PackedSeqParams: the model reads the device tensor
        pass
    return psp


def host_offsets(psp) -> Optional[tuple[tuple[int, ...], Optional[tuple[int, ...]]]]:
    """``(cu_seqlens, cu_seqlens_padded or None)`` as host ints when the packer attached them and
    the tensors are still the ones it made (self-attention: kv offsets are the q offsets)."""
    host = getattr(psp, _ATTR, None)
    if host is None or psp.cu_seqlens_kv is not psp.cu_seqlens_q:
        return None
    if (host[1] is None) != (getattr(psp, "cu_seqlens_q_padded", None) is None):
        return None
    return host


def thd_params(cu_seqlens: Sequence[int], device: torch.device | str, max_seqlen: Optional[int] = None, *,
               defer_copy: bool = False):
    """megatron ``PackedSeqParams(qkv_format="thd")`` for samples at host offsets ``cu_seqlens``
    (``[S+1]`` ints from 0), its int32 offsets on ``device`` (no host sync), the host copy attached.
    ``defer_copy`` (CUDA ``device``): the int32 offsets stay a CPU tensor, for a consumer that
    moves them (:func:`offsets_to_device`; :class:`~model_bridge.modeling.thinker.OmniThinker` does)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = [int(x) for x in cu_seqlens]
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0, got {cu}")
    if max_seqlen is None:
        max_seqlen = max((b - a for a, b in zip(cu, cu[1:])), default=0)
    device = torch.device(device)
    defer = defer_copy and device.type == "cuda"
    cu_dev = torch.tensor(cu, dtype=torch.int32) if defer else ints_to_device(cu, device)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_dev, cu_seqlens_kv=cu_dev, max_seqlen_q=max_seqlen,
                          max_seqlen_kv=max_seqlen)
    if defer:
        setattr(psp, _FOR_DEVICE, device)
    return attach_host_offsets(psp, cu)


def offsets_to_device(psp):
    """``psp`` with offsets that :func:`thd_params` left on the host (``defer_copy``) on their
    device (a new ``PackedSeqParams``, host copy attached); any other ``psp`` as it is."""
    import dataclasses

    device = getattr(psp, _FOR_DEVICE, None)
    host = host_offsets(psp)
    if device is None or host is None or psp.cu_seqlens_q.device == device:
        return psp
    cu = ints_to_device(host[0], device, psp.cu_seqlens_q.dtype)
    padded = None if host[1] is None else ints_to_device(host[1], device, psp.cu_seqlens_q.dtype)
    out = dataclasses.replace(psp, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                              cu_seqlens_kv_padded=padded)
    return attach_host_offsets(out, host[0], host[1])
