"""Size presets for the tiny random Qwen3-Omni-MoE checkpoint (`mgrpo make-tiny --preset`).

Every preset keeps the released model's *structure* (MoE in every layer, q/k RMSNorm, GQA,
interleaved MRoPE, untied embeddings, audio tower + minimal vision tower) and only shrinks the
sizes. The checks in ``__post_init__`` encode what the rest of the stack relies on: a head_dim
that vLLM's CPU attention supports, an ``mrope_section`` that covers head_dim / 2 frequencies,
KV heads / audio heads that TP=2 divides, and at least two audio encoder layers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

#: head sizes vLLM's CPU attention backend accepts (checked: 0.32).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128)


@dataclass(frozen=True)
class TextPreset:
    """Thinker text decoder (the MoE LLM)."""

    hidden_size: int
    """Residual width (release: 2048)."""
    num_layers: int
    """Decoder layers, all MoE (release: 48)."""
    num_heads: int
    """Query heads (release: 32)."""
    num_kv_heads: int
    """Key/value heads for GQA (release: 4)."""
    head_dim: int
    """Per-head size; must be one vLLM's CPU attention supports (release: 128)."""
    num_experts: int
    """Routed experts per layer (release: 128)."""
    top_k: int
    """Experts per token, ``num_experts_per_tok`` (release: 8)."""
    moe_intermediate_size: int
    """FFN width of one expert (release: 768)."""
    mrope_section: tuple[int, int, int]
    """Frequencies per T/H/W axis of the interleaved MRoPE; sums to head_dim // 2
    (release: [24, 20, 20] for head_dim 128)."""
    intermediate_size: int = 128
    """Dense-MLP width; unused because every layer is MoE, kept because the config has it."""
    max_position_embeddings: int = 32768
    """Maximum positions (release: 65536)."""


@dataclass(frozen=True)
class AudioPreset:
    """Audio tower (Whisper-like encoder with a conv2d down-sampler)."""

    d_model: int
    """Encoder width (release: 1280)."""
    num_layers: int
    """Encoder layers, >= 2 so layer-wise code paths are exercised (release: 32)."""
    num_heads: int
    """Attention heads; even, so TP=2 can split them (release: 20)."""
    ffn_dim: int
    """Encoder FFN width (release: 5120)."""
    downsample_hidden_size: int
    """Channels of the three stride-2 Conv2d layers (release: 480)."""


@dataclass(frozen=True)
class VisionPreset:
    """Minimal vision tower. Its geometry (patch 16, image_size 768, 2304 position embeddings,
    absolute position embedding on) is what vLLM requires and is not a preset choice."""

    depth: int = 2
    """ViT blocks (release: 27)."""
    hidden_size: int = 32
    """ViT width (release: 1152)."""
    intermediate_size: int = 64
    """ViT MLP width (release: 4304)."""
    num_heads: int = 2
    """ViT heads (release: 16)."""


@dataclass(frozen=True)
class TalkerPreset:
    """Talker (codec LM, MoE with a shared expert), its code predictor and the code2wav vocoder.
    Only written with ``with_talker=True``; the product copies them through untouched."""

    hidden_size: int = 32
    """Talker and code-predictor width (release: 1024)."""
    num_layers: int = 1
    """Talker decoder layers (release: 20)."""
    num_heads: int = 2
    """Talker query heads (release: 16)."""
    num_kv_heads: int = 1
    """Talker KV heads (release: 2)."""
    head_dim: int = 32
    """Talker head size (release: 128)."""
    num_experts: int = 4
    """Talker routed experts (release: 128)."""
    top_k: int = 2
    """Talker experts per token (release: 6)."""
    moe_intermediate_size: int = 16
    """Talker expert FFN width (release: 384)."""
    shared_expert_intermediate_size: int = 32
    """Talker shared-expert FFN width (release: 768)."""
    mrope_section: tuple[int, int, int] = (8, 4, 4)
    """Talker MRoPE sections; sum to head_dim // 2."""
    codec_vocab_size: int = 128
    """Talker codec vocabulary (release: 3072)."""
    num_code_groups: int = 4
    """Codebooks per frame (release: 16)."""
    codebook_size: int = 64
    """Entries per codebook, the code predictor's vocabulary (release: 2048)."""
    code2wav_hidden_size: int = 32
    """code2wav pre-transformer width (release: 1024)."""
    code2wav_decoder_dim: int = 32
    """code2wav decoder channels; halves at each of the 4 up-sampling blocks (release: 1536)."""


