"""Qwen3-Omni's thinker in megatron-core: GPT MoE decoder + interleaved MRoPE + audio tower.

``build_thinker(spec, layout)`` -> :class:`OmniThinker` with

* ``.language_model``: megatron ``GPTModel`` (``position_embedding_type="mrope"``, rotary base
  ``rope_theta``, vocab padded to ``padded_vocab_size(vocab, tp)``, untied embeddings,
  pre/post-process from this rank's pipeline stage) whose rotary embedding is replaced by
  :class:`~model_bridge.modeling.mrope.InterleavedMRoPE` (Qwen3-Omni's layout);
* ``.audio_tower``: :class:`~model_bridge.modeling.audio.AudioTower`, on the first pipeline stage
  only (``None`` elsewhere).

On the first stage the forward embeds the tokens, runs the audio tower on the clips' features and
writes its embeddings into the rows of ``audio_token_id`` (clips in order, as transformers'
``masked_scatter``), then feeds that to the decoder (``[s, b, h]``, split over the TP ranks along
the sequence when sequence parallelism is on).

Anti-hang invariant: the audio tower runs on every micro-batch of every rank. A micro-batch with no
audio runs it on a one-frame dummy clip and adds ``0 * out.sum()`` to the embeddings, so every
rank issues the same collectives and gets (zero) gradients for every audio weight. Switch it off
with ``dummy_audio=False`` for inference-only use.

Shapes: T tokens of the (packed) micro-batch, b = 1 for packed input, V vocab, Vp padded vocab.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron.core.transformer.module import MegatronModule

from model_bridge.config import OmniSpec, ParallelLayout, check_layout, padded_vocab_size, thinker_transformer_config

from .mrope import InterleavedMRoPE, mrope_position_ids
from .specs import resolve_backend, thinker_layer_spec

from .thd import attach_host_offsets, host_offsets, ints_to_device, offsets_to_device

__all__ = ["OmniThinker", "build_thinker", "gather_logits", "mrope_position_ids", "VOCAB_PAD_LOGIT"]

VOCAB_PAD_LOGIT = -1.0e4
"""Logit written into the padded vocab columns: exp() of it underflows to exactly 0 in every float
dtype, so softmax/log-softmax over the padded vocab equal those over the real one, while staying
finite (``p * logp`` stays 0, never NaN)."""


def _normalize_packed(psp, T: int):
    """Make trailing padding after the last sample explicit for megatron's THD RoPE.

    megatron's ``_apply_rotary_pos_emb_thd`` splits the T tokens by the (padded) ``cu_seqlens``
    and needs them to cover all T. When they end before T, extend the last slot of
    ``cu_seqlens_*_padded`` to T: the samples keep their real lengths (``cu_seqlens``), so the
    core attention leaves the padding out (zero outputs), and RoPE maps every token exactly.
    """
    if psp is None or psp.qkv_format != "thd":
        return psp
    cu = psp.cu_seqlens_q
    if cu is None:
        raise ValueError("PackedSeqParams(qkv_format='thd') needs cu_seqlens_q")
    host = host_offsets(psp)  # the packer's host copy: no device read (thd.py)
    layout = psp.cu_seqlens_q_padded if psp.cu_seqlens_q_padded is not None else cu
    end = (host[1] or host[0])[-1] if host is not None else int(layout[-1])
    if end > T:
        raise ValueError(f"packed cu_seqlens end at {end} but the micro-batch has only {T} tokens")
    if end == T:
        return psp
    if host is not None:  # from the host copy: writing a host int into a device tensor syncs
        padded_host = (host[1] or host[0])[:-1] + (T,)
        padded = ints_to_device(padded_host, layout.device, layout.dtype)
    else:
        padded = layout.clone()
        padded[-1] = T
    kv_layout = psp.cu_seqlens_kv_padded if psp.cu_seqlens_kv_padded is not None else psp.cu_seqlens_kv
    kv_padded = padded if kv_layout is None or kv_layout is layout or torch.equal(kv_layout, layout) else None
    if kv_padded is None:
        raise NotImplementedError("different q and kv packing is not supported (self-attention only)")
    out = dataclasses.replace(psp, cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=kv_padded)
    if host is not None:
        attach_host_offsets(out, host[0], padded_host)
    return out


def _lookup_only(embedding) -> bool:
    """Whether megatron's ``LanguageModelEmbedding`` forward is the word lookup transposed to
    ``[s, b, h]`` and nothing else (no position or token-type embeddings, no sequence-parallel
    scatter, no fp32 cast or MuP scale, dropout off): the embedding is then called directly, one
    module call and a dropout call fewer in the step's prologue, where the host paces the GPU."""
    cfg = embedding.config
    drop = embedding.embedding_dropout
    return (not embedding.add_position_embedding and getattr(embedding, "tokentype_embeddings", None) is None
            and not getattr(embedding, "reduce_scatter_embeddings", False) and not cfg.sequence_parallel
            and not cfg.fp32_residual_connection
            and not (getattr(cfg, "use_mup", False) and getattr(cfg, "mup_embedding_mult", 1.0) != 1.0)
            and (drop.p == 0 or not embedding.training))


