"""Multi-source weight push (weight_sync/multisource.py) from real gloo trainer ranks into the real
vLLM CPU server (the session `vllm_server`).

At EP2, TP2, PP2 and TP2xEP2 (2 ranks) the tiny model, perturbed on the ranks, is pushed twice into the server: by every
rank that owns a shard (multisource) and through `export_to_rank0` + `push` (gather); the served
prompt logprobs agree (fp32, <= 1e-5) and differ from the checkpoint's. Each rank's sent bytes equal
its own shards by Megatron's own parameter attributes (expert / tensor-parallel), and the server's
assembler refuses a shard claimed twice or missing, so a landed push proves exactly-once coverage.
A sender killed mid-push leaves the server resumed on its previous version with an error naming
the rank and the stage; the next push (fresh ranks) lands. Without a server: the shards of 2 gloo
ranks, packed and merged as on the wire, equal `export_to_rank0`'s tensors bit for bit at the same
four layouts; on a GPU (marked gpu) the same path on the device at full width (2 layers).
"""
from __future__ import annotations

import json
import os
import zlib

import pytest
import requests
import torch

from megatron_grpo.weight_sync.shards import ShardAssembler, mapping_from_spec, mapping_spec
from model_bridge import spawn
from model_bridge.spawn import run_ranks

BUCKET = 16 * 1024  # bytes: several rounds, some shards alone in theirs
PROMPT = [(37 * i + 11) % 480 for i in range(24)]  # ids inside the tiny vocab (513)
ATOL = 1e-5


def _build(hf_dir, tp, ep, etp, pp):
    from model_bridge.config import ParallelLayout, read_omni_config
    from model_bridge.load import load_hf
    from model_bridge.modeling import build_thinker
    from model_bridge.parallel import init_parallel

    init_parallel(tp=tp, ep=ep, etp=etp, pp=pp)
    spec = read_omni_config(hf_dir)
    model = build_thinker(spec, ParallelLayout(tp=tp, ep=ep, etp=etp, pp=pp))
    load_hf(model, hf_dir)
    with torch.no_grad():  # the same noise for a parameter name on every layout's rank
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            p.add_(0.3 * p.float().std() * torch.randn(p.shape, generator=g))
    return model


def served_prompt_logprobs(url: str) -> list[float]:
    body = {"model": _model_name(url), "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0,
            "prompt_logprobs": 0}
    r = requests.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text[:2000]
    out = []
    for tok, entry in zip(PROMPT[1:], r.json()["choices"][0]["prompt_logprobs"][1:]):
        out.append(float(entry[str(tok)]["logprob"]))
    return out


def _model_name(url: str) -> str:
    return requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def _own_bytes(model) -> int:
    """What this rank must send, from megatron-core's own view (not our mapping table): parameters
    of data-parallel replica 0 (expert-data-parallel for experts) that are tensor-parallel
    (a slice of this rank's own) or, when replicated, sit on tensor-parallel rank 0."""
    from megatron.core import parallel_state as ps

    dense = (ps.get_data_parallel_rank(with_context_parallel=True), ps.get_tensor_model_parallel_rank())
    expert = (ps.get_expert_data_parallel_rank(), ps.get_expert_tensor_parallel_rank())
    n = 0
    for name, p in model.named_parameters():
        dp, tp = expert if ".experts." in name else dense
        if dp == 0 and (getattr(p, "tensor_model_parallel", False) or tp == 0):
            n += p.nbytes
    return n


