"""CUDA graphs for the trainer's micro-batches (``trainer.cuda_graphs``).

What is graphed: each training micro-batch's decoder stack (the transformer layers and the final
norm, forward and backward), captured with ``torch.cuda.make_graphed_callables`` once per *bucket*
shape and replayed for every micro-batch of that shape in every later step. The token embedding,
the audio tower, the fused LM-head logprob, the GRPO loss and megatron's schedule stay eager around
it: their shapes follow the micro-batch's clips and loss tokens, and they cost a small part of the
step. The graphed function's parameter gradients leave it as ordinary autograd outputs, so
megatron's DDP hooks add them into the fp32 grad buffers as for an eager micro-batch (gradient
accumulation, the distributed optimizer and grad clipping see the same buffers).

Buckets: a micro-batch of ``T`` tokens runs in the smallest bucket ``T_b >= T`` among the multiples
of ``budget / 4`` up to the token budget (4 shapes, all graphs in one memory pool: the schedule runs
one micro-batch's forward and backward before the next one starts, so they never overlap). Its
decoder input gets ``T_b - T`` zero rows as more padding segments, the segment offsets are padded
to the graph's fixed number of slots with zero-length segments, and the graph reads them from a
device buffer that each replay refills, so one capture serves every packing. The padding rows
attend only within their own segment and get no loss; they do go through the router, but a padding
mask (True on the bucket's rows) keeps them out of the MoE load-balancing and z losses, which
therefore equal the unpadded micro-batch's (the packer's own padding tokens count there, as in an
eager micro-batch).

Segment bound and slots: flash's varlen kernels launch ``ceil(max_seqlen / 128) x segments x heads``
thread blocks and a block past its segment's end exits at once, so ``max_seqlen`` and the number of
offsets fix the captured attention's grid. With ``max_seqlen = T_b`` and 64 offsets, a 65,536-token
bucket launches ~1 M blocks per attention call against ~30 k for the same micro-batch eagerly (~20
samples of at most ~5 k tokens), 24 such calls per 4-layer step: what the graphs' 0.90x of eager at
that budget points to (docs/performance.md, "Training phase"). Each bucket's graph is therefore
captured for a :class:`GraphShape` (:func:`graph_shape`): a power-of-two number of segment slots
above the micro-batch's segments and a power-of-two bound ``L`` at least its longest segment, the
pair that launches the fewest blocks; the bucket padding is cut into segments of at most ``L``
(:meth:`GraphShape.offsets`); a micro-batch that does not fit recaptures its bucket's graph with a
larger shape (logged; shapes only grow, so a run recaptures a bucket at most ~``3 + log2(T_b /
128)`` times, in practice in its first steps). For that micro-batch: ``L / 128 x 32 x heads`` ~ 65 k
blocks (``L`` = 8,192, 32 slots).

Falls back to eager, with one logged reason, where graphs cannot apply: no CUDA; pipeline
parallelism (PP > 1: megatron's 1F1B exchanges activations between stages around each forward);
expert parallelism (EP > 1: the all-to-all dispatcher reads its split sizes on the host); tensor
parallelism (TP > 1, not checked yet); a layer spec other than ``torch`` (megatron's local and TE
specs read offsets on the host); recomputation (``model.recompute`` other than ``none``); float32
(its attention is per-sample SDPA, planned on the host); a head size flash refuses; and per
micro-batch: more than ``MAX_SEGMENTS`` samples, or more tokens than the budget (an oversized
sample), which run eagerly in the same step (one logged line each kind).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Optional, Union

import torch

from . import grad_accum

__all__ = ["MicroBatchGraphs", "GraphShape", "graph_fallback_reason", "bucket_sizes", "graph_shape",
           "segment_bound", "enable_graphs", "trainer_stream", "capture_stream", "warm_up_on_capture_stream",
           "MAX_SEGMENTS", "AUTO_MAX_BUDGET", "graphs_wanted"]

log = logging.getLogger("megatron_grpo.engine.graphs")

MAX_SEGMENTS = 64
"""Most segments (samples plus padding) a graph takes: its largest offsets buffer (``GraphShape.slots``)."""
BUCKETS_PER_BUDGET = 4
"""Bucket shapes: the multiples of ``budget / BUCKETS_PER_BUDGET`` up to the budget."""
MIN_SEQLEN = 128
"""Smallest segment bound of a graph: flash's row block (a smaller bound launches no fewer blocks)."""
MIN_SLOTS = 8
"""Fewest segment slots of a graph (a few more samples in a later step then need no recapture)."""
AUTO_MAX_BUDGET = 4096
"""``trainer.cuda_graphs: auto`` turns graphs on for a fixed token budget of at most this many tokens:
there the eager micro-batches are host-bound and graphs made the 4-layer training phase 1.13x
faster (2026-12-04, before each graph took its own shape and the padding mask came in: not yet
re-measured with them); at 16,384 tokens (0.966x) and at the ``auto`` budget of 65,536 (0.958x) the eager phase is
GPU-bound and the graphed attention's wider grid and the bucket padding cost more than the launches
they save (one H200, 2026-12-04/05, docs/performance.md, "Training phase")."""


