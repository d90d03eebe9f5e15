"""What lets a training checkpoint load at another TP/PP/EP/ETP/DP layout.

* The optimizer is stored in megatron-core's ``fully_reshardable`` form: every fp32 main parameter
  and Adam moment as a tensor of its model parameter's shape, under that parameter's own key
  (``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``), sharded like the parameter. With
  ``chained_optim_avoid_prefix`` the keys do not depend on how megatron splits the parameters
  between its dense and expert sub-optimizers either.
* Vocab-parallel tensors (embedding, output layer, and their optimizer states) are stored with
  the real vocab's rows only: megatron pads the vocab to a multiple of 128 * TP, so the padded
  shape belongs to the layout, not to the model. On load the padding rows come back as zeros,
  which is what they hold in training (never indexed, masked out of the softmax, zero moments).
* Layouts are compared and described here; a checkpoint that cannot load at the new layout is
  refused before anything is read, in one line naming both layouts and the fix.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

FULLY_RESHARDABLE = "fully_reshardable"
LAYOUT_KEYS = ("tp", "pp", "ep", "etp", "dp", "world_size")
MODEL_PARALLEL_KEYS = ("tp", "pp", "ep", "etp")
VOCAB_PARAMS = ("language_model.embedding.word_embeddings.weight", "language_model.output_layer.weight")


def optimizer_metadata(sharding: str) -> dict:
    """``metadata`` for megatron's ``optimizer.sharded_state_dict``."""
    return {"distrib_optim_sharding_type": sharding, "chained_optim_avoid_prefix": sharding == FULLY_RESHARDABLE}


def describe_layout(layout: dict) -> str:
    """``tp2 pp1 ep1 etp1 dp1 (2 ranks)``."""
    parts = " ".join(f"{k}{layout[k]}" for k in LAYOUT_KEYS[:-1] if k in layout)
    return f"{parts} ({layout.get('world_size', '?')} ranks)"


def layout_changed(saved: dict, now: dict) -> bool:
    return any(saved.get(k) != now.get(k) for k in LAYOUT_KEYS if k in saved and k in now)


def check_resumable(ckpt, meta: dict, now: dict) -> None:
    """Raise ValueError (one line: both layouts and the fix) when ``ckpt`` cannot load at ``now``."""
    saved = meta.get("layout", {})
    moved = [k for k in MODEL_PARALLEL_KEYS if k in saved and k in now and saved[k] != now[k]]
    if not moved:
        return
    if meta.get("optimizer") and meta.get("optimizer_sharding", "dp_reshardable") != FULLY_RESHARDABLE:
        why = f"its optimizer is stored as {meta.get('optimizer_sharding', 'dp_reshardable')!r}, which reloads "
    elif not meta.get("vocab_unpadded"):
        why = "its vocab-parallel tensors are stored padded for its TP size, which reloads "
    else:
        return
    same = " ".join(f"parallel.{k}={saved[k]}" for k in MODEL_PARALLEL_KEYS if k in saved)
    raise ValueError(f"cannot resume {ckpt} (saved at {describe_layout(saved)}) at {describe_layout(now)}: {why}"
                     f"only at the same TP/PP/EP/ETP (any DP); resume with {same} and any parallel.nproc that "
                     "fits; its next checkpoint is then saved layout-free")


# ------------------------------------------------------------------------------------------------
# vocab padding
# ------------------------------------------------------------------------------------------------


