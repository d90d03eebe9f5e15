"""The torch Adam inside megatron's distributed optimizer, around a checkpoint's save and load
(``engine/checkpoint.py``, module doc: the three megatron-core quirks without Transformer Engine or
Apex): a state before the first step, ``step`` kept where the checkpoint has none, one ``step``
tensor per parameter after loading."""
from __future__ import annotations

import torch

__all__ = ["inner_optimizers", "init_optimizer_state", "keep_adam_step_on_load", "fix_shared_adam_steps"]


def inner_optimizers(optimizer) -> list:
    """The megatron sub-optimizers (a ChainedOptimizer's parts, or the optimizer itself)."""
    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if not getattr(o, "is_stub_optimizer", False)]


def is_torch_adam(opt) -> bool:
    return isinstance(opt, (torch.optim.Adam, torch.optim.AdamW))


def init_optimizer_state(optimizer) -> None:
    """Give a fresh torch Adam inside megatron's DistributedOptimizer a state (zeros, step 0), so its
    ``state_dict()`` works before loading (see the module doc; values are overwritten by the load)
    and a checkpoint of a run that has not stepped yet holds Adam moments (``mgrpo bench checkpoint``)."""
    try:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    except ImportError:  # pragma: no cover
        return
    for sub in inner_optimizers(optimizer):
        inner = getattr(sub, "optimizer", None)
        if not isinstance(sub, DistributedOptimizer) or not is_torch_adam(inner):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    st = {"step": torch.tensor(0.0, dtype=torch.float32),
                          "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                          "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
                    if group.get("amsgrad"):
                        st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group.get("capturable") or group.get("fused"):
                        st["step"] = st["step"].to(p.device)
                    inner.state[p] = st


def keep_adam_step_on_load(optimizer) -> None:
    """megatron's ``fully_reshardable`` load copies every state of the inner optimizer from the
    checkpoint, but stores no ``step`` (the param groups carry it): with torch's Adam, whose state
    holds ``step``, it would raise KeyError. Keys the checkpoint lacks keep their current value."""
    try:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    except ImportError:  # pragma: no cover
        return
    for sub in inner_optimizers(optimizer):
        if not isinstance(sub, DistributedOptimizer) or not is_torch_adam(getattr(sub, "optimizer", None)) \
                or "_set_main_param_and_optimizer_states" in vars(sub):
            continue
        original = sub._set_main_param_and_optimizer_states

        def keep_missing(model_param, tensors, _sub=sub, _original=original):
            group_index, group_order = _sub.model_param_group_index_map[model_param]
            main_param = _sub.optimizer.param_groups[group_index]["params"][group_order]
            for k, v in _sub.optimizer.state[main_param].items():
                tensors.setdefault(k, v)
            return _original(model_param, tensors)

        sub._set_main_param_and_optimizer_states = keep_missing


def fix_shared_adam_steps(optimizer) -> None:
    """One ``step`` tensor per parameter, with the value megatron restored into the param groups."""
    for sub in inner_optimizers(optimizer):
        inner = getattr(sub, "optimizer", None)
        if not is_torch_adam(inner):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state.get(p)
                if not st or "step" not in st or not torch.is_tensor(st["step"]):
                    continue
                value = group["step"] if "step" in group else st["step"].item()
                st["step"] = torch.tensor(float(value), dtype=st["step"].dtype, device=st["step"].device)
