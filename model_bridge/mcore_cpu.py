"""megatron-core on a CPU-only torch (gloo): the few patches it needs, and nothing more.

megatron-core assumes CUDA throughout: ``torch.cuda.current_device()`` as an allocation device,
``device="cuda"`` literals, CUDA RNG states, streams and ``torch.cuda.synchronize()``. On a CPU
build of torch each of those raises. ``apply_cpu_patches()`` installs one small patch per problem
when CUDA is absent, so TP + sequence parallel, EP (alltoall dispatcher), expert TP, PP (1F1B), DDP
with the distributed optimizer and ``dist_checkpointing`` run on gloo with fp32 results equal to
a single-rank run. On a CUDA machine it changes nothing CUDA-related.

Three fixes are not about CUDA but about a machine without Transformer Engine and Apex (the GPU
machine has neither); ``apply_compat_fixes()`` installs them on any machine, and
``apply_cpu_patches()`` calls it.

Every patch is idempotent and guarded so that megatron-core 0.16.1 and 0.19.x both work: a patch
whose target does not exist in the installed version is skipped, never an error. Notes:

* The patches change process-wide state (``torch.cuda.*`` functions, a torch function mode on the
  calling thread). They are meant for CPU development, tests and CI, not for a CUDA process.
* The CUDA-to-CPU device mode is pushed on the thread that calls ``apply_cpu_patches()``; threads
  started later do not see it.
* ``dist_checkpointing`` also needs ``psutil`` installed (a save hangs without it) and, because its
  writer uses a spawn-context multiprocessing manager, an ``if __name__ == "__main__":`` guard in
  the launching script.
"""
from __future__ import annotations

import functools
import sys
from typing import Callable

import torch

__all__ = ["apply_cpu_patches", "apply_compat_fixes", "applied_patches"]

_APPLIED: list[str] = []


def _once(name: str) -> Callable[[Callable[[], bool]], Callable[[], bool]]:
    """Run a patch function at most once; record its name when it reports it was applied."""

    def deco(fn: Callable[[], bool]) -> Callable[[], bool]:
        @functools.wraps(fn)
        def wrapper() -> bool:
            if name in _APPLIED:
                return True
            if fn():
                _APPLIED.append(name)
                return True
            return False

        wrapper.patch_name = name  # type: ignore[attr-defined]
        return wrapper

    return deco


# --------------------------------------------------------------------------------------------
# torch.cuda functions megatron-core calls unconditionally
# --------------------------------------------------------------------------------------------


@_once("cuda.current_device")
def _patch_current_device() -> bool:
    """~90 megatron call sites allocate on ``torch.cuda.current_device()``: make it the CPU."""
    torch.cuda.current_device = lambda: torch.device("cpu")
    return True


@_once("cuda.synchronize")
def _patch_synchronize() -> bool:
    """Batched p2p (pipeline), DDP and checkpoint code call ``torch.cuda.synchronize()``: no-op."""
    torch.cuda.synchronize = lambda *args, **kwargs: None
    return True


