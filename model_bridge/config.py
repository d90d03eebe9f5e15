"""Qwen3-Omni checkpoint config -> typed specs -> Megatron `TransformerConfig`s, with layout checks.

Always read the checkpoint's config.json, never class defaults: the release differs from them
(e.g. audio_token_id 151675). Old-style (`rope_scaling` + `rope_theta`) and transformers-5 style
(`rope_parameters`) rope fields are both accepted.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

SUPPORTED_ARCH = "Qwen3OmniMoeForConditionalGeneration"
SUPPORTED_MODEL_TYPES = ("qwen3_omni_moe",)
VOCAB_DIVISIBLE_BY = 128
"""Megatron pads the vocab to a multiple of this times TP (like Megatron-LM's default)."""


class ConfigError(ValueError):
    """A checkpoint config or a parallel layout this bridge cannot serve; the message says why."""


@dataclass(frozen=True)
class TextSpec:
    """The thinker's language model (MoE decoder)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    topk: int
    moe_ffn_hidden_size: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    mrope_interleaved: bool
    vocab_size: int
    tie_word_embeddings: bool
    router_aux_loss_coef: float
    max_position_embeddings: int


@dataclass(frozen=True)
class AudioSpec:
    """The Whisper-like audio tower: conv front-end, windowed encoder, projections."""

    num_mel_bins: int
    num_layers: int
    d_model: int
    num_heads: int
    ffn_dim: int
    activation: str
    downsample_hidden_size: int
    output_dim: int
    n_window: int
    n_window_infer: int
    max_source_positions: int
    scale_embedding: bool
    conv_chunksize: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


@dataclass(frozen=True)
class OmniSpec:
    """Everything the bridge needs from a Qwen3-Omni config.json."""

    text: TextSpec
    audio: AudioSpec
    audio_token_id: int
    audio_start_token_id: int
    audio_end_token_id: int
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    raw: dict = field(repr=False, compare=False, hash=False, default_factory=dict)
    """The full config.json, written back unchanged on export."""


def _need(d: dict, key: str, where: str):
    if key not in d:
        raise ConfigError(f"{where} has no '{key}': is this a Qwen3-Omni-MoE config.json?")
    return d[key]


def _rope_fields(tc: dict) -> tuple[float, tuple[int, int, int], bool]:
    rp = tc.get("rope_parameters") or tc.get("rope_scaling") or {}
    theta = rp.get("rope_theta", tc.get("rope_theta"))
    if theta is None:
        raise ConfigError("thinker_config.text_config has no rope_theta (in rope_parameters or top level)")
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"thinker text rope_type {rope_type!r} is not supported (only default/mrope)")
    section = tuple(rp.get("mrope_section", (24, 20, 20)))
    interleaved = bool(rp.get("mrope_interleaved", rp.get("interleaved", False)))
    head_dim = tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"]
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise ConfigError(f"mrope_section {list(section)} must have 3 entries summing to head_dim/2 = "
                          f"{head_dim // 2}")
    return float(theta), section, interleaved


def parse_omni_config(cfg: dict, where: str = "config.json") -> OmniSpec:
    """Typed spec from a parsed config.json (top-level Qwen3OmniMoe config)."""
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"{where}: model_type {mt!r} is not supported; expected one of "
                          f"{list(SUPPORTED_MODEL_TYPES)} (architecture {SUPPORTED_ARCH})")
    th = _need(cfg, "thinker_config", where)
    tc = _need(th, "text_config", f"{where} thinker_config")
    ac = _need(th, "audio_config", f"{where} thinker_config")
    tw = f"{where} thinker_config.text_config"
    if tc.get("mlp_only_layers") or tc.get("decoder_sparse_step", 1) != 1:
        raise ConfigError(f"{tw}: dense (mlp_only_layers={tc.get('mlp_only_layers')}, decoder_sparse_step="
                          f"{tc.get('decoder_sparse_step')}) layers are not supported: every layer must be MoE")
    if tc.get("attention_bias", False):
        raise ConfigError(f"{tw}: attention_bias=true is not supported (Qwen3-Omni has none)")
    if tc.get("shared_expert_intermediate_size"):
        raise ConfigError(f"{tw}: shared experts are not supported (Qwen3-Omni has none)")
    theta, section, interleaved = _rope_fields(tc)
    n_heads = _need(tc, "num_attention_heads", tw)
    text = TextSpec(
        hidden_size=_need(tc, "hidden_size", tw), num_layers=_need(tc, "num_hidden_layers", tw),
        num_heads=n_heads, num_kv_heads=tc.get("num_key_value_heads", n_heads),
        head_dim=tc.get("head_dim") or tc["hidden_size"] // n_heads,
        num_experts=_need(tc, "num_experts", tw), topk=_need(tc, "num_experts_per_tok", tw),
        moe_ffn_hidden_size=_need(tc, "moe_intermediate_size", tw),
        norm_topk_prob=bool(tc.get("norm_topk_prob", True)), rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, mrope_section=section, mrope_interleaved=interleaved,
        vocab_size=_need(tc, "vocab_size", tw),
        tie_word_embeddings=bool(th.get("tie_word_embeddings", tc.get("tie_word_embeddings", False))),
        router_aux_loss_coef=float(tc.get("router_aux_loss_coef", 0.0)),
        max_position_embeddings=int(tc.get("max_position_embeddings", 32768)),
    )
    if text.num_heads % text.num_kv_heads:
        raise ConfigError(f"{tw}: num_attention_heads {text.num_heads} is not a multiple of "
                          f"num_key_value_heads {text.num_kv_heads}")
    if text.topk > text.num_experts:
        raise ConfigError(f"{tw}: num_experts_per_tok {text.topk} > num_experts {text.num_experts}")
    aw = f"{where} thinker_config.audio_config"
    audio = AudioSpec(
        num_mel_bins=_need(ac, "num_mel_bins", aw), num_layers=_need(ac, "encoder_layers", aw),
        d_model=_need(ac, "d_model", aw), num_heads=_need(ac, "encoder_attention_heads", aw),
        ffn_dim=_need(ac, "encoder_ffn_dim", aw), activation=ac.get("activation_function", "gelu"),
        downsample_hidden_size=_need(ac, "downsample_hidden_size", aw),
        output_dim=_need(ac, "output_dim", aw), n_window=ac.get("n_window", 50),
        n_window_infer=ac.get("n_window_infer", 800),
        max_source_positions=ac.get("max_source_positions", 1500),
        scale_embedding=bool(ac.get("scale_embedding", False)), conv_chunksize=ac.get("conv_chunksize", 500),
    )
    if audio.d_model % audio.num_heads:
        raise ConfigError(f"{aw}: d_model {audio.d_model} is not a multiple of encoder_attention_heads "
                          f"{audio.num_heads}")
    if audio.output_dim != text.hidden_size:
        raise ConfigError(f"{aw}: output_dim {audio.output_dim} must equal the thinker hidden_size "
                          f"{text.hidden_size} (audio embeddings replace token embeddings)")
    if audio.activation != "gelu":
        raise ConfigError(f"{aw}: activation_function {audio.activation!r} is not supported (only gelu)")
    tok = lambda k: int(_need(th, k, f"{where} thinker_config"))  # noqa: E731
    return OmniSpec(text=text, audio=audio, audio_token_id=tok("audio_token_id"),
                    audio_start_token_id=tok("audio_start_token_id"),
                    audio_end_token_id=tok("audio_end_token_id"), image_token_id=tok("image_token_id"),
                    video_token_id=tok("video_token_id"), vision_start_token_id=tok("vision_start_token_id"),
                    raw=cfg)


def read_omni_config(hf_dir: str | Path) -> OmniSpec:
    """Read and check `hf_dir/config.json`."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found: point at an HF Qwen3-Omni checkpoint directory")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e})") from e
    return parse_omni_config(cfg, where=str(path))


