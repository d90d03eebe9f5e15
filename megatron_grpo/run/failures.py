"""A rollout that fails ends the run on every rank with one line; the full trace goes to the run dir.

Rank 0 rolls out; when that raises, it hands the other ranks a `RolloutFailed` instead of the
trajectories (through the same broadcast), so they stop together and quietly instead of each
printing a collective's traceback when rank 0 goes away.
"""
from __future__ import annotations

import traceback
from pathlib import Path

ERROR_LOG = "error.log"
"""run_dir/error.log: the full traceback of the error that ended the run."""

_FIXES = {
    "ServerError": "the vLLM server stopped; read its log (run_dir/vllm-server.log) for the cause",
    "ClientConnectorError": "the vLLM server stopped answering; read its log (run_dir/vllm-server.log)",
}


class RolloutFailed(RuntimeError):
    """Picklable one-line reason a step's rollout failed, raised on every rank."""


def rollout_failure(e: BaseException, run_dir: str | Path) -> RolloutFailed:
    """Append `e`'s full traceback to run_dir/error.log and return the one-line `RolloutFailed`:
    the exception's first line, the fix where the message does not already name one, the log."""
    log = Path(run_dir) / ERROR_LOG
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            f.write("".join(traceback.format_exception(e)))
        where = f"full trace in {log}"
    except OSError:
        where = "the trace could not be written to the run dir"
    first = (str(e).strip().splitlines() or [""])[0] or "(no message)"
    fix = _FIXES.get(type(e).__name__)
    return RolloutFailed(f"{type(e).__name__}: {first}" + (f"; {fix}" if fix else "") + f" ({where})")
