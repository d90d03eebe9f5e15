"""The audio tower's own CUDA stream (``trainer.audio_stream``): the pooled clips' tower batches
(``model_bridge/modeling/shared_audio.py``, "Side stream") run there, so their forwards and
backwards overlap the decoder's micro-batches on the main stream instead of running between them.
The tower's kernels are compute-bound (its convolutions and linears) and much of the decoder's
time is memory-bound (gradient accumulation, the experts' gathers, norms): on one GPU the two
share the SMs.

Gradients: a side-stream backward takes the tower parameters' gradients with
``torch.autograd.grad`` and adds them into megatron's fp32 ``main_grad`` buffers on the side
stream (:func:`_backward`; the same fp32 + float(bf16) add, once per parameter per batch, as DDP's
hook). DDP's own hook is not used there: autograd runs a parameter's accumulator on the stream it
was created on, the main one, which would make the main stream wait for the tower. Everything that
reads those buffers waits for the side stream first: the schedule's ``finalize_model_grads``
(:func:`finalize_after_side_streams`) and the end of every pass (``engine.forward.run_schedule``).

A micro-batch without audio runs the tower on a dummy input on the main stream (anti-hang
invariant 2) and adds its zero gradients there: that pass first waits for the side stream
(``OmniThinker.tower_stream``), and the side stream waits for the main one before each backward.

Where it applies: CUDA, the pooled clips (``trainer.shared_clips`` with ``shared_clips_keep > 0``,
the default), a replicated tower (a tensor-parallel one's collectives would move between the
decoder's), PP 1 (1F1B interleaves the micro-batches' forwards and backwards), megatron's DDP
without an overlapped gradient reduce (whose bucket bookkeeping runs in DDP's hook) and no CUDA
graphs (captured on the main stream while the side one runs). Elsewhere :func:`audio_tower_stream`
returns None with its reason, logged once.
"""
from __future__ import annotations

import functools
import logging
from typing import Optional, Sequence

import torch

from model_bridge.modeling.shared_audio import TowerStream

from . import grad_accum

__all__ = ["audio_tower_stream", "side_stream_fallback_reason", "join_side_streams", "finalize_after_side_streams"]

log = logging.getLogger("megatron_grpo.engine.audio_stream")

_STREAMS: dict[int, "torch.cuda.Stream"] = {}
"""CUDA device index -> the tower's stream there (one per process and device)."""
_logged: set[str] = set()


def side_stream_fallback_reason(*, enabled: bool, cuda: bool, pooled: bool, overlap_grad_reduce: bool,
                                graphs: bool, tower: bool, tower_tp: int = 1, pp: int = 1) -> Optional[str]:
    """Why the tower's batches stay on the main stream, or None where they go to their own."""
    if not enabled:
        return "trainer.audio_stream is false"
    if not cuda:
        return "no CUDA device"
    if not tower:
        return "this rank holds no audio tower"
    if tower_tp > 1:
        return f"the audio tower is tensor-parallel (tp={tower_tp}): its collectives would move between the decoder's"
    if pp > 1:
        return (f"pipeline parallelism (pp={pp}): 1F1B interleaves micro-batches' forwards and backwards, so a "
                "micro-batch without audio could add its dummy pass's gradients beside the side stream's")
    if not pooled:
        return "the clips are not pooled (trainer.shared_clips false or shared_clips_keep 0)"
    if overlap_grad_reduce:
        return "optim.overlap_grad_reduce is on (its bucket bookkeeping runs in DDP's hook on the main stream)"
    if graphs:
        return "trainer.cuda_graphs captures the decoder on the main stream"
    return None


def audio_tower_stream(engine, enabled: bool = True, pooled: bool = True) -> Optional[TowerStream]:
    """The :class:`TowerStream` for ``build_train_microbatches(tower_stream=...)``, or None (module
    doc; the reason is logged once)."""
    from model_bridge.load import unwrap_model

    thinker = unwrap_model(engine.model[0])
    tower = getattr(thinker, "audio_tower", None)
    layout = engine.layout
    reason = side_stream_fallback_reason(enabled=enabled, cuda=torch.cuda.is_available(), pooled=pooled,
                                         overlap_grad_reduce=engine.optim.overlap_grad_reduce,
                                         graphs=getattr(engine, "graphs", None) is not None,
                                         tower=tower is not None, pp=layout.pp,
                                         tower_tp=layout.tp if getattr(tower, "tensor_parallel", False) else 1)
    if reason is not None:
        if thinker is not None and hasattr(thinker, "tower_stream"):
            thinker.tower_stream = None
        if enabled and torch.cuda.is_available() and reason not in _logged:  # on CPU there is nothing to say
            _logged.add(reason)
            log.warning("trainer.audio_stream: the audio tower stays on the main stream: %s", reason)
        return None
    dev = torch.cuda.current_device()
    if dev not in _STREAMS:
        _STREAMS[dev] = torch.cuda.Stream(dev)
    side = TowerStream(_STREAMS[dev], _backward)
    thinker.tower_stream = side  # a micro-batch without audio: its dummy tower pass waits for the side stream
    return side


def join_side_streams() -> None:
    """The current stream waits for the tower's streams (before their gradients or outputs are read)."""
    if _STREAMS:
        cur = torch.cuda.current_stream()
        for s in _STREAMS.values():
            if s.device == cur.device:
                cur.wait_stream(s)


def finalize_after_side_streams(finalize):
    """megatron's ``finalize_model_grads`` (the gradient reduction) after :func:`join_side_streams`."""

    @functools.wraps(finalize)
    def wrapped(*args, **kwargs):
        join_side_streams()
        return finalize(*args, **kwargs)

    return wrapped


def _backward(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], tower: torch.nn.Module) -> None:
    """On the current (side) stream: the tower's parameter gradients of ``outputs`` given their
    ``grads``, added into the parameters' ``main_grad`` (module doc)."""
    params = [p for p in tower.parameters() if p.requires_grad]
    with grad_accum.paused():  # our accumulation hooks would add on their own; the adds are below
        got = torch.autograd.grad(list(outputs), params, list(grads), allow_unused=True)
    for p, g in zip(params, got):
        if g is None:
            continue
        main_grad = getattr(p, "main_grad", None)
        if main_grad is None:
            raise RuntimeError("trainer.audio_stream needs the model in megatron's DDP (a main_grad per "
                               "parameter); build the engine with wrap=True or set trainer.audio_stream: false")
        grad_accum.accumulate_(main_grad, g)
