"""What :mod:`launch.bench.layers` runs on: the batch's lengths, the geometry, useful FLOPs, the
model config, the targets, the token ids and the micro-batch packing."""
from __future__ import annotations

DEFAULT_LENGTHS = [2814, 1536, 376, 1902, 1108, 2290, 744, 1650, 980, 2047, 612, 1420, 1764, 1233, 858, 1466]
"""Tokens of the 16 trajectories of the default batch (sum 22,800); see :mod:`launch.bench.layers`."""
TARGET_VS_HF_BS1 = 1.8
TARGET_VS_CEILING = 0.85
TARGET_EP_VS_EP1 = 0.9
"""``--ep 2``: per-GPU useful tok/s at least this fraction of EP1's (the fast-path issue)."""
TARGET_EP_WIDE_VS_EP1 = 0.85
"""``--ep N`` with N >= 4: the scale-run issue's target (named for EP8; the same bar for EP4)."""


def ep_target(ep: int) -> float:
    """The per-GPU tok/s target of an EP-``ep`` run, as a fraction of EP1's."""
    return TARGET_EP_VS_EP1 if ep <= 2 else TARGET_EP_WIDE_VS_EP1


def lengths_for(total: int | None, base=DEFAULT_LENGTHS) -> list[int]:
    """The default lengths rescaled to about ``total`` tokens (each at least 16)."""
    if not total:
        return list(base)
    f = total / sum(base)
    return [max(16, int(round(n * f))) for n in base]


def geometry(layers: int, tiny: bool = False) -> dict:
    """The thinker's text geometry (or a tiny one for CPU smoke tests)."""
    if tiny:
        return dict(hidden=64, heads=4, kv_heads=2, head_dim=16, experts=8, topk=2, ffn=32, vocab=512,
                    layers=layers, mrope_section=[2, 3, 3])
    return dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, topk=8, ffn=768, vocab=152064,
                layers=layers, mrope_section=[24, 20, 20])


def useful_flops(lengths: list[int], g: dict) -> dict:
    """Forward FLOPs per layer by part, and the fwd+bwd total over all layers (:mod:`launch.bench.layers`)."""
    T = sum(lengths)
    h, q, kv, d, E, k, F = g["hidden"], g["heads"], g["kv_heads"], g["head_dim"], g["experts"], g["topk"], g["ffn"]
    dense = 2 * T * h * (q + 2 * kv) * d + 2 * T * (q * d) * h + 2 * T * h * E
    experts = 2 * T * k * (h * 2 * F + F * h)
    attn = sum(2 * q * d * L * (L + 1) for L in lengths)
    per_layer = {"dense": dense, "experts": experts, "attn": attn}
    return {"per_layer_fwd": per_layer, "total_fwd_bwd": 3 * g["layers"] * (dense + experts + attn)}


def omni_config(g: dict) -> dict:
    """config.json of a Qwen3-Omni checkpoint with this text geometry (audio tower unused)."""
    from launch.bench.convert import bench_config

    cfg = bench_config(g["layers"], audio_layers=1, vision_blocks=1)
    tc = cfg["thinker_config"]["text_config"]
    tc.update(hidden_size=g["hidden"], num_attention_heads=g["heads"], num_key_value_heads=g["kv_heads"],
              head_dim=g["head_dim"], num_experts=g["experts"], num_experts_per_tok=g["topk"],
              moe_intermediate_size=g["ffn"], intermediate_size=g["ffn"], vocab_size=g["vocab"],
              num_hidden_layers=g["layers"])
    tc["rope_parameters"]["mrope_section"] = list(g["mrope_section"])
    if "rope_scaling" in tc:
        tc["rope_scaling"]["mrope_section"] = list(g["mrope_section"])
    cfg["thinker_config"]["audio_config"]["output_dim"] = g["hidden"]
    return cfg


FIRST_SPECIAL_TOKEN = 151643
"""Ids from here on are Qwen's special tokens (audio/image placeholders among them): never drawn."""


def make_batch(lengths: list[int], vocab: int, hidden: int, device, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    hi = min(vocab, FIRST_SPECIAL_TOKEN)
    ids = [torch.randint(0, hi, (n,), generator=g) for n in lengths]
    probe = torch.randn(sum(lengths), hidden, generator=g)
    return [x.to(device) for x in ids], probe.to(device)


def pack_by_budget(lengths: list[int], budget: int | None) -> list[list[int]]:
    """Sample indices in micro-batches of at most ``budget`` tokens (first-fit decreasing; a longer
    sample gets its own); one micro-batch of everything when ``budget`` is None."""
    if not budget:
        return [list(range(len(lengths)))]
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        for b, r in enumerate(room):
            if lengths[i] <= r:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return [sorted(b) for b in bins]


def rank_lengths(lengths: list[int], rank: int, seed: int) -> list[int]:
    """Rank ``rank``'s samples in an ``--ep N`` run: the documented lengths in a seeded per-rank
    order (rank 0: as documented). Every GPU packs the same number of tokens from the same length
    distribution as the EP1 run (the same per-GPU micro-batch); token ids are drawn per rank."""
    if rank == 0:
        return list(lengths)
    import random

    order = list(range(len(lengths)))
    random.Random(seed * 7919 + rank).shuffle(order)
    return [lengths[i] for i in order]


def _base_lengths(tokens, tiny: bool) -> list[int]:
    """The batch's lengths: ``tokens`` as a list is the batch itself (``--lengths``), an int rescales
    the documented batch to about that many tokens (``--tokens``), None is the documented batch."""
    if isinstance(tokens, (list, tuple)):
        return [int(n) for n in tokens]
    if tiny and not tokens:
        return [max(8, n // 40) for n in DEFAULT_LENGTHS]
    return lengths_for(tokens)


_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
"""``--dtype`` spellings: the short ones and torch's (as model.dtype and ``mgrpo serve --dtype`` spell them)."""
