"""Skipped updates: a step whose gradients are not finite on some rank skips the optimizer update on
every rank; too many in a row stop the run. The counters are part of the trainer's checkpoint."""
from __future__ import annotations

from typing import Optional

__all__ = ["NonFiniteGradError", "NonFiniteSkips"]


class NonFiniteGradError(RuntimeError):
    """Too many consecutive steps with non-finite gradients; raised on every rank."""


class NonFiniteSkips:
    """Counts consecutive skipped updates; raises after ``max_consecutive`` of them."""

    def __init__(self, max_consecutive: int = 3):
        self.max_consecutive = int(max_consecutive)
        self.consecutive = 0
        self.total = 0

    def record(self, skipped: bool, grad_norm: float, step: Optional[int] = None) -> None:
        if not skipped:
            self.consecutive = 0
            return
        self.consecutive += 1
        self.total += 1
        if self.consecutive >= self.max_consecutive:
            where = "" if step is None else f" (at step {step})"
            raise NonFiniteGradError(
                f"{self.consecutive} consecutive training steps had non-finite gradients (grad norm {grad_norm}); "
                f"the update was skipped each time and the run stops{where}. Lower the LR, check the rewards / "
                f"advantages for NaN, or raise StepConfig.max_consecutive_skips (now {self.max_consecutive})")

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive, "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive = int(state.get("consecutive", 0))
        self.total = int(state.get("total", 0))
