"""Skipped updates: a step whose gradients are not finite on some rank skips the optimizer update on
every rank; too many in a row stop the run. The counters are part of the trainer's checkpoint.
A skipped step names the parameters whose gradients are not finite on each rank
(:func:`nonfinite_grads`), down to the experts of a stacked expert weight, so a NaN can be traced
to a layer without rerunning under hooks."""
from __future__ import annotations

import logging
from typing import Iterable, Optional

import torch

__all__ = ["NonFiniteGradError", "NonFiniteSkips", "nonfinite_grads", "log_nonfinite"]

log = logging.getLogger("megatron_grpo.engine.nonfinite")

MAX_NAMED = 8
"""Parameters named in a skipped step's log line (the rest are counted): a NaN that spread
through the whole model would otherwise print every parameter of it."""


def _listed(names: list[str]) -> str:
    """The first :data:`MAX_NAMED` names, the rest counted."""
    more = f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else ""
    return "; ".join(names[:MAX_NAMED]) + more


def _runs(indices: list[int]) -> str:
    """``[5, 6, 7, 9]`` -> ``"5-7, 9"``."""
    out, start = [], None
    for i, v in enumerate(indices):
        if start is None:
            start = v
        if i + 1 == len(indices) or indices[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)


def nonfinite_grads(chunks: Iterable[torch.nn.Module]) -> list[str]:
    """This rank's parameters whose gradient (megatron's ``main_grad``, else ``.grad``) holds a NaN or
    an infinity, by name; a 3-D expert weight (``[E, out, in]``, a name with ``experts``) lists its
    local experts that do, as runs (``"decoder.layers.1.mlp.experts.weight2 (local experts 50-79)"``).
    One device-to-host copy for the whole model; meant for skipped steps only (it reads every
    gradient once)."""
    from model_bridge.load import unwrap_model

    named, flags = [], []
    for chunk in chunks:
        for name, p in unwrap_model(chunk).named_parameters():  # names without DDP's `module.` prefixes
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is None or g.numel() == 0:
                continue
            per_expert = g.dim() == 3 and "experts" in name
            # not finite per expert (rows of a stacked expert weight), or one flag for the tensor
            bad = ~torch.isfinite(g).reshape(g.shape[0], -1).all(1) if per_expert else ~torch.isfinite(g).all().view(1)
            named.append((name, per_expert))
            flags.append(bad)
    if not flags:
        return []
    host = torch.cat(flags).cpu().tolist()
    out, pos = [], 0
    for (name, per_expert), f in zip(named, flags):
        vals, pos = host[pos:pos + f.numel()], pos + f.numel()
        if per_expert and any(vals):
            out.append(f"{name} (local experts {_runs([i for i, v in enumerate(vals) if v])})")
        elif not per_expert and vals[0]:
            out.append(name)
    return out


def log_nonfinite(chunks: Iterable[torch.nn.Module], grad_norm: float, step: Optional[int] = None,
                  rank: Optional[int] = None) -> list[str]:
    """Log (warning) which of this rank's parameters have non-finite gradients; returns their names."""
    names = nonfinite_grads(chunks)
    where = "" if step is None else f"step {step}: "
    who = "" if rank is None else f" on rank {rank}"
    if names:
        log.warning("%supdate skipped (grad norm %s); non-finite gradients%s in %s", where, grad_norm, who,
                    _listed(names))
    else:
        log.warning("%supdate skipped (grad norm %s); every gradient%s is finite (another rank's are not)",
                    where, grad_norm, who)
    return names


class NonFiniteGradError(RuntimeError):
    """Too many consecutive steps with non-finite gradients; raised on every rank."""


class NonFiniteSkips:
    """Counts consecutive skipped updates; raises after ``max_consecutive`` of them."""

    def __init__(self, max_consecutive: int = 3):
        self.max_consecutive = int(max_consecutive)
        self.consecutive = 0
        self.total = 0

    def record(self, skipped: bool, grad_norm: float, step: Optional[int] = None,
               nonfinite: Optional[list[str]] = None) -> None:
        """Count one step; ``nonfinite``: the parameters :func:`nonfinite_grads` named for it on this rank."""
        if not skipped:
            self.consecutive = 0
            return
        self.consecutive += 1
        self.total += 1
        if self.consecutive >= self.max_consecutive:
            where = "" if step is None else f" (at step {step})"
            named = f" The last one's non-finite gradients on this rank: {_listed(nonfinite)}." if nonfinite else ""
            raise NonFiniteGradError(
                f"{self.consecutive} consecutive training steps had non-finite gradients (grad norm {grad_norm}); "
                f"the update was skipped each time and the run stops{where}.{named} Lower the LR, check the rewards "
                f"/ advantages for NaN, or raise StepConfig.max_consecutive_skips (now {self.max_consecutive})")

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive, "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive = int(state.get("consecutive", 0))
        self.total = int(state.get("total", 0))
