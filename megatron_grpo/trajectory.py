"""One rollout sample as the trainer sees it: token ids from vLLM, never re-tokenised text.

Shape legend: T = tokens of the whole multi-turn conversation (prompt, every generated turn,
every tool turn's template tokens), A = audio clips in the conversation, in order of appearance.

Alignment (checked by `check_alignment`):
  - `input_ids_T[t]` is the t-th token of the conversation as vLLM saw it;
  - `loss_mask_T[t] == 1` only where the policy sampled `input_ids_T[t]` (generated turns);
    prompt, tool outputs and chat-template tokens are 0; the first token is never generated;
  - `rollout_logprobs_T[t]` is vLLM's log p(input_ids_T[t] | input_ids_T[:t]) where the mask
    is 1 (finite, <= 0), and 0.0 elsewhere;
  - the A clips of `audios` fill the A runs of `audio_token_id` in `input_ids_T`, in order; run i
    has exactly `audio_token_counts[i]` tokens (when given), and optionally exactly the tokens
    clip i's length gives under vLLM's feature rule (`check_audio_samples=True`).

The per-token fields are lists or 1-D numpy arrays. The rollout hands arrays (:func:`token_arrays`:
int64 ids, bool mask, float64 logprobs, vLLM's values unrounded): the trainer's packer then takes them
without a pass over Python numbers (~12 ns per value: ~20 ms for a rank's 366,000-token step), and
they cross to the DP ranks as raw bytes (`megatron_grpo.run.to_ranks`).

Saving (`to_dict` / `from_dict`, `save_trajectories` / `load_trajectories`): one JSON object per
trajectory, the per-token fields as JSON lists (read back as lists); waveforms either inline (base64
of little-endian float32) or in an ``.npz`` next to the JSON lines; numpy arrays elsewhere (e.g.
`routed_experts`) as tagged base64.  Every value round-trips exactly (floats through ``repr``).
"""
from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np

__all__ = ["Trajectory", "TrajectoryError", "check_alignment", "save_trajectories",
           "load_trajectories", "token_arrays", "FORMAT_VERSION"]

FORMAT_VERSION = 1


class TrajectoryError(ValueError):
    """A trajectory whose tokens, mask, logprobs or audio do not line up; the message says where."""


