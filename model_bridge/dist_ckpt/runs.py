"""The checkpoints of a training run directory: where they live and which one is the latest.

Layout (``run_dir/checkpoints/``; ``megatron_grpo.engine.checkpoint`` writes it)::

    latest                        text: "step_00000012" -- written last, atomically (tmp + rename)
    step_00000012/                one complete checkpoint; its META_FILE marks it complete
    .tmp-step_00000014/           a save in progress, or one that died: ignored (warning)

Lookup only (no collectives, no torch): the trainer resumes from :func:`find_latest_checkpoint` and
``mgrpo convert mcore-to-hf`` takes a run directory through it.
"""
from __future__ import annotations

import json
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Optional

__all__ = ["CHECKPOINT_FORMAT", "META_FILE", "LATEST_FILE", "checkpoint_root", "step_dirname",
           "list_checkpoints", "find_latest_checkpoint", "read_run_meta"]

log = logging.getLogger("megatron_grpo.engine.checkpoint")  # the trainer's checkpoint log, where users look

CHECKPOINT_FORMAT = "megatron-grpo/1"
META_FILE = "mgrpo_checkpoint.json"
LATEST_FILE = "latest"
STEP_RE = re.compile(r"^step_(\d{8,})$")
TMP_PREFIX = ".tmp-"
DEL_PREFIX = ".del-"


def checkpoint_root(run_dir: os.PathLike | str) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dirname(step: int) -> str:
    return f"step_{int(step):08d}"


def read_run_meta(path: Path) -> Optional[dict]:
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT or "step" not in meta:
        return None
    return meta


def list_checkpoints(run_dir: os.PathLike | str) -> list[tuple[int, Path]]:
    """Complete checkpoints ``(step, path)`` under ``run_dir``, oldest first."""
    root = checkpoint_root(run_dir)
    out = []
    if not root.is_dir():
        return out
    for p in root.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir() and read_run_meta(p) is not None:
            out.append((int(m.group(1)), p))
    return sorted(out)


def find_latest_checkpoint(run_dir: os.PathLike | str, *, warn: bool = True) -> Optional[Path]:
    """The checkpoint to resume from (see the module doc), or None. Local: no collective."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return None
    if warn:
        for p in sorted(root.iterdir()):
            if p.name.startswith(TMP_PREFIX):
                warn_checkpoint(f"ignoring incomplete checkpoint {p} (a save that did not finish)")
            elif STEP_RE.match(p.name) and p.is_dir() and read_run_meta(p) is None:
                warn_checkpoint(f"ignoring {p}: it has no valid {META_FILE}, so it is not a complete checkpoint")
    good = list_checkpoints(run_dir)
    marker = root / LATEST_FILE
    if marker.exists():
        name = marker.read_text().strip()
        cand = root / name
        if STEP_RE.match(name) and read_run_meta(cand) is not None:
            return cand
        if warn:
            warn_checkpoint(f"{marker} names {name!r}, which is not a complete checkpoint; "
                            + (f"using the newest complete one, {good[-1][1].name}" if good
                               else "no complete checkpoint found"))
    elif good and warn:
        warn_checkpoint(f"{marker} is missing; using the newest complete checkpoint, {good[-1][1].name}")
    return good[-1][1] if good else None


def warn_checkpoint(msg: str) -> None:
    log.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