class OmniThinker(MegatronModule):
    """The thinker of one pipeline stage: ``language_model`` (GPTModel) + ``audio_tower`` (stage 0).

    ``forward(input_ids[1, T], position_ids[3, 1, T], packed_seq_params=None, audio_features=None,
    audio_feature_lens=None, return_hidden=False)`` returns logits ``[T, 1, Vp/tp]`` on the last
    stage (padded vocab columns set to :data:`VOCAB_PAD_LOGIT` unless ``mask_vocab_padding=False``)
    and hidden states ``[T(/tp with SP), 1, h]`` on the others. ``audio_features`` is
    ``[num_mel_bins, F_total]`` (the clips' frames concatenated), ``audio_feature_lens``
    ``[n_clips]``. With ``return_hidden=True`` the last stage skips the output layer and returns
    the final hidden states (after the final norm) ``[T, 1, h]``, as the output layer would see
    them (:meth:`lm_head_input`); :meth:`lm_head_weight` is the output layer's weight shard
    ``[Vp/tp, h]`` (for ``megatron_grpo.engine.fused_logprobs``). Other stages ignore it.
    """

    def __init__(self, spec: OmniSpec, layout: ParallelLayout, config, *, pre_process: bool = True,
                 post_process: bool = True, backend: str = "auto", dummy_audio: bool = True,
                 mask_vocab_padding: bool = True, audio_dtype: Optional[torch.dtype] = None,
                 vp_stage: Optional[int] = None, build_audio: bool = True):
        super().__init__(config=config)
        from megatron.core.enums import ModelType
        from megatron.core.models.gpt.gpt_model import GPTModel

        t = spec.text
        if t.tie_word_embeddings:
            raise ValueError("tied word embeddings are not supported (Qwen3-Omni's thinker has untied ones)")
        if not t.mrope_interleaved:
            raise ValueError("the checkpoint's MRoPE is not interleaved; only Qwen3-Omni's interleaved layout "
                             "is implemented")
        self.spec = spec
        self.layout = layout
        self.pre_process = pre_process
        self.post_process = post_process
        self.share_embeddings_and_output_weights = False
        self.model_type = ModelType.encoder_or_decoder
        self.dummy_audio = dummy_audio
        self.mask_vocab_padding = mask_vocab_padding
        self.vocab_size = t.vocab_size
        self.padded_vocab_size = padded_vocab_size(t.vocab_size, layout.tp)
        self.backend = backend

        block_spec = thinker_layer_spec(config, backend, vp_stage=vp_stage)
        kw = dict(config=config, transformer_layer_spec=block_spec, vocab_size=self.padded_vocab_size,
                  max_sequence_length=t.max_position_embeddings, pre_process=pre_process,
                  post_process=post_process, parallel_output=True, share_embeddings_and_output_weights=False,
                  position_embedding_type="mrope", rotary_base=t.rope_theta)
        if vp_stage is not None:
            kw["vp_stage"] = vp_stage
        self.language_model = GPTModel(**kw)
        self.language_model.rotary_pos_emb = InterleavedMRoPE(kv_channels=t.head_dim, rotary_base=t.rope_theta)
        # the torch backend's attention takes packed offsets left on the host (thd_params(...,
        # defer_copy=True)) and copies them after layer 0's qkv GEMM is queued; other specs get
        # them on the device before the forward (thd.offsets_to_device)
        self._host_offsets_ok = resolve_backend(backend) == "torch"
        if self._host_offsets_ok:  # the torch backend's kernels outside the layer spec
            self.language_model.rotary_pos_emb.defer_launch = True  # its RoPE is rope.py's wrapper
            from .embedding import use_sorted_embedding_backward
            from .norm import use_fast_rms_norms

            use_fast_rms_norms(self.language_model)
            if pre_process:
                use_sorted_embedding_backward(self.language_model.embedding.word_embeddings)

        self.audio_tower = None
        if pre_process and build_audio:
            from .audio import AudioTower

            self.audio_tower = AudioTower(spec, layout, audio_dtype or config.params_dtype)

    # ---- megatron plumbing (schedules, finalize_model_grads) -------------------------------

    @property
    def decoder(self):
        return self.language_model.decoder

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline stages > 0: the previous stage's hidden states (megatron schedules call this)."""
        self.language_model.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self):
        return self.language_model.shared_embedding_or_output_weight()

    # ---- forward -----------------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor, audio_features: Optional[torch.Tensor] = None,
              audio_feature_lens: Optional[torch.Tensor] = None, audio_token_count: Optional[int] = None,
              clip_use=None) -> torch.Tensor:
        """Decoder input [s(/tp with SP), b, h]: token embeddings with the audio rows replaced.

        First pipeline stage only. Raises ValueError when the number of ``audio_token_id`` tokens
        differs from the number of audio embeddings the clips give. ``audio_token_count``: that
        number as the caller counted it on the host (saves a device sync; it must be right).
        ``clip_use`` (``shared_audio.ClipUse``): clips this micro-batch shares with others of the
        pass, interleaved with its own (``audio_features``) in token order.
        """
        if not self.pre_process:
            raise RuntimeError("embed() runs on the first pipeline stage only")
        from megatron.core import tensor_parallel

        lm = self.language_model
        if _lookup_only(lm.embedding):  # megatron's module would add nothing to the lookup
            emb = lm.embedding.word_embeddings(input_ids).transpose(0, 1).contiguous()  # [s, b, h]
        else:
            emb = lm.embedding(input_ids=input_ids, position_ids=None)  # [s(/tp), b, h]
        # [b, s]; not made when the caller counted the audio tokens and there are none (a launch
        # in the step's prologue, where the GPU waits for the host)
        has_audio = audio_features is not None or clip_use is not None
        is_audio = None if audio_token_count is not None and not has_audio else input_ids == self.spec.audio_token_id
        # a device read (host sync) unless the caller counted them on the host
        n_tokens = int(is_audio.sum()) if audio_token_count is None else int(audio_token_count)
        if has_audio:
            # A micro-batch whose clips are all in clip_use and which is no batch's last user runs no
            # tower here, and needs no dummy clip for invariant 2: the tower's parameters get their
            # gradient in the last users' backward, a rank's last micro-batch is the last user of
            # every batch it uses (DDP's grad sync, overlapped or not, sees every tower gradient by
            # then), and TP ranks hold the same micro-batches (the tower's collectives match).
            audio = self.audio_rows(audio_features, audio_feature_lens, clip_use)  # [n_audio, h]
            if audio.shape[0] != n_tokens:
                lens = [] if audio_feature_lens is None else torch.as_tensor(audio_feature_lens).reshape(-1).tolist()
                shared = "" if clip_use is None else f" and {len(clip_use.order) - clip_use.num_own} shared clip(s)"
                raise ValueError(
                    f"audio token count mismatch: input_ids hold {n_tokens} audio tokens (id "
                    f"{self.spec.audio_token_id}) but the audio tower made {audio.shape[0]} embeddings from "
                    f"{len(lens)} clip(s) with feature_lens={lens}{shared}")
            b, s = is_audio.shape
            if not self.config.sequence_parallel:
                # the audio rows copied in at their positions (b-major, as the clips come); the
                # positions' count is known, so neither pass reads the device (a masked_scatter's
                # backward would: masked_select), and the backward is an index_select and an
                # index_fill instead of two full-size selects
                f = is_audio.reshape(-1).nonzero_static(size=n_tokens).squeeze(1)  # flat [b, s] positions
                rows = (f % s) * b + f // s  # the same tokens in the [s, b] layout of emb
                h = emb.shape[-1]
                emb = emb.reshape(s * b, h).index_copy(0, rows, audio.to(emb.dtype)).view(s, b, h)
            else:  # each rank holds a slice of the sequence: the overlay and mask are scattered
                overlay = emb.new_zeros(b, s, emb.shape[-1]).masked_scatter(
                    is_audio.unsqueeze(-1), audio.to(emb.dtype)).transpose(0, 1)  # [s, b, h]
                mask = is_audio.transpose(0, 1).unsqueeze(-1)  # [s, b, 1]
                overlay = tensor_parallel.scatter_to_sequence_parallel_region(overlay)
                mask = tensor_parallel.scatter_to_sequence_parallel_region(mask)
                emb = torch.where(mask, overlay, emb)
        elif n_tokens:
            raise ValueError(f"input_ids hold {n_tokens} audio tokens (id {self.spec.audio_token_id}) "
                             "but no audio_features were given")
        elif self.dummy_audio and self.audio_tower is not None:
            emb = emb + 0.0 * self._dummy_tower_sum(emb)
        return emb

    def audio_rows(self, audio_features: Optional[torch.Tensor], audio_feature_lens: Optional[torch.Tensor],
                   clip_use=None) -> torch.Tensor:
        """The audio tower's rows ``[n_audio, h]`` of a micro-batch's clips in token order: its own
        (``audio_features [M, F]``, ``audio_feature_lens [A]``) and, with ``clip_use``, the shared ones."""
        if self.audio_tower is None:
            raise RuntimeError("audio_features given but this thinker was built without an audio tower")
        if audio_features is not None and audio_feature_lens is None:
            raise ValueError("audio_features given without audio_feature_lens (frames of each clip)")
        audio = None if audio_features is None else self.audio_tower(audio_features, audio_feature_lens)
        if clip_use is None:
            return audio
        from .audio import audio_output_lengths

        own_tokens = [] if audio is None else audio_output_lengths(
            torch.as_tensor(audio_feature_lens).reshape(-1).cpu(), self.spec.audio.n_window).tolist()
        return clip_use.rows(self.audio_tower, audio, own_tokens)

    def _dummy_tower_sum(self, like: torch.Tensor) -> torch.Tensor:
        """The audio tower's output on a one-frame dummy clip, summed (``like``'s dtype): times zero,
        it keeps anti-hang invariant 2 in a micro-batch whose tower would not run otherwise."""
        from .audio import dummy_audio_input

        feats, lens = dummy_audio_input(self.spec, dtype=like.dtype, device=like.device)
        return self.audio_tower(feats, lens).sum().to(like.dtype)

    def forward(self, input_ids: Optional[torch.Tensor], position_ids: torch.Tensor, packed_seq_params=None,
                audio_features: Optional[torch.Tensor] = None, audio_feature_lens: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, return_hidden: bool = False,
                audio_token_count: Optional[int] = None, clip_use=None) -> torch.Tensor:
        if position_ids.dim() == 2:  # [3, T] -> [3, 1, T]
            position_ids = position_ids.unsqueeze(1)
        if position_ids.dim() != 3 or position_ids.shape[0] != 3:
            raise ValueError(f"position_ids must be [3, b, T] (MRoPE t/h/w), got {tuple(position_ids.shape)}")
        T = position_ids.shape[-1]
        if input_ids is not None and tuple(input_ids.shape) != tuple(position_ids.shape[1:]):
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and position_ids {tuple(position_ids.shape)} "
                             "disagree on [b, T]")
        if self.config.sequence_parallel and T % self.layout.tp:
            raise ValueError(f"with sequence parallelism the micro-batch length ({T}) must be a multiple of "
                             f"tp={self.layout.tp}: pad it (trailing padding after cu_seqlens[-1] is ignored)")
        if not self._host_offsets_ok:
            packed_seq_params = offsets_to_device(packed_seq_params)
        packed_seq_params = _normalize_packed(packed_seq_params, T)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd" and position_ids.shape[1] != 1:
            raise ValueError("packed (THD) input must have batch size 1")

        decoder_input = None
        if self.pre_process:
            if input_ids is None:
                raise ValueError("the first pipeline stage needs input_ids")
            decoder_input = self.embed(input_ids, audio_features, audio_feature_lens, audio_token_count,
                                       clip_use)
        lm = self.language_model
        hidden_only = return_hidden and self.post_process
        if hidden_only:
            lm.post_process = False  # GPTModel._postprocess then returns the decoder's (final-normed) output
        try:
            out = lm(input_ids, position_ids, attention_mask, decoder_input=decoder_input,
                     packed_seq_params=packed_seq_params)
        finally:
            if hidden_only:
                lm.post_process = True
        if hidden_only:
            return self.lm_head_input(out)
        if not self.post_process:
            return out  # hidden states [s(/tp), b, h]
        logits = out.transpose(0, 1)  # GPTModel gives [b, s, Vp/tp]; -> [s, b, Vp/tp]
        if self.mask_vocab_padding and self.padded_vocab_size != self.vocab_size:
            n_real = self._local_real_vocab(logits.shape[-1])
            if n_real < logits.shape[-1]:
                logits[..., n_real:] = VOCAB_PAD_LOGIT
        return logits

    def lm_head_weight(self) -> torch.Tensor:
        """The output layer's weight shard ``[Vp/tp, h]`` (last pipeline stage)."""
        if not self.post_process:
            raise RuntimeError("lm_head_weight() exists on the last pipeline stage only")
        return self.language_model.output_layer.weight

    def lm_head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``[s(/tp), b, h]`` -> what the output layer multiplies, ``[s, b, h]``.

        Does the output layer's input handling (``ColumnParallelLinear``) without its GEMM: with
        sequence parallelism an all-gather over TP whose backward reduce-scatters, else (tp > 1)
        an identity whose backward all-reduces (each TP rank's gradient covers its vocab shard
        only). First runs the output layer's forward pre-hooks, as calling it would (megatron DDP's
        ``overlap_param_gather`` waits there for the weight's all-gather).
        """
        from megatron.core import tensor_parallel

        ol = self.language_model.output_layer
        for hook_id, hook in list(ol._forward_pre_hooks.items()):
            if hook_id in ol._forward_pre_hooks_with_kwargs:
                hook(ol, (hidden,), {})
            else:
                hook(ol, (hidden,))
        group = ol.tp_group
        if ol.sequence_parallel:
            return tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True,
                                                                        group=group)
        if group is not None and group.size() > 1:
            return tensor_parallel.copy_to_tensor_model_parallel_region(hidden, group=group)
        return hidden

    def _local_real_vocab(self, local: int) -> int:
        """Real (non-padding) vocab columns in this TP rank's slice of the logits."""
        from megatron.core import parallel_state

        rank = parallel_state.get_tensor_model_parallel_rank() if self.layout.tp > 1 else 0
        return max(0, min(local, self.vocab_size - rank * local))


