"""The kernel ceiling of :mod:`launch.bench.layers`: the essential kernels of each layer
micro-benchmarked on the same shapes."""
from __future__ import annotations

import math
import statistics

from launch.bench._layers_geometry import useful_flops
from launch.bench._layers_timing import _bench_fn, time_alternating


def kernel_ceiling(g: dict, lengths: list[int], counts_per_layer: list[list[int]], device, dtype,
                   paired_step=None, warmup: int = 3, iters: int = 6, back_to_back: bool = True) -> dict:
    """The essential kernels of each layer, fwd+bwd, on the same shapes (:mod:`launch.bench.layers`).

    Two measurements of the same kernels (the second only with ``back_to_back``):

    * ``total_s`` (the ceiling of the target, as the issue defines it) and ``layers``: each part
      (both grouped GEMMs with that layer's token counts, attention, the dense GEMMs)
      micro-benchmarked on its own (median of 10, each call timed alone: :func:`_bench_fn`),
      summed over the layers.
    * ``back_to_back_s``: the stricter **ceiling step**, every layer's parts back to back in one
      timed call (no host gaps between the parts), median of ``iters`` after ``warmup``. With
      ``paired_step`` (our step) the two take turns, one of each per round
      (:func:`time_alternating`), so both run in the same GPU state (an H200 at its power limit
      lowers its clocks under back-to-back work: 1.71-1.79 GHz during our steps, 1.97 GHz after
      0.3 s idle); ``paired_step_s`` holds our step's times from those rounds.
    """
    import torch
    import torch.nn.functional as F

    if device.type != "cuda":
        return {"note": "kernel ceiling needs CUDA (varlen_attn)"}
    from torch.nn.attention.varlen import varlen_attn

    from model_bridge.modeling.attention import varlen_kwargs

    h, q, kv, d, E, F_ = g["hidden"], g["heads"], g["kv_heads"], g["head_dim"], g["experts"], g["ffn"]
    T = sum(lengths)
    gen = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, grad=True, scale=1.0):
        t = (torch.randn(*shape, device=device, dtype=torch.float32, generator=gen) * scale).to(dtype)
        return t.requires_grad_(grad)

    out = {"layers": []}
    # experts: both grouped GEMMs, forward + backward (dX, dW), per layer's token counts (every
    # layer routes the same N = T * k rows, so the operands are shared; the offsets are per layer)
    w1, w2 = rnd(E, 2 * F_, h, scale=0.02), rnd(E, h, F_, scale=0.02)
    N = sum(counts_per_layer[0])
    x, a = rnd(N, h), rnd(N, F_)
    g1, g2 = rnd(N, 2 * F_, grad=False), rnd(N, h, grad=False)
    offs_per_layer = [torch.tensor(c, device=device).cumsum(0).to(torch.int32) for c in counts_per_layer]
    if any(sum(c) != N for c in counts_per_layer):
        raise ValueError(f"every layer must route the same number of rows, got {[sum(c) for c in counts_per_layer]}")

    def gmm(offs):
        y1 = F.grouped_mm(x, w1.transpose(-2, -1), offs=offs)
        y2 = F.grouped_mm(a, w2.transpose(-2, -1), offs=offs)
        torch.autograd.backward([y1, y2], [g1, g2])
        x.grad = a.grad = w1.grad = w2.grad = None

    # attention
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=device)
    qq, kk, vv = rnd(T, q, d), rnd(T, kv, d), rnd(T, kv, d)
    go = rnd(T, q, d, grad=False)
    kw = varlen_kwargs(qq, kk, causal=True, scale=1.0 / math.sqrt(d))  # the model's own arguments

    def attn():
        o = varlen_attn(qq, kk, vv, cu, cu, max(lengths), max(lengths), **kw)
        o.backward(go)
        qq.grad = kk.grad = vv.grad = None

    # dense GEMMs: qkv, output projection, router (all bf16)
    xh, xo = rnd(T, h), rnd(T, q * d)
    wqkv, wo, wr = rnd((q + 2 * kv) * d, h, scale=0.02), rnd(h, q * d, scale=0.02), rnd(E, h, scale=0.02)
    gq, go2, gr = rnd(T, (q + 2 * kv) * d, grad=False), rnd(T, h, grad=False), rnd(T, E, grad=False)

    def dense():
        torch.autograd.backward([xh @ wqkv.t(), xo @ wo.t(), xh @ wr.t()], [gq, go2, gr])
        xh.grad = xo.grad = wqkv.grad = wo.grad = wr.grad = None

    def ceiling_step():
        for offs in offs_per_layer:
            gmm(offs)
            attn()
            dense()

    # the parts, each micro-benchmarked alone
    gmm_times = [_bench_fn(lambda offs=offs: gmm(offs), device) for offs in offs_per_layer]
    t_attn, t_dense = _bench_fn(attn, device), _bench_fn(dense, device)
    fl = useful_flops(lengths, g)["per_layer_fwd"]
    for t_gmm in gmm_times:
        out["layers"].append({"grouped_mm_s": t_gmm, "varlen_attn_s": t_attn, "dense_s": t_dense,
                              "grouped_mm_tflops": 3 * fl["experts"] / t_gmm / 1e12,
                              "varlen_attn_tflops": 3 * fl["attn"] / t_attn / 1e12,
                              "dense_tflops": 3 * fl["dense"] / t_dense / 1e12})
    out["total_s"] = sum(x["grouped_mm_s"] + x["varlen_attn_s"] + x["dense_s"] for x in out["layers"])
    if not back_to_back:
        return out
    # the ceiling step, taking turns with ours
    fns = [ceiling_step] + ([paired_step] if paired_step is not None else [])
    times = time_alternating(fns, device, warmup, iters)
    out["back_to_back_s"] = times[0]
    out["back_to_back_s_median"] = statistics.median(times[0])
    if paired_step is not None:
        out["paired_step_s"] = times[1]
        out["paired_step_s_median"] = statistics.median(times[1])
    return out


