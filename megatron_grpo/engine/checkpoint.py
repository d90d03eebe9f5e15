"""Distributed training checkpoints: save, find the latest complete one, resume exactly.

Layout (``run_dir/checkpoints/``)::

    latest                        text: "step_00000012" -- written last, atomically (tmp + rename)
    step_00000012/                one complete checkpoint (megatron dist_checkpointing, torch_dist)
        mgrpo_checkpoint.json     our metadata; its presence marks the directory complete
        metadata.json, common.pt  megatron's: format, the common (rank-0) state (megatron-core >= 0.19
                                  keeps the common state in the .distcp files instead of common.pt)
        __*_*.distcp              the sharded tensors and objects of every rank
    .tmp-step_00000014/           a save in progress, or one that died: ignored on load (warning)

What one checkpoint holds (every rank contributes its shards), in a layout-free form
(``engine/reshard.py``): it loads at any TP/PP/EP/ETP/DP the model allows.

* ``model`` (``model0``, ``model1``, ... with several virtual-pipeline chunks): each chunk's
  megatron ``sharded_state_dict()`` (DDP / Float16Module wrappers stripped), vocab-parallel
  tensors with the real vocab's rows only (the padding depends on TP);
* ``optimizer``: ``tensors``: the distributed optimizer's fp32 main parameters and Adam moments
  in megatron's ``fully_reshardable`` form (model-shaped, keyed by parameter; each written by one
  DP rank, built one bucket at a time: ``engine/optim_state.py``), ``common``: one list of param
  groups (hyper-parameters, step);
* ``scheduler``: ``OptimizerParamScheduler.state_dict()`` and the step (common state, rank 0);
* ``rank_state``: one object per rank (a ``ShardedObject`` of shape ``[world]``): its RNG states
  (Python, NumPy, torch CPU, torch CUDA, megatron's TP/EP RNG tracker) and ``extra_state`` (the
  data iterator's position, the skipped-update counters, ...: anything picklable).

Save protocol (all ranks call :func:`save_checkpoint`): rank 0 creates ``.tmp-step_N``; all ranks
write their shards into it with ``dist_checkpointing.save``; rank 0 writes
``mgrpo_checkpoint.json``, renames the directory to ``step_N`` (atomic on one file system), then
replaces ``latest``, then deletes older checkpoints beyond ``keep_last`` -- only after the new one is
complete, and never the one just written, so a crash at any point leaves at least one good
checkpoint. A failure on any rank in the steps around the megatron save is raised on every rank.

Load (:func:`load_checkpoint`, all ranks): rank 0 picks the checkpoint (``latest`` if it names a
complete one, else the highest complete ``step_*``, with a warning; ``.tmp-*`` directories are
ignored with a warning; one whose files are missing or short is passed over, with a warning) and
broadcasts its path; every rank loads model, optimizer, scheduler and its own RNG states and extra
state, and gets ``(step, extra_state)`` back. Training continues at ``step + 1``; on CPU that step
is bit-identical to an uninterrupted run (tested). At another layout (any of TP/PP/EP/ETP/DP or
the world size differs) the model and optimizer reshard, every rank gets rank 0's
``extra_state`` and host RNG streams (when the saved ranks' agree), the device streams restart
from the seed, and rank 0 says so (the change from -> to, and the RNG consequence: one line each).

Three megatron-core quirks are handled in ``engine/ckpt_adam.py`` (both when neither Transformer Engine nor Apex is
installed, as on our CPU and GPU machines): its ``DistributedOptimizer.state_dict()`` asserts on a
fresh torch Adam with no state, so the state is initialised (zeros, step 0) before loading; and its
load hands every parameter the *same* ``step`` tensor, which torch's foreach Adam then increments
once per parameter, so each parameter gets its own step tensor after loading; and its
``fully_reshardable`` load copies every state key of the inner optimizer from the checkpoint,
which has no ``step`` for a torch Adam, so keys the checkpoint lacks keep their value.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_grpo.engine.ckpt_adam import fix_shared_adam_steps as _fix_shared_adam_steps
from megatron_grpo.engine.ckpt_adam import init_optimizer_state
from megatron_grpo.engine.ckpt_adam import keep_adam_step_on_load as _keep_adam_step_on_load
from megatron_grpo.engine.ckpt_comm import CheckpointError
from megatron_grpo.engine.ckpt_comm import barrier as _barrier
from megatron_grpo.engine.ckpt_comm import broadcast_from_zero as _broadcast_from_zero
from megatron_grpo.engine.ckpt_comm import comm_device as _device
from megatron_grpo.engine.ckpt_comm import dist_or_none as _dist
from megatron_grpo.engine.ckpt_comm import pack as _pack
from megatron_grpo.engine.ckpt_comm import rank as _rank
from megatron_grpo.engine.ckpt_comm import raise_if_any_failed as _raise_if_any_failed
from megatron_grpo.engine.ckpt_comm import unpack as _unpack
from megatron_grpo.engine.ckpt_comm import world as _world
from megatron_grpo.engine.ckpt_rng import HOST_STREAMS, agreeing_host_streams, rng_state, set_host_rng, set_rng_state
from megatron_grpo.engine.optim_state import light_fully_reshardable
from megatron_grpo.engine.reshard import (FULLY_RESHARDABLE, check_resumable, describe_layout, layout_changed,
                                          join_optimizer_sd, optimizer_metadata, repad_vocab, split_optimizer_sd,
                                          unpad_vocab, vocab_keys)
from model_bridge.dist_ckpt.runs import (CHECKPOINT_FORMAT, DEL_PREFIX, LATEST_FILE, META_FILE, TMP_PREFIX,
                                         checkpoint_root, find_latest_checkpoint, list_checkpoints, read_run_meta,
                                         step_dirname, warn_checkpoint)

__all__ = ["save_checkpoint", "begin_save", "SaveInProgress", "load_checkpoint", "find_latest_checkpoint", "list_checkpoints",
           "checkpoint_root", "CheckpointError", "rng_state", "set_rng_state", "CHECKPOINT_FORMAT",
           "DEFAULT_OPTIMIZER_SHARDING", "META_FILE", "LATEST_FILE", "init_optimizer_state"]

log = logging.getLogger(__name__)

DEFAULT_OPTIMIZER_SHARDING = FULLY_RESHARDABLE


# ------------------------------------------------------------------------------------------------
# state dicts
# ------------------------------------------------------------------------------------------------


def _chunks(model_chunks) -> list[torch.nn.Module]:
    from model_bridge.load import model_chunks as unwrap_chunks

    return unwrap_chunks(model_chunks)


def _model_keys(n: int) -> list[str]:
    return ["model"] if n == 1 else [f"model{i}" for i in range(n)]


def _mcore_async_strategy(save_fn, async_write: bool) -> dict:
    """megatron-core >= 0.19 defaults an asynchronous save to the ``nvrx`` strategy, which needs
    nvidia-resiliency-ext (not installed with megatron-core); ``mcore`` is the writer that older
    versions use, whose request ``checkpoint_async`` runs."""
    import inspect

    if async_write and "async_strategy" in inspect.signature(save_fn).parameters:
        return {"async_strategy": "mcore"}
    return {}


def _optimizer_sharded_state_dict(optimizer, model_sd: dict, is_loading: bool, sharding: str):
    with light_fully_reshardable(optimizer):  # no whole-buffer copies (engine/optim_state.py)
        return optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=optimizer_metadata(sharding))


def _sharded_state_dict(chunks, optimizer, is_loading: bool, sharding: str, unpadded: bool) -> tuple[dict, list]:
    """Model chunks (+ optimizer) as stored; with ``unpadded`` the vocab-parallel tensors (and
    their optimizer states) hold the real vocab's rows only. Returns ``(sd, changed)`` for
    :func:`repad_vocab`."""
    sd: dict = {}
    for key, chunk in zip(_model_keys(len(chunks)), chunks):
        sd[key] = chunk.sharded_state_dict()
    if optimizer is not None:
        osd = _optimizer_sharded_state_dict(optimizer, sd, is_loading, sharding)
        sd["optimizer"] = split_optimizer_sd(optimizer, osd) if sharding == FULLY_RESHARDABLE else osd
    changed: list = []
    if unpadded and chunks:
        keys = vocab_keys([sd[k] for k in _model_keys(len(chunks))])
        changed = unpad_vocab(sd, keys, chunks[0].spec.text.vocab_size)
    return sd, changed


def _layout_info() -> dict:
    info = {"world_size": _world()}
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            info.update(tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
                        ep=ps.get_expert_model_parallel_world_size(),
                        etp=ps.get_expert_tensor_parallel_world_size(), dp=ps.get_data_parallel_world_size())
    except Exception:  # noqa: BLE001
        pass
    return info


def _versions() -> dict:
    out = {"torch": torch.__version__}
    try:
        from megatron.core import package_info

        out["megatron_core"] = package_info.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        from megatron_grpo import __version__

        out["megatron_grpo"] = __version__
    except Exception:  # noqa: BLE001
        pass
    return out


# ------------------------------------------------------------------------------------------------
# save
# ------------------------------------------------------------------------------------------------


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_dir(path: Path) -> None:
    """Rename out of the way first (a half-deleted checkpoint never looks complete), then delete."""
    trash = path.with_name(f"{DEL_PREFIX}{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(path, trash)
    except OSError:
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


def _rotate(root: Path, keep_last: Optional[int], newest: Path) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep_last`` (never ``newest``), stale temp and
    trash directories. Rank 0, after ``newest`` is complete and ``latest`` names it."""
    removed = []
    for p in root.iterdir():
        if p.is_dir() and (p.name.startswith(DEL_PREFIX) or p.name.startswith(TMP_PREFIX)):
            shutil.rmtree(p, ignore_errors=True)
    if not keep_last or keep_last < 1:
        return removed
    others = [(s, p) for s, p in list_checkpoints(root.parent) if p.resolve() != newest.resolve()]
    for _, p in others[:max(0, len(others) - (keep_last - 1))]:
        _remove_dir(p)
        removed.append(p)
    return removed


