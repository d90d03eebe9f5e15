"""RNG states of one process: Python, NumPy, torch CPU, torch CUDA, megatron's TP/EP tracker."""
from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["rng_state", "set_rng_state", "agreeing_host_streams", "set_host_rng", "HOST_STREAMS"]


def rng_state() -> dict:
    """Every RNG state this process uses: Python, NumPy, torch CPU, torch CUDA, megatron's tracker."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch_cpu": torch.get_rng_state(),
             "torch_cuda": None, "megatron_tracker": None}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    try:
        from megatron.core import tensor_parallel

        tracker = tensor_parallel.get_cuda_rng_tracker()
        states = tracker.get_states() if getattr(tracker, "is_initialized", lambda: True)() else {}
        if states and all(torch.is_tensor(v) for v in states.values()):
            state["megatron_tracker"] = {k: v.detach().clone().cpu() for k, v in states.items()}
    except Exception:  # noqa: BLE001 - no megatron, or no tracker yet
        pass
    return state


def set_rng_state(state: dict) -> None:
    """Inverse of :func:`rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if state.get("torch_cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["torch_cuda"])
    if state.get("megatron_tracker"):
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(dict(state["megatron_tracker"]))


HOST_STREAMS = {"python": "Python", "numpy": "NumPy", "torch_cpu": "torch CPU"}


def _equal(x, y) -> bool:
    """RNG states equal by value (pickles of equal tensors differ)."""
    if torch.is_tensor(x) or torch.is_tensor(y):
        return torch.is_tensor(x) and torch.is_tensor(y) and torch.equal(x, y)
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return np.array_equal(x, y)
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        return len(x) == len(y) and all(_equal(u, v) for u, v in zip(x, y))
    return x == y


def agreeing_host_streams(states: list[dict]) -> list[str]:
    """The host streams (keys of :data:`HOST_STREAMS`) that every one of ``states`` has alike."""
    return [k for k in HOST_STREAMS if all(_equal(s[k], states[0][k]) for s in states[1:])]


def set_host_rng(state: dict, streams) -> None:
    """Restore the given host streams of a :func:`rng_state`."""
    if "python" in streams:
        random.setstate(state["python"])
    if "numpy" in streams:
        np.random.set_state(state["numpy"])
    if "torch_cpu" in streams:
        torch.set_rng_state(state["torch_cpu"])