def micro_batch_shapes(lengths: list[int], groups: list[list[int]], counts: list[list[int]],
                       layers: int) -> list[tuple[list[int], list[list[int]]]]:
    """Per micro-batch: its samples' lengths and its layers' expert counts. ``groups``: sample
    indices per micro-batch; ``counts``: the expert counts of every forward call of the experts in
    the order they ran (micro-batch 0's layers, then micro-batch 1's, ...)."""
    if len(counts) != len(groups) * layers:
        raise ValueError(f"expected the expert counts of {len(groups)} micro-batch(es) x {layers} layer(s) = "
                         f"{len(groups) * layers} expert calls, got {len(counts)} (a system that recomputes "
                         "the experts in its backward calls them twice: capture the counts of one without)")
    return [([lengths[i] for i in grp], counts[k * layers:(k + 1) * layers]) for k, grp in enumerate(groups)]


def micro_batch_ceiling(g: dict, lengths: list[int], groups: list[list[int]], counts: list[list[int]],
                        device, dtype) -> dict:
    """:func:`kernel_ceiling`'s parts (each timed alone) at each micro-batch's own shapes, summed:
    what the same kernels need when the batch is cut into ``groups`` (each micro-batch's grouped
    GEMMs write every expert's weight gradient again; ~256 rows per expert at 4,096 tokens). Its
    ratio to the whole batch's ceiling is the most a micro-batched step can reach of that ceiling
    with these kernels."""
    shapes = micro_batch_shapes(lengths, groups, counts, g["layers"])
    if device.type != "cuda":
        return {"note": "kernel ceiling needs CUDA (varlen_attn)"}
    per = [kernel_ceiling(g, lens, c, device, dtype, back_to_back=False) for lens, c in shapes]
    return {"total_s": sum(p["total_s"] for p in per),
            "micro_batches": [{"tokens": sum(lens), "total_s": p["total_s"], "layers": p["layers"]}
                              for (lens, _), p in zip(shapes, per)]}
