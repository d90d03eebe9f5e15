"""Tiny Qwen3-Omni checkpoint builder (`model_bridge.tiny`, `mgrpo make-tiny`): released on-disk
layout, exact round trip through transformers, deterministic bytes, tokenizer and chat template."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model_bridge.tiny import build_tiny_model, get_preset, make_tiny
from model_bridge.tiny.tokenizer import ADDED_TOKENS, CHAT_TEMPLATE

FUSED_SUFFIXES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _read_shards(ckpt: Path) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return {p.name: load_file(str(p)) for p in sorted(ckpt.glob("model-*.safetensors"))}


def _all_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for tensors in _read_shards(ckpt).values():
        out.update(tensors)
    return out


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, Path]:
    """Fresh builds (not the shared cache): seed 0 twice, seed 1, and seed 0 with the talker."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "a": make_tiny(root / "a", seed=0),
        "b": make_tiny(root / "b", seed=0),
        "seed1": make_tiny(root / "seed1", seed=1),
        "talker": make_tiny(root / "talker", seed=0, with_talker=True),
    }


@pytest.fixture(scope="module")
def reference():
    """The in-memory model + tokenizer of preset tiny, seed 0 (what make_tiny writes)."""
    return build_tiny_model("tiny", seed=0)


def _load_hf(ckpt: Path):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        str(ckpt), dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


def test_loads_with_transformers_exactly(tiny_ckpt, reference):
    ref, tok = reference
    model, info = _load_hf(tiny_ckpt)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"] and not info["error_msgs"], info
    assert not model.has_talker
    loaded, mem = model.state_dict(), ref.state_dict()
    assert loaded.keys() == mem.keys()
    assert [k for k in mem if not torch.equal(loaded[k], mem[k])] == []
    assert loaded["thinker.lm_head.weight"].std() > 0.4  # non-flat logits (N(0, 0.5))

    ids = torch.tensor([tok.encode("Hello world. When does the dog bark? [00:12 - 00:31]")])
    with torch.no_grad():
        a, b = ref.thinker(input_ids=ids).logits, model.thinker(input_ids=ids).logits
    assert torch.equal(a, b)
    assert a.softmax(-1).amax(-1).mean() > 0.05  # far from uniform over 576 rows


def test_audio_forward_matches(tiny_ckpt, reference):
    """The audio tower path (features scattered at <|audio_pad|>) matches bit for bit too."""
    ref, tok = reference
    model, _ = _load_hf(tiny_ckpt)
    cfg = ref.config.thinker_config
    frames = 200  # 2 s of 10 ms mel frames -> 26 audio tokens (13 per 100 frames)
    n_audio = 26
    feats = torch.randn(1, 128, frames, generator=torch.Generator().manual_seed(0))
    prefix = tok.encode("<|im_start|>user\n<|audio_start|>", add_special_tokens=False)
    suffix = tok.encode("<|audio_end|>When?<|im_end|>\n", add_special_tokens=False)
    ids = torch.tensor([prefix + [cfg.audio_token_id] * n_audio + suffix])
    kw = dict(input_ids=ids, input_features=feats,
              feature_attention_mask=torch.ones(1, frames, dtype=torch.long))
    with torch.no_grad():
        a, b = ref.thinker(**kw).logits, model.thinker(**kw).logits
    assert torch.isfinite(a).all() and torch.equal(a, b)