class _NullEvent:
    def record(self, *args, **kwargs) -> None:
        pass

    def wait(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullStream:
    def wait_event(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def record_event(self, *args, **kwargs) -> _NullEvent:
        return _NullEvent()


_NULL_STREAM = _NullStream()


@_once("cuda.current_stream")
def _patch_streams() -> bool:
    """megatron-core 0.19 DDP calls ``torch.cuda.current_stream()`` on every grad sync: null stream."""
    torch.cuda.current_stream = lambda *args, **kwargs: _NULL_STREAM
    torch.cuda.default_stream = lambda *args, **kwargs: _NULL_STREAM
    return True


# --------------------------------------------------------------------------------------------
# device="cuda" literals, .cuda(), and param.type() == "torch.cuda.FloatTensor" checks
# --------------------------------------------------------------------------------------------


def _is_cuda_device(d) -> bool:
    if isinstance(d, str):
        return d.startswith("cuda")
    if isinstance(d, torch.device):
        return d.type == "cuda"
    return isinstance(d, int) and not isinstance(d, bool)  # a bare index means a CUDA device


class _CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """Rewrite CUDA devices to CPU in every torch call (the mechanism behind ``with torch.device``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # The optimizers and clip_grads compare param.type() with "torch.cuda.FloatTensor";
            # answer with the CUDA name to megatron's callers only.
            name = func(*args)
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("megatron.") and not name.startswith("torch.cuda."):
                name = name.replace("torch.", "torch.cuda.", 1)
            return name
        return func(*args, **kwargs)


_MODE: _CudaToCpuMode | None = None


@_once("cuda_device_to_cpu_mode")
def _patch_cuda_devices() -> bool:
    """Hard-coded ``device="cuda"``/``.cuda()``/``param.type()`` checks (schedules, masks, optimizer,
    clip_grads, dist_checkpointing): a torch function mode rewrites them to CPU."""
    global _MODE
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()  # stays pushed on this thread for the life of the process
    return True


# --------------------------------------------------------------------------------------------
# megatron-core internals
# --------------------------------------------------------------------------------------------


@_once("rng_tracker")
def _patch_rng_tracker() -> bool:
    """The TP/EP RNG tracker stores and swaps CUDA generator states: use the CPU generator's."""
    try:
        from megatron.core.tensor_parallel import random as mrandom
    except ImportError:
        return False

    def get_state(*args, **kwargs) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state, *args, **kwargs) -> None:
        torch.set_rng_state(new_state)

    def add(self, name: str, seed: int) -> None:
        # Same contract as CudaRNGStatesTracker.add, on the CPU generator.
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom.CudaRNGStatesTracker.add = add
    return True


@_once("alltoall_dispatcher_dtoh")
def _patch_alltoall_dispatcher() -> bool:
    """The alltoall dispatcher copies split sizes device-to-host on a ``torch.cuda.Stream``: on CPU
    only turn them into numpy arrays, as that copy does (all_to_all_single rejects tensors)."""
    try:
        from megatron.core.transformer.moe import token_dispatcher as td
    except ImportError:
        return False
    cls = getattr(td, "MoEAlltoAllTokenDispatcher", None)
    if cls is None or not hasattr(cls, "_maybe_dtoh_and_synchronize"):
        return False
    # __init__ creates torch.cuda.Stream() only while this class attribute is None.
    cls.cuda_dtoh_stream = _NULL_STREAM

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for attr in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, attr, None)
                if torch.is_tensor(value):
                    setattr(self, attr, value.numpy())
        return tokens_per_expert

    cls._maybe_dtoh_and_synchronize = _maybe_dtoh_and_synchronize
    return True


@_once("gloo_uneven_gather_scatter")
def _patch_uneven_collectives() -> bool:
    """With expert TP > 1 the alltoall dispatcher all-gathers/reduce-scatters tokens in uneven
    splits; gloo rejects unequal tensor lists, so pad to the largest split (or all-reduce + slice)."""
    try:
        from megatron.core.tensor_parallel import mappings
    except ImportError:
        return False
    orig_gather = getattr(mappings, "_gather_along_first_dim", None)
    orig_scatter = getattr(mappings, "_reduce_scatter_along_first_dim", None)
    if orig_gather is None or orig_scatter is None:
        return False

    def _gather_along_first_dim(input_, group, output_split_sizes=None, *args, **kwargs):
        if output_split_sizes is None or group.size() == 1:
            return orig_gather(input_, group, output_split_sizes, *args, **kwargs)
        world, longest = group.size(), max(output_split_sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((world * longest, *input_.shape[1:]))
        torch.distributed.all_gather_into_tensor(out, padded, group=group)
        parts = [out[i * longest: i * longest + n] for i, n in enumerate(output_split_sizes)]
        return torch.cat(parts, dim=0)

    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, *args, **kwargs):
        if input_split_sizes is None or group.size() == 1:
            return orig_scatter(input_, group, input_split_sizes, *args, **kwargs)
        full = input_.contiguous().clone()
        torch.distributed.all_reduce(full, group=group)
        return torch.split(full, list(input_split_sizes), dim=0)[group.rank()].contiguous()

    mappings._gather_along_first_dim = _gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_along_first_dim
    return True


# --------------------------------------------------------------------------------------------
# No Transformer Engine / Apex (any device)
# --------------------------------------------------------------------------------------------


@_once("moe_utils.te_general_gemm")
def _fix_te_general_gemm() -> bool:
    """megatron-core 0.16.1 references ``te_general_gemm`` in the MoE router without defining it
    when Transformer Engine is absent (NameError); 0.19 defines it as None."""
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:
        return False
    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True