RECOMPUTE_CHOICES = ("none", "experts", "full")
"""What :func:`build_thinker` recomputes in the backward instead of saving."""


def build_thinker(spec: OmniSpec, layout: ParallelLayout, dtype: torch.dtype = torch.float32,
                  pre_process: Optional[bool] = None, post_process: Optional[bool] = None,
                  backend: str = "auto", *, dummy_audio: bool = True, mask_vocab_padding: bool = True,
                  vp_stage: Optional[int] = None, build_audio: bool = True, recompute: str = "none",
                  **config_overrides) -> OmniThinker:
    """Build this rank's :class:`OmniThinker` (megatron's parallel state must be initialised with
    the same tp/ep/etp/pp as ``layout``; pre/post-process default to this rank's pipeline stage).

    ``config_overrides`` go to :func:`model_bridge.config.thinker_transformer_config` (e.g.
    ``moe_aux_loss_coeff``); ``backend`` picks the layer spec (see ``modeling.specs``).
    ``recompute`` (:data:`RECOMPUTE_CHOICES`): ``"experts"`` recomputes the MoE experts' sorted
    input rows and SwiGLU output in the backward (``modeling/recompute.py``; the torch backend's
    experts), ``"full"`` is megatron's full recomputation of every decoder layer (granularity
    full, method uniform, one layer per checkpoint).
    """
    from megatron.core import parallel_state as ps

    if recompute not in RECOMPUTE_CHOICES:
        raise ValueError(f"recompute={recompute!r}: choose one of {', '.join(RECOMPUTE_CHOICES)}")
    if recompute == "full":
        config_overrides = {"recompute_granularity": "full", "recompute_method": "uniform",
                            "recompute_num_layers": 1, **config_overrides}

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("megatron's parallel state is not initialised: call "
                           "model_bridge.parallel.init_parallel(tp, ep, etp, pp) first")
    have = dict(tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
                ep=ps.get_expert_model_parallel_world_size(), etp=ps.get_expert_tensor_parallel_world_size())
    want = dict(tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.expert_tp)
    if have != want:
        raise ValueError(f"layout {want} does not match megatron's initialised parallel state {have}")
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    check_layout(spec, layout, world)
    config = thinker_transformer_config(spec, layout, dtype, **config_overrides)
    stage_kw = {} if vp_stage is None else dict(ignore_virtual=False, vp_stage=vp_stage)
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(**stage_kw)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(**stage_kw)
    model = OmniThinker(spec, layout, config, pre_process=pre_process, post_process=post_process, backend=backend,
                        dummy_audio=dummy_audio, mask_vocab_padding=mask_vocab_padding, vp_stage=vp_stage,
                        build_audio=build_audio)
    if recompute == "experts":
        _recompute_experts(model, backend)
    if dtype != torch.float32:
        # megatron builds torch norms in fp32 whatever params_dtype says (Float16Module casts them
        # later); cast every parameter so the model runs as built. Buffers are left alone.
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
    return model