def test_on_disk_layout(tiny_ckpt):
    shards = _read_shards(tiny_ckpt)
    assert len(shards) >= 2
    n = len(shards)
    assert sorted(shards) == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())
    on_disk = {k: f for f, ts in shards.items() for k in ts}
    assert index["weight_map"] == on_disk
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for ts in shards.values() for t in ts.values())

    names = set(on_disk)
    assert not [k for k in names if k.endswith(FUSED_SUFFIXES)]
    assert all(k.startswith("thinker.") for k in names)  # no talker without --with-talker
    p = get_preset("tiny").text
    h, hd = p.hidden_size, p.head_dim
    tensors = _all_tensors(tiny_ckpt)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    shapes = {k: tuple(t.shape) for k, t in tensors.items()}
    assert shapes["thinker.model.embed_tokens.weight"] == (576, h)
    assert shapes["thinker.lm_head.weight"] == (576, h)
    assert shapes["thinker.model.norm.weight"] == (h,)
    for layer in range(p.num_layers):
        pre = f"thinker.model.layers.{layer}"
        assert shapes[f"{pre}.self_attn.q_proj.weight"] == (p.num_heads * hd, h)
        assert shapes[f"{pre}.self_attn.k_proj.weight"] == (p.num_kv_heads * hd, h)
        assert shapes[f"{pre}.self_attn.v_proj.weight"] == (p.num_kv_heads * hd, h)
        assert shapes[f"{pre}.self_attn.o_proj.weight"] == (h, p.num_heads * hd)
        assert shapes[f"{pre}.self_attn.q_norm.weight"] == (hd,)
        assert shapes[f"{pre}.self_attn.k_norm.weight"] == (hd,)
        assert shapes[f"{pre}.input_layernorm.weight"] == (h,)
        assert shapes[f"{pre}.post_attention_layernorm.weight"] == (h,)
        assert shapes[f"{pre}.mlp.gate.weight"] == (p.num_experts, h)
        for e in range(p.num_experts):
            i = p.moe_intermediate_size
            assert shapes[f"{pre}.mlp.experts.{e}.gate_proj.weight"] == (i, h)
            assert shapes[f"{pre}.mlp.experts.{e}.up_proj.weight"] == (i, h)
            assert shapes[f"{pre}.mlp.experts.{e}.down_proj.weight"] == (h, i)
        assert f"{pre}.mlp.experts.{p.num_experts}.gate_proj.weight" not in names
        assert not [k for k in names if k.startswith(f"{pre}.mlp.shared_expert")]
    assert any(k.startswith("thinker.audio_tower.layers.1.") for k in names)
    assert any(k.startswith("thinker.visual.blocks.") for k in names)
    from safetensors import safe_open
    for name in shards:
        with safe_open(str(tiny_ckpt / name), "pt") as f:
            assert f.metadata() == {"format": "pt"}


