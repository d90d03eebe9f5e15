"""The audio tower's log-mel features computed on the training device (the GPU), clip by clip.

The same function as :func:`megatron_grpo.data.features.audio_features` with its defaults (each clip
on its own, zero-padded to a multiple of the hop length: what vLLM gave the rollout), written in
torch so the STFT, the mel projection and the log run where the model runs and the features never
cross the host: the Whisper feature extractor's torch path (``_torch_extract_fbank_features``)
per clip, with the clip's own maximum for the 8-decade floor. Only the waveform (float32, 4 bytes
a sample: 64 kB per second) travels to the device.

Tolerance against the extractor (``tests/megatron_grpo/data/test_device_features.py``): on the
CPU the two agree to float32 rounding (max abs diff < 1e-4 on features of magnitude ~1); on the
GPU cuFFT's and the GEMM's rounding differ from the CPU's, checked at max abs diff < 2e-3
(``log10`` of powers near the floor amplifies the relative error of tiny mel energies).
"""
from __future__ import annotations

import logging

from typing import Sequence

import numpy as np
import torch

from megatron_grpo.data.features import HOP_LENGTH, _prepare

__all__ = ["DeviceFeaturizer", "trainer_featurizer"]


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
        self.mel_T = torch.from_numpy(np.asarray(feature_extractor.mel_filters, dtype=np.float32)).T.contiguous() \
            .to(self.device)  # [M, n_fft // 2 + 1]

    def clip(self, wave: torch.Tensor) -> torch.Tensor:
        """Log-mel ``[M, len // hop]`` of one clip already padded to the hop (float32 on the device)."""
        stft = torch.stft(wave, self.n_fft, self.hop, window=self.window, return_complex=True)
        power = stft[..., :-1].abs().square()  # the last frame dropped, as the extractor does
        log_spec = (self.mel_T @ power).clamp_min(1e-10).log10()
        log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
        return (log_spec + 4.0) / 4.0

    def _to_device(self, clips: Sequence[np.ndarray]) -> torch.Tensor:
        """The clips end to end as one float32 tensor on the device. On CUDA they are written into a
        pinned staging buffer kept across calls (grown as needed) and cross in one asynchronous
        copy; the next call waits for that copy before it writes the buffer again."""
        total = sum(len(w) for w in clips)
        if self.device.type != "cuda":
            return torch.from_numpy(np.concatenate(clips) if len(clips) > 1 else clips[0])
        if self._copied is not None:
            self._copied.synchronize()
        if self._stage is None or self._stage.numel() < total:
            self._stage = torch.empty(int(total * 1.25) + 1, dtype=torch.float32, pin_memory=True)
        o = 0
        for w in clips:
            self._stage[o:o + len(w)].numpy()[:] = w  # a read-only clip is fine: numpy copies it
            o += len(w)
        out = self._stage[:total].to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out

    def __call__(self, waveforms: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        if len(waveforms) == 0:
            return torch.zeros(self.mel_T.shape[0], 0, device=self.device), torch.zeros(0, dtype=torch.long)
        clips = _prepare(waveforms, self.hop, False)  # checked; padded to the hop on the device
        parts = []
        for w in self._to_device(clips).split([len(w) for w in clips]):
            if len(w) % self.hop:
                w = torch.nn.functional.pad(w, (0, self.hop - len(w) % self.hop))
            parts.append(self.clip(w))
        lens = torch.tensor([-(-len(w) // self.hop) for w in clips], dtype=torch.long)
        return torch.cat(parts, dim=1), lens


def trainer_featurizer(feature_extractor, device_features: bool = True):
    """What ``mgrpo train`` featurises with: a :class:`DeviceFeaturizer` on the current CUDA device
    when ``device_features`` and CUDA is there, else the host extractor
    (``engine.batch.featurizer_from_extractor``)."""
    if device_features and torch.cuda.is_available():
        if float(getattr(feature_extractor, "dither", 0.0)) == 0.0:
            return DeviceFeaturizer(feature_extractor, torch.device("cuda", torch.cuda.current_device()))
        logging.getLogger("megatron_grpo.data").warning(
            "trainer.device_features: the feature extractor dithers (dither=%s, random per call); "
            "featurising on the host instead", feature_extractor.dither)
    from megatron_grpo.engine.batch import featurizer_from_extractor

    return featurizer_from_extractor(feature_extractor)
