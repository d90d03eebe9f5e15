"""``mgrpo bench layers``: N full-width Qwen3-Omni thinker layers, fwd+bwd bf16, ours vs HF vs megatron local.

What runs (one process, one GPU; all systems get the same weights and the same tokens):

* **ours**: :func:`model_bridge.modeling.thinker.build_thinker` with the ``"torch"`` layer-spec
  backend (varlen attention without host syncs, grouped-GEMM experts, sort-based token permutation),
  the whole batch packed into one THD micro-batch;
* **ours_mb**: the same, the batch packed into micro-batches of at most ``--mb-tokens`` tokens
  (first-fit decreasing, gradients accumulated): less activation memory for some throughput;
* **hf_bs1**: transformers' ``Qwen3OmniMoeThinkerTextModel`` (sdpa attention, ``grouped_mm``
  experts), one sample at a time (what users with batch size 1 run), gradients accumulated;
* **hf_bs4**: the same model on right-padded batches of 4 samples (in batch order);
* **mcore_local**: our ``"local"`` backend: megatron-core's local spec (``SequentialMLP``, a
  per-expert loop) with our packed core attention, packed like ours;
* **kernel ceiling**: ``F.grouped_mm`` (both expert GEMMs, forward and backward, with the token
  counts per expert that ours saw in each layer), ``varlen_attn`` (causal GQA, the batch's
  ``cu_seqlens``) and the dense GEMMs (qkv, output projection, router) micro-benchmarked in the
  same run on the same shapes. Their summed time is what the layers would take if they did
  nothing but these kernels; ``ours / ceiling`` is ceiling time over our time.

Geometry: Qwen3-Omni-30B-A3B's thinker (hidden 2048, 32 query / 4 KV heads of 128, 128 experts
top-8 of width 768, vocab 152064, RMSNorm eps 1e-6, interleaved MRoPE) with ``--layers`` layers;
token embedding in front, the final RMSNorm behind (no LM head); the loss is
``sum(final_hidden * R)`` with a fixed random ``R`` over real tokens (the same for every system).
Router aux loss as in training (megatron: coefficient 0.001).

Batch (``DEFAULT_LENGTHS``, documented): 16 multi-turn audio-agent trajectories of 376-2,814
tokens, 22,800 in all: each is a prompt with a 30-200 s recording (13 audio tokens per second),
one to three ``crop_audio`` tool turns returning 5-30 s clips, and short assistant turns. Token ids
are random (routing is what matters for speed; weights are random N(0, 0.02) with HF's init).
``--tokens T`` rescales the lengths to about T tokens in all.

Useful FLOPs (fwd+bwd = 3 x forward; padding, recomputation, norms, RoPE, embedding and the
router's softmax not counted), per layer over the real tokens ``T`` and samples of length ``L_i``:

    dense   = 2 T h (q + 2 kv) d  +  2 T (q d) h  +  2 T h E          (qkv, output proj, router)
    experts = 2 T k (h * 2F + F * h)                                   (gate/up and down GEMMs)
    attn    = sum_i 2 q d L_i (L_i + 1)                                (QK^T and PV, causal half)

with h=2048, q=32, kv=4, d=128, E=128, k=8, F=768. TFLOP/s = 3 (dense + experts + attn) N / time.
tok/s counts real tokens only.

Outputs under ``--out``: ``bench_layers.json`` (every number, the environment, the commands),
``bench_layers.png`` (tok/s, TFLOP/s with the ceiling, peak memory), ``bench_layers_profile.txt``
(torch profiler table of one step of ours, where the time goes).

Targets: ours >= 1.8x HF bs1 useful tok/s, >= 85% of the kernel ceiling, peak memory <= HF's.

``--ep N`` > 1 (ours only) runs twice in one invocation: first an **EP1 baseline** (one process
on GPU 0, all experts, rank 0's micro-batch), then **EP-N**: N processes (``run_ranks``, rank r on
GPU r, NCCL; gloo with ``--device cpu``), each holding ``E / N`` experts (megatron's all-to-all
token dispatcher), each with its own micro-batch of the *same size* as the EP1 one (the documented
lengths in a per-rank seeded order, token ids drawn per rank: :func:`rank_lengths`). Reported per
rank: tok/s and useful TFLOP/s per GPU, step time, peak memory, and the ratio to the EP1 baseline
(target: per-GPU tok/s >= ``TARGET_EP_VS_EP1`` = 0.9x EP1). A numerical check rides along: the
EP1 baseline also evaluates the loss on every EP rank's micro-batch, and each EP rank's loss on its
own micro-batch must equal it (``per_rank[r].loss_rel_diff``, relative to ``sum |out * R|``): the
sharded experts are the same experts. Every rank prints rank-prefixed, flushed progress lines;
each phase (init, build, steps, ...) is armed on a ``megatron_grpo.guard.Watchdog``
(``--hang-timeout``, default 300 s) that dumps the stuck rank's stacks into ``--out`` and ends it,
whereupon ``run_ranks`` stops the others; the process-group timeout is a little longer than that.
Profiles of EP runs go to ``bench_layers_ep{N}_profile_rank{r}.txt`` (one per rank).

``--tiny`` shrinks the geometry so the whole benchmark runs on a CPU (a smoke test of this script:
kernel ceilings and timings are then meaningless); ``--tiny --device cpu --ep 2 --dtype fp32`` is
the EP path on gloo that ``tests/launch/test_bench_layers_ep.py`` checks.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

__all__ = ["DEFAULT_LENGTHS", "lengths_for", "rank_lengths", "geometry", "useful_flops", "probe_losses", "run_bench",
           "add_parser"]

DEFAULT_LENGTHS = [2814, 1536, 376, 1902, 1108, 2290, 744, 1650, 980, 2047, 612, 1420, 1764, 1233, 858, 1466]
"""Tokens of the 16 trajectories of the default batch (sum 22,800); see the module docstring."""
TARGET_VS_HF_BS1 = 1.8
TARGET_VS_CEILING = 0.85
TARGET_EP_VS_EP1 = 0.9
"""``--ep N``: per-GPU useful tok/s at least this fraction of EP1's."""


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
    """Forward FLOPs per layer by part, and the fwd+bwd total over all layers (module docstring)."""
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