def test_config_fields(tiny_ckpt, reference):
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3OmniMoeForConditionalGeneration"]
    assert cfg["model_type"] == "qwen3_omni_moe" and cfg["dtype"] == "float32"
    assert cfg["enable_audio_output"] is False
    th = cfg["thinker_config"]
    text, audio, vision = th["text_config"], th["audio_config"], th["vision_config"]
    assert text["head_dim"] == 32 and text["num_attention_heads"] == 4
    assert text["num_key_value_heads"] == 2 and text["hidden_size"] == 64
    assert text["num_experts"] == 8 and text["num_experts_per_tok"] == 2
    assert text["moe_intermediate_size"] == 32 and text["norm_topk_prob"] is True
    assert text["decoder_sparse_step"] == 1 and text["mlp_only_layers"] == []
    assert text["router_aux_loss_coef"] == 0.001 and text["tie_word_embeddings"] is False
    assert text["rms_norm_eps"] == 1e-6 and text["attention_bias"] is False
    rope = text["rope_parameters"]
    assert rope["rope_theta"] == 1e6 and rope["mrope_section"] == [8, 4, 4]
    assert rope["interleaved"] is True and rope["mrope_interleaved"] is True
    assert sum(rope["mrope_section"]) == text["head_dim"] // 2
    assert audio["encoder_attention_heads"] % 2 == 0 and audio["encoder_layers"] >= 2
    assert audio["num_mel_bins"] == 128 and audio["output_dim"] == text["hidden_size"]
    assert vision["image_size"] == 768 and vision["apply_vit_abs_pos_embed"] is True
    assert th["tie_word_embeddings"] is False
    tok = json.loads((tiny_ckpt / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert th["audio_token_id"] == ids["<|audio_pad|>"]
    assert th["audio_start_token_id"] == ids["<|audio_start|>"]
    assert cfg["im_end_token_id"] == ids["<|im_end|>"]

    # reloading gives the in-memory config back (generic label maps aside)
    from transformers import AutoConfig

    def strip(d):
        return {k: strip(v) if isinstance(v, dict) else v for k, v in d.items()
                if k not in ("_name_or_path", "label2id", "id2label")}
    assert strip(AutoConfig.from_pretrained(str(tiny_ckpt)).to_dict()) == strip(
        reference[0].config.to_dict())
    gen = json.loads((tiny_ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]


def test_same_seed_same_bytes(builds):
    a, b = builds["a"], builds["b"]
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for expected in ("config.json", "generation_config.json", "model.safetensors.index.json",
                     "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                     "preprocessor_config.json", "processor_config.json",
                     "video_preprocessor_config.json"):
        assert expected in files
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_other_seed_other_weights(builds):
    a, c = _all_tensors(builds["a"]), _all_tensors(builds["seed1"])
    assert a.keys() == c.keys()
    for key in ("thinker.lm_head.weight", "thinker.model.embed_tokens.weight",
                "thinker.model.layers.0.mlp.experts.3.up_proj.weight",
                "thinker.audio_tower.layers.1.fc1.weight"):
        assert not torch.equal(a[key], c[key]), key
    # everything but the weights is seed-independent
    for name in ("config.json", "tokenizer.json", "model.safetensors.index.json"):
        assert (builds["a"] / name).read_bytes() == (builds["seed1"] / name).read_bytes()


def test_with_talker(builds):
    ckpt = builds["talker"]
    tensors = _all_tensors(ckpt)
    names = set(tensors)
    assert any(k.startswith("talker.") for k in names)
    assert any(k.startswith("code2wav.") for k in names)
    assert "talker.model.layers.0.mlp.experts.0.gate_proj.weight" in names
    assert not [k for k in names if k.endswith(FUSED_SUFFIXES)]
    assert json.loads((ckpt / "config.json").read_text())["enable_audio_output"] is True
    # the thinker is the same as without the talker (same seed)
    plain = _all_tensors(builds["a"])
    assert {k for k in names if k.startswith("thinker.")} == set(plain)
    assert all(torch.equal(tensors[k], plain[k]) for k in plain)
    # transformers loads all of it, nothing missing, talker included
    model, info = _load_hf(ckpt)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.has_talker
    ref, _ = build_tiny_model("tiny", seed=0, with_talker=True)
    mem, loaded = ref.state_dict(), model.state_dict()
    assert [k for k in mem if not torch.equal(mem[k], loaded[k])] == []


def test_added_tokens_in_release_order(tiny_ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt))
    base = get_preset("tiny").bpe_vocab_size
    assert len(tok) == base + len(ADDED_TOKENS)
    assert [tok.convert_tokens_to_ids(t) for t, _ in ADDED_TOKENS] == list(
        range(base, base + len(ADDED_TOKENS)))
    decoder = tok.added_tokens_decoder
    assert {decoder[base + i].content: decoder[base + i].special
            for i in range(len(ADDED_TOKENS))} == dict(ADDED_TOKENS)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.audio_token == "<|audio_pad|>"
    for word in ("system", "user", "assistant"):
        assert len(tok.encode(word, add_special_tokens=False)) == 1
    text = "<think>\nok\n</think>\n\n<tool_call>\n{}\n</tool_call>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<think>") in ids
    assert tok.decode(ids, skip_special_tokens=True) == text  # non-special, survive decoding


CROP_TOOL = {"type": "function", "function": {
    "name": "crop_audio", "description": "Crop the audio.",
    "parameters": {"type": "object", "properties": {"start_sec": {"type": "number"},
                                                    "end_sec": {"type": "number"}},
                   "required": ["start_sec", "end_sec"]}}}


def test_chat_template_tools_audio_think(tiny_ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt))
    assert tok.chat_template == CHAT_TEMPLATE
    messages = [
        {"role": "system", "content": "You are a careful listener."},
        {"role": "user", "content": [{"type": "audio", "audio": "a.wav"},
                                     {"type": "text", "text": "When does the dog bark?"}]},
        {"role": "assistant", "content": "", "reasoning_content": "Crop first.",
         "tool_calls": [{"type": "function", "function": {
             "name": "crop_audio", "arguments": {"start_sec": 10, "end_sec": 20}}}]},
        {"role": "tool", "content": [{"type": "audio", "audio": "clip.wav"}]},
        {"role": "assistant", "content": "[00:12 - 00:15]", "reasoning_content": "Heard it."},
    ]
    text = tok.apply_chat_template(messages, tools=[CROP_TOOL], tokenize=False)
    expected = (
        "<|im_start|>system\nYou are a careful listener.\n\n# Tools\n\nYou may call one or more "
        "functions to assist with the user query.\n\nYou are provided with function signatures "
        "within <tools></tools> XML tags:\n<tools>\n" + json.dumps(CROP_TOOL) + "\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
        "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|>When does the dog bark?"
        "<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nCrop first.\n</think>\n\n<tool_call>\n{\"name\": "
        "\"crop_audio\", \"arguments\": {\"start_sec\": 10, \"end_sec\": 20}}\n</tool_call>"
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n<|audio_start|><|audio_pad|><|audio_end|>\n"
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nHeard it.\n</think>\n\n[00:12 - 00:15]<|im_end|>\n"
    )
    assert text == expected

    # generation prompt; enable_thinking=False closes an empty think block
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("When does the dog bark?<|im_end|>\n<|im_start|>assistant\n")
    no_think = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True,
                                       enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")

    # as in Qwen3: reasoning of turns before the last user query is dropped; a <think> prefix
    # in content is understood like reasoning_content
    multi = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": "<think>\nold\n</think>\n\nhello"},
             {"role": "user", "content": "again"},
             {"role": "assistant", "content": "<think>\nnew\n</think>\n\nyes"}]
    text = tok.apply_chat_template(multi, tokenize=False)
    assert "old" not in text and "<|im_start|>assistant\nhello<|im_end|>" in text
    assert "<|im_start|>assistant\n<think>\nnew\n</think>\n\nyes<|im_end|>" in text

    # string tool responses; consecutive tool messages share one user turn
    two = [{"role": "user", "content": "q"},
           {"role": "tool", "content": "first"}, {"role": "tool", "content": "second"}]
    assert tok.apply_chat_template(two, tokenize=False).endswith(
        "<|im_start|>user\n<tool_response>\nfirst\n</tool_response>\n<tool_response>\nsecond\n"
        "</tool_response><|im_end|>\n")


