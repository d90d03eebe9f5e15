"""The audio of one rank's training step: each clip featurised once and checked against its sample's
audio-token runs, the clips that go through :class:`~model_bridge.modeling.shared_audio.SharedClips`
cut into batches of micro-batches, and the first micro-batch's batches run through the tower ahead
of the schedule (``engine.batch.build_train_microbatches`` calls :func:`step_audio`).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch

from megatron_grpo.host_ranges import host_range
from model_bridge.modeling.shared_audio import ClipUse, SharedClips, frame_batches

__all__ = ["Featurizer", "featurizer_from_extractor", "step_audio"]

Featurizer = Callable[[Sequence[np.ndarray]], tuple[torch.Tensor, torch.Tensor]]
"""waveforms (16 kHz float mono, one per clip) -> (features [M, F_total], feature_lens [A]). Each clip is
featurised on its own (`build_train_microbatches` calls it one clip at a time and caches per clip). A
featurizer with a ``frames(waveform) -> int`` method (the frame count it will give the clip) lets the
build plan the audio-tower batches before featurising (`megatron_grpo.data.device_features.DeviceFeaturizer`,
:func:`featurizer_from_extractor`)."""


# --------------------------------------------------------------------------------------------
# features
# --------------------------------------------------------------------------------------------


class _ExtractorFeaturizer:
    """``megatron_grpo.data.features.audio_features`` with its defaults (each clip on its own, padded
    to the hop length: what vLLM gave the rollout), and the frame count that gives a clip."""

    def __init__(self, feature_extractor):
        from megatron_grpo.data.features import HOP_LENGTH

        self.feature_extractor = feature_extractor
        self.hop = int(getattr(feature_extractor, "hop_length", HOP_LENGTH))

    def __call__(self, waves: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        from megatron_grpo.data.features import audio_features

        return audio_features(self.feature_extractor, waves)

    def frames(self, waveform: np.ndarray) -> int:
        from megatron_grpo.data.features import num_frames

        return int(num_frames(len(waveform), self.hop))


def featurizer_from_extractor(feature_extractor) -> Featurizer:
    """A :data:`Featurizer` from the checkpoint's feature extractor (``WhisperFeatureExtractor``)."""
    return _ExtractorFeaturizer(feature_extractor)


# --------------------------------------------------------------------------------------------
# the step's clips
# --------------------------------------------------------------------------------------------


def _sample_audio(i: int, traj, featurize: Optional[Featurizer], n_window: int, cache: dict):
    """[(features [M, F_c], lens [1])] of sample i's clips, checked against its audio-token runs.
    Each clip is featurised on its own, once per clip object (``cache``: a recording shared by a
    group's generations is one object, `megatron_grpo.run.to_ranks`)."""
    from model_bridge.modeling.audio import audio_output_lengths

    if featurize is None:
        raise ValueError(f"sample {i} (prompt {traj.prompt_index}) has {len(traj.audios)} audio clip(s) but "
                         "no featurizer was given: pass featurize= or feature_extractor=")
    parts = []
    for a in traj.audios:
        if id(a) not in cache:
            f, ln = featurize([a])
            f, ln = torch.as_tensor(f, dtype=torch.float32), torch.as_tensor(ln, dtype=torch.long).reshape(-1)
            if ln.numel() != 1 or int(ln.sum()) != f.shape[-1]:
                raise ValueError(f"sample {i}: the featurizer returned {ln.numel()} lengths summing to "
                                 f"{int(ln.sum())} for 1 clip and {f.shape[-1]} frames")
            cache[id(a)] = (a, f, ln)  # the clip itself is kept so its id is not reused
        parts.append(cache[id(a)][1:])
    if traj.audio_token_counts:
        lens = torch.cat([ln for _, ln in parts])
        made = [audio_output_lengths(n, n_window) for n in lens.tolist()]  # host ints: no tensor ops per clip
        if [int(n) for n in made] != [int(n) for n in traj.audio_token_counts]:
            raise ValueError(f"sample {i} (prompt {traj.prompt_index}): its clips give {made} audio tokens "
                             f"(frames {lens.tolist()}) but input_ids hold runs of {list(traj.audio_token_counts)} "
                             "audio tokens; the rollout and the trainer disagree on the audio")
    return parts