def _walk(obj: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _walk(v, path + (i,))
    else:
        yield path, obj


def _get(obj: Any, path: tuple) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def _set(obj: Any, path: tuple, value: Any) -> None:
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


def _delete(obj: Any, path: tuple) -> None:
    parent = _get(obj, path[:-1])
    if isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = None


def vocab_keys(model_sds: list[dict]) -> set[str]:
    """The sharded keys of this rank's vocab-parallel tensors."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {sd[n].key for sd in model_sds for n in VOCAB_PARAMS if isinstance(sd.get(n), ShardedTensor)}


def unpad_vocab(sd: dict, keys: set[str], vocab_size: int) -> list[tuple[tuple, torch.Size, torch.dtype]]:
    """In place: every ShardedTensor of ``sd`` that is (a state of) a vocab-parallel tensor becomes
    its rows below ``vocab_size`` (removed on a rank that holds padding only). Returns, per entry,
    ``(path, padded local shape, dtype)`` for :func:`repad_vocab`."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from model_bridge.dist_ckpt.sharded import _unpadded_vocab

    changed = []
    for path, sh in list(_walk(sd)):
        if not isinstance(sh, ShardedTensor) or not any(sh.key == k or sh.key.endswith("." + k) for k in keys):
            continue
        if sh.global_shape[0] == vocab_size:
            continue
        changed.append((path, torch.Size(sh.local_shape), sh.dtype))
        piece = _unpadded_vocab(sh, vocab_size)
        if piece is None:
            _delete(sd, path)
        else:
            _set(sd, path, piece)
    return changed


def repad_vocab(loaded: dict, changed: list[tuple[tuple, torch.Size, torch.dtype]]) -> None:
    """In place: the loaded unpadded rows back at their padded local shape, padding rows zero."""
    for path, shape, dtype in changed:
        try:
            rows = _get(loaded, path)
        except (KeyError, IndexError):
            rows = None
        full = torch.zeros(shape, dtype=dtype)
        if torch.is_tensor(rows) and rows.numel():
            full = full.to(rows.device)
            full[:rows.shape[0]].copy_(rows)
        _set(loaded, path, full)


# ------------------------------------------------------------------------------------------------
# optimizer: per-parameter tensors plus one set of param groups, whatever the sub-optimizers
# ------------------------------------------------------------------------------------------------


def _group_keys() -> tuple:
    try:
        from megatron.core.optimizer.optimizer import param_group_identifier_keys

        return tuple(param_group_identifier_keys)
    except ImportError:  # pragma: no cover
        return ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")


def _subs(optimizer, osd: dict) -> list[dict]:
    """The per-sub-optimizer state dicts of megatron's (Chained)Optimizer.sharded_state_dict."""
    if len(getattr(optimizer, "chained_optimizers", [optimizer])) == 1:
        return [osd]
    return [osd[i] for i in sorted(osd)]


def split_optimizer_sd(optimizer, osd: dict) -> dict:
    """megatron's fully_reshardable optimizer state dict as stored: the tensors of every
    sub-optimizer (keyed by model parameter, so where a parameter lives does not matter) and one
    union of the param groups (hyper-parameters, step), identified as megatron identifies them.
    megatron splits its optimizer into dense and expert parts only at some layouts (not at EP1 with
    ETP=TP), so its own nesting is not layout-free."""
    subs = _subs(optimizer, osd)
    keys = _group_keys()
    groups: dict = {}
    for sub in subs:
        for g in sub["optimizer"]["param_groups"]:
            groups.setdefault(tuple(repr(g.get(k)) for k in keys), g)
    common = {"param_groups": list(groups.values()), "sharding": subs[0]["param_state_sharding_type"]}
    if "grad_scaler" in subs[0]:
        common["grad_scaler"] = subs[0]["grad_scaler"]
    # a dict, not a list: megatron merges the saved common structure into the loaded one by key,
    # and another layout may have another number of sub-optimizers
    return {"tensors": {i: sub["param_state"] for i, sub in enumerate(subs)}, "common": common}


def _matching_group(saved: list[dict], group: dict, keys: tuple) -> dict:
    """The saved param group for one of this layout's groups: the one with the same identifiers,
    else the same ones but ``is_expert_parallel`` (megatron keeps expert parameters with the dense
    ones when ep=1 and etp=tp, so a checkpoint of that layout has no expert group; the
    hyper-parameters and step are the same)."""
    want = tuple(repr(group.get(k)) for k in keys)
    for relaxed in (False, True):
        for g in saved:
            have = tuple(repr(g.get(k)) for k in keys)
            if all(h == w or (relaxed and k == "is_expert_parallel") for k, h, w in zip(keys, have, want)):
                return {**g, **{k: group[k] for k in keys if k in group}}
    raise ValueError(f"the checkpoint has no optimizer param group like this run's "
                     f"{dict(zip(keys, want))} (saved: {[dict(zip(keys, (g.get(k) for k in keys))) for g in saved]})")


def join_optimizer_sd(optimizer, stored: dict) -> dict:
    """Inverse of :func:`split_optimizer_sd` for this layout's optimizer (after loading): every
    sub-optimizer gets the saved param groups matching its own."""
    common, keys = stored["common"], _group_keys()
    subs = []
    for i, part in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        groups = [_matching_group(common["param_groups"], g, keys) for g in part.optimizer.param_groups]
        sub = {"optimizer": {"param_groups": groups}, "param_state_sharding_type": common["sharding"],
               "param_state": stored["tensors"][i]}
        if "grad_scaler" in common:
            sub["grad_scaler"] = common["grad_scaler"]
        subs.append(sub)
    return subs[0] if len(subs) == 1 else dict(enumerate(subs))