# ------------------------------------------------------------------------------------------------
# timing helpers
# ------------------------------------------------------------------------------------------------

class _Timer:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        import torch

        if self.cuda:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import torch

        if self.cuda:
            self.b.record()
            torch.cuda.synchronize()
            self.s = self.a.elapsed_time(self.b) / 1e3
        else:
            self.s = time.perf_counter() - self.t0


def _time_steps(step, device, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        step()
    out = []
    for _ in range(iters):
        with _Timer(device) as t:
            step()
        out.append(t.s)
    return out


def _mem_reset(device):
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


# ------------------------------------------------------------------------------------------------
# weights: one HF model, copied into the others
# ------------------------------------------------------------------------------------------------

def _hf_classes():
    import transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe as m

    model_cls = m.Qwen3OmniMoeThinkerTextModel
    return model_cls.config_class, model_cls


def build_hf(cfg: dict, device, dtype, seed: int):
    """(HF text model, which attention / experts implementation it runs)."""
    import torch

    cfg_cls, model_cls = _hf_classes()
    tc = dict(cfg["thinker_config"]["text_config"])
    tc.pop("model_type", None)
    hf_cfg = cfg_cls(**tc)
    torch.manual_seed(seed)
    impl = {}
    for kw in ({"attn_implementation": "sdpa", "experts_implementation": "grouped_mm"},
               {"attn_implementation": "sdpa"}):
        try:
            with torch.device(device):
                model = model_cls._from_config(hf_cfg, dtype=dtype, **kw)
            break
        except (TypeError, ValueError) as e:  # an older transformers without experts_implementation
            impl["note"] = f"{type(e).__name__}: {e}"
    c = model.config
    impl["attn_implementation"] = getattr(c, "_attn_implementation", None)
    impl["experts_implementation"] = getattr(c, "_experts_implementation", None)
    return model.train(), impl


def hf_state_as_checkpoint(model, hidden: int, ffn: int) -> dict:
    """The HF text model's tensors (CPU) under the checkpoint's per-expert names (``thinker.model.*``).

    transformers 5.x holds a layer's experts fused: ``gate_up_proj [E, 2F, h]`` (gate rows first)
    and ``down_proj [E, h, F]``; a transposed layout (``[E, h, 2F]`` / ``[E, F, h]``) is recognised by
    its shape."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu")
        if name.endswith("mlp.experts.gate_up_proj"):
            if tuple(t.shape[1:]) == (hidden, 2 * ffn) and hidden != 2 * ffn:
                t = t.transpose(1, 2)
            base = "thinker.model." + name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :ffn].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, ffn:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            if tuple(t.shape[1:]) == (ffn, hidden) and ffn != hidden:
                t = t.transpose(1, 2)
            base = "thinker.model." + name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out["thinker.model." + name] = t
    return out


def build_megatron(spec, ep: int, backend: str, dtype, device, tensors: dict):
    """Our thinker (embedding + decoder, no output layer, no audio tower) with ``tensors``' weights."""
    import torch

    from model_bridge.config import ParallelLayout
    from model_bridge.mappings import DictSource, ParallelContext, build_tasks
    from model_bridge.modeling.thinker import build_thinker
    from model_bridge.qwen3_omni import mapping_rules

    on_cuda = device.type == "cuda"
    model = build_thinker(spec, ParallelLayout(ep=ep), dtype, post_process=False, backend=backend,
                          dummy_audio=False, build_audio=False, perform_initialization=False,
                          use_cpu_initialization=not on_cuda)
    model = model.to(device)
    src = DictSource(tensors)
    ctx = ParallelContext.from_parallel_state()
    with torch.no_grad():
        for t in build_tasks(model, mapping_rules(spec, 1), ctx):
            t.param.data.copy_(t.mapping.load(src, t.hf, t.param.shape, t.shard).to(device, t.param.dtype))
    return model.train()


# ------------------------------------------------------------------------------------------------
# the systems
# ------------------------------------------------------------------------------------------------

def _rms_norm(x, w, eps: float = 1e-6):
    import torch

    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


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


def _micro_batches(spec, ids: list, probe, device, groups: list[list[int]] | None = None) -> list[tuple]:
    """``(sample indices, lengths, cu_seqlens, tokens [1, T], MRoPE positions, probe rows)`` per
    micro-batch (``groups``: sample indices per micro-batch; default one micro-batch of all)."""
    import torch

    from model_bridge.modeling.thinker import mrope_position_ids

    lens_all = [int(x.numel()) for x in ids]
    starts = [0] + list(torch.tensor(lens_all).cumsum(0).tolist())
    mbs = []
    for grp in groups or [list(range(len(ids)))]:
        lens = [lens_all[i] for i in grp]
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
        tokens = torch.cat([ids[i] for i in grp]).unsqueeze(0)
        pos = mrope_position_ids(tokens, spec, cu_seqlens=cu.cpu()).unsqueeze(1).to(device)
        pr = torch.cat([probe[starts[i]:starts[i + 1]] for i in grp])
        mbs.append((grp, lens, cu, tokens, pos, pr))
    return mbs


def _forward_mb(model, mb: tuple, norm_w):
    """Final-normed hidden states ``[T, h]`` of one micro-batch from :func:`_micro_batches`."""
    from megatron.core.packed_seq_params import PackedSeqParams

    _, lens, cu, tokens, pos, _ = mb
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                          max_seqlen_kv=max(lens))
    hidden = model(tokens, pos, psp)  # [T, 1, h]
    return _rms_norm(hidden[:, 0], norm_w)