def _layouts(hf_dir, url, layouts):
    """Rank body: per layout, multisource push then gather push; rank 0 reads the served logprobs."""
    import torch.distributed as dist

    from megatron_grpo.weight_sync import WeightReceiver, push
    from megatron_grpo.weight_sync.gather import export_to_rank0
    from megatron_grpo.weight_sync.multisource import push_multisource

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    rx = WeightReceiver(url, backend="gloo", transfer_timeout_s=120) if rank == 0 else None
    out = []
    try:
        for layout in layouts:
            model = _build(hf_dir, *layout)
            tag = "x".join(map(str, layout))
            st: dict = {}
            stats = push_multisource(model, f"ms-{tag}", [rx] if rx else None, bucket_bytes=BUCKET, stats=st)
            res = {"layout": layout, "sent": st, "own": _own_bytes(model)}
            if rank == 0:
                res.update(version=rx.weight_version(), paused=rx.is_paused(), ms=served_prompt_logprobs(url),
                           rounds=stats.buckets, summary=stats.summary())
            weights = export_to_rank0(model)
            if rank == 0:
                push(weights, f"g-{tag}", [rx])
                res["gather"] = served_prompt_logprobs(url)
            else:
                sum(1 for _ in weights)
            out.append(res)
    finally:
        if rx is not None:
            rx.close()
    return out


def _dies(hf_dir, url, result_file):
    """Rank body: rank 1 dies after its first bucket went out; rank 0 records its error."""
    import torch.distributed as dist

    from megatron_grpo.weight_sync import WeightPushError, WeightReceiver
    from megatron_grpo.weight_sync import gloo, multisource

    model = _build(hf_dir, 1, 2, 1, 1)
    rank = dist.get_rank()
    if rank == 1:
        real = gloo.send_to

        def send_then_die(*a, **k):
            real(*a, **k)
            os._exit(3)  # killed mid-push: its sockets close, nothing is reported

        multisource.send_to = send_then_die
    rx = WeightReceiver(url, backend="gloo", transfer_timeout_s=60) if rank == 0 else None
    try:
        multisource.push_multisource(model, "dead", [rx] if rx else None, bucket_bytes=BUCKET)
    except WeightPushError as e:
        with open(result_file, "w") as f:
            json.dump({"msg": str(e), "stage": e.stage, "rank": e.rank, "states": e.states,
                       "version": rx.weight_version(), "paused": rx.is_paused()}, f)
    finally:
        if rx is not None:
            rx.close()


def _assembled(hf_dir, layouts):
    """Rank body, no server: every rank's owned shards, packed and unpacked as on the wire, merged on
    rank 0 by `ShardAssembler`, against rank 0's `export_to_rank0` stream (name -> bytes)."""
    import torch.distributed as dist

    from megatron_grpo.weight_sync.buckets import pack_bucket, unpack_bucket
    from megatron_grpo.weight_sync.gather import export_to_rank0
    from megatron_grpo.weight_sync.multisource import plan_buckets
    from megatron_grpo.weight_sync.shards import owned_shards

    out = []
    for layout in layouts:
        model = _build(hf_dir, *layout)
        wire = []
        for bucket in plan_buckets(owned_shards(model), BUCKET):
            buf = pack_bucket([e.tensor for e in bucket])
            views = unpack_bucket(buf, [e.wire_name for e in bucket], [e.tensor.dtype for e in bucket],
                                  [list(e.tensor.shape) for e in bucket])
            wire += [(e.meta(), t) for e, (_, t) in zip(bucket, views)]
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, wire)
        stream = {n: _bytes(t) for n, t in export_to_rank0(model)}
        if dist.get_rank() == 0:
            asm, merged = ShardAssembler(), {}
            for shards in every:
                for meta, t in shards:
                    for n, x in asm.add(meta, t):
                        assert n not in merged, n
                        merged[n] = _bytes(x)
            assert asm.missing() == [], (layout, asm.missing())
            out.append((layout, sorted(merged) == sorted(stream),
                        [n for n in stream if merged.get(n) != stream[n]], [len(w) for w in every]))
    # no receiver on rank 0: every rank raises (none is left waiting in a collective)
    from megatron_grpo.weight_sync.multisource import push_multisource

    try:
        push_multisource(model, 1, [] if dist.get_rank() == 0 else None)
    except Exception as e:  # noqa: BLE001 - returned for the test to check
        return out, f"{type(e).__name__}: {e}"
    return out, None


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.slow  # ~20 s on 2 idle cores (4 layouts, 2 ranks, no server)
def test_assembled_shards_are_the_gather_paths_tensors_bit_for_bit(tiny_ckpt):
    layouts = [(1, 2, 1, 1), (2, 1, 2, 1), (1, 1, 1, 2), (2, 2, 1, 1)]
    (checked, err0), (_, err1) = run_ranks(_assembled, 2, str(tiny_ckpt), layouts, timeout=300)
    for layout, same_names, differ, shards_per_rank in checked:
        assert same_names and differ == [], (layout, differ[:5])
        assert all(shards_per_rank), layout  # both ranks send at every layout
    assert err0 == "ValueError: push_multisource needs at least one WeightReceiver on rank 0"
    assert err1.startswith("WeightPushError: (from trainer rank 0) push_multisource needs at least one")


