"""Named host ranges of the training step, for ``torch.profiler`` (``mgrpo bench train --profile``
attributes the device's idle time to them: ``launch.bench._idle``).

``host_range("pack")`` is ``torch.profiler.record_function("mgrpo/pack")``: with no profiler running it
costs a few microseconds, and a step opens a few dozen of them.
"""
from __future__ import annotations

import torch

PREFIX = "mgrpo/"
"""What every range name here starts with (the profile's attribution keeps only these)."""

__all__ = ["PREFIX", "host_range"]


def host_range(name: str) -> torch.profiler.record_function:
    """A context manager: the host range ``mgrpo/<name>`` in a profile."""
    return torch.profiler.record_function(PREFIX + name)