@contextlib.contextmanager
def trainer_stream(enabled: bool = True):
    """The trainer's work on one side stream of the current CUDA device, which is also the stream
    the graphs are captured on (``torch.cuda.graph``'s default capture stream). Enter it before the
    engine is built: megatron's DDP takes every parameter's gradient-accumulation node at its
    construction, and autograd ties such a node to the stream current then; a capture on another
    stream would make that stream (the legacy default stream, without this) wait on the capturing
    one, which fails the capture (``operation would make the legacy stream depend on a capturing
    blocking stream``). Elsewhere (CPU, or ``enabled`` false) nothing changes."""
    if not (enabled and torch.cuda.is_available()):
        yield None
        return
    stream = torch.cuda.Stream()
    prev = torch.cuda.graph.default_capture_stream
    torch.cuda.graph.default_capture_stream = stream
    try:
        with torch.cuda.stream(stream):
            yield stream
    finally:
        torch.cuda.graph.default_capture_stream = prev


def graphs_wanted(setting: Union[bool, str], budget: Union[int, str], fallback: Optional[str] = None) -> bool:
    """``trainer.cuda_graphs`` resolved against the configured ``packing.max_tokens_per_microbatch``
    before the engine is built (the trainer's stream must be entered by then): ``auto`` is on for a
    number of at most :data:`AUTO_MAX_BUDGET` tokens and no ``fallback`` (the
    :func:`graph_fallback_reason` of what the config already tells: device, parallel layout, layer
    spec, recomputation, dtype), off otherwise, logged on GPU. Whether graphs then apply is
    :func:`enable_graphs`' question."""
    if setting != "auto":
        return bool(setting)
    small = budget != "auto" and int(budget) <= AUTO_MAX_BUDGET
    if small and fallback is None:
        return True
    if torch.cuda.is_available():
        if fallback is not None and small:
            log.info("trainer.cuda_graphs: auto: off: %s", fallback)
        else:
            log.info("trainer.cuda_graphs: auto: off at a token budget of %s (graphs pay at budgets of at most %d "
                     "tokens, where eager micro-batches are host-bound; trainer.cuda_graphs=true turns them on)",
                     budget, AUTO_MAX_BUDGET)
    return False


