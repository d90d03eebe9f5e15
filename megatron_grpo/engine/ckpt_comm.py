"""The collectives of a distributed checkpoint's save and load (``engine/checkpoint.py``): rank,
world, the device a collective uses, "did any rank fail" (every rank raises), broadcast from rank 0
and barriers; each a no-op without torch.distributed or with one rank. Objects travel as uint8
tensors (``pack`` / ``unpack``), which ``torch.load(weights_only=True)`` accepts."""
from __future__ import annotations

import pickle
from typing import Any, Optional

import torch

__all__ = ["CheckpointError", "pack", "unpack", "dist_or_none", "rank", "world", "comm_device",
           "raise_if_any_failed", "broadcast_from_zero", "barrier"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; raised on every rank."""


def pack(obj: Any) -> torch.Tensor:
    """Arbitrary picklable object -> uint8 tensor (safe for torch.load(weights_only=True))."""
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


def unpack(t) -> Any:
    if isinstance(t, torch.Tensor):
        return pickle.loads(t.cpu().numpy().tobytes())
    return t


def dist_or_none():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    d = dist_or_none()
    return d.get_rank() if d else 0


def world() -> int:
    d = dist_or_none()
    return d.get_world_size() if d else 1


def comm_device():
    d = dist_or_none()
    if d is not None and "nccl" in str(d.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def raise_if_any_failed(error: Optional[BaseException], what: str) -> None:
    """Collective: every rank learns whether one failed; all raise (the failing rank its own error,
    the others a :class:`CheckpointError` naming ``what`` and the first failing rank)."""
    from model_bridge.load import raise_if_any_failed as _any_failed

    _any_failed(error, what, CheckpointError)


def broadcast_from_zero(obj: Any) -> Any:
    d = dist_or_none()
    if d is None or d.get_world_size() == 1:
        return obj
    box = [obj]
    kw = {"device": comm_device()} if comm_device().type == "cuda" else {}
    d.broadcast_object_list(box, src=0, **kw)
    return box[0]


def barrier() -> None:
    d = dist_or_none()
    if d is not None and d.get_world_size() > 1:
        if comm_device().type == "cuda":
            d.barrier(device_ids=[torch.cuda.current_device()])
        else:
            d.barrier()