@dataclass(frozen=True)
class TinyPreset:
    """One named size: all sub-presets plus how the files are written."""

    name: str
    """Preset name (``tiny`` or ``small``)."""
    text: TextPreset
    """Thinker text decoder."""
    audio: AudioPreset
    """Audio tower."""
    vision: VisionPreset = field(default_factory=VisionPreset)
    """Vision tower (minimal; only there because the released layout has one)."""
    talker: TalkerPreset = field(default_factory=TalkerPreset)
    """Talker + code2wav, written only with ``with_talker=True``."""
    bpe_vocab_size: int = 480
    """Byte-level BPE vocabulary trained on the embedded corpus (256 bytes + merges);
    the Qwen3-Omni added tokens come after it and the total is padded to a multiple of 64."""
    num_shards: int = 2
    """Number of safetensors shards (>= 2 so sharded loading is always exercised)."""
    lm_head_std: float = 0.5
    """Std of the random lm_head, large enough that logits are not flat and sampling
    differences are visible (HF's init gives std 0.02)."""

    def __post_init__(self) -> None:
        t, a = self.text, self.audio
        if t.head_dim not in VLLM_CPU_HEAD_DIMS:
            raise ValueError(f"{self.name}: head_dim {t.head_dim} not supported by vLLM CPU "
                             f"attention {VLLM_CPU_HEAD_DIMS}")
        if sum(t.mrope_section) != t.head_dim // 2:
            raise ValueError(f"{self.name}: mrope_section {t.mrope_section} must sum to "
                             f"head_dim // 2 = {t.head_dim // 2}")
        if t.num_heads % t.num_kv_heads or t.num_kv_heads % 2:
            raise ValueError(f"{self.name}: need num_heads % num_kv_heads == 0 and an even "
                             f"num_kv_heads (TP=2), got {t.num_heads}/{t.num_kv_heads}")
        if not 1 <= t.top_k <= t.num_experts:
            raise ValueError(f"{self.name}: top_k {t.top_k} vs {t.num_experts} experts")
        if a.d_model % a.num_heads or a.num_heads % 2 or a.num_layers < 2:
            raise ValueError(f"{self.name}: audio needs d_model % heads == 0, even heads and "
                             f">= 2 layers, got d_model {a.d_model}, {a.num_heads} heads, "
                             f"{a.num_layers} layers")
        if sum(self.talker.mrope_section) != self.talker.head_dim // 2:
            raise ValueError(f"{self.name}: talker mrope_section must sum to head_dim // 2")
        if self.num_shards < 2:
            raise ValueError(f"{self.name}: num_shards must be >= 2")


PRESETS: dict[str, TinyPreset] = {
    # CPU unit tests: whole checkpoint ~1-2 MB, builds in well under a second.
    "tiny": TinyPreset(
        name="tiny",
        text=TextPreset(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                        num_experts=8, top_k=2, moe_intermediate_size=32,
                        mrope_section=(8, 4, 4)),
        audio=AudioPreset(d_model=64, num_layers=2, num_heads=4, ffn_dim=128,
                          downsample_hidden_size=16),
    ),
    # A bit wider/deeper: GQA group of 4, 16 experts top-4, head_dim 64, 3 shards.
    "small": TinyPreset(
        name="small",
        text=TextPreset(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64,
                        num_experts=16, top_k=4, moe_intermediate_size=128,
                        mrope_section=(16, 8, 8), intermediate_size=512),
        audio=AudioPreset(d_model=128, num_layers=4, num_heads=4, ffn_dim=256,
                          downsample_hidden_size=32),
        num_shards=3,
    ),
}


def get_preset(name: str) -> TinyPreset:
    """The preset called ``name``; a clear error listing the choices otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown tiny preset {name!r}; choose one of {sorted(PRESETS)}") from None
