"""Pure transforms, mapping classes (split for a rank / merge back), rule resolution and the
streaming safetensors reader/writer. Fast: no process groups, no megatron model."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_bridge import transforms as T
from model_bridge.io import INDEX_NAME, CheckpointError, SafetensorsReader, ShardedWriter
from model_bridge.mappings import (QKV, ColumnParallel, DictSource, ExpertStacked, GatedMLP, MappingError,
                                   ParallelContext, Replicated, RowParallel, Rule, Shard, VocabParallel, build_tasks,
                                   task_shard)


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------ transforms


@pytest.mark.parametrize("heads,kv,hd,rest", [(8, 2, 4, (6,)), (4, 4, 3, (5,)), (6, 1, 2, ()), (8, 2, 4, ())])
def test_qkv_fuse_split_round_trip_and_megatron_layout(heads, kv, hd, rest):
    q, k, v = _rand(heads * hd, *rest, seed=1), _rand(kv * hd, *rest, seed=2), _rand(kv * hd, *rest, seed=3)
    fused = T.fuse_qkv(q, k, v, heads, kv, hd)
    assert fused.shape == ((heads + 2 * kv) * hd, *rest)
    q2, k2, v2 = T.split_qkv(fused, heads, kv, hd)
    assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)
    # what megatron's attention does with the fused output: view [groups, (h + 2) * hd] and split
    h = heads // kv
    grouped = fused.reshape(kv, (h + 2) * hd, *rest)
    mq, mk, mv = torch.split(grouped, [h * hd, hd, hd], dim=1)
    for g in range(kv):  # group g = query heads [g*h, (g+1)*h) with KV head g (HF repeat_kv order)
        assert torch.equal(mq[g], q[g * h * hd:(g + 1) * h * hd])
        assert torch.equal(mk[g], k[g * hd:(g + 1) * hd])
        assert torch.equal(mv[g], v[g * hd:(g + 1) * hd])


def test_qkv_shape_errors():
    with pytest.raises(ValueError, match="do not fit"):
        T.fuse_qkv(torch.zeros(8, 2), torch.zeros(4, 2), torch.zeros(2, 2), 4, 2, 2)
    with pytest.raises(ValueError, match="rows"):
        T.split_qkv(torch.zeros(10, 2), 4, 2, 2)
    with pytest.raises(ValueError, match="multiple"):
        T.fuse_qkv(torch.zeros(6, 2), torch.zeros(4, 2), torch.zeros(4, 2), 3, 2, 2)


def test_gate_up_fuse_split_and_tp_shards():
    gate, up = _rand(8, 5, seed=1), _rand(8, 5, seed=2)
    fused = T.fuse_gate_up(gate, up)
    assert torch.equal(fused[:8], gate) and torch.equal(fused[8:], up)
    g2, u2 = T.split_gate_up(fused)
    assert torch.equal(g2, gate) and torch.equal(u2, up)
    shards = [T.gate_up_shard(gate, up, 2, r) for r in range(2)]
    assert torch.equal(shards[1], torch.cat([gate[4:], up[4:]]))  # [gate_r; up_r], not a slice of [gate; up]
    g3, u3 = T.split_gate_up_shards(shards)
    assert torch.equal(g3, gate) and torch.equal(u3, up)


def test_vocab_pad_unpad():
    w = _rand(10, 3)
    p = T.pad_vocab(w, 16)
    assert p.shape == (16, 3) and torch.equal(p[:10], w) and not p[10:].any()
    assert torch.equal(T.unpad_vocab(p, 10), w)
    assert T.pad_vocab(w, 10) is w
    with pytest.raises(ValueError):
        T.pad_vocab(w, 8)


# ------------------------------------------------------------------------------------ mappings


def _split_merge(mapping, full: dict, keys: dict, local_shape, size):
    """Load every rank's shard from full HF tensors and merge them back."""
    src = DictSource({keys[r]: full[r] for r in keys})
    shards = [mapping.load(src, keys, local_shape, Shard(size=size, rank=r)) for r in range(size)]
    for s in shards:
        assert tuple(s.shape) == tuple(local_shape)
    return shards, mapping.merge(shards)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_row_replicated_round_trip(tp):
    w = _rand(8, 12)
    shards, out = _split_merge(ColumnParallel(), {"hf": w}, {"hf": "w"}, (8 // tp, 12), tp)
    assert torch.equal(out["hf"], w) and torch.equal(shards[-1], w[-8 // tp:])
    b = _rand(8)
    _, out = _split_merge(ColumnParallel(), {"hf": b}, {"hf": "b"}, (8 // tp,), tp)
    assert torch.equal(out["hf"], b)
    shards, out = _split_merge(RowParallel(), {"hf": w}, {"hf": "w"}, (8, 12 // tp), tp)
    assert torch.equal(out["hf"], w) and torch.equal(shards[0], w[:, :12 // tp])
    src = DictSource({"n": b})
    assert torch.equal(Replicated().load(src, {"hf": "n"}, (8,), Shard(tp, tp - 1)), b)
    assert Replicated().replicated and Replicated().hf_shapes((8,), Shard(tp, 0)) == {"hf": (8,)}


@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_mapping_shards_whole_groups(tp):
    heads, kv, hd, hidden = 8, 2, 4, 6
    full = {"q": _rand(heads * hd, hidden, seed=1), "k": _rand(kv * hd, hidden, seed=2),
            "v": _rand(kv * hd, hidden, seed=3)}
    keys = {"q": "q", "k": "k", "v": "v"}
    m = QKV(heads, kv, hd)
    rows = (heads + 2 * kv) * hd
    shards, out = _split_merge(m, full, keys, (rows // tp, hidden), tp)
    fused = T.fuse_qkv(full["q"], full["k"], full["v"], heads, kv, hd)
    for r, s in enumerate(shards):  # megatron's TP shard: contiguous rows of the fused tensor
        assert torch.equal(s, fused.chunk(tp)[r])
    assert all(torch.equal(out[x], full[x]) for x in "qkv")
    assert m.hf_shapes((rows // tp, hidden), Shard(tp, 0)) == {"q": (32, 6), "k": (8, 6), "v": (8, 6)}
    with pytest.raises(MappingError):
        m.hf_shapes((rows // tp + 1, hidden), Shard(tp, 0))


def test_qkv_replicated_mha_with_bias():
    heads, hd = 4, 3
    full = {x: _rand(heads * hd, seed=i) for i, x in enumerate("qkv")}
    m = QKV(heads, heads, hd, replicated=True)
    shard = task_shard(m, ParallelContext(shards={"tp": Shard(2, 1), "etp": Shard()}))
    assert shard.size == 1 and shard.replica_rank == 1  # tp rank 1 holds it whole, does not export
    got = m.load(DictSource(full), {x: x for x in "qkv"}, (3 * heads * hd,), shard)
    assert torch.equal(got.view(heads, 3, hd)[2, 1], full["k"][2 * hd:3 * hd])  # per head [q_h, k_h, v_h]
    assert all(torch.equal(m.merge([got])[x], full[x]) for x in "qkv")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gated_mlp_mapping(tp):
    full = {"gate": _rand(8, 6, seed=1), "up": _rand(8, 6, seed=2)}
    shards, out = _split_merge(GatedMLP(group="etp"), full, {"gate": "g", "up": "u"}, (16 // tp, 6), tp)
    assert torch.equal(shards[0], T.gate_up_shard(full["gate"], full["up"], tp, 0))
    assert torch.equal(out["gate"], full["gate"]) and torch.equal(out["up"], full["up"])


@pytest.mark.parametrize("tp,padded", [(1, 16), (2, 16), (4, 16), (4, 32)])
def test_vocab_parallel_pads_and_drops(tp, padded):
    w = _rand(10, 3)
    shards, out = _split_merge(VocabParallel(10), {"hf": w}, {"hf": "e"}, (padded // tp, 3), tp)
    local = torch.cat(shards)
    assert torch.equal(local[:10], w) and not local[10:].any()
    assert torch.equal(out["hf"], w)


def test_merge_of_a_group_of_one_is_views_of_the_parameter():
    """TP=1 export: no copy for the plain split mappings and stacked experts (the weight-sync hot path);
    the values are those of a one-shard concatenation, contiguous."""
    def views_of(t, base):
        return t.is_contiguous() and t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()

    w = _rand(8, 6)
    for m in (ColumnParallel(), RowParallel(), Replicated()):
        assert m.merge([w])["hf"] is w
    out = GatedMLP().merge([w])
    assert torch.equal(out["gate"], w[:4]) and torch.equal(out["up"], w[4:]) and views_of(out["up"], w)
    assert views_of(VocabParallel(5).merge([w])["hf"], w) and torch.equal(VocabParallel(5).merge([w])["hf"], w[:5])
    stack = _rand(3, 8, 6, seed=3)  # three local experts of [gate; up] rows
    fc1 = ExpertStacked(GatedMLP("etp")).bind(3)
    out = fc1.merge([stack])
    assert list(out) == list(fc1.roles) == ["gate@0", "up@0", "gate@1", "up@1", "gate@2", "up@2"]
    for e in range(3):
        assert torch.equal(out[f"gate@{e}"], stack[e, :4]) and torch.equal(out[f"up@{e}"], stack[e, 4:])
        assert views_of(out[f"gate@{e}"], stack)
    fc2 = ExpertStacked(RowParallel("etp")).bind(3)
    out = fc2.merge([stack])
    assert all(torch.equal(out[f"hf@{e}"], stack[e]) and views_of(out[f"hf@{e}"], stack) for e in range(3))
    # a non-contiguous parameter still gives contiguous tensors with the same values
    out = fc2.merge([stack.transpose(1, 2)])
    assert all(torch.equal(out[f"hf@{e}"], stack[e].t()) and out[f"hf@{e}"].is_contiguous() for e in range(3))
    # two ETP shards: the concatenating path gives the same full tensors
    two = fc2.merge([stack[:, :, :3], stack[:, :, 3:]])
    assert all(torch.equal(two[f"hf@{e}"], stack[e]) for e in range(3))


def test_expert_rule_names_every_local_expert():
    rule = Rule("layers.{layer}.fc1", {"gate": "m.{layer}.experts.{expert}.gate", "up": "m.{layer}.experts.{expert}.up"},
                ExpertStacked(GatedMLP("etp")))
    names = rule.expanded_hf_names({"layer": 7}, 2, 10)
    assert names == {"gate@0": "m.7.experts.10.gate", "up@0": "m.7.experts.10.up",
                     "gate@1": "m.7.experts.11.gate", "up@1": "m.7.experts.11.up"}


def test_mapping_reads_only_its_slice():
    class Counting(DictSource):
        def __init__(self, t):
            super().__init__(t)
            self.calls = []

        def read(self, key, dim=0, start=None, stop=None, expect_shape=None):
            self.calls.append((key, dim, start, stop))
            return super().read(key, dim, start, stop, expect_shape)

    src = Counting({"w": _rand(8, 4)})
    RowParallel().load(src, {"hf": "w"}, (8, 2), Shard(2, 1))
    ColumnParallel().load(src, {"hf": "w"}, (4, 4), Shard(2, 1))
    assert src.calls == [("w", 1, 2, 4), ("w", 0, 4, 8)]


# ------------------------------------------------------------------------------------ rules / tasks


class _Layer(torch.nn.Module):
    def __init__(self, number):
        super().__init__()
        self.layer_number = number
        self.norm = torch.nn.Parameter(torch.zeros(2))
        self.experts = torch.nn.ModuleList([torch.nn.Linear(2, 4, bias=False) for _ in range(2)])


class _Toy(torch.nn.Module):
    def __init__(self, offset=0, extra=False):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(offset + i + 1) for i in range(2)])
        if extra:
            self.stray = torch.nn.Parameter(torch.zeros(1))


_TOY_RULES = [
    Rule("layers.{layer}.norm", "m.layers.{layer}.norm.weight", Replicated()),
    Rule("layers.{layer}.experts.{expert}.weight", "m.layers.{layer}.experts.{expert}.w", ColumnParallel("etp")),
]


def test_rules_resolve_global_layers_and_experts():
    ctx = ParallelContext(shards={"tp": Shard(), "etp": Shard()}, ep_rank=1, ep_size=2)
    tasks = build_tasks(_Toy(offset=4), _TOY_RULES, ctx)
    names = {t.name: t.hf["hf"] for t in tasks}
    assert names["layers.0.norm"] == "m.layers.4.norm.weight"  # PP offset from layer_number
    assert names["layers.1.experts.1.weight"] == "m.layers.5.experts.3.w"  # EP rank 1 of 2, 2 local
    assert [t.name for t in tasks] == [n for n, _ in _Toy().named_parameters()]  # deterministic order


def test_uncovered_and_doubly_covered_parameters_are_listed():
    with pytest.raises(MappingError, match=r"1 Megatron parameter\(s\) not covered.*stray \[1\]"):
        build_tasks(_Toy(extra=True), _TOY_RULES, ParallelContext())
    with pytest.raises(MappingError, match="several rules"):
        build_tasks(_Toy(), _TOY_RULES + [Rule("layers.0.norm", "x", Replicated())], ParallelContext())


def test_rule_checks_roles_and_placeholders():
    with pytest.raises(MappingError, match="roles"):
        Rule("a.{layer}.w", "x", QKV(2, 1, 2))
    with pytest.raises(MappingError, match="does not capture"):
        Rule("a.w", "x.{layer}", Replicated())


def test_mappings_module_is_model_agnostic():
    import model_bridge.mappings as M

    text = Path(M.__file__).read_text().lower()
    assert not any(word in text for word in ("thinker", "audio", "omni_moe", "qwen3."))


# ------------------------------------------------------------------------------------ io


def _write_ckpt(d: Path, tensors: dict, shards: list[list[str]]):
    d.mkdir(parents=True, exist_ok=True)
    wm = {}
    for i, names in enumerate(shards, 1):
        f = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(d / f), metadata={"format": "pt"})
        wm.update({n: f for n in names})
    (d / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": wm}))
    return d


@pytest.fixture()
def small_ckpt(tmp_path):
    t = {"a.weight": _rand(6, 4, seed=1), "b.weight": _rand(3, seed=2), "c.weight": _rand(4, 8, seed=3)}
    return _write_ckpt(tmp_path / "ck", t, [["a.weight"], ["b.weight", "c.weight"]]), t


def test_reader_lazy_slices_and_counts(small_ckpt):
    d, t = small_ckpt
    r = SafetensorsReader(d)
    assert r.keys() == sorted(t) and r.shape("c.weight") == (4, 8) and r.dtype("a.weight") == torch.float32
    assert torch.equal(r.read("a.weight", 0, 2, 4), t["a.weight"][2:4])
    assert torch.equal(r.read("c.weight", 1, 4, 8), t["c.weight"][:, 4:])
    assert torch.equal(r.read("b.weight", expect_shape=(3,)), t["b.weight"])
    assert dict(r.reads) == {"a.weight": 1, "c.weight": 1, "b.weight": 1}
    assert r.read_bytes == (2 * 4 + 4 * 4 + 3) * 4


def test_reader_single_file(tmp_path):
    save_file({"x": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    assert torch.equal(SafetensorsReader(tmp_path).read("x"), torch.ones(2))


def test_reader_missing_shard(small_ckpt):
    d, _ = small_ckpt
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"missing from .*model-00002-of-00002.safetensors \(2 tensors\)"):
        SafetensorsReader(d)


def test_reader_missing_key_names_near_keys(small_ckpt):
    d, _ = small_ckpt
    with pytest.raises(CheckpointError, match=r"'a.weigth' is not in the checkpoint.*near names: a.weight"):
        SafetensorsReader(d).read("a.weigth")


def test_reader_corrupt_header(small_ckpt):
    d, _ = small_ckpt
    f = d / "model-00001-of-00002.safetensors"
    data = bytearray(f.read_bytes())
    data[8:16] = b"\x00garbag"
    f.write_bytes(bytes(data))
    r = SafetensorsReader(d)
    assert torch.equal(r.read("b.weight"), small_ckpt[1]["b.weight"])  # other shards still readable
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002.safetensors: corrupt or unreadable safetensors"):
        r.read("a.weight")


def test_reader_shape_mismatch_and_index_disagreement(small_ckpt):
    d, _ = small_ckpt
    r = SafetensorsReader(d)
    with pytest.raises(CheckpointError, match=r"shape mismatch for a.weight .*expected \[6, 5\], found \[6, 4\]"):
        r.read("a.weight", expect_shape=(6, 5))
    idx = json.loads((d / INDEX_NAME).read_text())
    idx["weight_map"]["a.weight"] = "model-00002-of-00002.safetensors"
    (d / INDEX_NAME).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="has no such tensor"):
        SafetensorsReader(d).read("a.weight")


def test_writer_bounded_shards_and_index(tmp_path):
    tensors = {f"t{i}": _rand(10 + i, seed=i) for i in range(7)}  # 40..64 bytes each
    tensors["big"] = _rand(100)  # 400 bytes: a shard of its own
    with ShardedWriter(tmp_path, max_shard_bytes=128) as w:
        w.add_all(tensors.items())
        with pytest.raises(ValueError, match="twice"):
            w.add("t0", torch.zeros(1))
    idx = json.loads((tmp_path / INDEX_NAME).read_text())
    files = sorted(set(idx["weight_map"].values()))
    assert len(files) >= 4 and files[0].endswith(f"-of-{len(files):05d}.safetensors")
    assert idx["metadata"]["total_size"] == sum(t.numel() * 4 for t in tensors.values())
    for f in files:
        part = load_file(str(tmp_path / f))
        assert sum(t.numel() * 4 for t in part.values()) <= 128 or list(part) == ["big"]
    r = SafetensorsReader(tmp_path)
    assert all(torch.equal(r.read(k), v) for k, v in tensors.items())
    assert not list(tmp_path.glob("*.tmp"))


def test_writer_prefix_without_index(tmp_path):
    w = ShardedWriter(tmp_path, prefix="model-rank00001", index_name=None)
    w.add("x", torch.ones(3))
    assert w.close() == {"x": "model-rank00001-00001-of-00001.safetensors"}
    assert not (tmp_path / INDEX_NAME).exists()
    shutil.rmtree(tmp_path)