def test_mapping_spec_round_trip_merges_like_the_table():
    from model_bridge.mappings import QKV, ColumnParallel, ExpertStacked, GatedMLP, VocabParallel

    for m in (QKV(4, 2, 8), VocabParallel(10), ExpertStacked(GatedMLP(), 3), ColumnParallel()):
        assert mapping_spec(mapping_from_spec(mapping_spec(m))) == mapping_spec(m)
    m = VocabParallel(10)
    a = ShardAssembler()
    shards = [torch.randn(6, 4), torch.randn(6, 4)]
    meta = {"key": "emb", "size": 2, "hf": {"hf": "emb"}, "mapping": mapping_spec(m)}
    assert a.add({**meta, "rank": 1}, shards[1]) == [] and a.missing() == ["emb: have shards [1] of 2"]
    with pytest.raises(ValueError, match="sent twice"):
        a.add({**meta, "rank": 1}, shards[1])
    (name, t), = a.add({**meta, "rank": 0}, shards[0])
    assert name == "emb" and torch.equal(t, torch.cat(shards)[:10]) and a.missing() == []
    with pytest.raises(ValueError, match="unknown parameter mapping 'Nope'"):
        mapping_from_spec({"kind": "Nope"})


@pytest.mark.slow  # ~100 s on 2 shared cores (two 2-rank runs, nine pushes)
def test_multisource_matches_gather_and_survives_a_dead_sender(vllm_server, tiny_ckpt, tmp_path, monkeypatch):
    from conftest import restore_checkpoint_weights

    url = vllm_server.url
    before = served_prompt_logprobs(url)
    version = requests.get(f"{url}/weight_info", timeout=30).json()["weight_version"]
    try:
        # 1. a sender dies mid-push: rank 0 must recover the server before run_ranks stops it
        monkeypatch.setattr(spawn, "_GRACE_S", 120.0)
        result = tmp_path / "rank0.json"
        with pytest.raises(Exception, match="rank 1 exited with code 3"):
            run_ranks(_dies, 2, str(tiny_ckpt), url, str(result), timeout=300)
        err = json.loads(result.read_text())
        print(f"\n[dead sender] {err['msg'][:700]}")
        assert err["stage"] == "update_weights" and err["rank"] == 1
        assert "trainer rank 1" in err["msg"] and "version 'dead'" in err["msg"]
        assert err["states"] == {url: "previous version, resumed"}
        assert err["version"] == version and not err["paused"]
        assert max(abs(a - b) for a, b in zip(served_prompt_logprobs(url), before)) <= ATOL

        # 2. the next pushes land: multisource equals gather at every layout
        monkeypatch.setattr(spawn, "_GRACE_S", 1.0)
        layouts = [(1, 2, 1, 1), (2, 1, 2, 1), (1, 1, 1, 2), (2, 2, 1, 1)]  # EP2, TP2, PP2, TP2xEP2
        per_rank = run_ranks(_layouts, 2, str(tiny_ckpt), url, layouts, timeout=400)
        for i, layout in enumerate(layouts):
            r0 = per_rank[0][i]
            print(f"[{layout}] {r0['summary']}")
            assert r0["version"] == "ms-" + "x".join(map(str, layout)) and not r0["paused"]
            d_gather = max(abs(a - b) for a, b in zip(r0["ms"], r0["gather"]))
            d_before = max(abs(a - b) for a, b in zip(r0["ms"], before))
            print(f"[{layout}] max |dlogp| multisource vs gather {d_gather:.2e}, vs checkpoint {d_before:.2e}")
            assert d_gather <= ATOL and d_before > 1e-2
            assert r0["rounds"] > 1
            for rank, res in enumerate(per_rank):
                st = res[i]
                assert st["sent"]["sent_bytes"] == st["own"] > 0, (layout, rank, st)
    finally:
        restore_checkpoint_weights(vllm_server)