def graph_fallback_reason(*, cuda: bool, tp: int = 1, pp: int = 1, ep: int = 1, backend: str = "torch",
                          recompute: str = "none", dtype: torch.dtype = torch.bfloat16,
                          head_dim: int = 128) -> Optional[str]:
    """Why the trainer's micro-batches cannot be CUDA-graphed in this configuration (module doc), or None.
    ``backend`` ``auto`` is the layer spec it resolves to here; a named one is taken as it is."""
    from model_bridge.modeling.attention import flash_refusal_for
    from model_bridge.modeling.specs import resolve_backend

    if backend == "auto":
        backend = resolve_backend()
    if not cuda:
        return "no CUDA device (graphs are a GPU feature)"
    if pp > 1:
        return f"pipeline parallelism (pp={pp}): megatron's 1F1B schedule exchanges activations between stages"
    if ep > 1:
        return f"expert parallelism (ep={ep}): the all-to-all token dispatcher reads its split sizes on the host"
    if tp > 1:
        return f"tensor parallelism (tp={tp}): not checked under graphs yet"
    if backend != "torch":
        return f"layer-spec backend {backend!r}: only the 'torch' backend's layers run without host syncs"
    if recompute != "none":
        return f"model.recompute={recompute!r}: recomputation under graphs is not checked yet"
    why = flash_refusal_for("cuda", dtype, head_dim, head_dim, head_dim)
    if why is not None:
        return f"attention would not run flash varlen ({why}): its SDPA path plans on the host"
    return None