@dataclass(frozen=True)
class ParallelLayout:
    """Model-parallel sizes of the trainer. Data parallelism is what remains of the world size."""

    tp: int = 1
    """Tensor parallel size (attention heads, dense linears, vocab)."""
    ep: int = 1
    """Expert parallel size (experts are split across EP ranks)."""
    etp: int | None = None
    """Expert tensor parallel size; None means equal to tp."""
    pp: int = 1
    """Pipeline parallel size (decoder layers split into pp stages)."""
    sp: bool | None = None
    """Sequence parallel; None means on whenever tp > 1 (MoE with tp > 1 requires it)."""

    def __post_init__(self):
        for name in ("tp", "ep", "pp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel size {name}={getattr(self, name)} must be >= 1")
        if self.etp is not None and self.etp < 1:
            raise ConfigError(f"parallel size etp={self.etp} must be >= 1")
        if self.ep == 1 and self.expert_tp != self.tp:
            # with ep == 1 megatron-core reduces expert grads over the dense DP group, which only
            # matches the expert DP group when etp == tp: otherwise expert grads are never synced
            raise ConfigError(f"tp={self.tp} with etp={self.expert_tp} and ep=1 is refused: megatron-core "
                              f"then never syncs expert gradients across the TP ranks; use etp=tp ({self.tp}) "
                              "or ep>1")
        if self.sp is False and self.tp > 1:
            raise ConfigError(f"sp=false with tp={self.tp}: megatron-core MoE layers need sequence "
                              "parallelism whenever tp > 1")

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1 if self.sp is None else self.sp

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp


def padded_vocab_size(vocab: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Vocab rows Megatron allocates: a multiple of divisible_by * tp (extra rows are padding)."""
    m = divisible_by * tp
    return (vocab + m - 1) // m * m


def audio_is_tensor_parallel(spec: OmniSpec, layout: ParallelLayout) -> bool:
    """The audio tower's transformer is TP-sharded when TP divides its heads, else replicated."""
    return layout.tp > 1 and spec.audio.num_heads % layout.tp == 0


def check_layout(spec: OmniSpec, layout: ParallelLayout, world_size: int | None = None) -> None:
    """Raise ConfigError naming the numbers when `layout` cannot shard this model."""
    t = spec.text
    problems = []
    if t.num_heads % layout.tp:
        problems.append(f"tp={layout.tp} does not divide num_attention_heads={t.num_heads}")
    if t.num_kv_heads % layout.tp:
        problems.append(f"tp={layout.tp} does not divide num_key_value_heads={t.num_kv_heads} "
                        "(query groups are split across TP ranks)")
    if t.num_experts % layout.ep:
        problems.append(f"ep={layout.ep} does not divide num_experts={t.num_experts}")
    if t.moe_ffn_hidden_size % layout.expert_tp:
        problems.append(f"etp={layout.expert_tp} does not divide moe_intermediate_size={t.moe_ffn_hidden_size}")
    if t.num_layers % layout.pp:
        problems.append(f"pp={layout.pp} does not divide num_hidden_layers={t.num_layers}")
    if world_size is not None:
        if world_size % layout.model_parallel_size:
            problems.append(f"world size {world_size} is not a multiple of tp*pp={layout.model_parallel_size}")
        elif world_size % (layout.pp * layout.ep * layout.expert_tp):
            problems.append(f"world size {world_size} is not a multiple of pp*ep*etp="
                            f"{layout.pp * layout.ep * layout.expert_tp}")
    if problems:
        raise ConfigError("parallel layout does not fit the model: " + "; ".join(problems))


def _common_kwargs(layout: ParallelLayout, dtype: torch.dtype) -> dict:
    return dict(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        sequence_parallel=layout.sequence_parallel,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        # fusions that need TE/apex/CUDA kernels stay off; the GPU fast path plugs its own modules
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
    )


def thinker_transformer_config(spec: OmniSpec, layout: ParallelLayout, dtype: torch.dtype = torch.float32,
                               **overrides):
    """Megatron `TransformerConfig` for the thinker's MoE decoder."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    t = spec.text
    check_layout(spec, layout)
    kw = _common_kwargs(layout, dtype)
    kw.update(
        num_layers=t.num_layers, hidden_size=t.hidden_size, num_attention_heads=t.num_heads,
        num_query_groups=t.num_kv_heads, kv_channels=t.head_dim, ffn_hidden_size=t.moe_ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=t.rms_norm_eps, qk_layernorm=True,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=False,
        num_moe_experts=t.num_experts, moe_router_topk=t.topk, moe_ffn_hidden_size=t.moe_ffn_hidden_size,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.expert_tp,
        # norm_topk_prob: softmax over the top-k logits == renormalised top-k of the full softmax
        moe_router_score_function="softmax", moe_router_pre_softmax=not t.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=t.router_aux_loss_coef,
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False, moe_permute_fusion=False,
        # router GEMM in the model dtype and softmax in fp32, as HF and vLLM compute it (a fp32 GEMM
        # gives other logits in bf16 -> other routing than the rollout engine; and costs 2 fp32 GEMMs)
        moe_router_dtype=None,
        mrope_section=list(t.mrope_section),
        init_method_std=0.02,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def audio_transformer_config(spec: OmniSpec, layout: ParallelLayout, dtype: torch.dtype = torch.float32,
                             **overrides):
    """Megatron `TransformerConfig` for the audio tower's encoder layers.

    Sharded over TP when TP divides the audio heads; otherwise built with tp=1 and replicated on
    every TP rank. Its inputs are identical on the TP ranks, so the replicated gradients already
    agree bit for bit there; only the data-parallel grad sync applies (no TP all-reduce, which would
    double them).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    a = spec.audio
    tp = layout.tp if audio_is_tensor_parallel(spec, layout) else 1
    kw = _common_kwargs(ParallelLayout(tp=tp, ep=1, etp=tp, pp=1, sp=False if tp == 1 else None), dtype)
    # the audio tower runs outside the decoder's pipeline and sequence-parallel regions
    kw.update(sequence_parallel=False, pipeline_model_parallel_size=1)
    kw.update(
        num_layers=a.num_layers, hidden_size=a.d_model, num_attention_heads=a.num_heads,
        kv_channels=a.head_dim, ffn_hidden_size=a.ffn_dim, normalization="LayerNorm", layernorm_epsilon=1e-5,
        gated_linear_unit=False, activation_func=torch.nn.functional.gelu, add_bias_linear=True,
        add_qkv_bias=True, init_method_std=0.02,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)
