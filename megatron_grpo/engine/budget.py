"""``packing.max_tokens_per_microbatch: auto``: the token budget from free GPU memory and the model.

After the engine is built (weights, fp32 grad buffers and master weights allocated; Adam's two
fp32 moments not yet: torch allocates them at the first step), the budget is

    T = (free * FREE_FRACTION - Adam moments - RESERVE - LM-head chunk) / bytes per token

rounded down to a multiple of 256 (and of ``pad_multiple``), where bytes per token is what one
token's activations kept for the backward take, counted from the geometry and multiplied by
``SAFETY`` (temporaries the count leaves out: the backward's own buffers, allocator slack):

* per decoder layer on this rank, bf16: the attention's input norm, q/k/v, the attention output
  and its projection (``2h + (nq + 2 nkv) d + nq d``) and the MoE's router logits (fp32), the
  ``k`` routed copies of the token, their gate/up output, SwiGLU output and down output
  (``k (2h + 3F)``);
* per audio-tower layer, counted as if every token were an audio token (recordings are most of an
  audio agent's tokens): ``6 d_model + 2 ffn``.

On CPU there is nothing to measure: ``auto`` is the default budget, 4,096. The choice and its
inputs go to the log in one line.
"""
from __future__ import annotations

import logging

__all__ = ["activation_bytes_per_token", "auto_token_budget", "resolve_token_budget", "common_token_budget",
           "DEFAULT_BUDGET"]

log = logging.getLogger("megatron_grpo.engine.budget")

DEFAULT_BUDGET = 4096
"""The budget on CPU, and ``packing.max_tokens_per_microbatch``'s default."""
FREE_FRACTION = 0.9
SAFETY = 1.5
RESERVE = 2 * 2**30
"""Bytes kept free for the CUDA context's growth, NCCL buffers and fragmentation."""
MIN_BUDGET, MAX_BUDGET = 256, 65536


def activation_bytes_per_token(spec, layers: int, audio_layers: int, dtype_bytes: int = 2) -> int:
    """Bytes of activations one token keeps for the backward (module doc), before ``SAFETY``."""
    t, a = spec.text, spec.audio
    attn = 2 * t.hidden_size + (t.num_heads + 2 * t.num_kv_heads) * t.head_dim + t.num_heads * t.head_dim
    moe = t.num_experts * 4 // dtype_bytes + t.topk * (2 * t.hidden_size + 3 * t.moe_ffn_hidden_size)
    audio = 6 * a.d_model + 2 * a.ffn_dim
    return dtype_bytes * (layers * (attn + moe) + audio_layers * audio)


def auto_token_budget(spec, *, free_bytes: int, layers: int, audio_layers: int, adam_params: int,
                      chunk_tokens: int, vocab_local: int, multiple: int = 1) -> tuple[int, str]:
    """``(budget, log line)`` for a rank with ``free_bytes`` of free device memory, ``layers`` /
    ``audio_layers`` of its own, ``adam_params`` parameters whose Adam moments are still to come
    (8 B each), the logprob's ``chunk_tokens`` x ``vocab_local`` fp32 temporaries."""
    per = int(SAFETY * activation_bytes_per_token(spec, layers, audio_layers))
    fixed = 8 * adam_params + RESERVE + 3 * 4 * chunk_tokens * vocab_local
    avail = int(free_bytes * FREE_FRACTION) - fixed
    step = 256 * multiple
    budget = min(MAX_BUDGET // step * step, max(0, avail) // per // step * step)
    line = (f"packing.max_tokens_per_microbatch=auto -> {budget} tokens (free {free_bytes / 2**30:.1f} GiB x "
            f"{FREE_FRACTION} - Adam moments {8 * adam_params / 2**30:.1f} GiB - reserve {RESERVE / 2**30:.0f} GiB - "
            f"LM-head chunk {12 * chunk_tokens * vocab_local / 2**30:.2f} GiB, over {per / 2**20:.2f} MiB of "
            f"activations per token: {layers} decoder + {audio_layers} audio layers x {SAFETY})")
    if budget < MIN_BUDGET:
        raise RuntimeError(f"packing.max_tokens_per_microbatch=auto: too little free GPU memory for {MIN_BUDGET} "
                           f"tokens per micro-batch ({line}); use more GPUs (EP/TP/PP) or recompute "
                           "(model.recompute), or set the budget by hand")
    return budget, line


def resolve_token_budget(value, engine, *, chunk_tokens: int, multiple: int = 1) -> int:
    """``packing.max_tokens_per_microbatch`` as an int: ``value`` itself, or for ``"auto"`` the
    budget of this rank's free memory (:func:`auto_token_budget`; CPU: :data:`DEFAULT_BUDGET`),
    logged once. Every rank must use the same budget: the caller takes the MIN over ranks."""
    import torch

    if value != "auto":
        return int(value)
    if not torch.cuda.is_available():
        log.info("packing.max_tokens_per_microbatch=auto on CPU -> %d tokens (the default)", DEFAULT_BUDGET)
        return DEFAULT_BUDGET
    from megatron.core import parallel_state as ps

    from .setup import unwrapped

    thinker = unwrapped(engine.model[0])
    layers = len(thinker.decoder.layers)
    audio_layers = 0 if thinker.audio_tower is None else engine.spec.audio.num_layers
    local = sum(p.numel() for m in engine.model for p in m.parameters())
    dp = ps.get_data_parallel_world_size() if engine.optim.use_distributed_optimizer else 1
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    free += torch.cuda.memory_reserved() - torch.cuda.memory_allocated()  # the caching allocator's idle blocks
    vocab_local = thinker.lm_head_weight().shape[0] if thinker.post_process else 0
    budget, line = auto_token_budget(engine.spec, free_bytes=free, layers=layers, audio_layers=audio_layers,
                                     adam_params=-(-local // dp), chunk_tokens=chunk_tokens, vocab_local=vocab_local,
                                     multiple=multiple)
    log.warning("%s", line)
    return budget


def common_token_budget(value, engine, *, chunk_tokens: int, multiple: int = 1) -> int:
    """:func:`resolve_token_budget` agreed by every rank: for ``"auto"`` the smallest of the ranks'
    budgets (one all-reduce; ranks differ in free memory and in the layers they hold)."""
    import torch
    import torch.distributed as dist

    budget = resolve_token_budget(value, engine, chunk_tokens=chunk_tokens, multiple=multiple)
    if value == "auto" and dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([budget], device="cuda" if torch.cuda.is_available() else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        budget = int(t.item())
    return budget