def test_processor_loads_and_expands_audio(tiny_ckpt):
    import numpy as np
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(str(tiny_ckpt))
    assert type(proc).__name__ == "Qwen3OmniMoeProcessor"
    fe = proc.feature_extractor
    assert fe.feature_size == 128 and fe.sampling_rate == 16000
    audio = np.zeros(32000, dtype=np.float32)  # 2 s
    out = proc(text="<|audio_start|><|audio_pad|><|audio_end|>hi", audio=[audio],
               return_tensors="pt")
    audio_id = proc.tokenizer.convert_tokens_to_ids("<|audio_pad|>")
    assert out["input_features"].shape[1] == 128
    assert int((out["input_ids"] == audio_id).sum()) == 26  # 200 mel frames -> 26 tokens


def test_presets_and_cli(tmp_path):
    from model_bridge.tiny.checkpoint import build_config
    from model_bridge.tiny.tokenizer import build_tokenizer, padded_vocab_size, token_ids

    small = get_preset("small")
    tok = build_tokenizer(small.bpe_vocab_size)
    cfg = build_config(small, token_ids(tok), padded_vocab_size(tok))
    text = cfg.thinker_config.text_config
    assert text.head_dim == 64 and text.rope_parameters["mrope_section"] == [16, 8, 8]
    assert text.num_experts == 16 and text.num_experts_per_tok == 4
    with pytest.raises(ValueError, match="unknown tiny preset"):
        get_preset("huge")

    from launch.cli import main
    assert main(["make-tiny", "--out", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "model.safetensors.index.json").exists()
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cli").iterdir()}
    with pytest.raises(SystemExit) as e:  # a non-empty --out (e.g. a real checkpoint) is never written into
        main(["make-tiny", "--out", str(tmp_path / "cli"), "--seed", "1"])
    assert e.value.code == 2
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cli").iterdir()} == before
    assert main(["make-tiny", "--out", str(tmp_path / "cli"), "--force"]) == 0