def test_resolve_mode(capsys):
    from megatron_grpo.weight_sync.multisource import resolve_mode

    assert resolve_mode("auto", "gloo", 2) == resolve_mode("multisource", "gloo", 4) == "multisource"
    assert resolve_mode("auto", "gloo", 1) == resolve_mode("gather", "gloo", 2) == "gather"
    assert resolve_mode("auto", "nccl", 8) == "gather" and capsys.readouterr().out == ""
    assert resolve_mode("multisource", "nccl", 8) == resolve_mode("multisource", "nccl", 8) == "gather"
    assert capsys.readouterr().out.count("falls back to gather on the nccl data plane") == 1
    with pytest.raises(ValueError, match="weight_sync.mode must be auto, gather or multisource"):
        resolve_mode("fast", "gloo", 2)


def random_model(device: str, tiny: bool, layers: int):
    """(model, spec): one rank's thinker without audio tower on `device`, the release's widths unless
    `tiny`, `layers` layers, random bf16 weights (seed 0)."""
    from launch.bench._sync_common import sync_config
    from model_bridge.config import ParallelLayout, parse_omni_config
    from model_bridge.modeling import build_thinker
    from model_bridge.parallel import init_parallel

    if device == "cuda":
        torch.cuda.set_device(0)
    init_parallel(seed=0)
    spec = parse_omni_config(sync_config(layers, 0, tiny, None), where="test_multisource")
    with torch.device("meta"):
        model = build_thinker(spec, ParallelLayout(), torch.bfloat16, backend="torch", dummy_audio=False,
                              perform_initialization=False, build_audio=False)
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g) if p.is_floating_point() else p.zero_()
    return model, spec


def _on_device(device: str, tiny: bool, layers: int):
    """Rank body: the multi-source path on one device (owned shards -> buckets -> pack -> unpack ->
    merge, all on `device`) against `export_hf` of the same model, bit for bit; the release's widths
    unless `tiny`, random bf16 weights."""
    from megatron_grpo.weight_sync.buckets import default_bucket_bytes, pack_bucket, unpack_bucket
    from megatron_grpo.weight_sync.multisource import plan_buckets
    from megatron_grpo.weight_sync.shards import owned_shards
    from model_bridge.export import export_hf

    model, spec = random_model(device, tiny, layers)
    ref = dict(export_hf(model, spec))
    got, buckets, asm = {}, 0, ShardAssembler()
    for bucket in plan_buckets(owned_shards(model, spec), default_bucket_bytes(device)):
        buf = pack_bucket([e.tensor for e in bucket])
        assert buf.device.type == device
        views = unpack_bucket(buf, [e.wire_name for e in bucket], [e.tensor.dtype for e in bucket],
                              [list(e.tensor.shape) for e in bucket])
        for e, (_, t) in zip(bucket, views):
            for n, x in asm.add(e.meta(), t):
                r = ref[n]
                got[n] = (x.device.type == device and x.dtype == r.dtype and x.shape == r.shape
                          and torch.equal(x.contiguous().view(torch.uint8), r.contiguous().view(torch.uint8)))
        buckets += 1
    return {"names_equal": sorted(got) == sorted(ref), "differ": [n for n, ok in got.items() if not ok],
            "tensors": len(got), "buckets": buckets, "missing": asm.missing()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_multisource_packing_is_the_gather_paths_tensors_full_width():
    """Two full-width layers (the release's hidden size, 128 experts, vocab) on one GPU, 512 MiB buckets."""
    res = run_ranks(_on_device, 1, "cuda", False, 2, timeout=600)[0]
    assert res["names_equal"] and res["differ"] == [] and res["missing"] == [], res
    assert res["tensors"] > 2 * 3 * 128 and res["buckets"] >= 2, res