def probe_losses(model, spec, ids: list, probe, norm_w, device) -> dict:
    """Forward only (training mode, no grad) of the whole batch as one micro-batch: the bench's loss
    ``sum(out * R)``, its scale ``sum(|out * R|)`` and ``sum(out^2)`` (fp32 sums, Python floats).
    The EP-N run compares these per rank with the EP1 model's on the same tokens."""
    import torch

    (mb,) = _micro_batches(spec, ids, probe, device)
    with torch.no_grad():
        out = _forward_mb(model, mb, norm_w).float()
        lo = out * mb[5].float()
        return {"loss": lo.sum().item(), "loss_scale": lo.abs().sum().item(), "sumsq": out.pow(2).sum().item()}


def run_ours(model, spec, ids: list, probe, norm_w, device, warmup: int, iters: int, profile_path=None,
             capture_counts: bool = False, groups: list[list[int]] | None = None, barrier=None) -> dict:
    """fwd+bwd of the packed batch (``groups``: micro-batches of sample indices, grads accumulated).

    Every rank of an EP run must call this with the same arguments apart from the data (same
    warmup/iters, ``profile_path`` given on all ranks or on none): each step is collective.
    ``barrier`` (a callable) lines the ranks up before the timed steps."""
    import torch

    mbs = _micro_batches(spec, ids, probe, device, groups)
    counts = []
    hooks = []
    if capture_counts:
        from model_bridge.modeling.experts import TorchGroupedMLP

        def hook(mod, args):
            counts.append([int(v) for v in torch.as_tensor(args[1]).tolist()])

        for m in model.modules():
            if isinstance(m, TorchGroupedMLP):
                hooks.append(m.register_forward_pre_hook(hook))

    def step(keep=False):
        model.zero_grad(set_to_none=True)
        norm_w.grad = None
        outs = {}
        for grp, lens, cu, tokens, pos, pr in mbs:
            out = _forward_mb(model, (grp, lens, cu, tokens, pos, pr), norm_w)
            (out.float() * pr).sum().backward()
            if keep:
                off = 0
                for i, n in zip(grp, lens):
                    outs[i] = out[off:off + n].detach()
                    off += n
        return torch.cat([outs[i] for i in range(len(ids))]) if keep else None

    first = step(keep=True)
    for h in hooks:
        h.remove()
    if barrier is not None:
        barrier()
    times = _time_steps(step, device, warmup, iters)
    res = {"step_s": times, "output": first, "expert_counts": counts,
           "micro_batch_tokens": [sum(m[1]) for m in mbs]}
    if profile_path is not None and device.type == "cuda":
        res["profile"] = _profile(step, profile_path)
        res["host_syncs"] = _count_syncs(step)
    return res


def _count_syncs(step) -> dict:
    """Synchronizing CUDA calls in one step (torch's sync debug mode), by the Python line that made them."""
    import collections
    import warnings

    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    where = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                                if "synchroniz" in str(w.message))
    return {"total": sum(where.values()), "by_line": dict(where.most_common(12))}


def _profile(step, path) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    try:
        table = ka.table(sort_by="device_time_total", row_limit=45, max_name_column_width=70)
    except Exception:  # noqa: BLE001 - older torch: the CUDA column's old name
        table = ka.table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=70)
    Path(path).write_text(table + "\n")
    return table


def run_hf(model, ids: list, probe, device, batch: int, warmup: int, iters: int, keep_output: bool) -> dict:
    import torch

    lens = [int(x.numel()) for x in ids]
    starts = [0] + list(torch.tensor(lens).cumsum(0).tolist())
    groups = [list(range(i, min(i + batch, len(ids)))) for i in range(0, len(ids), batch)]
    padded = 0
    for grp in groups:
        padded += max(lens[i] for i in grp) * len(grp)

    def step(keep=False):
        model.zero_grad(set_to_none=True)
        outs = {}
        for grp in groups:
            L = max(lens[i] for i in grp)
            inp = torch.zeros(len(grp), L, dtype=torch.long, device=device)
            mask = torch.zeros(len(grp), L, dtype=torch.long, device=device)
            pr = torch.zeros(len(grp), L, probe.shape[1], device=device)
            for j, i in enumerate(grp):
                inp[j, :lens[i]] = ids[i]
                mask[j, :lens[i]] = 1
                pr[j, :lens[i]] = probe[starts[i]:starts[i + 1]]
            kw = {} if len(grp) == 1 else {"attention_mask": mask}
            out = model(input_ids=inp, use_cache=False, **kw).last_hidden_state
            (out.float() * pr).sum().backward()
            if keep:
                for j, i in enumerate(grp):
                    outs[i] = out[j, :lens[i]].detach()
        return outs

    first = step(keep=keep_output)
    times = _time_steps(step, device, warmup, iters)
    return {"step_s": times, "output": torch.cat([first[i] for i in range(len(ids))]) if keep_output else None,
            "padded_tokens": padded}


