"""Config, random weights and sharded safetensors of the tiny Qwen3-Omni-MoE checkpoint.

The model is instantiated with transformers' ``Qwen3OmniMoeForConditionalGeneration`` so every
tensor name and shape is the released one. transformers 5 holds the MoE experts fused in memory
(``mlp.experts.gate_up_proj`` [E, 2I, H] = gate rows then up rows, ``mlp.experts.down_proj``
[E, H, I]); the files keep the released per-expert keys
``mlp.experts.{e}.{gate,up,down}_proj.weight``, so we split them here and write the shards
ourselves (sorted keys, fixed metadata) to get byte-identical files for the same seed.
"""
from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

import torch

from .presets import TinyPreset

#: metadata of every shard (what transformers writes; fixed so the bytes are deterministic).
SHARD_METADATA = {"format": "pt"}
INDEX_NAME = "model.safetensors.index.json"
_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_SHARD_FILE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")


def build_config(preset: TinyPreset, ids: dict[str, int], vocab_size: int,
                 with_talker: bool = False):
    """The top-level ``Qwen3OmniMoeConfig`` (architecture ``Qwen3OmniMoeForConditionalGeneration``).

    ``ids`` maps the added tokens and role words to their ids (see ``tokenizer.token_ids``).
    The talker / code2wav configs are always present (as in the release); ``enable_audio_output``
    says whether their weights exist.
    """
    from transformers import Qwen3OmniMoeConfig

    t, a, v, k = preset.text, preset.audio, preset.vision, preset.talker
    text_config = dict(
        vocab_size=vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_layers, num_attention_heads=t.num_heads,
        num_key_value_heads=t.num_kv_heads, head_dim=t.head_dim, hidden_act="silu",
        max_position_embeddings=t.max_position_embeddings, rms_norm_eps=1e-6,
        attention_bias=False, attention_dropout=0.0, initializer_range=0.02, use_cache=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                         "mrope_section": list(t.mrope_section), "interleaved": True,
                         "mrope_interleaved": True},
        decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=t.moe_intermediate_size,
        num_experts=t.num_experts, num_experts_per_tok=t.top_k, norm_topk_prob=True,
        router_aux_loss_coef=0.001, output_router_logits=False, sliding_window=None,
        tie_word_embeddings=False,
    )
    audio_config = dict(
        num_mel_bins=128, encoder_layers=a.num_layers, encoder_attention_heads=a.num_heads,
        encoder_ffn_dim=a.ffn_dim, d_model=a.d_model, activation_function="gelu",
        max_source_positions=1500, n_window=50, n_window_infer=800, conv_chunksize=500,
        downsample_hidden_size=a.downsample_hidden_size, output_dim=t.hidden_size,
        scale_embedding=False,
    )
    vision_config = dict(
        depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
        num_heads=v.num_heads, hidden_act="gelu_pytorch_tanh", in_channels=3, patch_size=16,
        spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=t.hidden_size,
        num_position_embeddings=2304, deepstack_visual_indexes=[0],
        # read by vLLM (grid side = image_size / patch_size = sqrt(num_position_embeddings))
        image_size=768, apply_vit_abs_pos_embed=True,
    )
    token_fields = dict(
        audio_token_id=ids["<|audio_pad|>"], image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], audio_start_token_id=ids["<|audio_start|>"],
        vision_start_token_id=ids["<|vision_start|>"],
    )
    thinker_config = dict(
        text_config=text_config, audio_config=audio_config, vision_config=vision_config,
        **token_fields, audio_end_token_id=ids["<|audio_end|>"],
        vision_end_token_id=ids["<|vision_end|>"], user_token_id=ids["user"],
        position_id_per_seconds=13, seconds_per_chunk=2, initializer_range=0.02,
        tie_word_embeddings=False,
    )
    # codec special ids sit at the top of the talker's codec vocabulary, as in the release
    top = k.codec_vocab_size
    talker_config = dict(
        text_config=dict(
            vocab_size=k.codec_vocab_size, hidden_size=k.hidden_size,
            intermediate_size=2 * k.hidden_size, num_hidden_layers=k.num_layers,
            num_attention_heads=k.num_heads, num_key_value_heads=k.num_kv_heads,
            head_dim=k.head_dim, hidden_act="silu", rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                             "mrope_section": list(k.mrope_section), "interleaved": True},
            decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=k.moe_intermediate_size,
            num_experts=k.num_experts, num_experts_per_tok=k.top_k, norm_topk_prob=False,
            shared_expert_intermediate_size=k.shared_expert_intermediate_size,
            router_aux_loss_coef=0.001, tie_word_embeddings=False,
        ),
        code_predictor_config=dict(
            vocab_size=k.codebook_size, hidden_size=k.hidden_size,
            intermediate_size=2 * k.hidden_size, num_hidden_layers=1,
            num_attention_heads=k.num_heads, num_key_value_heads=k.num_kv_heads,
            head_dim=k.head_dim, num_code_groups=k.num_code_groups, rms_norm_eps=1e-6,
        ),
        num_code_groups=k.num_code_groups, thinker_hidden_size=t.hidden_size,
        accept_hidden_layer=t.num_layers - 1, spatial_merge_size=2, position_id_per_seconds=13,
        codec_pad_id=top - 10, codec_bos_id=top - 9, codec_eos_token_id=top - 8,
        codec_nothink_id=top - 3, codec_think_bos_id=top - 2, codec_think_eos_id=top - 1,
        speaker_id={"aiden": top - 7, "chelsie": top - 6, "ethan": top - 5},
        **token_fields,
    )
    code2wav_config = dict(
        codebook_size=k.codebook_size, hidden_size=k.code2wav_hidden_size,
        num_attention_heads=k.num_heads, num_key_value_heads=k.num_heads,
        intermediate_size=2 * k.code2wav_hidden_size, num_hidden_layers=1,
        num_quantizers=k.num_code_groups, decoder_dim=k.code2wav_decoder_dim,
        upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], sliding_window=72,
    )
    config = Qwen3OmniMoeConfig(
        thinker_config=thinker_config, talker_config=talker_config,
        code2wav_config=code2wav_config, enable_audio_output=with_talker,
        im_start_token_id=ids["<|im_start|>"], im_end_token_id=ids["<|im_end|>"],
        tts_pad_token_id=ids["<tts_pad>"], tts_bos_token_id=ids["<tts_text_bos>"],
        tts_eos_token_id=ids["<tts_text_eod>"], system_token_id=ids["system"],
        user_token_id=ids["user"], assistant_token_id=ids["assistant"],
    )
    config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    config.dtype = torch.float32
    return config