def _featurize_clips(clips: Sequence, featurize: Optional[Featurizer], cache: dict) -> None:
    """Featurise the distinct ``clips`` not in ``cache`` in one call (one launch sequence and sync
    instead of one per clip) and cache each clip's part. A clip the featurizer refuses is left out:
    :func:`_sample_audio` then featurises the sample's clips one by one and its error names the sample."""
    todo = {id(a): a for a in clips if id(a) not in cache}
    if featurize is None or not todo:
        return
    try:
        f, ln = featurize(list(todo.values()))
    except ValueError:
        return
    f, ln = torch.as_tensor(f, dtype=torch.float32), torch.as_tensor(ln, dtype=torch.long).reshape(-1)
    if ln.numel() != len(todo) or int(ln.sum()) != f.shape[-1]:
        return  # the per-clip path names the clip
    for (k, a), part, n in zip(todo.items(), f.split(ln.tolist(), dim=1), ln.split(1)):
        cache[k] = (a, part, n)


def step_audio(trajectories, mb_ids: Sequence[tuple[int, ...]], featurize: Optional[Featurizer], n_window: int,
                share: bool, keep_shared: float, max_frames: int, audio_tower) -> tuple[list, list]:
    """``(per_mb, uses)``: each micro-batch's own clips ``(features, frame counts, clip order)`` and its
    :class:`ClipUse` (None without shared clips), every clip featurised and checked against its
    sample's audio-token runs (:func:`build_train_microbatches` says what is shared and kept).

    The shared clips' batches are planned from their frame counts: from their lengths where the
    featurizer gives them (``featurize.frames``), so that with ``audio_tower`` only the clips of the
    first micro-batch's batches are featurised and run through it here (``ClipUse.prefetch``) before
    the rest are featurised, while the device runs them; else from their features, every clip
    featurised first."""
    cache: dict = {}
    mine = [i for ids in mb_ids for i in ids]
    pool = keep_shared > 0  # every clip through SharedClips: a tower call per batch, not per micro-batch
    with host_range("clip_batches"):
        shared_ix, span = _clip_uses(mb_ids, trajectories, share, pool)
        clips_C = {shared_ix[id(a)]: a for i in mine for a in trajectories[i].audios if id(a) in shared_ix}
        orders = [_clip_order(ids, trajectories, shared_ix) for ids in mb_ids]
    frames_of = getattr(featurize, "frames", None)
    if frames_of is None:  # the frame counts from the features: every clip featurised first
        with host_range("featurise"):
            _featurize_clips([a for i in mine for a in trajectories[i].audios], featurize, cache)
        frames_of = lambda a: cache[id(a)][1].shape[-1] if id(a) in cache else 0  # noqa: E731 (refused: named below)
    with host_range("clip_batches"):
        shared, uses = (_shared_plan(span, [int(frames_of(clips_C[c])) for c in range(len(clips_C))], orders,
                                     max_frames, keep_shared, pool) if shared_ix else (None, [None] * len(mb_ids)))
    prefetch = audio_tower is not None and uses[0] is not None
    if prefetch:  # the clips of the first micro-batch's batches first, then those batches through the tower
        first = [c for b in sorted({shared.batch_of[-1 - c] for c in uses[0].order if c < 0})
                 for c in shared.batches[b]]
        with host_range("featurise"):
            _featurize_clips([clips_C[c] for c in first], featurize, cache)
        if all(id(clips_C[c]) in cache for c in first):  # else the checks below name the clip
            for c in first:
                shared.set_features(c, cache[id(clips_C[c])][1])
            with host_range("prefetch_tower"):
                uses[0].prefetch(audio_tower)
    with host_range("featurise"):
        _featurize_clips([a for i in mine for a in trajectories[i].audios], featurize, cache)
    with host_range("clip_batches"):
        per_mb = []
        for ids, order in zip(mb_ids, orders):
            feats, lens = [], []
            for i in ids:
                if not trajectories[i].audios:
                    continue
                for j, (a, (f, ln)) in enumerate(zip(trajectories[i].audios,
                                                      _sample_audio(i, trajectories[i], featurize, n_window, cache))):
                    c = shared_ix.get(id(a))
                    if c is None:
                        feats.append(f)
                        lens.append(ln)
                    elif f.shape[-1] != shared.lens[c]:
                        raise ValueError(f"sample {i} (prompt {trajectories[i].prompt_index}): audio clip {j} of "
                                         f"{len(a)} samples has {f.shape[-1]} feature frames, but the featurizer's "
                                         f"frames() gave {shared.lens[c]}; they must agree")
                    elif shared.features_MF[c] is None:
                        shared.set_features(c, f)
            per_mb.append((feats, lens, order))
    if prefetch and not shared.prefetched:
        with host_range("prefetch_tower"):
            uses[0].prefetch(audio_tower)
    return per_mb, uses


