"""The Qwen3-Omni-MoE mapping table: HF checkpoint keys <-> Megatron parameters of ``OmniThinker``.

Everything model-specific about conversion lives here; ``mappings.py`` is generic and
``load.py``/``export.py`` only walk a table. A second model is a second module like this one
exposing a ``ModelBridge``.

Placeholders: ``{layer}`` decoder layer (local on the Megatron side, global on the HF side),
``{expert}`` routed expert (local to the EP rank / global), ``{i}`` audio encoder layer (no PP),
``{c}`` audio conv index. Groups: ``"tp"`` dense tensor parallel, ``"etp"`` expert tensor parallel.

Megatron (under the OmniThinker)                        <- HF (under ``thinker.``)             mapping
language_model.embedding.word_embeddings.weight         <- model.embed_tokens.weight           VocabParallel
language_model.decoder.layers.{layer}.
  input_layernorm.weight                                <- model.layers.{layer}.input_layernorm Replicated
  self_attention.linear_qkv.weight                      <- ...self_attn.{q,k,v}_proj.weight    QKV (per KV group)
  self_attention.{q,k}_layernorm.weight                 <- ...self_attn.{q,k}_norm.weight      Replicated
  self_attention.linear_proj.weight                     <- ...self_attn.o_proj.weight          RowParallel
  pre_mlp_layernorm.weight                              <- ...post_attention_layernorm.weight  Replicated
  mlp.router.weight                                     <- ...mlp.gate.weight                  Replicated
  mlp.experts.local_experts.{expert}.linear_fc1.weight  <- ...mlp.experts.{expert}.{gate,up}_proj  GatedMLP (etp)
  mlp.experts.local_experts.{expert}.linear_fc2.weight  <- ...mlp.experts.{expert}.down_proj   RowParallel (etp)
  mlp.experts.weight1 [E_local, 2F/etp, h]               <- ...mlp.experts.{expert}.{gate,up}_proj  ExpertStacked(GatedMLP)
  mlp.experts.weight2 [E_local, h, F/etp]                <- ...mlp.experts.{expert}.down_proj   ExpertStacked(RowParallel)
language_model.decoder.final_layernorm.weight           <- model.norm.weight                   Replicated
language_model.output_layer.weight                      <- lm_head.weight                      VocabParallel
audio_tower.{conv2d1,2,3,conv_out,ln_post,proj1,proj2}  <- audio_tower.<same>                  Replicated
audio_tower.encoder.layers.{i}.
  input_layernorm.{weight,bias}                         <- audio_tower.layers.{i}.self_attn_layer_norm  Rep.
  self_attention.linear_qkv.{weight,bias}               <- ...self_attn.{q,k,v}_proj.{weight,bias}  QKV (per head)*
  self_attention.linear_proj.weight / .bias             <- ...self_attn.out_proj.{weight,bias}  Row* / Rep.
  pre_mlp_layernorm.{weight,bias}                       <- ...final_layer_norm                 Replicated
  mlp.linear_fc1.{weight,bias}                          <- ...fc1                              ColumnParallel*
  mlp.linear_fc2.weight / .bias                         <- ...fc2                              RowParallel* / Replicated

The ``weight1``/``weight2`` rules cover the grouped-GEMM experts of the ``"torch"`` layer-spec
backend (``modeling.experts.TorchGroupedMLP``: a layer's local experts stacked along dim 0, each
slice laid out like SequentialMLP's per-expert weight); a model has one kind or the other.

``*``: when TP does not divide the audio heads the encoder is replicated on every TP rank and all
its mappings are ``Replicated`` (``config.audio_is_tensor_parallel``). Not held by the Megatron
model, copied through on export: ``PASSTHROUGH_PREFIXES``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from model_bridge.config import (OmniSpec, ParallelLayout, audio_is_tensor_parallel, read_omni_config)
from model_bridge.mappings import (QKV, ColumnParallel, ExpertStacked, GatedMLP, ParamMapping, Replicated,
                                   RowParallel, Rule, VocabParallel)

__all__ = ["ModelBridge", "QWEN3_OMNI", "PASSTHROUGH_PREFIXES", "OWNED_PREFIXES", "mapping_rules"]

PASSTHROUGH_PREFIXES = ("thinker.visual.", "talker.", "code2wav.")
"""HF tensors the trainer does not hold: copied untouched from the source checkpoint on export."""
OWNED_PREFIXES = ("thinker.model.", "thinker.lm_head.", "thinker.audio_tower.")
"""HF tensors the Megatron model holds (every one must be covered by the table)."""


@dataclass(frozen=True)
class ModelBridge:
    """What load/export need to know about one model family."""

    name: str
    read_spec: Callable[[str], object]
    """hf_dir -> spec (raises on a config of another model type)."""
    rules: Callable[[object, int], list[Rule]]
    """(spec, tp size) -> the mapping table."""
    passthrough_prefixes: Sequence[str]
    owned_prefixes: Sequence[str]


def _text_rules(spec: OmniSpec) -> list[Rule]:
    t = spec.text
    L = "language_model.decoder.layers.{layer}."
    H = "thinker.model.layers.{layer}."
    E = L + "mlp.experts.local_experts.{expert}."
    HE = H + "mlp.experts.{expert}."
    rep = Replicated()
    return [
        Rule("language_model.embedding.word_embeddings.weight", "thinker.model.embed_tokens.weight",
             VocabParallel(t.vocab_size)),
        Rule(L + "input_layernorm.weight", H + "input_layernorm.weight", rep),
        Rule(L + "self_attention.linear_qkv.weight",
             {r: H + f"self_attn.{r}_proj.weight" for r in "qkv"},
             QKV(t.num_heads, t.num_kv_heads, t.head_dim)),
        Rule(L + "self_attention.q_layernorm.weight", H + "self_attn.q_norm.weight", rep),
        Rule(L + "self_attention.k_layernorm.weight", H + "self_attn.k_norm.weight", rep),
        Rule(L + "self_attention.linear_proj.weight", H + "self_attn.o_proj.weight", RowParallel()),
        Rule(L + "pre_mlp_layernorm.weight", H + "post_attention_layernorm.weight", rep),
        Rule(L + "mlp.router.weight", H + "mlp.gate.weight", rep),
        Rule(E + "linear_fc1.weight", {"gate": HE + "gate_proj.weight", "up": HE + "up_proj.weight"},
             GatedMLP(group="etp")),
        Rule(E + "linear_fc2.weight", HE + "down_proj.weight", RowParallel(group="etp")),
        # grouped-GEMM experts (torch backend): the same per-expert mappings over a stacked dim 0
        Rule(L + "mlp.experts.weight1", {"gate": HE + "gate_proj.weight", "up": HE + "up_proj.weight"},
             ExpertStacked(GatedMLP(group="etp"))),
        Rule(L + "mlp.experts.weight2", HE + "down_proj.weight", ExpertStacked(RowParallel(group="etp"))),
        Rule("language_model.decoder.final_layernorm.weight", "thinker.model.norm.weight", rep),
        Rule("language_model.output_layer.weight", "thinker.lm_head.weight", VocabParallel(t.vocab_size)),
    ]


def _audio_rules(spec: OmniSpec, tp: int) -> list[Rule]:
    a = spec.audio
    sharded = audio_is_tensor_parallel(spec, ParallelLayout(tp=tp, ep=1, etp=tp))
    rep = Replicated()
    col: ParamMapping = ColumnParallel() if sharded else rep
    row: ParamMapping = RowParallel() if sharded else rep
    qkv = QKV(a.num_heads, a.num_heads, a.head_dim, replicated=not sharded)
    M, H = "audio_tower.", "thinker.audio_tower."
    ML, HL = M + "encoder.layers.{i}.", H + "layers.{i}."
    rules = [Rule(M + f"conv2d{{c}}.{w}", H + f"conv2d{{c}}.{w}", rep) for w in ("weight", "bias")]
    rules += [Rule(M + f"{m}.{w}", H + f"{m}.{w}", rep)
              for m, ws in (("conv_out", ("weight",)), ("ln_post", ("weight", "bias")),
                            ("proj1", ("weight", "bias")), ("proj2", ("weight", "bias"))) for w in ws]
    for w in ("weight", "bias"):
        rules += [
            Rule(ML + f"input_layernorm.{w}", HL + f"self_attn_layer_norm.{w}", rep),
            # fused per head (one query group per head)
            Rule(ML + f"self_attention.linear_qkv.{w}", {r: HL + f"self_attn.{r}_proj.{w}" for r in "qkv"}, qkv),
            Rule(ML + f"pre_mlp_layernorm.{w}", HL + f"final_layer_norm.{w}", rep),
            Rule(ML + f"mlp.linear_fc1.{w}", HL + f"fc1.{w}", col),
        ]
    rules += [
        Rule(ML + "self_attention.linear_proj.weight", HL + "self_attn.out_proj.weight", row),
        Rule(ML + "self_attention.linear_proj.bias", HL + "self_attn.out_proj.bias", rep),
        Rule(ML + "mlp.linear_fc2.weight", HL + "fc2.weight", row),
        Rule(ML + "mlp.linear_fc2.bias", HL + "fc2.bias", rep),
    ]
    return rules


def mapping_rules(spec: OmniSpec, tp: int = 1) -> list[Rule]:
    """The full table for a thinker (+ audio tower) at tensor-parallel size ``tp``."""
    return _text_rules(spec) + _audio_rules(spec, tp)


QWEN3_OMNI = ModelBridge(name="qwen3_omni_moe", read_spec=read_omni_config, rules=mapping_rules,
                         passthrough_prefixes=PASSTHROUGH_PREFIXES, owned_prefixes=OWNED_PREFIXES)