def bucket_sizes(budget: int, multiple: int = 1) -> list[int]:
    """The bucket shapes of a token budget (module doc), each a multiple of ``multiple``."""
    step = max(multiple, -(-budget // BUCKETS_PER_BUDGET // multiple) * multiple)
    out = list(range(step, budget, step)) + [budget]
    return sorted(set(out))


def _pow2(n: int) -> int:
    return 1 << (max(1, int(n)) - 1).bit_length()


def segment_bound(host_cu, tokens: int, slots: int = MAX_SEGMENTS) -> int:
    """The longest segment a graph of a ``tokens``-token bucket with ``slots`` segment slots must take
    for a micro-batch with offsets ``host_cu`` (host ints, last = its token count): its longest
    sample, and its bucket padding cut over the free slots."""
    cu = [int(x) for x in host_cu]
    need = max((b - a for a, b in zip(cu, cu[1:])), default=0)
    pad = tokens - cu[-1]
    if pad > 0:
        free = slots - (len(cu) - 1)
        if free < 1:
            raise ValueError(f"{len(cu) - 1} segments leave no slot for the bucket padding (at most "
                             f"{slots - 1})")
        need = max(need, -(-pad // free))
    return need


@dataclass(frozen=True)
class GraphShape:
    """What one captured graph of the decoder stack takes: ``tokens`` rows (the bucket), at most
    ``slots`` segments (its offsets buffer holds ``slots + 1``), each of at most ``seqlen`` tokens
    (the attention's ``max_seqlen``). Flash launches ``seqlen / 128 x slots x heads`` blocks per
    attention call whatever the packing (module doc, "Segment bound and slots")."""

    tokens: int
    seqlen: int
    slots: int

    @property
    def blocks_per_head(self) -> int:
        """Thread blocks flash launches per head and attention call (rows of :data:`MIN_SEQLEN`)."""
        return -(-self.seqlen // MIN_SEQLEN) * self.slots

    def offsets(self, host_cu) -> list[int]:
        """The ``slots + 1`` offsets this graph replays a micro-batch with: its own (``host_cu``), then
        the bucket padding ``[T, tokens)`` in segments of at most ``seqlen`` tokens, then zero-length
        segments."""
        cu = [int(x) for x in host_cu]
        need = segment_bound(cu, self.tokens, self.slots)
        if need > self.seqlen:
            raise ValueError(f"a segment of {need} tokens exceeds the graph's bound {self.seqlen}")
        while cu[-1] < self.tokens:
            cu.append(min(self.tokens, cu[-1] + self.seqlen))
        return cu + [self.tokens] * (self.slots + 1 - len(cu))


def graph_shape(host_cu, tokens: int, prev: Optional[GraphShape] = None) -> GraphShape:
    """The shape a ``tokens``-token bucket's graph needs for a micro-batch with offsets ``host_cu``,
    never smaller than ``prev`` (the bucket's current graph) in either dimension, so a bucket
    recaptures at most ~``3 + log2(tokens / 128)`` times in a run. Of the slot counts that are powers
    of two above its segment count (the packer's padding segment included; at least
    :data:`MIN_SLOTS`, at most :data:`MAX_SEGMENTS`), the one whose bound gives flash the fewest
    blocks (``seqlen / 128 x slots``; fewer slots on a tie); the bound for ``s`` slots is a power of
    two at least the longest segment (the bucket padding spread over the free slots included),
    :data:`MIN_SEQLEN` and ``tokens / s`` (so the slots cover the bucket), capped at ``tokens``
    (then not a power of two when the bucket is not)."""
    segments = len(host_cu) - 1
    best = None
    slots = min(MAX_SEGMENTS, max(prev.slots if prev else 0, _pow2(max(MIN_SLOTS, segments + 1))))
    while slots <= MAX_SEGMENTS:
        floor = max(MIN_SEQLEN, -(-tokens // slots), segment_bound(host_cu, tokens, slots))
        shape = GraphShape(tokens, min(tokens, max(prev.seqlen if prev else 0, _pow2(floor))), slots)
        if best is None or shape.blocks_per_head < best.blocks_per_head:
            best = shape
        slots *= 2
    return best


class _Stack(torch.nn.Module):
    """The thinker's decoder stack for one :class:`GraphShape`: ``(decoder_input [T_b, 1, h],
    position_ids [3, 1, T_b], cu_seqlens int32 [slots + 1], padding_mask bool [1, T_b]) ->
    final-normed hidden [T_b, 1, h]``, segments of at most ``seqlen`` tokens (``max_seqlen``)."""

    def __init__(self, thinker, shape: GraphShape):
        super().__init__()
        self.lm = thinker.language_model
        self.thinker = [thinker]  # not a submodule: only the decoder's parameters belong to the graph
        self.shape = shape
        # the host copy the attention plans with: one segment over the whole bucket, so the plan is
        # the same for every packing (n_real = T_b, no compaction) and the kernel reads the real
        # offsets from the device buffer
        self.host_cu = (0,) + (shape.tokens,) * shape.slots

    def forward(self, decoder_input, position_ids, cu_seqlens, padding_mask):
        from megatron.core.packed_seq_params import PackedSeqParams

        from model_bridge.modeling.thd import attach_host_offsets

        psp = attach_host_offsets(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                                  max_seqlen_q=self.shape.seqlen, max_seqlen_kv=self.shape.seqlen),
                                  self.host_cu)
        self.lm.post_process = False  # GPTModel then returns the decoder's final-normed output
        try:
            # padding_mask [1, T_b] (True: the bucket's padding rows): megatron's routers leave those
            # rows out of the load-balancing and z losses (they are still routed and computed)
            out = self.lm(None, position_ids, None, decoder_input=decoder_input, packed_seq_params=psp,
                          padding_mask=padding_mask)
        finally:
            self.lm.post_process = True
        return self.thinker[0].lm_head_input(out)


def capture_stream() -> torch.cuda.Stream:
    """The stream ``torch.cuda.graph`` (and so ``make_graphed_callables``) captures on when given
    none: :func:`trainer_stream`'s, else torch's own default capture stream (made here if new)."""
    if torch.cuda.graph.default_capture_stream is None:
        torch.cuda.graph.default_capture_stream = torch.cuda.Stream()
    return torch.cuda.graph.default_capture_stream


def warm_up_on_capture_stream(fn: torch.nn.Module, args: tuple) -> None:
    """One eager forward and backward of ``fn(*args)`` on the capture stream, before capturing it.

    cuBLAS and cuBLASLt keep a workspace per (thread, stream) that torch allocates on the first GEMM
    there (32 MiB on Hopper) and keeps for the process. ``make_graphed_callables`` warms up on a
    side stream of its own, so without this the first GEMM of the backward on the capture stream,
    run by autograd's device thread, allocates that thread's workspace inside the capture, from the
    graph's private pool, over memory that the forward graph's saved tensors also occupy (blocks
    freed earlier in the backward). The workspace outlives the capture, and every later eager GEMM
    of a backward on that stream (the LM head's, between a micro-batch's forward and backward
    replays) writes its scratch there, over the forward's saved activations. On the H200 that
    turned rows of the last layer's saved SwiGLU output into NaN before the backward replay read
    them (docs/performance.md, "Where the graphs NaN was"). Gradients are taken with
    ``autograd.grad`` (as ``make_graphed_callables``' own warm-up), so nothing accumulates into
    ``.grad`` or megatron's grad buffers."""
    stream = capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = fn(*args)
        inputs = [a for a in args if torch.is_tensor(a) and a.requires_grad]
        inputs += [p for p in fn.parameters() if p.requires_grad]
        torch.autograd.grad(out, inputs, torch.zeros_like(out), allow_unused=True)
        del out
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


class MicroBatchGraphs:
    """The graphed decoder stacks of one model chunk, by bucket shape, captured on first use."""

    def __init__(self, thinker, budget: int, multiple: int = 1):
        self.thinker = thinker
        self.buckets = bucket_sizes(budget, multiple)
        self.graphed: dict[int, object] = {}
        self.shapes: dict[int, GraphShape] = {}
        """Each bucket's graph's shape (:func:`graph_shape`)."""
        self.captures = 0
        """Graphs captured, recaptures with a larger shape included."""
        self.pool = None
        self._noted: set[str] = set()
        self.replays = 0
        self.eager = 0

    def _note(self, kind: str, reason: str) -> None:
        if kind not in self._noted:  # one line per kind of reason, the first case's numbers in it
            self._noted.add(kind)
            log.warning("trainer.cuda_graphs: a micro-batch runs eagerly: %s", reason)

    def bucket(self, tokens: int, segments: int) -> Optional[int]:
        """The bucket of a micro-batch, or None (it runs eagerly; the reason is logged once)."""
        if segments + 1 > MAX_SEGMENTS:
            self._note("segments", f"{segments} samples in one micro-batch (graphs take up to {MAX_SEGMENTS - 1})")
            return None
        for b in self.buckets:
            if tokens <= b:
                return b
        self._note("oversized", f"{tokens} tokens exceed the token budget {self.buckets[-1]} (an oversized sample)")
        return None

    def _drop(self, bucket: int) -> None:
        """Free bucket ``bucket``'s graph before its recapture. ``make_graphed_callables``' module and
        autograd function refer to each other, so only the cycle collector frees them (and with them
        their static tensors and saved activations, back to the pool for the new capture). The last
        graph of the pool gone, the pool itself goes (its use count is then 0, and the allocator
        refuses a new capture into such a pool); the next capture takes a fresh one."""
        import gc

        del self.graphed[bucket]
        gc.collect()
        if not self.graphed and self.pool is not None:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the emptied pool's memory back to the device for the fresh pool
            self.pool = None

    def _capture(self, shape: GraphShape, like: torch.Tensor):
        from megatron.core.transformer.moe.moe_utils import (MoEAuxLossAutoScaler,
                                                             get_moe_layer_wise_logging_tracker)

        if MoEAuxLossAutoScaler.main_loss_backward_scale is None:  # megatron copies into it from now on
            MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=like.device))
        # the warm-up and capture runs add to the MoE aux-loss log; put it back as it was
        saved = {k: v["values"].clone() for k, v in get_moe_layer_wise_logging_tracker().items()}
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        h, tokens = like.shape[-1], shape.tokens
        args = (torch.zeros(tokens, 1, h, dtype=like.dtype, device=like.device, requires_grad=True),
                torch.zeros(3, 1, tokens, dtype=torch.long, device=like.device),
                torch.tensor(shape.offsets([0]), dtype=torch.int32, device=like.device),
                torch.zeros(1, tokens, dtype=torch.bool, device=like.device))
        stack = _Stack(self.thinker, shape)
        torch.cuda.synchronize()
        # the GPT model's embedding and output layer are in its parameters but not in this graph
        with grad_accum.paused():  # the warm-up and capture take parameter gradients without accumulating
            warm_up_on_capture_stream(stack, args)
            graphed = torch.cuda.make_graphed_callables(stack, args, allow_unused_input=True, pool=self.pool)
        torch.cuda.synchronize()
        for k, v in get_moe_layer_wise_logging_tracker().items():
            if k in saved:
                v["values"].copy_(saved[k])
            else:
                v["values"].zero_()
        log.info("trainer.cuda_graphs: captured the decoder stack for %d-token micro-batches, up to %d segments "
                 "of up to %d tokens", tokens, shape.slots, shape.seqlen)
        return graphed

    def run(self, decoder_input: torch.Tensor, position_ids: torch.Tensor, host_cu) -> Optional[torch.Tensor]:
        """Final-normed hidden ``[T, 1, h]`` of the decoder stack through the bucket's graph, or None
        when this micro-batch must run eagerly. ``host_cu``: its segment offsets (host ints, last = T)."""
        T = decoder_input.shape[0]
        cu = [int(x) for x in host_cu]
        b = self.bucket(T, len(cu) - 1)
        if b is None:
            self.eager += 1
            return None
        prev = self.shapes.get(b)
        shape = graph_shape(cu, b, prev)
        graphed = self.graphed.get(b)
        if graphed is None or shape != prev:
            if graphed is not None:
                longest = max(hi - lo for lo, hi in zip(cu, cu[1:]))
                log.info("trainer.cuda_graphs: a micro-batch of %d segments (the longest %d tokens, %d tokens of "
                         "bucket padding) does not fit the %d-token bucket's graph of %d segments of up to %d "
                         "tokens: recapturing it for %d segments of up to %d tokens", len(cu) - 1, longest, b - T,
                         b, prev.slots, prev.seqlen, shape.slots, shape.seqlen)
                del graphed
                self._drop(b)
            graphed = self._capture(shape, decoder_input)  # a capture that fails records nothing
            self.graphed[b], self.shapes[b] = graphed, shape
            self.captures += 1
        pad = b - T
        if pad:
            decoder_input = torch.cat([decoder_input, decoder_input.new_zeros(pad, *decoder_input.shape[1:])])
            position_ids = torch.cat([position_ids, position_ids.new_zeros(3, 1, pad)], dim=-1)
        cu = shape.offsets(cu)  # then padding segments, then zero-length ones
        from model_bridge.modeling.thd import ints_to_device

        padding_1T = (torch.arange(b, device=decoder_input.device) >= T).view(1, b)
        out = graphed(decoder_input, position_ids, ints_to_device(cu, decoder_input.device), padding_1T)
        self.replays += 1
        return out[:T] if pad else out


def enable_graphs(engine, enabled: bool, budget: int, *, backend: str = "auto", recompute: str = "none",
                  multiple: int = 1, requested: bool = True) -> Optional[MicroBatchGraphs]:
    """Set up ``engine.graphs`` (read by ``engine.step.forward_backward``) when
    ``enabled`` and the configuration allows (:func:`graph_fallback_reason`; else one logged line
    with the reason and eager micro-batches: a warning where the user asked for graphs on GPU,
    info where ``auto`` chose them, ``requested`` False). Returns the graphs or None."""
    from model_bridge.modeling.specs import resolve_backend

    from .setup import unwrapped

    engine.graphs = engine.graphs_fallback = None
    if not enabled:
        return None
    layout, text = engine.layout, engine.spec.text
    why = graph_fallback_reason(cuda=torch.cuda.is_available(), tp=layout.tp, pp=layout.pp, ep=layout.ep,
                                backend=resolve_backend(backend), recompute=recompute, dtype=engine.dtype,
                                head_dim=text.head_dim)
    if why is not None:
        # on CPU that is the expected case: no warning in every CPU run
        log.log(logging.WARNING if torch.cuda.is_available() and requested else logging.INFO,
                "trainer.cuda_graphs: micro-batches run eagerly: %s", why)
        engine.graphs_fallback = why
        return None
    engine.graphs = MicroBatchGraphs(unwrapped(engine.model[0]), budget, multiple)
    log.info("trainer.cuda_graphs: on, bucket shapes %s tokens", engine.graphs.buckets)
    return engine.graphs