def _clip_order(ids: Sequence[int], trajectories, shared_ix: dict[int, int]) -> tuple[int, ...]:
    """``ClipUse.order`` of the micro-batch of samples ``ids``: per clip in token order ``j >= 0`` for its
    j-th own clip, ``-1 - c`` for shared clip ``c``."""
    order, own = [], 0
    for i in ids:
        for a in trajectories[i].audios:
            c = shared_ix.get(id(a))
            order.append(own if c is None else -1 - c)
            own += c is None
    return tuple(order)


def _shared_plan(span: dict[int, tuple[int, int]], frames_C: Sequence[int], orders: Sequence[tuple[int, ...]],
                 max_frames: int, keep_shared: float, pool: bool) -> tuple[SharedClips, list]:
    """The step's :class:`SharedClips` for clips of ``frames_C`` frames (features set later), in
    batches of at most a micro-batch's budget of audio frames (``max_frames``; shared_audio.py), and
    each micro-batch's :class:`ClipUse` (None without shared clips; ``orders``: :func:`_clip_order`)."""
    keep_frames = int(keep_shared * max_frames)
    batches, always = (_pooled_batches(span, frames_C, min(max_frames, keep_frames), max_frames)
                       if pool else (None, ()))
    shared = SharedClips([None] * len(frames_C), max_frames=max_frames, keep_frames=keep_frames, batches=batches,
                         always_keep=always, lens=frames_C)
    batch_last: dict[int, int] = {}
    for c, (_, k) in span.items():
        b = shared.batch_of[c]
        batch_last[b] = max(k, batch_last.get(b, k))
    return shared, [ClipUse(shared, order, tuple(sorted(b for b, last in batch_last.items() if last == k)))
                    if any(c < 0 for c in order) else None for k, order in enumerate(orders)]


def _clip_uses(mb_ids: Sequence[Sequence[int]], trajectories, share: bool,
               pool: bool) -> tuple[dict[int, int], dict[int, tuple[int, int]]]:
    """``(index, span)``: id of each clip of the micro-batches of samples ``mb_ids`` that goes
    through :class:`SharedClips` -> its index there (first-use order), and that index -> the first
    and the last micro-batch that use it. Without ``pool`` only the clips used more than once; with
    it every clip; both empty unless ``share``."""
    if not share:
        return {}, {}
    counts: dict[int, int] = {}
    span: dict[int, tuple[int, int]] = {}
    for k, ids in enumerate(mb_ids):
        for i in ids:
            for a in trajectories[i].audios:
                counts[id(a)] = counts.get(id(a), 0) + 1
                span[id(a)] = (span.get(id(a), (k, k))[0], k)
    index = {key: c for c, key in enumerate(key for key, n in counts.items() if pool or n > 1)}
    return index, {c: span[key] for key, c in index.items()}


def _pooled_batches(span: dict[int, tuple[int, int]], lens: Sequence[int], local_frames: int, max_frames: int):
    """``(batches, always_keep)`` of a pooled :class:`SharedClips`: the clips that one micro-batch
    alone uses go in batches of whole micro-batches' clips, consecutive micro-batches while the
    batch holds at most ``local_frames`` frames; each such batch is freed by the backward of its last
    micro-batch, before the next one runs, so all of them keep their first pass
    (``always_keep``). The clips that several micro-batches use go, in first-use order, in batches
    of at most ``max_frames`` frames, which :class:`SharedClips` keeps only within its
    ``keep_frames`` (they may live across many micro-batches)."""
    local, wide = [], []
    for c in range(len(lens)):
        (local if span[c][0] == span[c][1] else wide).append(c)
    batches: list[list[int]] = []
    for c in local:  # first-use order: micro-batch by micro-batch
        last = batches[-1] if batches else None
        same_mb = last is not None and span[last[-1]][0] == span[c][0]
        if last is not None and (same_mb or sum(lens[j] for j in last) + lens[c] <= local_frames):
            last.append(c)
        else:
            batches.append([c])
    keep = tuple(range(len(batches)))
    return batches + frame_batches(wide, lens, max_frames), keep
