"""Grouped-GEMM MoE experts for megatron-core without Transformer Engine (the ``"torch"`` backend).

:class:`TorchGroupedMLP` is a drop-in for megatron's ``SequentialMLP`` (same constructor and
forward contract: ``forward(permuted_tokens [N, h], tokens_per_expert [E_local], permuted_probs
[N]) -> (out [N, h], None)`` with the tokens sorted by local expert, as megatron's token
dispatcher hands them over). Instead of a Python loop of per-expert linears it runs two
``torch.nn.functional.grouped_mm`` calls over all local experts:

    h   = grouped_mm(x, weight1^T, offs)        # [N, 2F/etp]  (gate rows, then up rows)
    a   = (silu(gate) * up * probs).to(dtype)   # probs applied like MLP(per_token_scale=...)
    out = grouped_mm(a, weight2^T, offs)        # [N, h] (partial sums over ETP ranks)

Parameters (stacked experts, each slice laid out exactly like SequentialMLP's per-expert weight,
which is also the HF checkpoint's per-expert layout):

* ``weight1`` ``[E_local, 2 * F / etp, h]`` (``F`` = moe_ffn_hidden_size; without a gated
  linear unit ``[E_local, F / etp, h]``): expert ``e``'s ``linear_fc1.weight`` (column parallel:
  this ETP rank's rows of gate and of up, ``[gate_r; up_r]``);
* ``weight2`` ``[E_local, h, F / etp]``: expert ``e``'s ``linear_fc2.weight`` (row parallel).

Parallelism follows megatron's expert linears (``is_expert=True``): the module does no
communication. Under EP it holds and computes only its local experts (the dispatcher's
all-to-all brings it their tokens); under ETP each rank computes with its shard and returns
partial sums that the dispatcher's reduce-scatter adds up (and whose all-gather backward adds the
partial input gradients). Parameter attributes match SequentialMLP's expert linears
(``allreduce = not expert_parallel``, ``tensor_model_parallel``, ``partition_dim``), so DDP,
the distributed optimizer and grad clipping treat them the same way.

``sharded_state_dict`` writes the same checkpoint keys, shapes and offsets as SequentialMLP
(``{prefix}experts.linear_fc{1,2}.weight`` with an expert axis; fc1 as gate/up halves), so dist
checkpoints are interchangeable between the ``"local"`` and ``"torch"`` backends. The bridge's
mapping table covers ``weight1``/``weight2`` with ``ExpertStacked`` rules (``qwen3_omni.py``).

Kernels: ``grouped_mm`` where a one-off probe says it works for the device and dtype (CUDA bf16
on sm80+, and CPU fp32/bf16 in torch >= 2.10); otherwise a per-expert matmul loop (same math).
``MGRPO_GROUPED_MM=0`` forces the loop. The SwiGLU with probabilities is one autograd node that
saves only its input and the probabilities and recomputes in the backward: on CUDA one fused
Triton kernel each way (fp32 math; ``MGRPO_TRITON_GLU=0`` disables it), elsewhere eager torch.

The token permutation the torch backend's dispatcher uses around these experts is in ``permute.py``.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from megatron.core.transformer.module import MegatronModule

from ._triton import import_triton, triton_runs_on
from .empty_groups import zero_empty_group_grads
from .permute import select_rows
from .recompute import ROWS_OF_ATTR, RecomputeSaved

__all__ = ["TorchGroupedMLP", "grouped_linear", "grouped_mm_available", "expert_offsets", "weighted_glu"]

_GLU_CHUNK_ROWS = 16384


# ------------------------------------------------------------------------------------------------
# grouped GEMM
# ------------------------------------------------------------------------------------------------

def _loop_linear(x: torch.Tensor, w: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    outs, start = [], 0
    for e, n in enumerate(counts):
        outs.append(x[start:start + n] @ w[e].t())
        start += n
    if start < x.shape[0]:
        outs.append(x.new_zeros(x.shape[0] - start, w.shape[1]))
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[1])


@functools.lru_cache(maxsize=None)
def _probe_grouped_mm(device_type: str, device_index: Optional[int], dtype: torch.dtype) -> bool:
    """Does ``F.grouped_mm`` run (forward and backward, transposed B) and agree with a loop here?"""
    fn = getattr(F, "grouped_mm", None)
    if fn is None:
        return False
    dev = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(64, 64, generator=g).to(dev, dtype).requires_grad_()
        w = torch.randn(3, 32, 64, generator=g).to(dev, dtype).requires_grad_()
        counts = [24, 0, 40]
        offs = torch.tensor([24, 24, 64], dtype=torch.int32, device=dev)
        y = fn(x, w.transpose(-2, -1), offs=offs)
        gy = torch.randn(y.shape, generator=g).to(dev, dtype)
        gx, gw = torch.autograd.grad(y, (x, w), gy)
        xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
        yr = _loop_linear(xr, wr, counts)
        gxr, gwr = torch.autograd.grad(yr, (xr, wr), gy.float())
        tol = 2e-5 if dtype == torch.float32 else 5e-2  # fp32 must be exact fp32 (no TF32)
        return all(torch.allclose(a.float(), b, rtol=tol, atol=tol * 8) for a, b in ((y, yr), (gx, gxr), (gw, gwr)))
    except Exception:  # noqa: BLE001 - any failure means "use the loop"
        return False


def grouped_mm_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """True when ``F.grouped_mm`` is used for ``dtype`` on ``device`` (probed once per pair)."""
    if os.environ.get("MGRPO_GROUPED_MM", "1") == "0":
        return False
    dev = torch.device(device)
    return _probe_grouped_mm(dev.type, dev.index if dev.type != "cpu" else None, dtype)


OFFSETS_ATTR = "_mgrpo_expert_offsets"


def with_offsets(counts_E: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """``counts_E`` (rows per expert) with its int32 cumulative sums attached, which
    :func:`expert_offsets` then returns instead of computing them (one launch fewer per MoE layer
    in the host-bound stretch between the router and the experts)."""
    setattr(counts_E, OFFSETS_ATTR, offs_E)
    return counts_E


def expert_offsets(tokens_per_expert, device: torch.device) -> torch.Tensor:
    """int32 cumulative row counts ``[E]`` on ``device`` (``grouped_mm``'s ``offs``), without a
    device sync: a host count vector is summed on the host and copied asynchronously; counts that
    carry their offsets (:func:`with_offsets`, the dispatcher's counting sort made both) give those."""
    t = tokens_per_expert
    offs = getattr(t, OFFSETS_ATTR, None)
    if offs is not None and offs.device == torch.device(device):
        return offs
    if not torch.is_tensor(t):
        t = torch.tensor(list(t), dtype=torch.int64)
    dev = torch.device(device)
    if t.device.type == dev.type and (dev.type == "cpu" or t.device == dev):
        return torch.cumsum(t, 0, dtype=torch.int32)
    offs = torch.cumsum(t.to("cpu"), 0, dtype=torch.int32)
    if dev.type == "cuda":
        return offs.pin_memory().to(dev, non_blocking=True)
    return offs.to(dev)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: Optional[torch.Tensor],
                   counts: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Rows ``[offs[e-1], offs[e])`` of ``x [N, in]`` times ``w[e]^T`` (``w [E, out, in]``) ->
    ``[N, out]``; rows after ``offs[-1]`` are unspecified (grouped_mm) or zero (loop).

    ``counts`` (host ints) is needed only by the loop fallback; it is read from ``offs`` otherwise.
    """
    if offs is not None and grouped_mm_available(x.device, x.dtype) and w.dtype == x.dtype:
        # grouped_mm leaves the weight gradient of empty groups uninitialised (empty_groups.py)
        return F.grouped_mm(x, zero_empty_group_grads(w, offs).transpose(-2, -1), offs=offs)
    if counts is None:
        o = [int(v) for v in offs.tolist()]
        counts = [b - a for a, b in zip([0] + o[:-1], o)]
    return _loop_linear(x, w, counts)


# ------------------------------------------------------------------------------------------------
# gated activation with routing probabilities
# ------------------------------------------------------------------------------------------------

def _triton_glu_available(t: torch.Tensor) -> bool:
    return triton_runs_on(t.is_cuda) and _triton_kernels() is not None




@functools.lru_cache(maxsize=None)
def _triton_kernels():
    """The fused weighted-SwiGLU kernels (one pass each way), or None without Triton."""
    if (mods := import_triton("MGRPO_TRITON_GLU")) is None:
        return None
    triton, tl = mods

    @triton.jit
    def fwd(h_ptr, p_ptr, out_ptr, N, F, stride_h, stride_o, HAS_P: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_F: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_F)
        rmask = rows < N
        mask = rmask[:, None] & (cols[None, :] < F)
        hp = h_ptr + rows[:, None].to(tl.int64) * stride_h + cols[None, :]
        g = tl.load(hp, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(hp + F, mask=mask, other=0.0).to(tl.float32)
        a = g * tl.sigmoid(g) * u
        if HAS_P:
            p = tl.load(p_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            a = a * p[:, None]
        op = out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :]
        tl.store(op, a.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def bwd(h_ptr, p_ptr, go_ptr, dh_ptr, dp_ptr, N, F, stride_h, stride_go, stride_dh, HAS_P: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_F)
        rmask = rows < N
        mask = rmask[:, None] & (cols[None, :] < F)
        r64 = rows[:, None].to(tl.int64)
        hp = h_ptr + r64 * stride_h + cols[None, :]
        g = tl.load(hp, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(hp + F, mask=mask, other=0.0).to(tl.float32)
        go = tl.load(go_ptr + r64 * stride_go + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        if HAS_P:
            p = tl.load(p_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            dp = tl.sum(go * silu * u, axis=1)
            tl.store(dp_ptr + rows, dp, mask=rmask)
            go = go * p[:, None]
        du = go * silu
        dg = go * u * sig * (1.0 + g * (1.0 - sig))
        dp_ = dh_ptr + r64 * stride_dh + cols[None, :]
        tl.store(dp_, dg.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dp_ + F, du.to(dh_ptr.dtype.element_ty), mask=mask)

    def launch_cfg(n: int, f: int, tile: int = 8192):
        import triton as _t

        block_f = _t.next_power_of_2(max(f, 16))
        block_m = max(1, min(64, tile // block_f))
        return (_t.cdiv(max(n, 1), block_m),), block_m, block_f

    return fwd, bwd, launch_cfg


def _glu_fwd_triton(h: torch.Tensor, probs: Optional[torch.Tensor]) -> torch.Tensor:
    fwd, _, cfg = _triton_kernels()
    n, two_f = h.shape
    f = two_f // 2
    out = torch.empty(n, f, dtype=h.dtype, device=h.device)
    if n:
        grid, bm, bf = cfg(n, f)
        p = probs.contiguous() if probs is not None else h
        fwd[grid](h, p, out, n, f, h.stride(0), out.stride(0), HAS_P=probs is not None, BLOCK_M=bm, BLOCK_F=bf,
                  num_warps=8 if bf * bm >= 4096 else 4)
    return out


def _glu_bwd_triton(h: torch.Tensor, probs: Optional[torch.Tensor], grad: torch.Tensor):
    _, bwd, cfg = _triton_kernels()
    n, two_f = h.shape
    f = two_f // 2
    grad = grad.contiguous()
    dh = torch.empty_like(h)
    dp = torch.empty(n, dtype=torch.float32, device=h.device) if probs is not None else None
    if n:
        grid, bm, bf = cfg(n, f, 4096)  # more live values than the forward: a smaller tile
        p = probs.contiguous() if probs is not None else h
        bwd[grid](h, p, grad, dh, dp if dp is not None else h, n, f, h.stride(0), grad.stride(0), dh.stride(0),
                  HAS_P=probs is not None, BLOCK_M=bm, BLOCK_F=bf, num_warps=8 if bf * bm >= 4096 else 4)
    return dh, dp


def _glu_forward(h: torch.Tensor, probs: Optional[torch.Tensor]) -> torch.Tensor:
    """The forward of :class:`_WeightedSwiGLU` without autograd (also its recomputation)."""
    if _triton_glu_available(h):
        return _glu_fwd_triton(h, probs)
    n, two_f = h.shape
    f = two_f // 2
    out = torch.empty(n, f, dtype=h.dtype, device=h.device)
    for s in range(0, n, _GLU_CHUNK_ROWS):
        e = min(n, s + _GLU_CHUNK_ROWS)
        g, u = h[s:e, :f], h[s:e, f:]
        a = F.silu(g) * u  # same roundings as megatron's MLP glu in low precision
        out[s:e] = a if probs is None else (a * probs[s:e].unsqueeze(-1)).to(h.dtype)
    return out


class _WeightedSwiGLU(torch.autograd.Function):
    """``(silu(gate) * up * probs).to(dtype)`` over ``h = [gate | up]``; saves h and probs only.

    On CUDA one fused Triton kernel each way (fp32 math, one rounding); elsewhere eager torch in
    row chunks (the forward with megatron's roundings, the backward in fp32)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, probs: Optional[torch.Tensor]):
        h = h.contiguous()
        ctx.save_for_backward(h, probs)
        ctx.has_probs = probs is not None
        return _glu_forward(h, probs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, probs = ctx.saved_tensors
        if _triton_glu_available(h):
            dh, dprobs = _glu_bwd_triton(h, probs, grad)
            return dh, (dprobs.to(probs.dtype) if dprobs is not None else None)
        n, two_f = h.shape
        f = two_f // 2
        dh = torch.empty_like(h)
        dprobs = torch.empty(n, dtype=torch.float32, device=h.device) if ctx.has_probs else None
        for s in range(0, n, _GLU_CHUNK_ROWS):
            e = min(n, s + _GLU_CHUNK_ROWS)
            g, u = h[s:e, :f].float(), h[s:e, f:].float()
            sig = torch.sigmoid(g)
            silu = g * sig
            gr = grad[s:e].float()
            if ctx.has_probs:
                dprobs[s:e] = (gr * (silu * u)).sum(-1)
                gr = gr * probs[s:e].float().unsqueeze(-1)
            dh[s:e, f:] = (gr * silu).to(h.dtype)
            dh[s:e, :f] = (gr * u * (sig * (1.0 + g * (1.0 - sig)))).to(h.dtype)
        if dprobs is not None:
            dprobs = dprobs.to(probs.dtype)
        return dh, dprobs


def weighted_glu(h: torch.Tensor, probs: Optional[torch.Tensor], activation=F.silu) -> torch.Tensor:
    """``act(gate) * up`` (times ``probs`` per row, cast back to ``h.dtype``) for ``h = [gate | up]``."""
    if activation is F.silu:
        return _WeightedSwiGLU.apply(h, probs)
    g, u = torch.chunk(h, 2, dim=-1)
    a = activation(g) * u
    return a if probs is None else (a * probs.unsqueeze(-1)).to(h.dtype)


# ------------------------------------------------------------------------------------------------
# the experts module
# ------------------------------------------------------------------------------------------------

def _groups(pg_collection):
    """(ep, expert-tp, expert-dp) process groups: from megatron's pg_collection or parallel_state."""
    if pg_collection is not None and getattr(pg_collection, "ep", None) is not None:
        return pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
    from megatron.core import parallel_state as ps

    return (ps.get_expert_model_parallel_group(), ps.get_expert_tensor_parallel_group(),
            ps.get_expert_data_parallel_group())


def _size_rank(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return group.size(), group.rank()


class TorchGroupedMLP(MegatronModule):
    """megatron MoE experts on grouped GEMM (module docstring). Constructor as megatron's
    ``SequentialMLP`` (``num_local_experts, config, submodules=None, pg_collection=None, name=None``;
    ``submodules`` is ignored: the linears are this module's own stacked weights)."""

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None,
                 name: Optional[str] = None, **unused):
        super().__init__(config=config)
        if config.add_bias_linear:
            raise NotImplementedError("TorchGroupedMLP has no expert biases (Qwen3-Omni has none): set "
                                      "add_bias_linear=False")
        if getattr(config, "fp8", None) or getattr(config, "fp4", None):
            raise NotImplementedError("TorchGroupedMLP does not implement fp8/fp4 experts")
        if getattr(config, "moe_latent_size", None):
            raise NotImplementedError("TorchGroupedMLP does not implement MoE latent projections")
        if config.gated_linear_unit and config.activation_func not in (F.silu, F.gelu):
            raise ValueError(f"gated experts need silu or gelu, got {config.activation_func}")
        self.num_local_experts = int(num_local_experts)
        self.ep_group, self.tp_group, self.dp_group = _groups(pg_collection)
        self.ep_size, self.ep_rank = _size_rank(self.ep_group)
        self.tp_size, self.tp_rank = _size_rank(self.tp_group)
        self.expert_parallel = config.expert_model_parallel_size > 1
        ffn = config.moe_ffn_hidden_size
        if ffn % self.tp_size:
            raise ValueError(f"expert TP size {self.tp_size} does not divide moe_ffn_hidden_size {ffn}")
        self.ffn_local = ffn // self.tp_size
        self.gated = bool(config.gated_linear_unit)
        fc1_rows = self.ffn_local * (2 if self.gated else 1)
        h = config.hidden_size
        kw = {"dtype": config.params_dtype}
        if not config.use_cpu_initialization:
            kw["device"] = torch.cuda.current_device()
        self.weight1 = torch.nn.Parameter(torch.empty(self.num_local_experts, fc1_rows, h, **kw))
        self.weight2 = torch.nn.Parameter(torch.empty(self.num_local_experts, h, self.ffn_local, **kw))
        if config.perform_initialization:
            self._init_weights()
        self.register_load_state_dict_post_hook(self._drop_extra_state_keys)
        self.recompute_activations = False
        """Recompute the sorted input rows and the SwiGLU output in the backward instead of saving
        them (``recompute.py``; ``build_thinker(..., recompute="experts")`` sets it)."""
        for p, dim in ((self.weight1, 1), (self.weight2, 2)):
            p.allreduce = not self.expert_parallel
            p.tensor_model_parallel = True
            p.partition_dim = dim
            p.partition_stride = 1

    @torch.no_grad()
    def _init_weights(self) -> None:
        """Per-expert init with config.init_method / output_layer_init_method (under megatron's
        expert-parallel RNG stream on CUDA). Loading from an HF checkpoint overwrites it."""
        import contextlib

        ctx = contextlib.nullcontext()
        if self.weight1.is_cuda:
            try:
                from megatron.core.tensor_parallel.random import (get_cuda_rng_tracker,
                                                                  get_expert_parallel_rng_tracker_name)

                ctx = get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name())
            except Exception:  # noqa: BLE001 - no tracker: plain RNG
                ctx = contextlib.nullcontext()
        with ctx:
            for e in range(self.num_local_experts):
                self.config.init_method(self.weight1.data[e])
                self.config.output_layer_init_method(self.weight2.data[e])

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert,
                permuted_probs: Optional[torch.Tensor]):
        x, probs = permuted_local_hidden_states, permuted_probs
        if getattr(self.config, "moe_apply_probs_on_input", False):
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        if x.shape[0] == 0:
            # no tokens for this rank's experts: keep every expert weight in the graph (zero grads)
            out = x.new_zeros(0, self.config.hidden_size)
            return out + 0.0 * (self.weight1.sum() + self.weight2.sum()).to(out.dtype), None
        use_gmm = grouped_mm_available(x.device, x.dtype) and self.weight1.dtype == x.dtype
        if use_gmm:
            offs, counts = expert_offsets(tokens_per_expert, x.device), None
        else:
            tpe = tokens_per_expert
            counts = [int(v) for v in (tpe.tolist() if torch.is_tensor(tpe) else tpe)]
            offs = None
        with self._recompute_rows_of(x):
            h = grouped_linear(x, self.weight1, offs, counts)
        if self.gated:
            a = weighted_glu(h, probs, self.config.activation_func)
        else:
            a = self.config.activation_func(h)
            if probs is not None:
                a = (a * probs.unsqueeze(-1)).to(h.dtype)
        with self._recompute_glu(a, h, probs):
            return grouped_linear(a, self.weight2, offs, counts), None

    # ---- selective recomputation (recompute.py): set ``recompute_activations = True`` -----------

    def _recompute_rows_of(self, x: torch.Tensor):
        """Save the recipe ``source[rows]`` instead of the expert-sorted rows ``x`` (when the
        dispatcher gathered them with ``permute.gather_rows``)."""
        rows_of = getattr(x, ROWS_OF_ATTR, None) if self.recompute_activations else None
        if rows_of is None:
            return contextlib.nullcontext()
        src, rows = rows_of
        return RecomputeSaved(x, lambda: select_rows(src, rows))

    def _recompute_glu(self, a: torch.Tensor, h: torch.Tensor, probs: Optional[torch.Tensor]):
        """Save the recipe ``swiglu(h) * probs`` instead of its output ``a`` (the SwiGLU node keeps
        ``h`` and ``probs`` for its own backward anyway)."""
        if not (self.recompute_activations and self.gated and self.config.activation_func is F.silu):
            return contextlib.nullcontext()
        h = h.contiguous()  # what _WeightedSwiGLU saved (a no-op: grouped outputs are contiguous)
        return RecomputeSaved(a, lambda: _glu_forward(h, probs))

    def backward_dw(self):  # megatron's delayed-wgrad hook: nothing is delayed here
        pass

    # ---- dist checkpointing: SequentialMLP's keys and offsets ------------------------------------

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """SequentialMLP's checkpoint layout: ``{prefix}weight1`` / ``{prefix}weight2`` are factories
        keyed ``{prefix}experts.linear_fc{1,2}.weight`` that build, per local expert, the
        ShardedTensors SequentialMLP writes for ``local_experts.{e}.linear_fc{1,2}.weight`` (fc1 as
        gate/up halves), plus placeholders for its per-expert ``_extra_state`` objects, so that
        checkpoints load across the two backends in both directions."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
        from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

        singleton = bool((metadata or {}).get("singleton_local_shards", False))
        n_local, ep_rank, ep_size = self.num_local_experts, self.ep_rank, self.ep_size
        tp_rank, tp_size = self.tp_rank, self.tp_size
        _, dp_rank = _size_rank(self.dp_group)
        n_global = ep_size * n_local
        gated = self.gated

        def expert_offsets_of(e: int):
            g = ep_rank * n_local + e
            if singleton:
                return g, tuple(sharded_offsets)
            return g, (*sharded_offsets, (len(sharded_offsets), g, n_global))

        def expert_key(key: str, g: int) -> str:
            # key is "<...>experts.linear_fc{1,2}.weight" (its prefix may have been rewritten by the
            # caller, e.g. the layer index dropped); singleton shards name the expert in the key
            if not singleton:
                return key
            head, tail = key.rsplit("experts.", 1)
            return f"{head}experts.{g}.{tail}"

        def build_fc1(key, t, rid, flattened_range):
            if flattened_range is not None:
                raise NotImplementedError("flattened ranges are not supported for TorchGroupedMLP weights")
            out = []
            for e in range(n_local):
                g, offs = expert_offsets_of(e)
                k, pre = expert_key(key, g), len(offs)
                if not gated:
                    out.append(ShardedTensor.from_rank_offsets(k, t[e], *offs, (pre, tp_rank, tp_size),
                                                               replica_id=rid, prepend_axis_num=pre))
                    continue
                w, v = torch.chunk(t[e], 2, dim=0)
                if singleton:
                    ow, ov, kw, kv = (pre, tp_rank, tp_size), (pre, tp_rank, tp_size), f"{k}_w", f"{k}_v"
                else:
                    ow, ov, kw, kv = (pre, tp_rank, 2 * tp_size), (pre, tp_size + tp_rank, 2 * tp_size), k, k
                out.append(ShardedTensor.from_rank_offsets(kw, w, *offs, ow, replica_id=rid, prepend_axis_num=pre))
                out.append(ShardedTensor.from_rank_offsets(kv, v, *offs, ov, replica_id=rid, prepend_axis_num=pre))
            return out

        def merge_fc1(parts):
            if not gated:
                return torch.stack(list(parts))
            return torch.stack([torch.cat([parts[2 * e], parts[2 * e + 1]], dim=0) for e in range(n_local)])

        def build_fc2(key, t, rid, flattened_range):
            if flattened_range is not None:
                raise NotImplementedError("flattened ranges are not supported for TorchGroupedMLP weights")
            out = []
            for e in range(n_local):
                g, offs = expert_offsets_of(e)
                pre = len(offs)
                out.append(ShardedTensor.from_rank_offsets(expert_key(key, g), t[e], *offs, (pre + 1, tp_rank, tp_size),
                                                           replica_id=rid, prepend_axis_num=pre))
            return out

        def merge_fc2(parts):
            return torch.stack(list(parts))

        # TP-sharded expert weights, replicated over the expert data-parallel group
        replica_id = (0, 0, dp_rank)
        sd = {
            f"{prefix}weight1": ShardedTensorFactory(f"{prefix}experts.linear_fc1.weight", self.weight1, build_fc1,
                                                     merge_fc1, replica_id),
            f"{prefix}weight2": ShardedTensorFactory(f"{prefix}experts.linear_fc2.weight", self.weight2, build_fc2,
                                                     merge_fc2, replica_id),
        }
        for e in range(n_local):
            g, offs = expert_offsets_of(e)
            for mod in ("linear_fc1", "linear_fc2"):
                key = f"{prefix}experts.{g}.{mod}._extra_state" if singleton else f"{prefix}experts.{mod}._extra_state"
                sd[f"{prefix}{_EXTRA}{g}.{mod}._extra_state"] = make_sharded_object_for_checkpoint(
                    None, key, offs, (0, tp_rank, dp_rank))
        return sd

    def _drop_extra_state_keys(self, module, incompatible_keys) -> None:
        """load_state_dict post-hook: the placeholder ``_extra_state`` entries have no parameter."""
        for k in list(incompatible_keys.unexpected_keys):
            if f".{_EXTRA}" in k and k.endswith("._extra_state"):
                incompatible_keys.unexpected_keys.remove(k)


_EXTRA = "mgrpo_expert"
"""State-dict key stem of the per-expert ``_extra_state`` placeholders."""
