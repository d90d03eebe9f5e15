"""Qwen3-Omni's audio tower as a Megatron-Core module, numerically equal to transformers'
``Qwen3OmniMoeAudioEncoder``.

Shapes: ``M`` mel bins, ``F`` mel frames (all clips of a micro-batch concatenated), ``C`` clips,
``K`` 100-frame chunks (``2 * n_window`` frames; a clip's last chunk may be shorter), ``T`` audio
tokens (13 per full chunk), ``D`` the encoder width (``d_model``), ``O`` the output width (the
thinker's hidden size).

Pipeline (as HF): each clip is cut into chunks, all chunks of all clips are zero-padded to the
longest chunk and go through three 3x3 stride-2 Conv2d+GELU (``audio_conv.py``: the same
arithmetic, laid out for speed) and ``conv_out`` in one batch;
sinusoidal positions restart at every chunk; padding positions are dropped; the tokens of all
clips then run through the encoder layers in ONE packed call, attention restricted to windows
(``n_window_infer`` frames = ``13 * n_window_infer // (2 * n_window)`` tokens per full window,
the remainder of a clip in a last, shorter window) expressed as ``cu_seqlens`` of a
``PackedSeqParams(qkv_format="thd")``; finally ``ln_post -> proj1 -> GELU -> proj2``.

Parallelism. The conv front-end, ``ln_post``, ``proj1`` and ``proj2`` are plain torch modules,
replicated on every rank. The encoder layers are megatron ``TransformerLayer``s (local spec:
torch LayerNorm with bias, ``linear_qkv`` column-parallel with bias, non-causal packed core
attention, ``linear_proj`` row-parallel with bias, ``linear_fc1`` column + GELU + ``linear_fc2``
row). They are tensor-parallel when TP divides the audio heads
(:func:`model_bridge.config.audio_is_tensor_parallel`); otherwise they are built over a
single-rank "TP" group, i.e. replicated whole on every TP rank.

Gradients of replicated weights. Every TP rank of a group feeds the tower the same features, and
every op either is replicated or ends in a TP all-reduce, so the gradient of each replicated
weight (conv/ln_post/proj, the norms and row-parallel biases of TP-sharded layers, and every
weight of a replicated encoder) comes out identical on all TP ranks, with no extra collective.
Megatron's DDP reduces them over the data-parallel group only (which is what they need), and
``finalize_model_grads`` adds nothing over TP because no audio weight is tagged
``sequence_parallel`` (the audio config never uses sequence parallelism). In the replicated case
the layers' weights are re-tagged ``tensor_model_parallel=False`` so grad-norm/zero counting
(``param_is_not_tensor_parallel_duplicate``) counts them on TP rank 0 only, and their dist-ckpt
``replica_id`` carries the global TP rank, so exactly one rank writes each tensor.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.transformer.module import MegatronModule

from model_bridge.config import (ConfigError, OmniSpec, ParallelLayout, audio_is_tensor_parallel,
                                 audio_transformer_config)

from .audio_conv import conv_front_end
from .thd import thd_params, to_device_async

__all__ = ["AudioTower", "audio_output_lengths", "audio_chunk_lengths", "audio_window_cu_seqlens",
           "dummy_audio_input", "audio_layer_spec", "sinusoid_positions"]

TOKENS_PER_FULL_CHUNK = 13
"""HF hard-codes 13 tokens per full ``2 * n_window``-frame chunk (100 frames -> 50 -> 25 -> 13)."""


# --------------------------------------------------------------------------------------------
# Host-side geometry (pure functions of the clip lengths; HF semantics)
# --------------------------------------------------------------------------------------------


def audio_output_lengths(feature_lens: torch.Tensor, n_window: int = 50) -> torch.Tensor:
    """Audio tokens the tower makes from clips of ``feature_lens`` mel frames.

    HF's ``_get_feat_extract_output_lengths``: 13 per full ``2 * n_window``-frame chunk plus the
    three stride-2 conv output length of the remainder. Works on tensors and ints alike.
    """
    chunk_len = n_window * 2
    leave = feature_lens % chunk_len
    feat = (leave - 1) // 2 + 1
    return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (feature_lens // chunk_len) * TOKENS_PER_FULL_CHUNK


def _check_lens(feature_lens: torch.Tensor) -> torch.Tensor:
    lens = torch.as_tensor(feature_lens).detach().to("cpu", torch.long).reshape(-1)
    if lens.numel() == 0:
        raise ValueError("feature_lens is empty: the audio tower needs at least one clip "
                         "(use dummy_audio_input(spec) for a micro-batch without audio)")
    if bool((lens <= 0).any()):
        raise ValueError(f"every clip needs at least one mel frame, got feature_lens={lens.tolist()}")
    return lens


def audio_chunk_lengths(feature_lens: torch.Tensor, n_window: int = 50) -> torch.Tensor:
    """Frames of each chunk, clips in order ([K] long, on CPU): full ``2 * n_window`` chunks and a
    shorter tail (HF's ``chunk_and_pad_features``; a clip that is a whole number of chunks has a
    full last chunk)."""
    lens = _check_lens(feature_lens)
    chunk = 2 * n_window
    out = []
    for n in lens.tolist():
        full, tail = divmod(n, chunk)
        out += [chunk] * full + ([tail] if tail else [])
    return torch.tensor(out, dtype=torch.long)


def audio_window_cu_seqlens(feature_lens: torch.Tensor, n_window: int = 50,
                            n_window_infer: int = 800) -> tuple[torch.Tensor, int]:
    """(cu_seqlens [W+1] int32 on CPU, max window length) of the attention windows over the
    packed tokens of all clips (HF's ``get_audio_cu_seqlens``).

    A window holds ``max_chunk_tokens * (n_window_infer // (2 * n_window))`` tokens, where
    ``max_chunk_tokens`` is the most tokens any chunk of the batch gives: 13 once any clip has a
    full chunk. When every clip is shorter than one chunk the window shrinks with it, but it still
    covers every clip whole, so each clip is then exactly one window (as in HF). Windows never
    straddle two clips.
    """
    lens = _check_lens(feature_lens)
    ratio = n_window_infer // (2 * n_window)
    if ratio < 1:
        raise ConfigError(f"n_window_infer={n_window_infer} < 2 * n_window={2 * n_window}: "
                          "the attention window would be empty")
    tokens = audio_output_lengths(lens, n_window).tolist()
    max_chunk_tokens = int(audio_output_lengths(audio_chunk_lengths(lens, n_window), n_window).max())
    window = max_chunk_tokens * ratio
    seg = []
    for t in tokens:
        seg += [window] * (t // window) + ([t % window] if t % window else [])
    cu = torch.zeros(len(seg) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(seg, dtype=torch.int64).cumsum(0).to(torch.int32)
    return cu, max(seg)


def dummy_audio_input(spec: OmniSpec, dtype: torch.dtype = torch.float32,
                      device: Optional[torch.device] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [M, 1] zeros on ``device``, feature_lens [1] on the host, where the tower reads
    it): the smallest valid clip (1 frame -> 1 token).

    For a micro-batch without audio: run the tower on it, multiply the output by zero and add it
    to the loss, so every parameter gets a (zero) gradient and every rank issues the same
    collectives. Zeros, not random values, so nothing non-finite can leak through ``0 * x``.
    """
    feats = torch.zeros(spec.audio.num_mel_bins, 1, dtype=dtype, device=device)
    return feats, torch.ones(1, dtype=torch.long)


def sinusoid_positions(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """[length, channels] float32 sin|cos table, bit-equal to HF's ``SinusoidsPositionEmbedding``."""
    if channels % 2:
        raise ConfigError(f"sinusoidal positions need an even d_model, got {channels}")
    log_timescale_increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_timescale_increment * torch.arange(channels // 2).float())
    scaled_time = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)


# --------------------------------------------------------------------------------------------
# Megatron layer spec
# --------------------------------------------------------------------------------------------


def _packed_core_attention_cls():
    """The thinker's packed (THD, cu_seqlens) core attention; it is non-causal for a self-attention
    built with ``attn_mask_type=AttnMaskType.no_mask``."""
    from model_bridge.modeling.attention import PackedCoreAttention

    return PackedCoreAttention


def audio_layer_spec(core_attention=None):
    """ModuleSpec of one encoder layer (megatron local modules, no TE/Apex needed).

    ``input_layernorm``/``pre_mlp_layernorm``: torch LayerNorm with bias; ``self_attention``:
    ``linear_qkv`` (column, bias) -> non-causal packed core attention -> ``linear_proj`` (row,
    bias), no q/k norm, no rotary; ``mlp``: ``linear_fc1`` (column, bias) -> GELU ->
    ``linear_fc2`` (row, bias). Built from megatron's own local GPT spec so the wiring follows
    the installed megatron-core version (0.16 and 0.19 differ in how MLPs are specified). The four
    linears are megatron's, adding their bias in the GEMM where the layer has its TP group to itself
    (``bias_linear.py``).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from .bias_linear import BiasInGemmColumnLinear, BiasInGemmRowLinear

    spec = get_gpt_layer_local_spec(num_experts=None, qk_layernorm=False, normalization="LayerNorm")
    sub = spec.submodules
    sub.input_layernorm = WrappedTorchNorm
    sub.pre_mlp_layernorm = WrappedTorchNorm
    attn = sub.self_attention
    attn.params = dict(attn.params or {}, attn_mask_type=AttnMaskType.no_mask)
    attn.submodules.core_attention = core_attention or _packed_core_attention_cls()
    attn.submodules.q_layernorm = IdentityOp
    attn.submodules.k_layernorm = IdentityOp
    # megatron 0.16: a ModuleSpec; 0.19: functools.partial(MLP..., submodules=MLPSubmodules(...))
    mlp = sub.mlp.keywords["submodules"] if isinstance(sub.mlp, functools.partial) else sub.mlp.submodules
    for subs, name, cls in ((attn.submodules, "linear_qkv", BiasInGemmColumnLinear),
                            (attn.submodules, "linear_proj", BiasInGemmRowLinear),
                            (mlp, "linear_fc1", BiasInGemmColumnLinear), (mlp, "linear_fc2", BiasInGemmRowLinear)):
        if not issubclass(cls, getattr(subs, name)):
            raise TypeError(f"audio layer spec: expected megatron's {cls.__mro__[2].__name__} as {name}, got "
                            f"{getattr(subs, name)!r} (a megatron-core whose local spec changed)")
        setattr(subs, name, cls)
    return spec


_SINGLETON_GROUPS: dict = {}


def _singleton_group():
    """A process group holding only this rank (created locally: no other rank takes part, so it
    is safe on ranks of any pipeline stage)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    key = (id(dist.group.WORLD), rank)  # a re-initialised default group needs new subgroups
    if key not in _SINGLETON_GROUPS:
        _SINGLETON_GROUPS[key] = dist.new_group([rank], use_local_synchronization=True)
    return _SINGLETON_GROUPS[key]


# --------------------------------------------------------------------------------------------
# The tower
# --------------------------------------------------------------------------------------------


class AudioTower(MegatronModule):
    """Qwen3-Omni audio encoder (HF ``Qwen3OmniMoeAudioEncoder`` semantics) on megatron layers.

    Parameter names (under the parent's ``audio_tower.``): ``conv2d{1,2,3}.{weight,bias}``,
    ``conv_out.weight``, ``encoder.layers.I.{input_layernorm,pre_mlp_layernorm}.{weight,bias}``,
    ``encoder.layers.I.self_attention.{linear_qkv,linear_proj}.{weight,bias}``,
    ``encoder.layers.I.mlp.{linear_fc1,linear_fc2}.{weight,bias}``, ``ln_post.{weight,bias}``,
    ``proj1.{weight,bias}``, ``proj2.{weight,bias}``. ``linear_qkv`` is megatron's fused layout,
    per head ``[q_h; k_h; v_h]`` (one query group per head), sharded by heads when
    ``self.tensor_parallel``.
    """

    def __init__(self, spec: OmniSpec, layout: ParallelLayout, dtype: torch.dtype = torch.float32,
                 core_attention=None):
        config = audio_transformer_config(spec, layout, dtype)
        super().__init__(config=config)
        from megatron.core import parallel_state as ps
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.transformer_block import TransformerBlock

        a = spec.audio
        self.spec = spec
        self.audio = a
        self.layout = layout
        self.tensor_parallel = audio_is_tensor_parallel(spec, layout)
        if 2 * a.n_window > a.n_window_infer:
            raise ConfigError(f"audio n_window_infer={a.n_window_infer} must be >= 2 * n_window="
                              f"{2 * a.n_window}")
        world_tp = ps.get_tensor_model_parallel_world_size()
        if world_tp != layout.tp:
            raise ConfigError(f"layout.tp={layout.tp} but megatron's tensor-parallel group has "
                              f"{world_tp} ranks: build the tower with the layout init_parallel used")
        self.tp_group = ps.get_tensor_model_parallel_group()  # replicated pieces: dist-ckpt replica ids

        kw = dict(dtype=dtype)
        ch = a.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, ch, 3, 2, padding=1, **kw)
        self.conv2d2 = nn.Conv2d(ch, ch, 3, 2, padding=1, **kw)
        self.conv2d3 = nn.Conv2d(ch, ch, 3, 2, padding=1, **kw)
        freq = (((a.num_mel_bins + 1) // 2 + 1) // 2 + 1) // 2
        self.conv_out = nn.Linear(ch * freq, a.d_model, bias=False, **kw)
        self.register_buffer("positional_embedding",
                             sinusoid_positions(a.max_source_positions, a.d_model), persistent=False)

        pg = ProcessGroupCollection.use_mpu_process_groups()
        if not self.tensor_parallel and world_tp > 1:
            pg.tp = _singleton_group()
        self.encoder = TransformerBlock(config, audio_layer_spec(core_attention), post_layer_norm=False,
                                        pre_process=True, post_process=True, pg_collection=pg)
        if not self.tensor_parallel:
            for p in self.encoder.parameters():  # whole copies: not TP shards of anything
                p.tensor_model_parallel = False
                p.partition_dim = -1
                p.partition_stride = 1

        self.ln_post = nn.LayerNorm(a.d_model, **kw)
        self.proj1 = nn.Linear(a.d_model, a.d_model, **kw)
        self.proj2 = nn.Linear(a.d_model, a.output_dim, **kw)
        self._init_replicated(config.init_method_std)

    @torch.no_grad()
    def _init_replicated(self, std: float) -> None:
        """Random init of the torch-native pieces (real runs load HF weights over it). Uses the
        default generator, which init_parallel seeds identically on every rank."""
        for m in (self.conv2d1, self.conv2d2, self.conv2d3, self.conv_out, self.proj1, self.proj2):
            m.weight.normal_(0.0, std)
            if m.bias is not None:
                m.bias.zero_()

    # ---- forward -------------------------------------------------------------------------

    def _front_end(self, features: torch.Tensor, chunk_lens: torch.Tensor) -> torch.Tensor:
        """Chunks -> conv stack -> conv_out + positions: [K, t_max, D] (padded positions kept)."""
        # every chunk's frames into [K, L, M] in one scatter (pad_sequence would copy chunk by chunk:
        # thousands of launches for a step's minutes of audio); rows past a chunk's length stay 0
        k, length, m = chunk_lens.numel(), int(chunk_lens.max()), features.shape[0]
        rows = (torch.arange(length) < chunk_lens[:, None]).flatten().nonzero().squeeze(-1)  # host
        padded = features.new_zeros(k * length, m).index_copy_(0, to_device_async(rows, features.device), features.T)
        dtype = self.conv2d1.weight.dtype
        x = padded.view(k, length, m).transpose(1, 2).unsqueeze(1).to(dtype)  # [K, 1, M, L]
        # oneDNN's half-precision stride-2 convolution returns garbage (1e36, NaN) for outputs one or
        # two columns wide on some x86 CPUs (torch 2.13; a 1-frame chunk, e.g. the dummy clip):
        # half-precision CPU runs convolve in float32
        conv_dtype = torch.float32 if x.device.type == "cpu" and dtype != torch.float32 else dtype
        convs = [(c.weight.to(conv_dtype), c.bias.to(conv_dtype)) for c in (self.conv2d1, self.conv2d2, self.conv2d3)]
        outs = [conv_front_end(part.to(conv_dtype), convs).to(dtype)  # conv_chunksize: bounds conv memory
                for part in x.split(max(1, self.audio.conv_chunksize), dim=0)]
        x = torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]
        k, c, f, t = x.shape
        x = self.conv_out(x.permute(0, 3, 1, 2).reshape(k, t, c * f))
        if t > self.positional_embedding.shape[0]:
            raise ValueError(f"chunk of {t} tokens exceeds max_source_positions="
                             f"{self.positional_embedding.shape[0]}")
        return x + self.positional_embedding[:t].unsqueeze(0).to(x.dtype)

    def forward(self, features: torch.Tensor, feature_lens: torch.Tensor) -> torch.Tensor:
        """features [M, F] (clips concatenated along frames), feature_lens [C] -> [T, O].

        ``T = audio_output_lengths(feature_lens).sum()``; rows are the clips' tokens in order.
        """
        a = self.audio
        if features.dim() != 2 or features.shape[0] != a.num_mel_bins:
            raise ValueError(f"features must be [num_mel_bins={a.num_mel_bins}, frames], "
                             f"got {tuple(features.shape)}")
        lens = _check_lens(feature_lens)
        if int(lens.sum()) != features.shape[1]:
            raise ValueError(f"feature_lens sum to {int(lens.sum())} frames but features has "
                             f"{features.shape[1]}")
        device = features.device
        chunk_lens = audio_chunk_lengths(lens, a.n_window)
        x = self._front_end(features, chunk_lens)  # [K, t_max, D]

        chunk_tokens = audio_output_lengths(chunk_lens, a.n_window)
        valid = (torch.arange(x.shape[1]) < chunk_tokens[:, None]).flatten().nonzero().squeeze(-1)
        h = x.reshape(-1, x.shape[-1]).index_select(0, to_device_async(valid, device))  # [T, D]

        cu, max_len = audio_window_cu_seqlens(lens, a.n_window, a.n_window_infer)
        # host offsets ride along and copies are pinned: with host feature_lens (as the trainer
        # passes them) the tower plans its windows without reading the device (thd.py)
        psp = thd_params(cu.tolist(), device, max_len)
        h = self.encoder(h.unsqueeze(1), attention_mask=None, packed_seq_params=psp)  # [T, 1, D]
        h = h.squeeze(1)
        h = self.ln_post(h)
        h = F.gelu(self.proj1(h))
        return self.proj2(h)

    # ---- distributed checkpointing ---------------------------------------------------------

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None):
        """Megatron's default, plus: a replicated encoder's tensors get the global TP rank in their
        replica id (built over a single-rank group they would all claim to be the main copy)."""
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.tensor_parallel or self.layout.tp == 1:
            return sd
        from megatron.core import parallel_state as ps

        tp_rank = ps.get_tensor_model_parallel_rank()
        enc = f"{prefix}encoder."
        for key, item in sd.items():
            rid = getattr(item, "replica_id", None)
            if key.startswith(enc) and isinstance(rid, tuple) and len(rid) == 3:
                item.replica_id = (rid[0], tp_rank, rid[2])
        return sd