# ------------------------------------------------------------------------------------------------
# kernel ceiling
# ------------------------------------------------------------------------------------------------

def _bench_fn(fn, device, warmup=3, iters=10) -> float:
    return statistics.median(_time_steps(fn, device, warmup, iters))


def kernel_ceiling(g: dict, lengths: list[int], counts_per_layer: list[list[int]], device, dtype) -> dict:
    """Median fwd+bwd time of the essential kernels of each layer (module docstring)."""
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
    # experts: both grouped GEMMs, forward + backward (dX, dW), per layer's token counts
    w1, w2 = rnd(E, 2 * F_, h, scale=0.02), rnd(E, h, F_, scale=0.02)
    gmm_times = []
    for counts in counts_per_layer:
        N = sum(counts)
        x, a = rnd(N, h), rnd(N, F_)
        offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
        g1, g2 = rnd(N, 2 * F_, grad=False), rnd(N, h, grad=False)

        def gmm():
            y1 = F.grouped_mm(x, w1.transpose(-2, -1), offs=offs)
            y2 = F.grouped_mm(a, w2.transpose(-2, -1), offs=offs)
            torch.autograd.backward([y1, y2], [g1, g2])
            x.grad = a.grad = w1.grad = w2.grad = None

        gmm_times.append(_bench_fn(gmm, device))
        del x, a, g1, g2
    # attention
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=device)
    qq, kk, vv = rnd(T, q, d), rnd(T, kv, d), rnd(T, kv, d)
    go = rnd(T, q, d, grad=False)
    kw = varlen_kwargs(qq, kk, causal=True, scale=1.0 / math.sqrt(d))  # the model's own arguments

    def attn():
        o = varlen_attn(qq, kk, vv, cu, cu, max(lengths), max(lengths), **kw)
        o.backward(go)
        qq.grad = kk.grad = vv.grad = None

    t_attn = _bench_fn(attn, device)
    del qq, kk, vv, go
    # dense GEMMs: qkv, output projection, router (all bf16)
    xh, xo = rnd(T, h), rnd(T, q * d)
    wqkv, wo, wr = rnd((q + 2 * kv) * d, h, scale=0.02), rnd(h, q * d, scale=0.02), rnd(E, h, scale=0.02)
    gq, go2, gr = rnd(T, (q + 2 * kv) * d, grad=False), rnd(T, h, grad=False), rnd(T, E, grad=False)

    def dense():
        torch.autograd.backward([xh @ wqkv.t(), xo @ wo.t(), xh @ wr.t()], [gq, go2, gr])
        xh.grad = xo.grad = wqkv.grad = wo.grad = wr.grad = None

    t_dense = _bench_fn(dense, device)
    fl = useful_flops(lengths, g)["per_layer_fwd"]
    for i, t_gmm in enumerate(gmm_times):
        out["layers"].append({"grouped_mm_s": t_gmm, "varlen_attn_s": t_attn, "dense_s": t_dense,
                              "grouped_mm_tflops": 3 * fl["experts"] / t_gmm / 1e12,
                              "varlen_attn_tflops": 3 * fl["attn"] / t_attn / 1e12,
                              "dense_tflops": 3 * fl["dense"] / t_dense / 1e12})
    out["total_s"] = sum(x["grouped_mm_s"] + x["varlen_attn_s"] + x["dense_s"] for x in out["layers"])
    return out


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------

def _summary(name: str, step_s: list[float], tokens: int, flops: int, peak, extra=None) -> dict:
    med = statistics.median(step_s)
    d = {"system": name, "step_s_median": med, "step_s": step_s, "useful_tokens": tokens,
         "tok_per_s": tokens / med, "useful_tflops": flops / med / 1e12, "peak_mem_gib": peak}
    if extra:
        d.update(extra)
    return d


def _env(device) -> dict:
    import torch

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__, "host": platform.node()}
    for name, mod in (("transformers", "transformers"), ("megatron_core", "megatron.core")):
        try:
            env[name] = __import__(mod, fromlist=["__version__"]).__version__
        except Exception:  # noqa: BLE001
            env[name] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env


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


