"""Record and replay rollouts: the training phase of `mgrpo train` without a vLLM server.

``rollout.record_dir``: rank 0 saves each step's trajectories exactly as the trainer consumed them
(after rewards, advantages and the advantage filter) to ``<record_dir>/step_{k:06d}.pt`` and keeps
``<record_dir>/manifest.json`` current. ``rollout.server: replay`` with ``rollout.replay_dir``:
step k trains on ``step_{k:06d}.pt``; no server is started or contacted and no weights are pushed.

A step file is ``torch.save`` of plain types only (readable with ``torch.load(weights_only=True)``)::

    {"format": 1, "step": k, "stats": {rollout counters}, "clips": [float32 [samples], ...],
     "trajectories": [{"input_ids_T": int64 [T], "loss_mask_T": int64 [T],
                       "rollout_logprobs_T": float64 [T], "audios": [index into clips, ...],
                       "audio_token_counts": [...], "group_id", "prompt_index", "reward",
                       "reward_terms", "advantage", "weight_version", ...}, ...]}

Waveforms (not mel features) are stored, each distinct clip once per step (a group's samples share
their prompt's clip): the trainer featurises them as in a live run, so a replayed step packs and
trains exactly what the recorded step did. The manifest holds the model dir, its
vocab size, the audio feature dims (mel bins, sampling rate), the steps recorded, the largest
token id and the run's config.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch

from megatron_grpo.trajectory import Trajectory, token_arrays

FORMAT = 1
MANIFEST = "manifest.json"
_TENSOR_FIELDS = {"input_ids_T": torch.int64, "loss_mask_T": torch.int64, "rollout_logprobs_T": torch.float64}


def _max_id(traj: Trajectory) -> int:
    return int(np.max(traj.input_ids_T)) if len(traj.input_ids_T) else -1


def step_path(directory, step: int) -> Path:
    return Path(directory) / f"step_{step:06d}.pt"


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(tmp)
    tmp.replace(path)


def _plain(v):
    """numpy -> torch (weights_only loads reject numpy); containers recursively."""
    if isinstance(v, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(v))
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def trajectory_to_record(t: Trajectory, clips: list, index: dict) -> dict:
    """A plain dict of `t`; its waveforms are appended to `clips` once per clip object (`index`: the
    object's id -> position; the step's trajectories keep the objects alive), so the replayed step
    shares exactly the clips the live one shared (a group's recording), which the trainer runs
    through the audio tower once."""
    d = {}
    for f in fields(t):
        v = getattr(t, f.name)
        if f.name in _TENSOR_FIELDS:
            d[f.name] = torch.as_tensor(np.asarray(v), dtype=_TENSOR_FIELDS[f.name])
        elif f.name == "audios":
            ids = []
            for a in v:
                key = id(a)
                if key not in index:
                    index[key] = len(clips)
                    clips.append(torch.from_numpy(np.array(a, dtype=np.float32, copy=True).reshape(-1)))
                ids.append(index[key])
            d[f.name] = ids
        else:
            d[f.name] = _plain(v)
    return d


def trajectory_from_record(d: dict, waves: list) -> Trajectory:
    """The trajectory of record ``d``; ``waves`` (the step's clips as numpy arrays, :func:`load_step`)
    are used as they are, so a clip several samples share (a group's recording) is again one object,
    as in the live run (the trainer then runs it through the audio tower once, ``engine.step_audio``)."""
    kw = dict(d)
    kw["input_ids_T"], kw["loss_mask_T"], kw["rollout_logprobs_T"] = token_arrays(
        *(kw[name].numpy() for name in _TENSOR_FIELDS))  # as the rollout hands them
    kw["audios"] = [waves[i] for i in kw.get("audios", [])]
    if isinstance(kw.get("routed_experts"), torch.Tensor):
        kw["routed_experts"] = kw["routed_experts"].numpy()
    return Trajectory(**kw)


# ---- manifest and checks ------------------------------------------------------------------------

def read_manifest(directory) -> dict:
    """The recording's manifest; ValueError naming what is missing."""
    d = Path(directory)
    if not d.is_dir():
        raise ValueError(f"rollout.replay_dir {d} does not exist: record one first with "
                         "rollout.record_dir=<dir> (docs/training.md, 'Record and replay rollouts')")
    p = d / MANIFEST
    if not p.is_file():
        raise ValueError(f"rollout.replay_dir {d} has no {MANIFEST}: not a recording of "
                         "rollout.record_dir (docs/training.md, 'Record and replay rollouts')")
    m = json.loads(p.read_text())
    if m.get("format") != FORMAT:
        raise ValueError(f"{p}: recording format {m.get('format')!r}, this code reads {FORMAT}")
    return m


def check_steps(directory, steps: int) -> None:
    """Every step 1..steps is recorded; ValueError naming the counts and the fix."""
    rec = set(read_manifest(directory)["steps"])
    missing = [k for k in range(1, steps + 1) if k not in rec]
    if missing:
        gap = f"step {missing[0]}" if len(missing) == 1 else f"steps {missing[0]}..{missing[-1]}"
        raise ValueError(f"rollout.replay_dir {directory} holds {len(rec)} recorded steps but trainer.steps="
                         f"{steps} (no {gap}): set trainer.steps<={len(rec)} or record {steps} steps "
                         f"(rollout.record_dir with trainer.steps={steps})")


SPECIAL_TOKENS = ("audio_token_id", "audio_start_token_id", "audio_end_token_id")
"""The ids the thinker finds audio by: a recording's must be the checkpoint's."""


def _special_token_ids(spec) -> dict:
    return {name: int(getattr(spec, name)) for name in SPECIAL_TOKENS}


def check_compatible(manifest: dict, hf_dir, directory="") -> None:
    """The recording fits the checkpoint: token ids < its vocab size, same audio mel bins, same
    audio special token ids (recordings older than that field are not checked for them)."""
    from model_bridge.config import read_omni_config

    spec = read_omni_config(hf_dir)
    vocab = spec.text.vocab_size
    if manifest["max_token_id"] >= vocab:
        raise ValueError(f"rollout.replay_dir {directory}: recorded token id {manifest['max_token_id']} >= "
                         f"vocab_size {vocab} of model.hf_dir {hf_dir} (recorded with {manifest['model_dir']}, "
                         f"vocab_size {manifest['vocab_size']})")
    mels = manifest["audio"]["num_mel_bins"]
    if mels != spec.audio.num_mel_bins:
        raise ValueError(f"rollout.replay_dir {directory}: recorded with {mels} audio mel bins "
                         f"({manifest['model_dir']}), but model.hf_dir {hf_dir} has "
                         f"audio_config.num_mel_bins={spec.audio.num_mel_bins}")
    want, have = manifest.get("special_token_ids"), _special_token_ids(spec)
    if want is not None and want != have:
        diff = ", ".join(f"{k} {want.get(k)} vs {have[k]}" for k in SPECIAL_TOKENS if want.get(k) != have[k])
        raise ValueError(f"rollout.replay_dir {directory}: recorded with other audio token ids than model.hf_dir "
                         f"{hf_dir} has ({diff}; recording vs checkpoint): the thinker would find no audio "
                         f"positions; replay on a checkpoint with the recording's thinker token ids")


# ---- recording ----------------------------------------------------------------------------------

class Recorder:
    """Rank 0: writes each consumed step to ``record_dir`` and keeps the manifest current."""

    def __init__(self, cfg, directory=None):
        from megatron_grpo.configtree import to_dict
        from model_bridge.config import read_omni_config

        self.dir = Path(cfg.rollout.record_dir if directory is None else directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        spec = read_omni_config(cfg.model.hf_dir)
        config = to_dict(cfg)
        config["rollout"]["api_key"] = None
        old = json.loads((self.dir / MANIFEST).read_text()) if (self.dir / MANIFEST).is_file() else {}
        same_model = old.get("model_dir") == str(cfg.model.hf_dir)
        self.manifest = {
            "format": FORMAT, "model_dir": str(cfg.model.hf_dir), "vocab_size": spec.text.vocab_size,
            "audio": {"num_mel_bins": spec.audio.num_mel_bins, "sampling_rate": 16000,
                      "n_window": spec.audio.n_window},
            "special_token_ids": _special_token_ids(spec),
            "steps": sorted(old.get("steps", [])) if same_model else [],
            "max_token_id": old.get("max_token_id", -1) if same_model else -1,
            "config": config, "created": old.get("created", time.time()) if same_model else time.time()}
        if directory is None:
            print(f"[train] recording each step's trajectories to {self.dir}", flush=True)

    def record(self, step: int, trajs, stats, extra: dict | None = None) -> None:
        """Write step ``step``; ``extra``: more plain entries for its payload (megatron_grpo/run/trajlog.py)."""
        clips, index = [], {}
        records = [trajectory_to_record(t, clips, index) for t in trajs]
        payload = {"format": FORMAT, "step": step, "stats": _plain(dict(stats or {})), "clips": clips,
                   "trajectories": records, **(extra or {})}
        _atomic(step_path(self.dir, step), lambda p: torch.save(payload, p))
        m = self.manifest
        m["steps"] = sorted(set(m["steps"]) | {step})
        m["max_token_id"] = max([m["max_token_id"]] + [_max_id(t) for t in trajs])
        _atomic(self.dir / MANIFEST, lambda p: p.write_text(json.dumps(m, indent=2) + "\n"))


def load_step(directory, step: int):
    """(trajectories, rollout stats) recorded for ``step``."""
    p = step_path(directory, step)
    if not p.is_file():
        raise ValueError(f"rollout.replay_dir {directory}: {p.name} not found (step {step} not recorded)")
    payload = torch.load(p, weights_only=True)
    waves = [c.numpy() for c in payload["clips"]]
    return [trajectory_from_record(d, waves) for d in payload["trajectories"]], payload.get("stats", {})


# ---- replay -------------------------------------------------------------------------------------

class ReplayBackend:
    """Rank 0's backend in replay mode: the tokenizer and the recording; no server, no push."""

    def __init__(self, cfg, run_dir=None):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.dir = Path(cfg.rollout.replay_dir)
        self.manifest = read_manifest(self.dir)
        check_compatible(self.manifest, cfg.model.hf_dir, self.dir)
        check_steps(self.dir, cfg.trainer.steps)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.rollout.tokenizer or cfg.model.hf_dir)
        s = self.manifest["steps"]
        print(f"[train] rollout.server=replay: step k trains on {self.dir}/step_k.pt ({len(s)} steps recorded "
              f"with {self.manifest['model_dir']}); no vLLM server is started or contacted, no weights are "
              "pushed", flush=True)

    def push(self, weights, version: int):
        """Nothing to push to (ReplaySource.push never exports the weights)."""

    def close(self):
        pass


class ReplaySource:
    """The TrajectorySource interface over a recording: step k's trajectories are step_k's, broadcast from
    rank 0 (advantages and filtering as recorded, not recomputed); prefetch/settle/push do nothing."""

    def __init__(self, backend, data, rank: int):
        self.backend, self.data, self.rank = backend, data, rank

    def rollout_and_score(self, step: int):
        """Rank 0: the trajectories recorded for `step` (rewards and advantages as recorded)."""
        if self.rank != 0:
            return None
        trajs, _ = load_step(self.backend.dir, step)
        vocab = self.backend.manifest["vocab_size"]
        if any(_max_id(t) >= vocab for t in trajs):  # pragma: no cover
            raise ValueError(f"{step_path(self.backend.dir, step)}: a token id >= vocab_size {vocab}")
        return trajs

    def advantages(self, step: int, trajs, to_ranks):
        """Rank 0's recorded trajectories handed to every rank (``to_ranks``: run/to_ranks.py); their
        advantages are the recorded ones."""
        return to_ranks(trajs), {"rollout_source": "replay"}

    def prefetch(self, next_step: int) -> None:
        pass

    def settle(self) -> None:
        pass

    def push(self, model, version: int) -> None:
        """No weight push in replay mode (no server); the model is not exported either."""

    def data_state(self) -> dict:
        return {} if self.data is None else self.data.state_dict()  # a replay reads no prompts

    def close(self) -> None:
        pass