def save_checkpoint(run_dir: os.PathLike | str, step: int, model_chunks, optimizer, scheduler,
                    extra_state: Any = None, *, keep_last: Optional[int] = 3,
                    optimizer_sharding: str = DEFAULT_OPTIMIZER_SHARDING) -> Path:
    """Save ``step`` (collective: every rank calls it); returns ``run_dir/checkpoints/step_N``.

    ``model_chunks``: this rank's model chunks as the engine holds them (DDP-wrapped is fine);
    ``optimizer``: the megatron optimizer; ``scheduler``: the ``OptimizerParamScheduler`` (or None);
    ``extra_state``: this rank's picklable extra state (data position...), returned by
    :func:`load_checkpoint`. ``keep_last``: complete checkpoints kept after this one is complete
    (None or 0: all). :func:`~megatron_grpo.engine.checkpoint_async.start_checkpoint` is the
    asynchronous variant (the shards are written while training goes on).
    """
    save = begin_save(run_dir, step, model_chunks, optimizer, scheduler, extra_state, keep_last=keep_last,
                      optimizer_sharding=optimizer_sharding, async_write=False)
    return save.finish()


class SaveInProgress:
    """A checkpoint whose directory ``.tmp-step_N`` exists on every rank's file system and whose
    shards are being (or have been) written; :meth:`finish` (collective) makes it visible."""

    def __init__(self, *, root: Path, tmp: Path, final: Path, step: int, t0: float, meta: dict,
                 keep_last: Optional[int], request=None):
        self.root, self.tmp, self.final, self.step, self.t0 = root, tmp, final, step, t0
        self.meta, self.keep_last = meta, keep_last
        self.request = request
        """megatron's ``AsyncRequest`` of the shards' write (async saves), None once written."""

    def finish(self, write_error: Optional[BaseException] = None) -> Path:
        """Collective: megatron's finalisation (its ``.metadata`` and ``metadata.json``), then rank 0
        writes ``mgrpo_checkpoint.json``, renames ``.tmp-step_N`` to ``step_N``, replaces ``latest``
        and rotates; a failure on any rank is raised on every rank."""
        step = self.step
        _raise_if_any_failed(write_error, f"writing the shards of step {step}")
        if self.request is not None:
            error = None
            try:
                for fn in self.request.finalize_fns:
                    fn()
            except BaseException as e:  # noqa: BLE001
                error = e
            self.request = None
            _raise_if_any_failed(error, f"finalising step {step}")
        error = None
        if _rank() == 0:
            try:
                meta = {**self.meta, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                        "save_seconds": round(time.monotonic() - self.t0, 3)}
                _write_text_atomic(self.tmp / META_FILE, json.dumps(meta, indent=1) + "\n")
                _fsync_dir(self.tmp)
                if self.final.exists():  # a checkpoint of the same step from an earlier attempt
                    _remove_dir(self.final)
                os.rename(self.tmp, self.final)
                _fsync_dir(self.root)
                _write_text_atomic(self.root / LATEST_FILE, self.final.name + "\n")
                _fsync_dir(self.root)
                for p in _rotate(self.root, self.keep_last, self.final):
                    log.info("removed old checkpoint %s (keep_last=%s)", p, self.keep_last)
            except BaseException as e:  # noqa: BLE001
                error = CheckpointError(f"finishing checkpoint {self.final}: {e}")
        _raise_if_any_failed(error, f"finishing step {step}")
        _barrier()
        log.info("saved checkpoint %s in %.1f s", self.final, time.monotonic() - self.t0)
        return self.final