@dataclass(eq=False)
class Trajectory:
    """A finished multi-turn rollout of one prompt, ready for rewards, advantages and packing."""

    prompt_index: int
    """Row of the dataset this rollout answered (for data position and grouping)."""
    group_id: int
    """Samples of one prompt share a group id (GRPO normalises rewards within a group)."""
    input_ids_T: Sequence[int]
    """Token ids of the whole conversation, exactly as the rollout server saw/sampled them (a list
    or a 1-D integer array, as every per-token field)."""
    loss_mask_T: Sequence[int]
    """1 on policy-generated tokens, 0 elsewhere."""
    rollout_logprobs_T: Sequence[float]
    """vLLM's per-token logprob of the sampled token where loss_mask is 1, else 0.0."""
    audios: list[np.ndarray] = field(default_factory=list)
    """16 kHz float32 mono waveforms of the audio clips, in order of appearance (prompt audio first,
    then clips returned by tools)."""
    audio_token_counts: list[int] = field(default_factory=list)
    """Length of each audio-token run in input_ids_T (from the server's prompt token ids)."""
    completion_texts: list[str] = field(default_factory=list)
    """Decoded text of each generated turn (for rewards and logs; never re-tokenised)."""
    num_turns: int = 0
    finish_reason: str = ""
    """Why the conversation ended: 'answer', 'max_turns', 'length', 'error: ...'."""
    weight_version: int = 0
    """Policy version (training step) of the server that sampled it (off-policy bookkeeping)."""
    routed_experts: Any = None
    """Optional rollout routing replay data (R3), when the server returns it."""
    columns: dict = field(default_factory=dict)
    """Extra dataset columns (e.g. ground_truth), passed through to reward functions."""
    reward: float = 0.0
    reward_terms: dict = field(default_factory=dict)
    advantage: float = 0.0

    def __eq__(self, other) -> bool:
        """Every field equal; per-token fields, clips and other arrays by value (a list equals an
        array of the same values)."""
        if not isinstance(other, Trajectory):
            return NotImplemented
        return all(_equal(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids_T)

    @property
    def num_generated(self) -> int:
        return int(np.count_nonzero(np.asarray(self.loss_mask_T)))

    # ---- saving ----------------------------------------------------------------------------

    def to_dict(self, *, audio_path: Optional[os.PathLike | str] = None,
                base_dir: Optional[os.PathLike | str] = None) -> dict:
        """A JSON-serialisable dict of every field.

        Waveforms: inline as base64 float32 (default), or, with ``audio_path``, written to that
        ``.npz`` (arrays ``a0``, ``a1``, ...) and referenced by its path (relative to
        ``base_dir`` when given, so a directory of rollouts can move)."""
        d: dict[str, Any] = {"format": FORMAT_VERSION}
        for f in fields(self):
            if f.name == "audios":
                continue
            v = getattr(self, f.name)
            if f.name in _PER_TOKEN and isinstance(v, np.ndarray):  # JSON lists, a mask of 0s and 1s
                v = (v.astype(np.int64) if v.dtype == np.bool_ else v).tolist()
            d[f.name] = _to_jsonable(v)
        audios = [np.asarray(a, dtype=np.float32).reshape(-1) for a in self.audios]
        if audio_path is None:
            d["audios"] = [_encode_array(a) for a in audios]
        else:
            ap = Path(audio_path)
            ap.parent.mkdir(parents=True, exist_ok=True)
            with open(ap, "wb") as fh:
                np.savez(fh, **{f"a{i}": a for i, a in enumerate(audios)})
            ref = os.path.relpath(ap, base_dir) if base_dir is not None else str(ap)
            d["audios"] = {"npz": Path(ref).as_posix(), "count": len(audios)}
        return d

    @classmethod
    def from_dict(cls, d: dict, *, base_dir: Optional[os.PathLike | str] = None) -> "Trajectory":
        """Inverse of :meth:`to_dict` (``base_dir`` resolves a relative ``.npz`` path)."""
        version = d.get("format", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise ValueError(f"trajectory format {version!r} is not supported (this code reads "
                             f"{FORMAT_VERSION})")
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names - {"format"}
        if unknown:
            raise ValueError(f"unknown trajectory fields: {sorted(unknown)}")
        kw = {k: _from_jsonable(v) for k, v in d.items() if k in names and k != "audios"}
        a = d.get("audios", [])
        if isinstance(a, dict):
            p = Path(a["npz"])
            if not p.is_absolute() and base_dir is not None:
                p = Path(base_dir) / p
            with np.load(p) as z:
                kw["audios"] = [np.asarray(z[f"a{i}"], dtype=np.float32) for i in range(int(a["count"]))]
        else:
            kw["audios"] = [_decode_array(x) for x in a]
        return cls(**kw)


_PER_TOKEN = ("input_ids_T", "loss_mask_T", "rollout_logprobs_T")


def token_arrays(input_ids, loss_mask, logprobs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A trajectory's per-token fields as the rollout hands them: int64 ids, bool mask, float64
    logprobs (1-D numpy arrays; from lists, arrays or tensors). A mask value other than 0 or 1 is
    refused here, since a bool array cannot keep it for :func:`check_alignment` to name."""
    mask = np.asarray(loss_mask)
    if mask.dtype != np.bool_:
        bad = np.flatnonzero((mask != 0) & (mask != 1))
        if bad.size:
            raise TrajectoryError(f"loss_mask[{int(bad[0])}] = {mask[bad[0]]}, expected 0 or 1")
    return (np.asarray(input_ids, dtype=np.int64), mask.astype(np.bool_),
            np.asarray(logprobs, dtype=np.float64))


def _equal(a: Any, b: Any) -> bool:
    if hasattr(a, "__array__") or hasattr(b, "__array__"):  # numpy arrays, host tensors
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and bool(np.array_equal(a, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


# ---- JSON helpers -------------------------------------------------------------------------------

_ND = "__ndarray__"


def _encode_array(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    dt = a.dtype.newbyteorder("<")
    return {_ND: {"dtype": dt.str, "shape": list(a.shape),
                  "data": base64.b64encode(a.astype(dt, copy=False).tobytes()).decode("ascii")}}


def _decode_array(x: dict) -> np.ndarray:
    spec = x[_ND]
    a = np.frombuffer(base64.b64decode(spec["data"]), dtype=np.dtype(spec["dtype"])).reshape(spec["shape"])
    return a.astype(a.dtype.newbyteorder("="), copy=True)


def _to_jsonable(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, np.ndarray):
        return _encode_array(v)
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, dict):
        return {str(k): _to_jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_to_jsonable(x) for x in v]
    try:
        import torch

        if isinstance(v, torch.Tensor):
            return _encode_array(v.detach().cpu().numpy())
    except ImportError:   # pragma: no cover
        pass
    raise TypeError(f"cannot save a value of type {type(v).__name__} in a trajectory")


def _from_jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        if set(v) == {_ND}:
            return _decode_array(v)
        return {k: _from_jsonable(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_from_jsonable(x) for x in v]
    return v


def save_trajectories(path: os.PathLike | str, trajectories: Iterable[Trajectory], *,
                      inline_audio: bool = False) -> Path:
    """Write one JSON line per trajectory to ``path``; unless ``inline_audio``, trajectory ``i``'s
    clips go to ``<path>.audio/{i:06d}.npz`` (referenced relative to ``path``'s directory)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    audio_dir = p.with_name(p.name + ".audio")
    with open(p, "w", encoding="utf-8") as fh:
        for i, t in enumerate(trajectories):
            ap = None if inline_audio or not t.audios else audio_dir / f"{i:06d}.npz"
            fh.write(json.dumps(t.to_dict(audio_path=ap, base_dir=p.parent), ensure_ascii=False) + "\n")
    return p


def load_trajectories(path: os.PathLike | str) -> list[Trajectory]:
    """Read what :func:`save_trajectories` wrote."""
    p = Path(path)
    out = []
    with open(p, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if line.strip():
                try:
                    out.append(Trajectory.from_dict(json.loads(line), base_dir=p.parent))
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{p} line {line_no}: not a saved trajectory ({e})") from None
    return out


# ---- alignment ----------------------------------------------------------------------------------

def check_alignment(traj: Trajectory, audio_token_id: int, *, check_audio_samples: bool = False,
                    hop_length: int = 160, n_window: int = 50) -> None:
    """Raise TrajectoryError naming the first place where tokens, mask, logprobs or audio disagree.

    Checks, in order: the mask and logprob lengths equal the token count; then, at the earliest
    token where anything is wrong: a mask value other than 0/1, a generated first token, a logprob
    on a non-generated token, a generated token whose logprob is not a finite value <= 0, a
    generated audio placeholder; then the number of audio-token runs equals the number of clips,
    ``audio_token_counts`` (when given) has one entry per clip and equals the run lengths; with
    ``check_audio_samples``, each clip's length gives exactly its run's token count under vLLM's
    rule (``megatron_grpo.data.features``: ceil(N / hop) frames -> tokens), which catches a
    waveform that differs from the one the server saw.
    """
    ids = traj.input_ids_T
    T = len(ids)
    where = f"trajectory (prompt {traj.prompt_index}, group {traj.group_id})"
    if len(traj.loss_mask_T) != T:
        raise TrajectoryError(f"{where}: loss_mask has {len(traj.loss_mask_T)} entries for {T} tokens")
    if len(traj.rollout_logprobs_T) != T:
        raise TrajectoryError(f"{where}: rollout_logprobs has {len(traj.rollout_logprobs_T)} entries "
                              f"for {T} tokens")
    if T:
        mask = np.asarray(traj.loss_mask_T)
        lp = np.asarray(traj.rollout_logprobs_T, dtype=np.float64)
        idarr = np.asarray(ids)
        gen = mask == 1
        conds = [
            (~np.isin(mask, (0, 1)),
             lambda t: f"loss_mask[{t}] = {traj.loss_mask_T[t]}, expected 0 or 1"),
            ((np.arange(T) == 0) & gen,
             lambda t: "the first token is marked generated; a conversation starts with the prompt"),
            ((~gen) & (lp != 0.0),
             lambda t: (f"token {t} (id {ids[t]}) is not generated (mask 0) but has rollout logprob "
                        f"{traj.rollout_logprobs_T[t]}")),
            (gen & ~((lp <= 0.0) & np.isfinite(lp)),
             lambda t: (f"token {t} (id {ids[t]}) is generated but its rollout logprob is "
                        f"{traj.rollout_logprobs_T[t]} (must be a finite value <= 0)")),
            (gen & (idarr == audio_token_id),
             lambda t: f"token {t} (id {ids[t]}) is an audio placeholder but marked as generated"),
        ]
        first = [(int(np.flatnonzero(c)[0]), k) for k, (c, _) in enumerate(conds) if c.any()]
        if first:
            t, k = min(first)
            raise TrajectoryError(f"{where}: {conds[k][1](t)}")
    runs = _audio_runs(ids, audio_token_id)
    if len(runs) != len(traj.audios):
        raise TrajectoryError(f"{where}: {len(runs)} audio-token runs in input_ids but "
                              f"{len(traj.audios)} audio clips")
    if traj.audio_token_counts:
        if len(traj.audio_token_counts) != len(traj.audios):
            raise TrajectoryError(f"{where}: audio_token_counts has {len(traj.audio_token_counts)} "
                                  f"entries for {len(traj.audios)} audio clips")
        for i, ((start, n), want) in enumerate(zip(runs, traj.audio_token_counts)):
            if n != want:
                raise TrajectoryError(f"{where}: audio run {i} at token {start} has {n} tokens, "
                                      f"expected {want}")
    if check_audio_samples:
        from megatron_grpo.data.features import audio_token_count, num_frames

        for i, ((start, n), a) in enumerate(zip(runs, traj.audios)):
            ns = int(np.asarray(a).shape[-1]) if np.ndim(a) else 0
            frames = int(num_frames(ns, hop_length))
            want = int(audio_token_count(frames, n_window)) if frames > 0 else 0
            if want != n:
                raise TrajectoryError(f"{where}: audio clip {i} has {ns} samples -> {frames} mel frames "
                                      f"-> {want} audio tokens, but its run at token {start} has {n} "
                                      "(the waveform is not the one the rollout server saw)")


def _audio_runs(ids: list[int], audio_token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of audio_token_id."""
    a = np.asarray(ids)
    if a.size == 0:
        return []
    hit = np.concatenate([[False], a == audio_token_id, [False]])
    edges = np.flatnonzero(hit[1:] != hit[:-1])
    starts, ends = edges[0::2], edges[1::2]
    return [(int(s), int(e - s)) for s, e in zip(starts, ends)]