def _base_lengths(tokens: int | None, tiny: bool) -> list[int]:
    if tiny and not tokens:
        return [max(8, n // 40) for n in DEFAULT_LENGTHS]
    return lengths_for(tokens)


_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def _logger(tag: str, rank: int):
    """Progress lines from every rank, rank-prefixed and flushed at once (a silent rank is a hang)."""
    prefix = f"[bench layers{' ' + tag if tag else ''} rank {rank}]"

    def log(msg: str) -> None:
        print(f"{prefix} {msg}", flush=True)

    return log


def _pg_timeout_minutes(hang_timeout_s: float) -> int:
    """Process-group (NCCL/gloo) timeout: longer than the watchdog's, so the watchdog names the stuck
    phase first (guard.py)."""
    return int(math.ceil(hang_timeout_s / 60.0)) + 2


def _rank_main(out_dir: str, layers: int, tokens, ep: int, tiny: bool, systems: list[str], warmup: int,
               iters: int, seed: int, device_name: str, mb_tokens: int | None = None, dtype_name: str = "bf16",
               loss_batches: int = 0, hang_timeout_s: float = 300.0, ceiling: bool = True, tag: str = "") -> dict:
    """One rank of one run (``ep`` ranks; rank r on GPU r). Every rank executes the same sequence of
    collective steps whatever its data: nothing below is conditional on the rank except logging
    and the kernel ceiling (which runs only in single-rank runs). Each phase is armed on a
    :class:`megatron_grpo.guard.Watchdog`: a phase that runs past ``hang_timeout_s`` dumps this
    rank's stacks (``hang-rank{R}-step{S}.txt`` under ``out_dir`` and stderr) and exits, and
    ``run_ranks`` then stops the other ranks. ``loss_batches`` > 0 (the EP1 baseline of an EP run):
    also return :func:`probe_losses` on the micro-batches of ranks 0..loss_batches-1."""
    import torch

    from megatron_grpo.guard import Watchdog

    rank = int(os.environ.get("RANK", "0"))
    log = _logger(tag, rank)
    out = Path(out_dir)
    wd = Watchdog(hang_timeout_s, out, rank=rank, first_step_timeout_s=hang_timeout_s)
    phase = iter(range(1000))
    with wd:
        with wd.step(next(phase), what="init_process_group + megatron parallel state"), wd.collective("init"):
            log(f"pid {os.getpid()}: init {'nccl' if device_name == 'cuda' else 'gloo'} process group "
                f"(world {ep}) and megatron parallel state")
            from model_bridge.parallel import init_parallel

            init_parallel(ep=ep, seed=seed, timeout_minutes=_pg_timeout_minutes(hang_timeout_s))
        return _rank_run(out, layers, tokens, ep, tiny, systems, warmup, iters, seed, device_name, mb_tokens,
                         getattr(torch, _DTYPES[dtype_name]), loss_batches, ceiling, log, wd, phase)


def _rank_run(out: Path, layers, tokens, ep, tiny, systems, warmup, iters, seed, device_name, mb_tokens, dtype,
              loss_batches, ceiling, log, wd, phase) -> dict:
    import contextlib

    import torch
    import torch.distributed as dist

    from model_bridge.config import parse_omni_config
    from model_bridge.parallel import destroy_parallel

    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if device_name == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    def armed(what: str):
        stack = contextlib.ExitStack()
        stack.enter_context(wd.step(next(phase), what=what))
        stack.enter_context(wd.collective(what))
        return stack

    g = geometry(layers, tiny)
    base_lengths = _base_lengths(tokens, tiny)
    lengths = rank_lengths(base_lengths, rank, seed)
    cfg = omni_config(g)
    spec = parse_omni_config(cfg, where="bench")
    T = sum(lengths)
    fl = useful_flops(lengths, g)
    ids, probe = make_batch(lengths, g["vocab"], g["hidden"], device, seed + 1 + rank)
    res = {"geometry": g, "lengths": lengths, "tokens": T, "flops": fl, "ep": ep, "rank": rank,
           "local_experts": g["experts"] // ep, "env": _env(device), "systems": {}, "dtype": str(dtype).split(".")[-1]}
    log(f"{layers} layers, {len(lengths)} samples, {T} tokens on this rank, ep={ep} ({g['experts'] // ep} of "
        f"{g['experts']} experts here), {fl['total_fwd_bwd'] / 1e12:.2f} useful TFLOP per step, "
        f"device {res['env'].get('gpu', device)}")

    # one set of weights: an HF model (its own init, same seed on every rank), copied into the megatron models
    with armed("build HF weights"):
        t0 = time.perf_counter()
        _mem_reset(device)
        hf, impl = build_hf(cfg, device, dtype, seed)
        res["hf_impl"] = impl
        tensors = hf_state_as_checkpoint(hf, g["hidden"], g["ffn"])
        norm_w = hf.norm.weight.detach().clone().requires_grad_()
        log(f"HF model built ({impl}) in {time.perf_counter() - t0:.1f} s")
    hf_out = None
    if ep == 1:
        for name, bs in (("hf_bs1", 1), ("hf_bs4", 4)):
            if name not in systems:
                continue
            with armed(f"{name} steps"):
                _mem_reset(device)
                r = run_hf(hf, ids, probe, device, bs, warmup, iters, keep_output=(bs == 1))
            if bs == 1:
                hf_out = r["output"]
            res["systems"][name] = _summary(name, r["step_s"], T, fl["total_fwd_bwd"], _peak_gib(device),
                                            {"padded_tokens": r["padded_tokens"], **impl})
            s = res["systems"][name]
            log(f"{name}: {s['tok_per_s']:.0f} tok/s, {s['useful_tflops']:.1f} TFLOP/s, peak {s['peak_mem_gib']}")
    del hf
    counts = None
    for name, backend, budget in (("ours", "torch", None), ("ours_mb", "torch", mb_tokens),
                                  ("mcore_local", "local", None)):
        if name not in systems or (ep > 1 and name != "ours"):
            continue
        with armed(f"build {name}"):
            _mem_reset(device)
            model = build_megatron(spec, ep, backend, dtype, device, tensors)
            log(f"{name}: megatron model built ({backend} backend)")
        n_it = iters if backend == "torch" else max(2, iters // 3)
        profile = None
        if name == "ours":
            profile = out / (f"bench_layers_ep{ep}_profile_rank{rank}.txt" if ep > 1 else "bench_layers_profile.txt")
        with armed(f"{name}: first step, {warmup} warm-up and {n_it} timed fwd+bwd steps"
                   + (", profile" if profile is not None and device.type == "cuda" else "")):
            r = run_ours(model, spec, ids, probe, norm_w, device, warmup if backend == "torch" else 1, n_it,
                         profile_path=profile, capture_counts=(name == "ours"), groups=pack_by_budget(lengths, budget),
                         barrier=dist.barrier if ep > 1 else None)
        peak = _peak_gib(device)
        extra = {"backend": backend, "micro_batch_tokens": r["micro_batch_tokens"]}
        if hf_out is not None:
            ref = hf_out.float()
            extra["rel_diff_vs_hf_bs1"] = ((r["output"].float() - ref).norm() / ref.norm()).item()
        if name == "ours":
            counts = r["expert_counts"]
            extra["host_syncs_per_step"] = r.get("host_syncs")
            extra["expert_tokens_per_layer_min_max"] = [[min(c), max(c)] for c in counts]
            if ep > 1:
                extra["local_experts"] = g["experts"] // ep
            if ep > 1 or loss_batches:
                # EP-N: this rank's micro-batch; the EP1 baseline: the micro-batch of each EP-N rank
                batches = [(ids, probe)] + [make_batch(rank_lengths(base_lengths, b, seed), g["vocab"], g["hidden"],
                                                       device, seed + 1 + b) for b in range(1, loss_batches)]
                with armed(f"probe losses on {len(batches)} micro-batch(es)"):
                    res["losses"] = [probe_losses(model, spec, bi, bp, norm_w, device) for bi, bp in batches]
                log(f"probe losses {[x['loss'] for x in res['losses']]}")
        res["systems"][name] = _summary(name, r["step_s"], T, fl["total_fwd_bwd"], peak, extra)
        s = res["systems"][name]
        log(f"{name}: {s['tok_per_s']:.0f} tok/s, {s['useful_tflops']:.1f} TFLOP/s, step "
            f"{s['step_s_median'] * 1e3:.1f} ms, peak {peak} GiB, micro-batches {r['micro_batch_tokens']}, "
            f"rel diff vs HF {extra.get('rel_diff_vs_hf_bs1')}"
            + (f", host syncs/step {extra['host_syncs_per_step']['total']}" if extra.get("host_syncs_per_step") else ""))
        del model, r
    _mem_reset(device)
    if ceiling and counts and dist.get_world_size() == 1:
        with armed("kernel ceiling"):
            ceil = kernel_ceiling(g, lengths, counts, device, dtype)
        res["kernel_ceiling"] = ceil
        if "total_s" in ceil:
            res["kernel_ceiling"]["useful_tflops"] = fl["total_fwd_bwd"] / ceil["total_s"] / 1e12
            res["kernel_ceiling"]["tok_per_s"] = T / ceil["total_s"]
    res["ratios"] = _ratios(res)
    with armed("destroy process group"):
        if dist.get_world_size() > 1:
            dist.barrier()
        destroy_parallel()
    log("done")
    return res


def _ratios(res: dict) -> dict:
    s = res["systems"]
    r = {}
    if "ours" in s:
        if "hf_bs1" in s:
            r["ours_vs_hf_bs1_tok_s"] = s["ours"]["tok_per_s"] / s["hf_bs1"]["tok_per_s"]
            if s["ours"]["peak_mem_gib"] and s["hf_bs1"]["peak_mem_gib"]:
                r["ours_vs_hf_bs1_peak_mem"] = s["ours"]["peak_mem_gib"] / s["hf_bs1"]["peak_mem_gib"]
        if "hf_bs4" in s:
            r["ours_vs_hf_bs4_tok_s"] = s["ours"]["tok_per_s"] / s["hf_bs4"]["tok_per_s"]
            if s["ours"]["peak_mem_gib"] and s["hf_bs4"]["peak_mem_gib"]:
                r["ours_vs_hf_bs4_peak_mem"] = s["ours"]["peak_mem_gib"] / s["hf_bs4"]["peak_mem_gib"]
        if "ours_mb" in s:
            for ref in ("hf_bs1", "hf_bs4"):
                if ref in s:
                    r[f"ours_mb_vs_{ref}_tok_s"] = s["ours_mb"]["tok_per_s"] / s[ref]["tok_per_s"]
                    if s["ours_mb"]["peak_mem_gib"] and s[ref]["peak_mem_gib"]:
                        r[f"ours_mb_vs_{ref}_peak_mem"] = s["ours_mb"]["peak_mem_gib"] / s[ref]["peak_mem_gib"]
        if "mcore_local" in s:
            r["ours_vs_mcore_local_tok_s"] = s["ours"]["tok_per_s"] / s["mcore_local"]["tok_per_s"]
        kc = res.get("kernel_ceiling", {})
        if "total_s" in kc:
            r["ours_vs_kernel_ceiling"] = kc["total_s"] / s["ours"]["step_s_median"]
    r["targets"] = {
        "vs_hf_bs1>=1.8": r.get("ours_vs_hf_bs1_tok_s", 0) >= TARGET_VS_HF_BS1 if "ours_vs_hf_bs1_tok_s" in r else None,
        "vs_ceiling>=0.85": r.get("ours_vs_kernel_ceiling", 0) >= TARGET_VS_CEILING
        if "ours_vs_kernel_ceiling" in r else None,
        "peak_mem<=hf_bs1": r["ours_vs_hf_bs1_peak_mem"] <= 1.0 if "ours_vs_hf_bs1_peak_mem" in r else None,
        "peak_mem<=hf_bs4": r["ours_vs_hf_bs4_peak_mem"] <= 1.0 if "ours_vs_hf_bs4_peak_mem" in r else None,
    }
    return r


def _plot(res: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - no matplotlib: JSON only
        return
    s = res["systems"]
    order = ("ours", "ours_mb", "hf_bs1", "hf_bs4", "mcore_local")
    names = [n for n in order if n in s] + [n for n in s if n not in order]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    axes[0].bar(names, [s[n]["tok_per_s"] / 1e3 for n in names], color="tab:blue")
    axes[0].set_ylabel("useful k tok/s" + (" per GPU" if res.get("ep", 1) > 1 else ""))
    if res.get("ep", 1) > 1 and "ours_ep1" in s:
        t = TARGET_EP_VS_EP1 * s["ours_ep1"]["tok_per_s"] / 1e3
        axes[0].axhline(t, color="k", ls="--", label=f"target {TARGET_EP_VS_EP1}x EP1")
        axes[0].legend()
    axes[1].bar(names, [s[n]["useful_tflops"] for n in names], color="tab:green")
    kc = res.get("kernel_ceiling", {})
    if "useful_tflops" in kc:
        axes[1].axhline(kc["useful_tflops"], color="k", ls="--", label=f"kernel ceiling {kc['useful_tflops']:.0f}")
        axes[1].legend()
    axes[1].set_ylabel("useful TFLOP/s" + (" per GPU" if res.get("ep", 1) > 1 else ""))
    mem = [s[n]["peak_mem_gib"] or 0 for n in names]
    axes[2].bar(names, mem, color="tab:red")
    axes[2].set_ylabel("peak GiB")
    g = res["geometry"]
    per = " per GPU" if res.get("ep", 1) > 1 else ""
    fig.suptitle(f"{g['layers']} thinker layers, {len(res['lengths'])} samples / {res['tokens']} tokens{per}, "
                 f"fwd+bwd {res.get('dtype', 'bfloat16')}, EP {res.get('ep', 1)} ({res['env'].get('gpu', 'cpu')})")
    for ax in axes:
        ax.tick_params(axis="x", rotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _merge_ep(base: dict, values: list[dict], ep: int) -> dict:
    """The JSON of an ``--ep N`` run from the EP1 baseline's result and the N ranks' results."""
    b = base["systems"]["ours"]
    per_rank = []
    for r, v in enumerate(values):
        s = v["systems"]["ours"]
        mine, ref = v["losses"][0], base["losses"][r]
        per_rank.append({
            "rank": r, "tokens": v["tokens"], "local_experts": v["local_experts"], "tok_per_s": s["tok_per_s"],
            "useful_tflops": s["useful_tflops"], "step_s_median": s["step_s_median"],
            "peak_mem_gib": s["peak_mem_gib"], "tok_per_s_vs_ep1": s["tok_per_s"] / b["tok_per_s"],
            "loss": mine["loss"], "loss_ep1": ref["loss"],
            "loss_rel_diff": abs(mine["loss"] - ref["loss"]) / max(ref["loss_scale"], 1e-30),
            "sumsq_rel_diff": abs(mine["sumsq"] - ref["sumsq"]) / max(ref["sumsq"], 1e-30)})
    res = {k: v for k, v in values[0].items() if k not in ("systems", "losses", "ratios", "rank")}
    res["lengths_per_rank"] = [v["lengths"] for v in values]
    res["systems"] = {"ours_ep1": b, **{f"ours_ep{ep}_rank{r}": v["systems"]["ours"] for r, v in enumerate(values)}}
    res["ep1_baseline"] = {"lengths": base["lengths"], "tokens": base["tokens"], "losses": base["losses"],
                           "env": base["env"]}
    res["per_rank"] = per_rank
    tps = [p["tok_per_s"] for p in per_rank]
    peaks = [p["peak_mem_gib"] for p in per_rank]
    mean_ratio = statistics.mean(tps) / b["tok_per_s"]
    res["ratios"] = {
        f"ep{ep}_vs_ep1_per_gpu_tok_s": mean_ratio,
        f"ep{ep}_vs_ep1_per_gpu_tok_s_slowest_rank": min(tps) / b["tok_per_s"],
        f"ep{ep}_vs_ep1_peak_mem": (max(peaks) / b["peak_mem_gib"]) if b["peak_mem_gib"] and all(peaks) else None,
        "loss_rel_diff_max": max(p["loss_rel_diff"] for p in per_rank),
        "targets": {f"ep{ep}_per_gpu_tok_s>={TARGET_EP_VS_EP1}x_ep1": mean_ratio >= TARGET_EP_VS_EP1},
    }
    return res


def run_bench(out_dir, layers: int = 2, tokens: int | None = None, ep: int = 1, tiny: bool = False,
              systems=("ours", "ours_mb", "hf_bs1", "hf_bs4", "mcore_local"), warmup: int = 2, iters: int = 6,
              seed: int = 0, device: str | None = None, mb_tokens: int = 4096, dtype: str = "bf16",
              hang_timeout_s: float = 300.0, timeout_s: float = 1800.0) -> dict:
    """Run the benchmark (module docstring); write ``bench_layers.json`` / ``.png`` under out_dir and
    return the JSON's content. ``--ep N`` > 1: the EP1 baseline (one rank, GPU 0) then the N-rank run."""
    import torch

    from megatron_grpo.testing.dist import run_ranks

    if dtype not in _DTYPES:
        raise SystemExit(f"--dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if ep > 1 and device == "cuda" and torch.cuda.device_count() < ep:
        raise SystemExit(f"--ep {ep} needs {ep} GPUs, this machine has {torch.cuda.device_count()}")
    env = {"PYTHONUNBUFFERED": "1"}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo, even on a GPU machine
    elif "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ:
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"  # a timed-out collective aborts its rank
    t0 = time.time()

    def launch(world: int, run_systems, loss_batches: int, ceiling: bool, tag: str) -> list[dict]:
        print(f"[bench layers] starting {world} rank(s) ({tag or 'ep1'}, {device}); progress lines come from every "
              f"rank; a phase longer than {hang_timeout_s:.0f} s dumps stacks under {out} and stops the run",
              flush=True)
        return run_ranks(_rank_main, world, str(out), layers, tokens, world, tiny, list(run_systems), warmup, iters,
                         seed, device, mb_tokens, dtype, loss_batches, hang_timeout_s, ceiling, tag,
                         timeout=timeout_s, env=env)

    if ep == 1:
        res = launch(1, systems, 0, True, "")[0]
    else:
        if [x for x in systems if x != "ours"]:
            print(f"[bench layers] --ep {ep}: only 'ours' runs (EP1 baseline and EP{ep}); ignoring "
                  f"{[x for x in systems if x != 'ours']}", flush=True)
        base = launch(1, ["ours"], ep, False, "ep1")[0]
        res = _merge_ep(base, launch(ep, ["ours"], 0, False, f"ep{ep}"), ep)
    res["wall_s"] = time.time() - t0
    argv = sys.argv[3:] if sys.argv[1:3] == ["bench", "layers"] else sys.argv[1:]
    res["command"] = " ".join(["mgrpo", "bench", "layers", *argv])
    for s in res["systems"].values():
        s.pop("output", None)
    (out / "bench_layers.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    _plot(res, out / "bench_layers.png")
    _print_table(res)
    return res


def _print_table(res: dict) -> None:
    s = res["systems"]
    w = max([12] + [len(n) for n in s])
    print(f"\n{'system':<{w}} {'tok/s':>10} {'TFLOP/s':>9} {'step ms':>9} {'peak GiB':>9}")
    for n, v in s.items():
        pk = f"{v['peak_mem_gib']:.1f}" if v["peak_mem_gib"] is not None else "-"
        print(f"{n:<{w}} {v['tok_per_s']:>10.0f} {v['useful_tflops']:>9.1f} {v['step_s_median'] * 1e3:>9.1f} {pk:>9}")
    kc = res.get("kernel_ceiling", {})
    if "total_s" in kc:
        print(f"{'ceiling':<{w}} {kc['tok_per_s']:>10.0f} {kc['useful_tflops']:>9.1f} {kc['total_s'] * 1e3:>9.1f}")
    for p in res.get("per_rank", []):
        print(f"rank {p['rank']}: {p['tokens']} tokens, {p['local_experts']} local experts, "
              f"{p['tok_per_s_vs_ep1']:.3f}x EP1 tok/s; probe loss {p['loss']:.6g} vs EP1 {p['loss_ep1']:.6g} "
              f"(rel diff {p['loss_rel_diff']:.2e}, sum sq rel diff {p['sumsq_rel_diff']:.2e})")
    print("ratios:", json.dumps(res["ratios"], indent=None, default=str))


def _cmd(args: argparse.Namespace) -> int:
    systems = [x for x in args.systems.split(",") if x]
    run_bench(args.out, layers=args.layers, tokens=args.tokens, ep=args.ep, tiny=args.tiny, systems=systems,
              warmup=args.warmup, iters=args.iters, seed=args.seed, device=args.device, mb_tokens=args.mb_tokens,
              dtype=args.dtype, hang_timeout_s=args.hang_timeout, timeout_s=args.timeout)
    return 0


def add_parser(bsub) -> argparse.ArgumentParser:
    s = bsub.add_parser("layers", help="N full-width thinker layers fwd+bwd: ours vs HF vs megatron local, "
                                       "with the kernel ceiling", description=__doc__.split("\n\n")[0])
    s.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    s.add_argument("--tokens", type=int, default=None,
                   help="total tokens of the batch (default: the documented 16-sample batch, 22,800 tokens)")
    s.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks (> 1: ours only; an EP1 baseline on GPU 0, then N ranks with their "
                        "own micro-batch each: per-GPU throughput, ratio to EP1, per-rank loss check)")
    s.add_argument("--out", default="bench_results/layers", help="results directory (JSON, PNG, profile)")
    s.add_argument("--systems", default="ours,ours_mb,hf_bs1,hf_bs4,mcore_local",
                   help="comma-separated subset of ours,ours_mb,hf_bs1,hf_bs4,mcore_local")
    s.add_argument("--mb-tokens", type=int, default=4096,
                   help="token budget of the micro-batches of ours_mb (same batch, packed into several "
                        "micro-batches with gradient accumulation: memory vs throughput)")
    s.add_argument("--warmup", type=int, default=2, help="untimed steps per system")
    s.add_argument("--iters", type=int, default=6, help="timed steps per system (median reported)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    s.add_argument("--tiny", action="store_true", help="tiny geometry: a CPU smoke test of this script")
    s.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES), help="weights and activations (default bf16)")
    s.add_argument("--hang-timeout", type=float, default=300.0,
                   help="seconds one phase of a rank (init, build, the steps, ...) may take before that rank dumps "
                        "its stacks and the run stops (default 300)")
    s.add_argument("--timeout", type=float, default=1800.0, help="seconds for each launch of ranks (default 1800)")
    s.set_defaults(func=_cmd)
    return s


def main(argv=None) -> int:
    """``python -m launch.bench.layers ARGS`` == ``mgrpo bench layers ARGS``."""
    p = argparse.ArgumentParser(prog="mgrpo bench")
    add_parser(p.add_subparsers(dest="kind", required=True))
    args = p.parse_args(["layers", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
