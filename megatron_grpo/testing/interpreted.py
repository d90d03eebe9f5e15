"""Tests of the torch backend's Triton kernels on CPU: Triton's interpreter, in a fresh process.

The kernels read ``TRITON_INTERPRET`` when Triton is imported and ``MGRPO_TRITON_GLU_CPU`` when
``model_bridge.modeling._triton`` is, so each check runs in a child process with both set.
"""
from __future__ import annotations

from typing import Any, Callable

from model_bridge.spawn import run_ranks

INTERPRETED_ENV = {"TRITON_INTERPRET": "1", "MGRPO_TRITON_GLU_CPU": "1"}

KERNEL_SWITCHES = ("GLU", "ROUTING", "NORM", "ROPE", "EMPTY_GROUPS", "EMBED", "AUDIO_CONV", "GRAD_ACCUM", "ADAMW")
"""The ``MGRPO_TRITON_<name>`` switches of the torch backend's and the engine's Triton kernels."""


def interpreting_only(*kernels: str) -> dict[str, str]:
    """The env of a child process that runs ``kernels`` (names from :data:`KERNEL_SWITCHES`) under
    Triton's interpreter and every other kernel's torch path: a whole-engine test of one kernel then
    pays the interpreter for that kernel alone (interpreted, the model's kernels take most of a
    step's time)."""
    unknown = set(kernels) - set(KERNEL_SWITCHES)
    if unknown:
        raise ValueError(f"unknown kernel switches {sorted(unknown)}; known: {', '.join(KERNEL_SWITCHES)}")
    return {**INTERPRETED_ENV, **{f"MGRPO_TRITON_{k}": "0" for k in KERNEL_SWITCHES if k not in kernels}}


def _in_child(kernels: Callable[[], Any], fn: Callable[..., Any], args: tuple):
    from model_bridge.modeling._triton import TRITON_ON_CPU

    if not TRITON_ON_CPU or kernels() is None:
        return None
    return fn(*args)


def run_interpreted(kernels: Callable[[], Any], fn: Callable[..., Any], *args: Any, timeout: float = 600) -> Any:
    """``fn(*args)`` in one child process under Triton's interpreter; ``kernels`` (the module's
    kernel factory, None when Triton is unusable) is checked first there. Skips the calling test
    when Triton is missing or its interpreter cannot run here."""
    import pytest

    pytest.importorskip("triton")
    res = run_ranks(_in_child, 1, kernels, fn, args, timeout=timeout, env=INTERPRETED_ENV)[0]
    if res is None:
        pytest.skip("Triton's interpreter is not usable here")
    return res
