"""The checkpoints of a training run directory: where they live and which one is the latest.

Layout (``run_dir/checkpoints/``; ``megatron_grpo.engine.checkpoint`` writes it)::

    latest                        text: "step_00000012" -- written last, atomically (tmp + rename)
    step_00000012/                one complete checkpoint; its META_FILE marks it complete
    .tmp-step_00000014/           a save in progress, or one that died: ignored (warning)

Lookup only (no collectives): the trainer resumes from :func:`find_latest_checkpoint` (with
``verify``: the files of a candidate are checked against megatron's and torch's metadata, and a
damaged one is passed over for the one before it) and ``mgrpo convert mcore-to-hf`` takes a run
directory through it.
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
           "list_checkpoints", "find_latest_checkpoint", "read_run_meta", "checkpoint_problem",
           "CheckpointFilesError", "CheckpointWarning"]

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


COMMON_STATE_FQN = "common_state"
"""megatron-core >= 0.19 keeps the common (non-tensor) state as this object inside the torch_dist
files; older versions write it to ``common.pt``."""


def checkpoint_problem(path: Path) -> Optional[str]:
    """Why the checkpoint files under ``path`` cannot be loaded (one line naming the file), or None.
    Checks what can be checked without reading the tensors: megatron's ``metadata.json`` is there,
    torch's ``.metadata`` reads, the common state is there (``common.pt``, or megatron-core >=
    0.19's ``common_state`` object), and every data file the metadata points into exists and is
    long enough."""
    for name in ("metadata.json", ".metadata"):
        if not (path / name).is_file():
            return f"{path / name} is missing"
    try:
        json.loads((path / "metadata.json").read_text())
        from torch.distributed.checkpoint import FileSystemReader

        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as e:  # noqa: BLE001 - any damage: name the file
        return f"{path / '.metadata'} (or metadata.json) cannot be read: {type(e).__name__}: {str(e)[:200]}"
    if not (path / "common.pt").is_file() and not any(i.fqn.startswith(COMMON_STATE_FQN) for i in storage):
        return f"{path / 'common.pt'} is missing"
    need: dict[str, int] = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        f = path / rel
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size < size:
            return f"{f} is truncated ({f.stat().st_size} of at least {size} bytes)"
    return None


def find_latest_checkpoint(run_dir: os.PathLike | str, *, warn: bool = True, verify: bool = False) -> Optional[Path]:
    """The checkpoint to resume from (see the module doc), or None. Local: no collective.
    ``verify``: pass over damaged checkpoints (:func:`checkpoint_problem`, one warning each) for
    the newest intact one; raises CheckpointFilesError when every complete one is damaged."""
    chosen = _find_latest(run_dir, warn=warn)
    if not verify or chosen is None:
        return chosen
    candidates = [chosen] + [p for _, p in reversed(list_checkpoints(run_dir)) if p != chosen]
    problems = []
    for p in candidates:
        problem = checkpoint_problem(p)
        if problem is None:
            return p
        problems.append(problem)
        if warn:
            warn_checkpoint(f"passing over damaged checkpoint {p.name}: {problem}")
    raise CheckpointFilesError(f"no intact checkpoint under {checkpoint_root(run_dir)}: {problems[0]}"
                               + (f" (and {len(problems) - 1} older one(s) damaged too)" if len(problems) > 1 else "")
                               + "; restore the file from a copy, or start the run over in a new trainer.run_dir")


class CheckpointFilesError(RuntimeError):
    """Every complete checkpoint of a run has missing or damaged files."""


def _find_latest(run_dir: os.PathLike | str, *, warn: bool = True) -> Optional[Path]:
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


class CheckpointWarning(RuntimeWarning):
    """What warn_checkpoint says, for callers that record warnings (``warnings.catch_warnings``);
    the CLI ignores it (``megatron_grpo.notices.quiet_known_notices``): there the log line says it."""


def warn_checkpoint(msg: str) -> None:
    log.warning(msg)
    warnings.warn(msg, CheckpointWarning, stacklevel=3)
