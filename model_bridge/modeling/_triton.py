"""What the torch backend's Triton kernels share: importing Triton behind a switch, and where they run."""
from __future__ import annotations

import os

TRITON_ON_CPU = os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("MGRPO_TRITON_GLU_CPU") == "1"
"""Tests only: run the Triton kernels through Triton's interpreter on CPU tensors."""


def import_triton(switch: str):
    """``(triton, triton.language)``, or None when the env var ``switch`` is ``"0"`` or Triton does
    not import (the callers then take their torch path)."""
    if os.environ.get(switch, "1") == "0":
        return None
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001
        return None
    return triton, tl


def triton_runs_on(is_cuda: bool) -> bool:
    """Whether a tensor on this device can go through a Triton kernel (CUDA, or the interpreter)."""
    return is_cuda or TRITON_ON_CPU
