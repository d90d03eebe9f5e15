"""Megatron dist checkpoints (``torch_dist``) of the thinker, one job per module; the public API is
re-exported by :mod:`model_bridge.checkpoint` (see its docstring for the format)."""
