"""``mgrpo bench train --syncs``: where a step makes the host wait for the device. One more step of a
system runs under ``torch.cuda.set_sync_debug_mode("warn")`` (CUDA), which warns at every
synchronising call; each warning is counted by the call site: its innermost frames in this
repository and megatron-core (the code that can be changed)."""
from __future__ import annotations

import collections
import traceback
import warnings
from pathlib import Path

__all__ = ["count_syncs", "sync_sites", "OURS", "SITE_FRAMES"]

SITE_FRAMES = 4
"""Frames (innermost first) that name a call site."""

_ROOT = Path(__file__).resolve().parents[2]
OURS = tuple(str(_ROOT / d) for d in ("megatron_grpo", "model_bridge", "launch"))
"""Where a call site's frames come from (with megatron-core's)."""
_MEGATRON = "megatron/core/"


def _site(roots: tuple[str, ...]) -> str:
    frames = [f for f in traceback.extract_stack()[:-2]
              if f.filename.startswith(roots) or _MEGATRON in f.filename.replace("\\", "/")]
    named = [f"{f.filename.replace(str(_ROOT) + '/', '').split('site-packages/')[-1]}:{f.lineno} {f.name}"
             for f in frames]
    return " <- ".join(reversed(named[-SITE_FRAMES:])) or "(outside this repository and megatron-core)"


def sync_sites(fn, roots: tuple[str, ...] = OURS, top: int = 20) -> dict:
    """Run ``fn()`` with every warning about a synchronising call counted by its call site (frames
    under ``roots`` or in megatron-core): ``{"total", "sites": [{"where", "count"}, ...]}``, most
    first, ``top`` of them. Other warnings pass through as usual."""
    seen: collections.Counter = collections.Counter()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                seen[_site(roots)] += 1
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show  # restored by catch_warnings
        fn()
    return {"total": sum(seen.values()), "sites": [{"where": w, "count": c} for w, c in seen.most_common(top)]}


def count_syncs(fn, top: int = 20) -> dict:
    """:func:`sync_sites` of one ``fn()`` under ``torch.cuda.set_sync_debug_mode("warn")``. Off CUDA
    there are none to count (a note)."""
    import torch

    if not torch.cuda.is_available():
        return {"note": "host syncs are counted on CUDA only (torch.cuda.set_sync_debug_mode)"}
    torch.cuda.set_sync_debug_mode("warn")
    try:
        return sync_sites(fn, top=top)
    finally:
        torch.cuda.set_sync_debug_mode(0)
