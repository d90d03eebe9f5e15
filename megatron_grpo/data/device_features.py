"""The audio tower's log-mel features computed on the training device (the GPU), all clips of a call
at once.

The same function as :func:`megatron_grpo.data.features.audio_features` with its defaults (each clip
on its own, zero-padded to a multiple of the hop length: what vLLM gave the rollout), written in
torch so the STFT, the mel projection and the log run where the model runs and the features never
cross the host: the Whisper feature extractor's torch path (``_torch_extract_fbank_features``)
per clip, with the clip's own maximum for the 8-decade floor. Only the waveform (float32, 4 bytes
a sample: 64 kB per second) travels to the device, every clip of the call in one copy, and the
frames of all clips go through one gather, FFT and mel projection (a step's ~136 clips in a few
dozen kernels instead of several per clip).

Tolerance against the extractor (``tests/megatron_grpo/data/test_device_features.py``): on the
CPU the two agree to float32 rounding (max abs diff < 1e-4 on features of magnitude ~1); on the
GPU cuFFT's and the GEMM's rounding differ from the CPU's, checked at max abs diff < 2e-3
(``log10`` of powers near the floor amplifies the relative error of tiny mel energies).
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import numpy as np
import torch

from megatron_grpo.data.features import HOP_LENGTH, _prepare, num_frames
from model_bridge.modeling.thd import to_device_async

__all__ = ["DeviceFeaturizer", "trainer_featurizer", "FRAME_CHUNK"]

FRAME_CHUNK = 32768
"""Frames gathered and transformed at once: a ``[FRAME_CHUNK, n_fft]`` float32 block (52 MB at
n_fft 400) and its index (105 MB), whatever the step's audio."""


STAGE_PIECE = 1 << 20
"""Samples (4 MiB) per piece of the staging copy; the pieces are spread over ``_stage_threads()``
threads (numpy releases the GIL while it copies)."""

H2D_PIECE = 8 << 20
"""Samples (32 MiB) per host-to-device copy on CUDA: each range of the staging buffer crosses as
soon as it is written, so the copy of one range runs while the host writes the next."""

_POOL: Optional[ThreadPoolExecutor] = None


def _stage_threads() -> int:
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def _stage_clips(host: np.ndarray, clips: Sequence[np.ndarray], padded: Sequence[int], lo: int = 0,
                 hi: Optional[int] = None) -> None:
    """Write ``clips`` end to end into ``host``, each followed by zeros up to its ``padded`` length,
    in pieces of at most :data:`STAGE_PIECE` samples over a few threads: a step's waveforms are
    hundreds of MB, which one thread copies at a fraction of the host's memory bandwidth. Only
    ``host[lo:hi]`` of that layout is written (default: all of it)."""
    global _POOL
    hi = sum(padded) if hi is None else hi
    pieces, o = [], 0
    for w, n in zip(clips, padded):
        a0, a1 = max(lo - o, 0), min(hi - o, len(w))  # the clip's samples inside [lo, hi)
        pieces += [(o + a, w, a, min(a + STAGE_PIECE, a1)) for a in range(a0, a1, STAGE_PIECE)]
        z0, z1 = max(o + len(w), lo), min(o + n, hi)
        if z0 < z1:
            host[z0:z1] = 0.0
        o += n

    def copy(batch):
        for dst, w, a, b in batch:
            host[dst:dst + b - a] = w[a:b]  # a read-only clip is fine: numpy copies it

    threads = min(_stage_threads(), len(pieces))
    if threads <= 1:
        copy(pieces)
        return
    if _POOL is None:
        _POOL = ThreadPoolExecutor(_stage_threads(), thread_name_prefix="mgrpo-stage")
    list(_POOL.map(copy, [pieces[t::threads] for t in range(threads)]))


