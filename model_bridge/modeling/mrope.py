"""Qwen3-Omni's interleaved multimodal RoPE (MRoPE) for megatron-core, and the positions it takes.

megatron-core's ``MultimodalRotaryEmbedding`` assigns the rotary frequency channels to the three
position axes (t, h, w) in contiguous chunks (Qwen2-VL layout). Qwen3-Omni's thinker interleaves
them instead: channel ``j`` takes its angle from axis h when ``j % 3 == 1 and j < 3 * section[1]``,
from axis w when ``j % 3 == 2 and j < 3 * section[2]``, else from axis t (transformers'
``Qwen3OmniMoeThinkerTextRotaryEmbedding.recomposition_frequencies``). The two layouts differ by up
to 2.0 in cos/sin as soon as the axes disagree, so ``GPTModel(position_embedding_type="mrope")``
gets its ``rotary_pos_emb`` replaced by :class:`InterleavedMRoPE`.

On CUDA (one sequence or a packed buffer, b = 1) the angles come from one Triton kernel that also
writes their fp32 ``cos``/``sin`` and hands them to the fused RoPE (rope.py's cache on the angles
tensor): one launch instead of ~11 small kernels and their host time, which sit in the step's
prologue while the GPU idles (``MGRPO_TRITON_ROPE=0`` switches it off with the other RoPE kernels).
For the torch backend (``InterleavedMRoPE.defer_launch``, set by the thinker; its RoPE is rope.py's
wrapper) that launch is deferred to the first RoPE that reads the angles, after layer 0's qkv GEMM
is queued (rope.py, "Deferred angles").

Shapes: T = tokens, b = batch, d = head_dim.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from ._triton import import_triton, triton_runs_on

__all__ = ["InterleavedMRoPE", "interleaved_mrope_freqs", "mrope_position_ids"]


def interleaved_mrope_freqs(position_ids: torch.Tensor, inv_freq: torch.Tensor,
                            mrope_section: Sequence[int]) -> torch.Tensor:
    """Rotary angles [b, T, d] (both halves, non-GPT-J layout) for positions [3, b, T].

    Computed the way transformers does it (positions in fp32 times inv_freq, then the interleaved
    axis selection), so ``cos``/``sin`` of the result equal HF's exactly.
    """
    if position_ids.dim() != 3 or position_ids.shape[0] != 3:
        raise ValueError(f"MRoPE position_ids must have shape [3, b, T], got {tuple(position_ids.shape)}")
    half = inv_freq.shape[0]
    if len(mrope_section) != 3 or sum(mrope_section) != half:
        raise ValueError(f"mrope_section {list(mrope_section)} must have 3 entries summing to "
                         f"head_dim/2 = {half}")
    pos = position_ids.to(device=inv_freq.device, dtype=torch.float32)
    freqs = pos[..., None] * inv_freq.float()  # [3, b, T, d/2]
    out = freqs[0].clone()
    for axis in (1, 2):
        idx = slice(axis, 3 * mrope_section[axis], 3)
        out[..., idx] = freqs[axis][..., idx]
    return torch.cat((out, out), dim=-1)  # [b, T, d]


_MROPE_BLOCK_T = 32
"""Tokens per program of the angle kernel (32 x 64 angles: a few KB of output each)."""


@functools.lru_cache(maxsize=None)
def _mrope_kernel():
    """The Triton kernel of :func:`_mrope_freqs_triton`; None without Triton or with ``MGRPO_TRITON_ROPE=0``."""
    if (mods := import_triton("MGRPO_TRITON_ROPE")) is None:
        return None
    triton, tl = mods

    @triton.jit
    def mrope_angles(pos_ptr, inv_ptr, f_ptr, cos_ptr, sin_ptr, T, s_axis, s_tok, sec1, sec2,
                     HALF: tl.constexpr, BLOCK_T: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = (t < T)[:, None]
        j = tl.arange(0, HALF)
        # the interleaved layout: channel j reads axis h (1) or w (2) where transformers' does
        axis = tl.where((j % 3 == 1) & (j < 3 * sec1), 1, tl.where((j % 3 == 2) & (j < 3 * sec2), 2, 0))
        pos = tl.load(pos_ptr + axis[None, :].to(tl.int64) * s_axis + t[:, None].to(tl.int64) * s_tok, mask=tm, other=0)
        ang = pos.to(tl.float32) * tl.load(inv_ptr + j)[None, :]  # fp32 product, as the eager path
        c, s_ = tl.cos(ang), tl.sin(ang)
        o = t[:, None].to(tl.int64) * (2 * HALF) + j[None, :]
        tl.store(f_ptr + o, ang, mask=tm)  # both halves: megatron's non-interleaved layout
        tl.store(f_ptr + o + HALF, ang, mask=tm)
        tl.store(cos_ptr + o, c, mask=tm)
        tl.store(cos_ptr + o + HALF, c, mask=tm)
        tl.store(sin_ptr + o, s_, mask=tm)
        tl.store(sin_ptr + o + HALF, s_, mask=tm)

    return mrope_angles


def _mrope_freqs_triton(position_ids: torch.Tensor, inv_freq: torch.Tensor, mrope_section: Sequence[int],
                        defer: bool = False):
    """``(freqs [T, 1, 1, d], cos [T, d], sin [T, d])`` fp32 for positions ``[3, 1, T]``, one launch;
    with ``defer`` the launch waits for the first RoPE that reads them (rope.py's deferred angles)."""
    import triton

    from .rope import defer_angles

    T, half = position_ids.shape[-1], inv_freq.shape[0]
    pos = position_ids[:, 0]
    freqs, cos, sin = (torch.empty(T, 2 * half, dtype=torch.float32, device=pos.device) for _ in range(3))

    def launch():
        if T:
            _mrope_kernel()[(triton.cdiv(T, _MROPE_BLOCK_T),)](
                pos, inv_freq, freqs, cos, sin, T, pos.stride(0), pos.stride(1), int(mrope_section[1]),
                int(mrope_section[2]), HALF=half, BLOCK_T=_MROPE_BLOCK_T, num_warps=4)

    out = freqs.view(T, 1, 1, 2 * half)
    if defer:
        defer_angles(out, launch)
    else:
        launch()
    return out, cos, sin


class InterleavedMRoPE(torch.nn.Module):
    """Drop-in replacement for megatron's ``MultimodalRotaryEmbedding`` with Qwen3-Omni's layout.

    ``forward(position_ids[3, b, T], mrope_section, cp_group=None) -> [T, b, 1, d]`` angles, the
    format megatron's ``apply_rotary_pos_emb`` expects. For packed (THD) input, pass positions for
    all T packed tokens (restarting per sample): megatron then maps each sample through its
    ``cu_seqlens`` offset (exact mapping because ``freqs.size(0) == cu_seqlens[-1]``).
    """

    def __init__(self, kv_channels: int, rotary_base: float, rotary_percent: float = 1.0,
                 rotary_interleaved: bool = False, seq_len_interpolation_factor: Optional[float] = None,
                 device: torch.device | str | None = None):
        super().__init__()
        if rotary_interleaved:
            raise ValueError("GPT-J style rotary_interleaved pairing is not Qwen3-Omni's; set it False")
        if rotary_percent != 1.0:
            raise ValueError("Qwen3-Omni rotates the whole head (rotary_percent must be 1.0)")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        dim = kv_channels
        # same expression as transformers' compute_default_rope_parameters (and megatron's). A plain
        # attribute, not a buffer (as in megatron): Float16Module / model.bfloat16() cast buffers,
        # and the angles must stay fp32.
        self.inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
        self.rotary_interleaved = False
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.defer_launch = False
        """Leave the angle kernel's launch to the first RoPE that reads the angles (rope.py's
        deferred angles); only for layer specs whose RoPE is rope.py's wrapper (the torch backend)."""

    def forward(self, position_ids: torch.Tensor, mrope_section: Sequence[int],
                cp_group: Optional[torch.distributed.ProcessGroup] = None) -> torch.Tensor:
        if cp_group is not None and cp_group.size() > 1:
            raise NotImplementedError("context parallelism is not supported by InterleavedMRoPE")
        if self.seq_len_interpolation_factor is not None:
            position_ids = position_ids.float() / self.seq_len_interpolation_factor
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        if self._kernel_ok(position_ids, mrope_section):
            from .rope import attach_cos_sin, fast_rope_installed

            # deferred (defer_launch: set by the thinker for the torch backend) only where every
            # RoPE of megatron's attention goes through rope.py's wrapper, which launches it first
            freqs, cos, sin = _mrope_freqs_triton(position_ids, self.inv_freq, mrope_section,
                                                  defer=self.defer_launch and fast_rope_installed())
            return attach_cos_sin(freqs, cos, sin)
        emb = interleaved_mrope_freqs(position_ids, self.inv_freq, mrope_section)  # [b, T, d]
        return emb[:, :, None, :].transpose(0, 1).contiguous()  # [T, b, 1, d]

    def _kernel_ok(self, position_ids: torch.Tensor, mrope_section: Sequence[int]) -> bool:
        half = self.inv_freq.shape[0]
        return (triton_runs_on(position_ids.is_cuda) and position_ids.dim() == 3 and position_ids.shape[0] == 3
                and position_ids.shape[1] == 1 and not position_ids.is_floating_point()
                and half & (half - 1) == 0 and len(mrope_section) == 3 and sum(mrope_section) == half
                and _mrope_kernel() is not None)


def mrope_position_ids(input_ids: torch.Tensor, spec, cu_seqlens: torch.Tensor | Sequence[int] | None = None
                       ) -> torch.Tensor:
    """The [3, T] MRoPE positions transformers uses for a text/audio sequence (int64).

    For text and audio (no image/video) Qwen3-Omni's ``get_rope_index`` gives every token the next
    sequential position on all three axes (audio tokens included). With ``cu_seqlens`` (packed
    samples) the positions restart at 0 at each sample start; tokens after ``cu_seqlens[-1]``
    (trailing padding) count on from 0 as one more segment. ``input_ids`` is [T] or [1, T];
    ``spec`` an :class:`~model_bridge.config.OmniSpec`.
    """
    ids = input_ids.reshape(-1) if input_ids.dim() == 2 and input_ids.shape[0] == 1 else input_ids
    if ids.dim() != 1:
        raise ValueError(f"input_ids must be [T] or [1, T], got {tuple(input_ids.shape)}")
    for name in ("image_token_id", "video_token_id"):
        tok = getattr(spec, name)
        if bool((ids == tok).any()):
            raise NotImplementedError(f"input_ids contain {name}={tok}: vision inputs are not supported "
                                      "(their 3-D MRoPE positions are not implemented)")
    T = ids.shape[0]
    if cu_seqlens is None:
        pos = torch.arange(T, device=ids.device)
    else:
        cu = [int(x) for x in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
        if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] > T:
            raise ValueError(f"cu_seqlens {cu} must start at 0, not decrease and end at <= T={T}")
        bounds = cu + ([T] if cu[-1] < T else [])
        pos = torch.cat([torch.arange(b - a, device=ids.device) for a, b in zip(bounds, bounds[1:])]
                        or [torch.zeros(0, dtype=torch.long, device=ids.device)])
    return pos.unsqueeze(0).expand(3, T).contiguous()