def begin_save(run_dir: os.PathLike | str, step: int, model_chunks, optimizer, scheduler,
               extra_state: Any = None, *, keep_last: Optional[int] = 3,
               optimizer_sharding: str = DEFAULT_OPTIMIZER_SHARDING, async_write: bool = False) -> SaveInProgress:
    """Collective: create ``.tmp-step_N``, build the sharded state dict and hand it to megatron's
    ``dist_checkpointing.save``: written before returning, or (``async_write``) planned, with
    megatron's ``AsyncRequest`` for the write in the result (``checkpoint_async.py`` runs it)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_grpo.hang import collective

    step = int(step)
    root = checkpoint_root(run_dir)
    final = root / step_dirname(step)
    tmp = root / f"{TMP_PREFIX}{final.name}"
    rank, world = _rank(), _world()
    t0 = time.monotonic()

    error = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except BaseException as e:  # noqa: BLE001 - shared with the other ranks
            error = CheckpointError(f"cannot create {tmp}: {e}")
    _raise_if_any_failed(error, f"creating {tmp}")

    error, request = None, None
    with collective(f"save_checkpoint(step {step})"):
        try:
            chunks = _chunks(model_chunks)
            sd, _ = _sharded_state_dict(chunks, optimizer, False, optimizer_sharding, unpadded=True)
            sd["scheduler"] = scheduler.state_dict() if scheduler is not None else None
            sd["mgrpo"] = {"format": CHECKPOINT_FORMAT, "step": step}
            sd["rank_state"] = ShardedObject("mgrpo.rank_state", _pack({"rng": rng_state(), "extra": extra_state}),
                                             (world,), (rank,), replica_id=0)
            request = dist_checkpointing.save(sd, str(tmp), async_sharded_save=async_write,
                                              **_mcore_async_strategy(dist_checkpointing.save, async_write))
        except BaseException as e:  # noqa: BLE001
            error = e
    _raise_if_any_failed(error, f"saving step {step}")
    meta = {"format": CHECKPOINT_FORMAT, "step": step, "complete": True, "layout": _layout_info(),
            "num_model_chunks": len(_chunks(model_chunks)), "optimizer": optimizer is not None,
            "optimizer_sharding": optimizer_sharding, "vocab_unpadded": True,
            "scheduler": scheduler is not None, "versions": _versions(), "async_write": bool(async_write)}
    return SaveInProgress(root=root, tmp=tmp, final=final, step=step, t0=t0, meta=meta, keep_last=keep_last,
                          request=request)


# ------------------------------------------------------------------------------------------------
# load
# ------------------------------------------------------------------------------------------------


def _resume_moved_rng(ckpt: Path, saved: dict, now: dict, states: list, load_rng: bool) -> None:
    """RNG at another layout: each host stream (Python, NumPy, torch CPU) continues from the saved
    one when every saved rank had the same (one seed, rank-independent draws); the device streams
    and megatron's TP/EP RNG tracker are seeded per TP/EP/PP coordinate, which the new layout does
    not have, so they start from the seed. Logged once, on rank 0."""
    agree = agreeing_host_streams([s["rng"] for s in states])
    if load_rng:
        set_host_rng(states[0]["rng"], agree)
    if _rank() != 0:
        return
    # info: `mgrpo train` says it once before the ranks start (launch/train_cli.py)
    log.info("resuming %s at another layout: %s -> %s", ckpt, describe_layout(saved), describe_layout(now))
    if not load_rng:
        return
    differ = [HOST_STREAMS[k] for k in HOST_STREAMS if k not in agree]
    host_line = (f"the host RNG streams ({', '.join(HOST_STREAMS[k] for k in agree) or 'none'}) continue from "
                 "the checkpoint" + (f"; {', '.join(differ)} differed between the saved ranks, so no one of them "
                                     "is right for every new rank: not restored" if differ else ""))
    warn_checkpoint(f"{ckpt} was saved at {describe_layout(saved)}, this run has {describe_layout(now)}: "
                    f"{host_line}; the device RNG streams and megatron's TP/EP RNG tracker (dropout) are seeded "
                    "per parallel rank, which the new layout does not have, so they restart from the seed and the "
                    "run is not bit-identical to one without the layout change; every rank gets rank 0's extra state")


def load_checkpoint(run_dir: os.PathLike | str, model_chunks, optimizer, scheduler, *,
                    path: Optional[os.PathLike | str] = None, load_optimizer: bool = True,
                    load_rng: bool = True, strict: bool = True) -> tuple[int, Any]:
    """Restore the latest complete checkpoint under ``run_dir`` (or ``path``); collective.

    Returns ``(step, extra_state)`` -- resume at ``step + 1`` -- or ``(0, None)`` when there is no
    checkpoint. ``load_optimizer=False`` loads weights only (optimizer and scheduler untouched).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_grpo.hang import collective

    chosen = None
    error = None
    if _rank() == 0:
        try:
            chosen = str(path) if path is not None else find_latest_checkpoint(run_dir, verify=True)
            chosen = None if chosen is None else str(chosen)
            if chosen is not None and read_run_meta(Path(chosen)) is None:
                raise CheckpointError(f"{chosen} is not a complete megatron-grpo checkpoint (no valid {META_FILE})")
        except BaseException as e:  # noqa: BLE001
            error = e
    _raise_if_any_failed(error, "finding the checkpoint")
    chosen = _broadcast_from_zero(chosen)
    if chosen is None:
        return 0, None
    ckpt = Path(chosen)

    error = None
    result = (0, None)
    with collective(f"load_checkpoint({ckpt.name})"):
        try:
            meta = read_run_meta(ckpt)
            if meta is None:
                raise CheckpointError(f"{ckpt}: cannot read {META_FILE} on rank {_rank()} (shared file system?)")
            chunks = _chunks(model_chunks)
            if meta.get("num_model_chunks", 1) != len(chunks):
                raise CheckpointError(f"{ckpt} holds {meta.get('num_model_chunks')} model chunk(s), this run has "
                                      f"{len(chunks)} (virtual pipeline size must match)")
            saved_layout, now = meta["layout"], _layout_info()
            try:
                check_resumable(ckpt, meta, now)
            except ValueError as e:
                raise CheckpointError(str(e)) from None
            saved_world = int(saved_layout["world_size"])
            moved = layout_changed(saved_layout, now) or saved_world != _world()
            with_opt = load_optimizer and optimizer is not None and meta.get("optimizer", True)
            if with_opt:
                init_optimizer_state(optimizer)
                _keep_adam_step_on_load(optimizer)
            sd, unpadded = _sharded_state_dict(chunks, optimizer if with_opt else None, True,
                                               meta.get("optimizer_sharding", "dp_reshardable"),
                                               unpadded=bool(meta.get("vocab_unpadded")))
            if not moved:
                sd["rank_state"] = ShardedObject("mgrpo.rank_state", None, (saved_world,), (_rank(),), replica_id=0)
            else:  # every rank reads every saved shard (rank 0 as the main replica, which megatron's
                # access check wants exactly once per shard) and uses rank 0's
                for r in range(saved_world):
                    sd[f"rank_state_{r}"] = ShardedObject("mgrpo.rank_state", None, (saved_world,), (r,),
                                                          replica_id=_rank())
            with torch.no_grad():
                loaded = dist_checkpointing.load(sd, str(ckpt))
                repad_vocab(loaded, unpadded)
                for key, chunk in zip(_model_keys(len(chunks)), chunks):
                    chunk.load_state_dict(loaded[key], strict=strict)
                if with_opt:
                    osd = loaded["optimizer"]
                    if meta.get("optimizer_sharding") == FULLY_RESHARDABLE:
                        osd = join_optimizer_sd(optimizer, osd)
                    optimizer.load_state_dict(osd)
                    _fix_shared_adam_steps(optimizer)
            if with_opt and scheduler is not None and loaded.get("scheduler") is not None:
                scheduler.num_steps = 0  # load_state_dict adds the saved count to the current one
                scheduler.load_state_dict(loaded["scheduler"])
            if not moved:
                rank_state = _unpack(loaded["rank_state"])
                if load_rng:
                    set_rng_state(rank_state["rng"])
            else:
                states = [_unpack(loaded[f"rank_state_{r}"]) for r in range(saved_world)]
                rank_state = states[0]
                _resume_moved_rng(ckpt, saved_layout, now, states, load_rng)
            result = (int(loaded["mgrpo"]["step"]), rank_state["extra"])
        except BaseException as e:  # noqa: BLE001
            error = e
    _raise_if_any_failed(error, f"loading {ckpt}")
    log.info("resumed from %s (step %d)", ckpt, result[0])
    return result