def build_model(config, preset: TinyPreset, seed: int):
    """Randomly initialised fp32 model in eval mode. The thinker's weights depend only on
    ``seed`` (not on whether a talker is built), the talker/code2wav use a derived seed."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    with_talker = bool(config.enable_audio_output)
    config.enable_audio_output = False
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed % 2**63)
            model = Qwen3OmniMoeForConditionalGeneration(config)
            # HF initialises lm_head with std 0.02: logits would be nearly flat
            gen = torch.Generator().manual_seed(seed % 2**63)
            with torch.no_grad():
                lm = model.thinker.lm_head.weight
                lm.copy_(torch.randn(lm.shape, generator=gen, dtype=lm.dtype) * preset.lm_head_std)
            if with_talker:
                torch.manual_seed((seed + 1_000_003) % 2**63)
                model.enable_talker()
                model.has_talker = True
    finally:
        config.enable_audio_output = with_talker
    model.config.enable_audio_output = with_talker
    _init_fused_experts(model, seed)
    return model.to(torch.float32).eval()


def _init_fused_experts(model, seed: int, std: float = 0.02) -> None:
    """Draw every fused expert tensor from its own seeded generator, N(0, std).

    transformers 5.19 leaves the talker's experts (``torch.empty``) uninitialised, i.e. memory
    garbage that differs between runs; initialising all experts here keeps the checkpoint
    deterministic whatever transformers' ``_init_weights`` covers."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if _FUSED_EXPERTS.match(name):
                gen = torch.Generator().manual_seed(
                    (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * std)


def checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """The module's state dict in the released on-disk layout: fused expert tensors split into
    per-expert ``gate_proj``/``up_proj``/``down_proj`` weights; every tensor contiguous."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        m = _FUSED_EXPERTS.match(name)
        if m is None:
            if tensor.dim() == 3 and ".experts." in name:
                raise RuntimeError(f"unexpected fused expert tensor {name} {tuple(tensor.shape)}")
            out[name] = tensor.detach().contiguous().clone()
            continue
        prefix, kind = m.groups()
        for e in range(tensor.shape[0]):
            w = tensor[e].detach()
            if kind == "gate_up_proj":
                # [2I, H]: rows [0, I) are the gate, [I, 2I) the up projection (forward does
                # linear(x, gate_up).chunk(2, dim=-1))
                gate, up = w.chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous().clone()
                out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous().clone()
            else:  # down_proj [H, I], already nn.Linear's [out, in]
                out[f"{prefix}.{e}.down_proj.weight"] = w.contiguous().clone()
    return out


def fused_shapes_ok(model) -> None:
    """Guard against a transformers layout change (e.g. transposed [E, H, 2I] experts): the
    fused tensors must be [E, 2I, H] and [E, H, I] as ``checkpoint_tensors`` assumes."""
    for name, p in model.named_parameters():
        m = _FUSED_EXPERTS.match(name)
        if m is None:
            continue
        experts = model.get_submodule(m.group(1))
        e, h, i = experts.num_experts, experts.hidden_dim, experts.intermediate_dim
        want = (e, 2 * i, h) if m.group(2) == "gate_up_proj" else (e, h, i)
        if tuple(p.shape) != want:
            raise RuntimeError(f"{name}: shape {tuple(p.shape)}, expected {want}; "
                               "transformers changed its fused expert layout")


def shard_plan(tensors: dict[str, torch.Tensor], num_shards: int) -> list[list[str]]:
    """Sorted names cut into ``num_shards`` groups of about equal bytes (empty groups dropped)."""
    names = sorted(tensors)
    total = sum(tensors[n].numel() * tensors[n].element_size() for n in names)
    groups: list[list[str]] = [[] for _ in range(num_shards)]
    done = 0
    for n in names:
        groups[min(num_shards - 1, done * num_shards // max(total, 1))].append(n)
        done += tensors[n].numel() * tensors[n].element_size()
    return [g for g in groups if g]


def write_sharded(tensors: dict[str, torch.Tensor], out_dir: str | Path, num_shards: int) -> list[Path]:
    """Write ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``
    (``metadata.total_size`` = bytes of all tensors, ``weight_map`` name -> shard). Weight files
    of an earlier build in ``out_dir`` are removed first so the index never mixes builds."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    for old in out_dir.iterdir():
        if _SHARD_FILE.match(old.name) or old.name == INDEX_NAME:
            old.unlink()
    groups = shard_plan(tensors, num_shards)
    weight_map: dict[str, str] = {}
    paths = []
    for i, names in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(out_dir / fname), metadata=dict(SHARD_METADATA))
        (out_dir / fname).chmod(0o644)  # safetensors creates 0600; match the other files
        weight_map.update({n: fname for n in names})
        paths.append(out_dir / fname)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return paths