@_once("torch_norm.sequence_parallel")
def _fix_torch_norm_sequence_parallel() -> bool:
    """Without TE/Apex the norm is a plain torch norm that refuses sequence parallel, which MoE with
    TP > 1 requires; allow it and tag the weights ``sequence_parallel`` so finalize_model_grads
    all-reduces their grads over TP (what the TE and Apex norms do)."""
    try:
        from megatron.core.transformer import torch_norm
    except ImportError:
        return False
    wrapped = getattr(torch_norm, "WrappedTorchNorm", None)
    if wrapped is None:
        return False
    original_new = wrapped.__new__

    def __new__(cls, config, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return original_new(cls, config, *args, **kwargs)
        config.sequence_parallel = False  # pass the original's assertion, keep its other checks
        try:
            norm = original_new(cls, config, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    wrapped.__new__ = staticmethod(__new__)
    return True


def _l2_norm_without_sync(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """amp_C.multi_tensor_l2norm's contract (``(norm [1] fp32, None)``) in two multi-tensor
    kernels and no host read: megatron's fallback reads every tensor's norm to the host (one
    device sync per parameter, 100 per step of a 4-layer model)."""
    tensors = [t for group in tensor_lists for t in group]
    if per_tensor or not tensors:
        from megatron.core.utils import local_multi_tensor_l2_norm

        return local_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args)
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1), None


def _scale_in_one_pass(chunk_size, noop_flag, tensor_lists, scale):
    """amp_C.multi_tensor_scale's contract, ``dst = src * scale`` in ``dst``'s dtype, in one pass:
    megatron's fallback ``dst.copy_(src * scale)`` writes and reads an fp32 temporary (the
    optimizer's fp32 -> bf16 weight copy runs through it every step)."""
    src, dst = tensor_lists
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(list(dst), scale)
    elif scale == 1.0:
        torch._foreach_copy_(list(dst), list(src))
    else:
        for s, d in zip(src, dst):
            torch.mul(s, scale, out=d)


@_once("local_multi_tensor_ops")
def _fix_local_multi_tensor_ops() -> bool:
    """Without TE and Apex megatron's optimizer and grad clipping use Python stand-ins for Apex's
    multi-tensor kernels; swap in :func:`_l2_norm_without_sync` and :func:`_scale_in_one_pass`
    (same results; the norm's reduction order differs in the last bits)."""
    try:
        from megatron.core import utils
        from megatron.core.optimizer import clip_grads, optimizer
    except ImportError:
        return False
    applied = False
    if getattr(clip_grads, "l2_norm_impl", None) is getattr(utils, "local_multi_tensor_l2_norm", object()):
        clip_grads.l2_norm_impl = _l2_norm_without_sync
        applied = True
    for mod in (clip_grads, optimizer):
        if getattr(mod, "multi_tensor_scale_impl", None) is getattr(utils, "local_multi_tensor_scale", object()):
            mod.multi_tensor_scale_impl = _scale_in_one_pass
            applied = True
    return applied


_COMPAT_FIXES = (_fix_te_general_gemm, _fix_torch_norm_sequence_parallel, _fix_local_multi_tensor_ops)
_CPU_PATCHES = (
    _patch_current_device,
    _patch_synchronize,
    _patch_streams,
    _patch_cuda_devices,
    _patch_rng_tracker,
    _patch_alltoall_dispatcher,
    _patch_uneven_collectives,
)


def apply_compat_fixes() -> list[str]:
    """Fix megatron-core's no-Transformer-Engine/no-Apex paths (any device). Idempotent."""
    for fix in _COMPAT_FIXES:
        fix()
    return list(_APPLIED)


def apply_cpu_patches() -> list[str]:
    """Make megatron-core run on a CPU-only torch with gloo; returns the names of applied patches.

    Does nothing CUDA-related when CUDA is available (only the compat fixes). Idempotent: a second
    call applies nothing new and returns the same list.
    """
    apply_compat_fixes()
    if not torch.cuda.is_available():
        for patch in _CPU_PATCHES:
            patch()
    return list(_APPLIED)


def applied_patches() -> list[str]:
    """Names of the patches applied so far in this process, in order."""
    return list(_APPLIED)
