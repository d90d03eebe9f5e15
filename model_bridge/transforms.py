"""Pure tensor reshapes between HF and Megatron layouts (no process groups, no I/O).

Layouts (dim 0 is the output dim of a ``[out, in]`` linear weight, or the only dim of a bias):

* fused QKV: Megatron's ``linear_qkv`` holds, for each KV group ``g`` in order, the group's query
  heads, then its key head, then its value head: ``[q_g0 .. q_g(h-1), k_g, v_g]`` with
  ``h = num_heads // num_kv_heads`` and each head ``head_dim`` rows. Megatron's attention views the
  output as ``[.., groups, (h + 2) * head_dim]`` and splits ``[h * head_dim, head_dim, head_dim]``.
  Multi-head attention is the case ``num_kv_heads == num_heads`` (``[q_i, k_i, v_i]`` per head).
  Tensor parallelism splits whole groups, so the shard of TP rank ``r`` is the fused tensor of
  groups ``[r * G / tp, (r + 1) * G / tp)``: contiguous rows of the fused tensor and contiguous rows
  of each of q, k, v (``qkv_group_rows``).
* fused gate/up (gated linear unit): ``[gate; up]`` along dim 0 (Megatron applies
  ``act(x[..., :I]) * x[..., I:]``). Under TP each rank holds ``[gate_r; up_r]``, so the full
  Megatron tensor is *not* ``[gate; up]`` once tp > 1; ``gate_up_shard`` builds one rank's shard
  and ``split_gate_up_shards`` undoes a list of them.
* vocab padding: Megatron allocates ``padded`` rows (a multiple of 128 * tp); rows past the real
  vocab are zero and never exported.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = [
    "fuse_qkv", "split_qkv", "qkv_group_rows", "fuse_gate_up", "split_gate_up",
    "gate_up_shard", "split_gate_up_shards", "pad_vocab", "unpad_vocab", "shard_range",
]


def _check_heads(num_heads: int, num_kv_heads: int) -> int:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    return num_heads // num_kv_heads


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int,
             head_dim: int) -> torch.Tensor:
    """Megatron fused ``linear_qkv`` weight (or bias) from HF ``q/k/v_proj`` (weights or biases).

    ``num_heads`` / ``num_kv_heads`` are the heads present in ``q`` / ``k`` (for a TP shard: the
    rank's heads). Shapes: q ``[num_heads*head_dim, *rest]``, k and v ``[num_kv_heads*head_dim, *rest]``.
    """
    h = _check_heads(num_heads, num_kv_heads)
    rest = tuple(q.shape[1:])
    want_q, want_kv = (num_heads * head_dim, *rest), (num_kv_heads * head_dim, *rest)
    if tuple(q.shape) != want_q or tuple(k.shape) != want_kv or tuple(v.shape) != want_kv:
        raise ValueError(f"fuse_qkv: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do "
                         f"not fit {num_heads} heads / {num_kv_heads} KV heads of dim {head_dim} "
                         f"(want q {want_q}, k and v {want_kv})")
    g = num_kv_heads
    fused = torch.cat([q.reshape(g, h * head_dim, *rest), k.reshape(g, head_dim, *rest),
                       v.reshape(g, head_dim, *rest)], dim=1)
    return fused.reshape(g * (h + 2) * head_dim, *rest)


def split_qkv(fused: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``fuse_qkv``: (q, k, v) as contiguous tensors."""
    h = _check_heads(num_heads, num_kv_heads)
    g = num_kv_heads
    rest = tuple(fused.shape[1:])
    if fused.shape[0] != g * (h + 2) * head_dim:
        raise ValueError(f"split_qkv: {fused.shape[0]} rows, expected {g * (h + 2) * head_dim} for "
                         f"{num_heads} heads / {num_kv_heads} KV heads of dim {head_dim}")
    grouped = fused.reshape(g, (h + 2) * head_dim, *rest)
    q, k, v = torch.split(grouped, [h * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(g * h * head_dim, *rest).contiguous(), k.reshape(g * head_dim, *rest).contiguous(),
            v.reshape(g * head_dim, *rest).contiguous())


def shard_range(n: int, size: int, rank: int, what: str = "dimension") -> tuple[int, int]:
    """[start, stop) of rank ``rank``'s equal part of ``n`` items split ``size`` ways."""
    if n % size:
        raise ValueError(f"{what} of size {n} cannot be split evenly over {size} ranks")
    part = n // size
    return rank * part, (rank + 1) * part


def qkv_group_rows(num_heads: int, num_kv_heads: int, head_dim: int, tp: int, rank: int
                   ) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """Rows of the HF q, k and v tensors that TP rank ``rank`` of ``tp`` holds (whole KV groups)."""
    h = _check_heads(num_heads, num_kv_heads)
    g0, g1 = shard_range(num_kv_heads, tp, rank, "query groups (num_kv_heads)")
    return ((g0 * h * head_dim, g1 * h * head_dim), (g0 * head_dim, g1 * head_dim),
            (g0 * head_dim, g1 * head_dim))


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``[gate; up]`` (Megatron ``linear_fc1`` of a gated MLP at TP=1)."""
    if gate.shape != up.shape:
        raise ValueError(f"fuse_gate_up: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    return torch.cat([gate, up], dim=0)


def split_gate_up(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``fuse_gate_up``."""
    if fused.shape[0] % 2:
        raise ValueError(f"split_gate_up: odd number of rows {fused.shape[0]}")
    gate, up = torch.chunk(fused, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def gate_up_shard(gate: torch.Tensor, up: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s ``linear_fc1`` shard ``[gate_r; up_r]`` from the full HF gate and up."""
    a, b = shard_range(gate.shape[0], tp, rank, "gated MLP intermediate size")
    return fuse_gate_up(gate[a:b], up[a:b])


def split_gate_up_shards(shards: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Full (gate, up) from every TP rank's ``[gate_r; up_r]`` shard, in rank order."""
    pairs = [split_gate_up(s) for s in shards]
    return torch.cat([p[0] for p in pairs], dim=0), torch.cat([p[1] for p in pairs], dim=0)


def pad_vocab(weight: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """Append zero rows up to ``padded_rows`` (Megatron's padded vocab)."""
    n = weight.shape[0]
    if padded_rows < n:
        raise ValueError(f"pad_vocab: cannot pad {n} rows down to {padded_rows}")
    if padded_rows == n:
        return weight
    return torch.cat([weight, weight.new_zeros((padded_rows - n, *weight.shape[1:]))], dim=0)


def unpad_vocab(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Drop the padding rows past ``vocab_size``."""
    if weight.shape[0] < vocab_size:
        raise ValueError(f"unpad_vocab: {weight.shape[0]} rows, fewer than the vocab {vocab_size}")
    return weight[:vocab_size]