#: generic ``PreTrainedConfig`` entries the release's config.json does not carry; dropped from
#: every (sub)config when they hold these default values, so loading gives the same config.
_GENERIC_DEFAULTS = {
    "_name_or_path": "", "architectures": None, "chunk_size_feed_forward": 0, "dtype": None,
    "id2label": {"0": "LABEL_0", "1": "LABEL_1"}, "label2id": {"LABEL_0": 0, "LABEL_1": 1},
    "is_encoder_decoder": False, "output_attentions": False, "output_hidden_states": False,
    "problem_type": None, "return_dict": True,
}


def _drop_generic(d: dict) -> dict:
    return {k: (_drop_generic(v) if isinstance(v, dict) else v) for k, v in d.items()
            if not (k in _GENERIC_DEFAULTS and v == _GENERIC_DEFAULTS[k])}


def config_json(config) -> str:
    """The config as stable JSON with every model field (not a diff against class defaults, so
    readers find e.g. ``router_aux_loss_coef`` and ``norm_topk_prob`` in the file as in the
    release), minus generic defaults (see ``_GENERIC_DEFAULTS``)."""
    return json.dumps(_drop_generic(config.to_dict()), indent=2, sort_keys=True) + "\n"


def generation_config(ids: dict[str, int]) -> dict:
    """Sampling defaults of the release (temperature 0.7, top_p 0.8, top_k 20), stop on
    ``<|im_end|>`` / ``<|endoftext|>``."""
    return {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"], "do_sample": True, "temperature": 0.7,
            "top_p": 0.8, "top_k": 20}