def _reflections(w: np.ndarray, n: int, half: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``half`` samples ``np.pad(x, half, mode="reflect")`` puts before and after ``x``, ``w``
    zero-padded to ``n`` samples, computed from ``x``'s ends only (at most ``half + 1`` samples each)."""
    k = min(n, half + 1)
    head = np.zeros(k, dtype=np.float32)
    head[:min(k, len(w))] = w[:k]
    tail = np.zeros(k, dtype=np.float32)
    lo = n - k  # tail = x[n - k:n]
    if lo < len(w):
        tail[:len(w) - lo] = w[lo:]
    return np.pad(head, (half, 0), mode="reflect")[:half], np.pad(tail, (0, half), mode="reflect")[-half:]


class DeviceFeaturizer:
    """``featurize(waveforms) -> (features [M, F] float32 on device, feature_lens [A] int64 on the host)``,
    a :data:`megatron_grpo.engine.batch.Featurizer` for ``build_train_microbatches``."""

    def __init__(self, feature_extractor, device):
        self.device = torch.device(device)
        self.hop = int(getattr(feature_extractor, "hop_length", HOP_LENGTH))
        self.n_fft = int(feature_extractor.n_fft)
        if float(getattr(feature_extractor, "dither", 0.0)) != 0.0:
            raise NotImplementedError("DeviceFeaturizer: the feature extractor dithers (dither != 0), which is "
                                      "random; featurise on the host (trainer.device_features: false)")
        self.window = torch.hann_window(self.n_fft, device=self.device)
        self._stage = None  # pinned host staging buffer (CUDA), reused across calls
        self._copied = None  # the event after its last host-to-device copy
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.mel_T = torch.from_numpy(np.asarray(feature_extractor.mel_filters, dtype=np.float32)).T.contiguous() \
            .to(self.device)  # [M, n_fft // 2 + 1]

    def frames(self, waveform: np.ndarray) -> int:
        """The mel frames this featurizer gives ``waveform`` (it pads each clip to the hop)."""
        return int(num_frames(len(waveform), self.hop))

    def _to_device(self, clips: Sequence[np.ndarray], padded: Sequence[int]) -> torch.Tensor:
        """The arrays ``clips`` end to end, each zero-padded to its ``padded`` length
        (:meth:`_layout`'s parts), as one float32 tensor on the device. On CUDA they are written
        into a pinned staging buffer kept across calls (grown as needed) and cross in asynchronous
        copies of :data:`H2D_PIECE` samples, each issued once its range is written; the next call
        waits for the last copy before it writes the buffer again. The copies run on a stream of
        their own, so they overlap the work already queued on the current stream (the tower batches
        of the step's first micro-batch, which run while the step's other clips are featurised);
        the current stream waits for them only where the features' kernels begin."""
        total = sum(padded)
        if self.device.type != "cuda":
            buf = torch.empty(total, dtype=torch.float32)
            _stage_clips(buf.numpy(), clips, padded)
            return buf
        if self._copied is not None:
            self._copied.synchronize()
        if self._stage is None or self._stage.numel() < total:
            self._stage = torch.empty(int(total * 1.25) + 1, dtype=torch.float32, pin_memory=True)
        buf = self._stage[:total]
        host = buf.numpy()
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            # allocated on the copy stream: memory the current stream's queued work may still use
            # is never handed out there, so the copies need not wait for that work
            out = torch.empty(total, dtype=torch.float32, device=self.device)
            for lo in range(0, total, H2D_PIECE):
                hi = min(lo + H2D_PIECE, total)
                _stage_clips(host, clips, padded, lo, hi)
                out[lo:hi].copy_(buf[lo:hi], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record(self._copy_stream)
        main.wait_event(self._copied)
        out.record_stream(main)  # freed for reuse once the current stream's work on it is done
        return out

    def _layout(self, clips: Sequence[np.ndarray], lens: torch.Tensor) -> tuple[list, list, list[int]]:
        """The staged waveform's parts: per clip its left reflection (``n_fft // 2`` samples), the
        clip zero-padded to its ``lens * hop`` samples, its right reflection, then zeros to a
        multiple of the hop (``_stage_clips``' arrays and slots); and each clip's first frame as a
        row of the hop grid (its segment's start over the hop)."""
        half = self.n_fft // 2
        arrays, slots, grid_C, start = [], [], [], 0
        for w, n in zip(clips, (lens * self.hop).tolist()):
            left, right = _reflections(w, n, half)
            seg = -(-(n + 2 * half) // self.hop) * self.hop
            arrays += [left, w, right]
            slots += [half, n, seg - n - half]
            grid_C.append(start // self.hop)
            start += seg
        return arrays, slots, grid_C

    def _log_mel(self, wave: torch.Tensor, pos_F: torch.Tensor) -> torch.Tensor:
        """Log-mel rows ``[F, M]`` (before the per-clip floor) of every frame of every clip
        (``pos_F``: each frame's row of the hop grid over ``wave``, see :meth:`_layout`).

        Frame ``f`` of a clip of (hop-padded) length ``L`` covers samples ``f * hop - n_fft // 2``
        to ``+ n_fft`` of the clip reflected at its edges (``torch.stft``'s ``center=True``,
        ``pad_mode="reflect"``); the STFT's last frame is dropped, as the extractor does, so a clip
        has ``L // hop`` frames. With each clip staged between its reflections at a multiple of the
        hop, every frame is one row of a strided ``[G, n_fft]`` view of the waveform: the frames are
        gathered as rows (an ``[F]`` index, not an ``[F, n_fft]`` one), windowed, transformed and
        projected, ``FRAME_CHUNK`` at a time (bounds the gathered ``[n, n_fft]`` block)."""
        grid = wave.as_strided(((wave.numel() - self.n_fft) // self.hop + 1, self.n_fft), (self.hop, 1))
        rows = []
        for f0 in range(0, pos_F.shape[0], FRAME_CHUNK):
            spec = torch.fft.rfft(grid[pos_F[f0:f0 + FRAME_CHUNK]] * self.window, n=self.n_fft)
            rows.append(spec.abs().square() @ self.mel_T.T)  # [n, M]
        return torch.cat(rows).clamp_min(1e-10).log10()

    def __call__(self, waveforms: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        if len(waveforms) == 0:
            return torch.zeros(self.mel_T.shape[0], 0, device=self.device), torch.zeros(0, dtype=torch.long)
        clips = _prepare(waveforms, self.hop, False)  # checked; padded to the hop while staged
        lens = torch.tensor([-(-len(w) // self.hop) for w in clips], dtype=torch.long)  # frames per clip
        frames = int(lens.sum())
        arrays, slots, grid_C = self._layout(clips, lens)
        # frame f (counted over all clips) of clip c is row f + shift_C[c] of the hop grid
        shift_C = torch.tensor(grid_C, dtype=torch.long) - (torch.cumsum(lens, 0) - lens)
        # [3, C] to the device in one pinned, non-blocking copy (a pageable copy waits for the stream)
        lens_C, ids_C, shift_C = to_device_async(torch.stack([lens, torch.arange(len(clips)), shift_C]), self.device)
        clip_F = torch.repeat_interleave(ids_C, lens_C, output_size=frames)  # output_size: no host sync
        pos_F = torch.arange(frames, device=self.device) + shift_C[clip_F]
        wave = self._to_device(arrays, slots)
        log_FM = self._log_mel(wave, pos_F)
        top_C = torch.full((len(clips),), -torch.inf, device=self.device).scatter_reduce(
            0, clip_F, log_FM.amax(dim=1), "amax")  # each clip's own maximum: the 8-decade floor is per clip
        log_FM = torch.maximum(log_FM, (top_C - 8.0)[clip_F].unsqueeze(1))
        return ((log_FM + 4.0) / 4.0).T.contiguous(), lens


def trainer_featurizer(feature_extractor, device_features: bool = True):
    """What ``mgrpo train`` featurises with: a :class:`DeviceFeaturizer` on the current CUDA device
    when ``device_features`` and CUDA is there, else the host extractor
    (``engine.step_audio.featurizer_from_extractor``)."""
    if device_features and torch.cuda.is_available():
        if float(getattr(feature_extractor, "dither", 0.0)) == 0.0:
            return DeviceFeaturizer(feature_extractor, torch.device("cuda", torch.cuda.current_device()))
        logging.getLogger("megatron_grpo.data").warning(
            "trainer.device_features: the feature extractor dithers (dither=%s, random per call); "
            "featurising on the host instead", feature_extractor.dither)
    from megatron_grpo.engine.step_audio import featurizer_from_extractor

    return featurizer_from_extractor(feature_extractor)