def _recompute_experts(model: torch.nn.Module, backend: str) -> None:
    from .experts import TorchGroupedMLP

    experts = [m for m in model.modules() if isinstance(m, TorchGroupedMLP)]
    if not experts:
        raise ValueError(f"recompute='experts' needs the torch backend's grouped experts, but backend={backend!r} "
                         "built none: use backend='torch' (or 'auto' on a GPU without transformer-engine), "
                         "or recompute='full'")
    for m in experts:
        m.recompute_activations = True


def gather_logits(logits: torch.Tensor, vocab_size: int, group=None) -> torch.Tensor:
    """TP-sharded logits [..., Vp/tp] -> full logits [..., vocab_size] (padding columns removed).

    ``[T, 1, Vp/tp]`` (OmniThinker's output) comes back as ``[T, V]``. Differentiable (all-gather
    forward, split backward). ``group`` defaults to megatron's tensor-parallel group.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    tp = group.size() if group is not None else (
        parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1)
    full = gather_from_tensor_model_parallel_region(logits, group=group) if tp > 1 else logits
    if full.shape[-1] < vocab_size:
        raise ValueError(f"gathered logits have {full.shape[-1]} columns < vocab_size {vocab_size}")
    full = full[..., :vocab_size]
    if full.dim() == 3 and full.shape[1] == 1:
        full = full[:, 0]
    return full
