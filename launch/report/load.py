"""What a run recorded, found from its run dir: the recordings of each step, the metrics, the model.

Sources, best first per step: ``rollout.record_dir`` (every sample; trainer logprobs in
``step_k.trainer.pt`` beside it), then ``<run_dir>/trajectories`` (``logging.trajectories``). A run
dir may also be a recording itself (it holds ``manifest.json``). Every bad input raises
:class:`ReportError` with one line naming the file and the fix.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_grpo.run.replay import FORMAT, MANIFEST, step_path
from megatron_grpo.run.trajlog import TRAJECTORIES_DIR, trainer_logprobs_path

RECORD_HINT = "train with logging.trajectories.every=N (or rollout.record_dir=DIR) to record them"


class ReportError(ValueError):
    """A one-line message naming the bad input and the fix."""


@dataclass
class Recording:
    """One directory of recorded steps and its manifest."""

    dir: Path
    manifest: dict
    kind: str
    """'record_dir' or 'trajectories'."""


@dataclass
class RunInputs:
    run_dir: Path
    config: dict
    recordings: dict[int, Recording]
    """The recording each step is read from."""
    metrics: dict[int, dict]
    """metrics.jsonl rows by step ({} without a metrics.jsonl)."""
    dirs: list[Path]
    """Every recording directory found, best first."""


def _manifest(d: Path) -> Optional[dict]:
    p = d / MANIFEST
    if not p.is_file():
        return None
    try:
        m = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ReportError(f"{p} is not JSON ({e}): record the run again, or remove that directory") from None
    if m.get("format") != FORMAT or not isinstance(m.get("steps"), list):
        raise ReportError(f"{p}: recording format {m.get('format')!r}, this report reads {FORMAT}: "
                          "report with the version of mgrpo that recorded it")
    return m


def _record_dir(run: Path, config: dict) -> Optional[Path]:
    rd = (config.get("rollout") or {}).get("record_dir")
    if not rd:
        return None
    for cand in (Path(rd), run / rd, run.parent / rd):
        if cand.is_dir():
            return cand
    return Path(rd)


def find_inputs(run_dir) -> RunInputs:
    from megatron_grpo.metrics import read_metrics

    run = Path(run_dir)
    if not run.is_dir():
        raise ReportError(f"{run} does not exist: pass the trainer.run_dir of a `mgrpo train` run")
    cfg_path = run / "config.json"
    try:
        config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ReportError(f"{cfg_path} is not JSON ({e}): pass the trainer.run_dir of a `mgrpo train` run") from None
    own = _manifest(run)
    if not config and own is None:
        raise ReportError(f"{run} has no config.json: not a run directory of `mgrpo train` (pass its "
                          "trainer.run_dir, or a rollout.record_dir)")
    dirs = []
    if own is not None:
        dirs.append((run, own, "record_dir"))
    rd = _record_dir(run, config)
    if rd is not None and own is None:
        m = _manifest(rd) if rd.is_dir() else None
        if m is not None:
            dirs.append((rd, m, "record_dir"))
    light = run / TRAJECTORIES_DIR
    if light.is_dir():
        m = _manifest(light)
        if m is None:
            raise ReportError(f"{light} has no {MANIFEST}: not written by logging.trajectories; remove it and "
                              f"{RECORD_HINT}")
        dirs.append((light, m, "trajectories"))
    recordings: dict[int, Recording] = {}
    for d, m, kind in dirs:
        for s in m["steps"]:
            recordings.setdefault(int(s), Recording(d, m, kind))
    if not recordings:
        where = (f"no {light}/ and rollout.record_dir is unset in {cfg_path}" if rd is None else
                 f"rollout.record_dir {rd} from {cfg_path} does not exist" if not rd.is_dir() else
                 f"rollout.record_dir {rd} has no {MANIFEST}")
        raise ReportError(f"{run} has no recorded trajectories ({where}): {RECORD_HINT}")
    metrics = {}
    if (run / "metrics.jsonl").is_file():
        try:
            metrics = {int(r["step"]): r for r in read_metrics(run / "metrics.jsonl")}
        except ValueError as e:
            raise ReportError(str(e)) from None
    return RunInputs(run, config, recordings, metrics, [d for d, _, _ in dirs])


def _ranges(steps) -> str:
    out, steps = [], sorted(steps)
    i = 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        out.append(str(steps[i]) if i == j else f"{steps[i]}-{steps[j]}")
        i = j + 1
    return ", ".join(out)


def select_steps(inputs: RunInputs, spec: Optional[str]) -> list[int]:
    """The recorded steps ``--steps`` names: ``N``, ``A:B`` (inclusive), ``A:`` or ``:B``; all when None."""
    have = sorted(inputs.recordings)
    if spec is None:
        return have
    m = re.fullmatch(r"\s*(\d*)\s*(:?)\s*(\d*)\s*", spec)
    if not m or (not m.group(2) and not m.group(1)):
        raise ReportError(f"--steps {spec!r}: use N, A:B, A: or :B (step numbers, B included)")
    lo = int(m.group(1)) if m.group(1) else 0
    hi = int(m.group(3)) if m.group(3) else (lo if not m.group(2) else 1 << 62)
    if lo > hi:
        raise ReportError(f"--steps {spec.strip()}: the range is reversed; pass {hi}:{lo}")
    chosen = [s for s in have if lo <= s <= hi]
    if not chosen:
        what = f"step {lo} is not" if not m.group(2) else f"no step in {spec.strip()} is"
        dirs = ", ".join(str(d) for d in inputs.dirs)
        raise ReportError(f"{what} recorded in {dirs} (recorded: {_ranges(have)}): choose --steps among those")
    return chosen


def _torch_load(path: Path, step: int, what: str):
    import torch

    if not path.is_file():
        raise ReportError(f"{path} is missing though {path.parent / MANIFEST} lists step {step}: record that step "
                          "again, or leave it out with --steps")
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError/EOFError/UnpicklingError for a bad file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ReportError(f"{path} is truncated or not {what} ({first}): record step {step} again, or leave it "
                          "out with --steps") from None


def load_step(rec: Recording, step: int) -> dict:
    """The step's payload: ``trajectories``, ``clips``, ``stats``, ``trainer_logprobs`` (list, or None
    where not recorded) and ``sample_index`` (each trajectory's position in the step)."""
    p = step_path(rec.dir, step)
    payload = _torch_load(p, step, "a recorded step")
    if not isinstance(payload, dict) or "trajectories" not in payload or "clips" not in payload:
        raise ReportError(f"{p} is not a recorded step (no trajectories/clips): record step {step} again")
    n = len(payload["trajectories"])
    lps = payload.get("trainer_logprobs")
    side = trainer_logprobs_path(rec.dir, step)
    if lps is None and side.is_file():
        lps = _torch_load(side, step, "a trainer-logprob file").get("trainer_logprobs")
    if lps is not None and len(lps) != n:
        raise ReportError(f"{side} holds trainer logprobs of {len(lps)} samples but {p} records {n}: "
                          f"remove {side.name} (it belongs to another recording)")
    payload["trainer_logprobs"] = lps if lps is not None else [None] * n
    payload.setdefault("sample_index", list(range(n)))
    payload.setdefault("stats", {})
    return payload
