"""Our export described for vLLM's nccl_m2n engine (weight_sync/m2n.py), checked with vLLM's own code.

On 2 real gloo ranks with the tiny checkpoint, at EP2, TP2 and TP2xEP2: every rank's description
(names, dtypes, shapes, placements, mesh) is the same, passes vLLM's validation (m2n_common's
checks, as its trainer and worker engines run them at init), and the HF tensors rebuilt from all
ranks' local pieces the way vLLM lays them out (m2n_common.resolve_layout: rank r of mesh (a, b) at
(r // b, r % b), one axis sharding a tensor dim in rank order, the other replicating) are the gather
path's tensors bit for bit (vLLM's fused expert tensors split as its MoE loader splits them: gate_up
halves along the row dim, per expert; the audio tower's convolutions viewed back from their
rank-3 form). Replicas of a piece agree bit for bit; vLLM's own init handshake takes our source.
PP2 is refused with the reason; bad descriptions get our error naming the parameter; a push without
nccl_m2n receivers is refused on every rank; mode selection says why it falls back or refuses.
On the real vLLM CPU server (slow): the m2n forms load into bit-identical parameters. On one GPU
(gpu): the full-width pieces on the device are `export_hf`'s tensors. The NCCL transfer itself
(`push_m2n`) needs 2 GPUs, vLLM and nccl-extensions: not run here.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from model_bridge.spawn import run_ranks

LAYOUTS = {"EP2": (1, 2, 1, 1), "TP2": (2, 1, 2, 1), "PP2": (1, 1, 1, 2), "TP2xEP2": (2, 2, 1, 1)}


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def _described(hf_dir, layouts):
    """Rank body: per layout, this rank's m2n description + local pieces; rank 0 also the gather
    path's HF tensors (name -> bytes)."""
    import torch.distributed as dist
    from test_multisource import _build

    from megatron_grpo.weight_sync.gather import export_to_rank0
    from megatron_grpo.weight_sync.m2n import M2NUnfit, describe, push_m2n, validate

    out = {}
    for tag, layout in layouts.items():
        model = _build(hf_dir, *layout)
        try:
            plan = describe(model)
            validate(plan, num_workers=2)
        except M2NUnfit as e:
            out[tag] = {"unfit": str(e)}
            sum(1 for _ in export_to_rank0(model))
            continue
        pieces = [(p.name, str(p.dtype), p.shape, p.placements, p.local()) for p in plan.pieces]
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, {"mesh": plan.mesh_dims, "split": plan.split, "pieces": pieces,
                                       "flattened": plan.flattened})
        stream = {n: _bytes(t) for n, t in export_to_rank0(model)}
        handshake = _handshake(plan)  # iterates the source: collective (the padded vocab's all-gather)
        if dist.get_rank() == 0:
            out[tag] = {"ranks": every, "gather": stream, "handshake": handshake}
    from megatron_grpo.weight_sync import WeightReceiver

    out["refused"] = []  # rank 0 without (nccl_m2n) receivers: every rank refuses, none waits in a collective
    for servers in ([], [WeightReceiver("http://127.0.0.1:9", backend="nccl")]):
        try:
            push_m2n(model, 1, servers if dist.get_rank() == 0 else None)
        except ValueError as e:
            out["refused"].append(str(e))
    from megatron_grpo.weight_sync import WeightPushError

    try:  # an nccl_m2n server that is not there: rank 0 fails at connect, before any rank joins NCCL
        push_m2n(model, 1, [WeightReceiver("http://127.0.0.1:9", backend="nccl_m2n")] if dist.get_rank() == 0
                 else None)
    except WeightPushError as e:
        out["dead_server"] = {"stage": e.stage, "msg": str(e), "states": e.states}
    from megatron_grpo.weight_sync.m2n import unfit_reason

    out["unfit_reason"] = unfit_reason(model)  # collective: one answer on every rank
    return out


def _handshake(plan):
    """What vLLM's trainer engine sends the workers at init (its own `_worker_init_info` over our
    source), through JSON, parsed by the worker's init-info class; the worker's per-parameter
    checks on it (its `init_transfer_engine` runs them after importing nccl.m2n)."""
    import json

    from vllm.distributed.weight_transfer.m2n_common import M2NMesh, resolve_layout, validate_layout
    from vllm.distributed.weight_transfer.m2n_engine import M2NWeightTransferInitInfo
    from vllm.distributed.weight_transfer.m2n_source import M2NWeightSource
    from vllm.distributed.weight_transfer.m2n_trainer import M2NTrainerInitInfo, M2NTrainerWeightTransferEngine

    source = make_source(plan)
    assert isinstance(source, M2NWeightSource)
    metas = source.metadata()
    assert [n for n, _ in source] == [m.name for m in metas]
    engine = M2NTrainerWeightTransferEngine(client=None, source=source, is_controller=True, num_trainer_ranks=2)
    engine._src_mesh, engine._metas = source.mesh(), metas
    init = M2NTrainerInitInfo(rank=0, world_size=4, num_trainer_ranks=2, master_address="127.0.0.1",
                              master_port=29999)
    info = M2NWeightTransferInitInfo(**json.loads(json.dumps(engine._worker_init_info(init))))
    src = M2NMesh(tuple(info.src_mesh_dims), 0)
    for name, dt, shape, placements in zip(info.names, info.dtype_names, info.shapes, info.src_placements):
        codes = None if placements is None else tuple(placements)
        validate_layout(*resolve_layout(src, codes, name), shape, "source")
        assert isinstance(getattr(torch, dt), torch.dtype)
    return {"params": len(info.names), "src_mesh": info.src_mesh_dims, "dst_mesh": info.dst_mesh_dims}


from megatron_grpo.weight_sync.m2n import make_source  # noqa: E402 - used by the rank bodies


def _rebuild(mesh_dims, placements, locals_by_rank):
    """The full tensor from every trainer rank's piece, laid out by vLLM's resolve_layout."""
    from vllm.distributed.weight_transfer.m2n_common import REPLICATE, M2NMesh, resolve_layout

    mesh, codes = resolve_layout(M2NMesh(tuple(mesh_dims), 0), placements)
    axis = next(a for a, c in enumerate(codes) if c != REPLICATE)
    parts: dict[int, torch.Tensor] = {}
    for r, x in enumerate(locals_by_rank):
        index = (r // mesh.dims[1], r % mesh.dims[1])[axis]
        if index in parts:  # a replica: the same bytes
            assert _bytes(parts[index]) == _bytes(x), (placements, r)
        parts[index] = x
    assert sorted(parts) == list(range(mesh.dims[axis]))
    return torch.cat([parts[i] for i in range(mesh.dims[axis])], dim=codes[axis])


def _checkpoint_form(name: str, full: torch.Tensor) -> dict[str, torch.Tensor]:
    """vLLM's fused expert tensors per expert, as its MoE loader reads them (chunk(2) of gate_up)."""
    if name.endswith(".experts.gate_up_proj"):
        base = name[: -len("gate_up_proj")]
        out = {}
        for e, x in enumerate(full.unbind(0)):
            gate, up = x.chunk(2, dim=0)
            out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        return out
    if name.endswith(".experts.down_proj"):
        base = name[: -len("down_proj")]
        return {f"{base}{e}.down_proj.weight": x for e, x in enumerate(full.unbind(0))}
    return {name: full}


@pytest.fixture(scope="module")
def described_ranks(tiny_ckpt):
    return run_ranks(_described, 2, str(tiny_ckpt), LAYOUTS, timeout=300)


@pytest.fixture(scope="module")
def described(described_ranks):
    return described_ranks[0]


@pytest.mark.parametrize("tag", ["EP2", "TP2", "TP2xEP2"])
def test_pieces_rebuild_the_gather_paths_tensors_bit_for_bit(described, tag):
    res = described[tag]
    assert "unfit" not in res, res
    ranks, stream = res["ranks"], res["gather"]
    assert all(r["mesh"] == ranks[0]["mesh"] and [p[:4] for p in r["pieces"]] == [p[:4] for p in ranks[0]["pieces"]]
               for r in ranks), tag  # one description on every rank
    mesh = ranks[0]["mesh"]
    assert mesh == (1, 2) and ranks[0]["split"] == {"EP2": "ep", "TP2": "tp", "TP2xEP2": "tp"}[tag]
    rebuilt, kinds = {}, {"replicated": 0, "sharded": 0, "fused": 0}
    for i, (name, dtype, shape, placements, _) in enumerate(ranks[0]["pieces"]):
        full = _rebuild(mesh, placements, [r["pieces"][i][4] for r in ranks])
        assert tuple(full.shape) == tuple(shape) and str(full.dtype) == dtype and len(shape) <= 3, name
        kinds["replicated" if placements is None else "sharded"] += 1
        kinds["fused"] += name.endswith(("gate_up_proj", "down_proj"))
        if name in ranks[0]["flattened"]:  # the servers' worker extension views it back
            full = full.view(ranks[0]["flattened"][name])
        for n, x in _checkpoint_form(name, full).items():
            assert n not in rebuilt, n
            rebuilt[n] = _bytes(x)
    # the audio tower's 4-D convolutions travel with their trailing dims merged (nccl_m2n: rank <= 3)
    assert sorted(ranks[0]["flattened"]) == [f"thinker.audio_tower.conv2d{i}.weight" for i in (1, 2, 3)]
    assert all(r["flattened"] == ranks[0]["flattened"] for r in ranks)
    assert sorted(rebuilt) == sorted(stream), (tag, sorted(set(rebuilt) ^ set(stream))[:5])
    assert [n for n in rebuilt if rebuilt[n] != stream[n]] == [], tag
    assert kinds["sharded"] > 0 and kinds["replicated"] > 0, kinds
    assert (kinds["fused"] > 0) == (tag != "TP2"), kinds  # EP: one fused gate_up and down per layer
    assert res["handshake"] == {"params": len(ranks[0]["pieces"]), "src_mesh": [1, 2], "dst_mesh": [2, 1]}


def test_push_without_nccl_m2n_receivers_is_refused_on_every_rank(described_ranks):
    why = ["push_m2n needs at least one WeightReceiver on rank 0",
           "push_m2n needs nccl_m2n receivers: ['http://127.0.0.1:9']"]
    assert described_ranks[0]["refused"] == why
    assert described_ranks[1]["refused"] == [f"(from trainer rank 0) {w}" for w in why]
    dead0, dead1 = described_ranks[0]["dead_server"], described_ranks[1]["dead_server"]
    assert dead0["stage"] == dead1["stage"] == "connect", (dead0, dead1)
    assert dead0["msg"].startswith("nccl_m2n weight push of version '1' failed at connect on http://127.0.0.1:9: "
                                   "ServerRequestError: GET http://127.0.0.1:9/get_world_size")
    assert dead0["states"] == {"http://127.0.0.1:9": "untouched"}
    assert dead1["msg"].startswith("(from trainer rank 0) trainer rank 0 failed at connect: ServerRequestError")
    # without nccl-extensions (CPU machines) the job cannot take the m2n path, on every rank alike
    assert described_ranks[0]["unfit_reason"] == described_ranks[1]["unfit_reason"]
    if importlib.util.find_spec("nccl") is None:
            assert described_ranks[0]["unfit_reason"].startswith("trainer rank 0: the nccl-extensions package "
                                                             "(nccl.m2n) is not importable")


def test_pipeline_parallel_is_refused_with_the_reason(described):
    assert described["PP2"]["unfit"].startswith("pipeline parallelism (PP=2): a stage's layers are held by its "
                                                 "ranks only")


def test_vllm_checks_name_the_parameter():
    from megatron_grpo.weight_sync.m2n import M2NPiece, M2NPlan, M2NUnfit, validate

    def plan(shape, placements=(-1, 0), dtype=torch.float32, mesh=(1, 2)):
        return M2NPlan(mesh, [M2NPiece("thinker.model.norm.weight", dtype, shape, placements, lambda: None)], "tp")

    validate(plan((8, 4)))
    with pytest.raises(M2NUnfit, match=r"parameter 'thinker.model.norm.weight' \[7, 4\] placed \(-1, 0\) on the "
                                       r"trainer mesh \(1, 2\): source layout shards dim 0 \(size 7\) over 2 ranks"):
        validate(plan((7, 4)))
    with pytest.raises(M2NUnfit, match="nccl_m2n needs one REPLICATE mesh axis"):
        validate(plan((8, 4), (0, 1), mesh=(2, 2)))
    with pytest.raises(M2NUnfit, match="has dtype torch.complex64, which nccl_m2n does not support"):
        validate(plan((8,), dtype=torch.complex64))
    with pytest.raises(M2NUnfit, match="has rank 4; nccl_m2n supports rank 1..3"):
        validate(plan((2, 2, 2, 2)))
    with pytest.raises(M2NUnfit, match="would feed 32 source shards into one replicated destination"):
        validate(plan((64, 4), mesh=(1, 32)))


def test_layouts_that_do_not_fit_say_why():
    from megatron_grpo.weight_sync.m2n import M2NUnfit, _split_size

    base = {"world": 8, "tp": 1, "ep": 1, "etp": 1, "pp": 1, "vpp": 1}
    assert _split_size(base) == ("none", 1)
    assert _split_size({**base, "tp": 2, "ep": 2}) == ("tp", 2) and _split_size({**base, "ep": 4}) == ("ep", 4)
    assert _split_size({**base, "tp": 4, "etp": 4}) == ("tp", 4)
    for bad, why in (({"tp": 2, "ep": 4}, "TP=2 and EP=4 differ"), ({"ep": 2, "etp": 2}, "EP=2 with ETP=2"),
                     ({"tp": 2, "etp": 4}, "TP=2 and ETP=4 differ"), ({"pp": 2}, r"pipeline parallelism \(PP=2\)")):
        with pytest.raises(M2NUnfit, match=why):
            _split_size({**base, **bad})


def test_mode_selects_m2n_only_on_nccl_m2n_servers_and_a_fitting_job(capsys):
    from megatron_grpo.weight_sync import multisource
    from megatron_grpo.weight_sync.multisource import resolve_mode

    multisource._FALLBACK_SAID.clear()
    fits = lambda: None  # noqa: E731
    assert resolve_mode("auto", "nccl_m2n", 4, m2n_unfit=fits) == resolve_mode("multisource", "nccl_m2n", 4,
                                                                                m2n_unfit=fits) == "m2n"
    assert resolve_mode("auto", "nccl_m2n", 1, m2n_unfit=fits) == "m2n"  # one rank: mesh (1, 1), all replicated
    assert capsys.readouterr().out == ""
    # nccl_m2n servers take nothing else: a job that does not fit, or mode gather, is refused up front
    why = "trainer rank 0: pipeline parallelism (PP=2): ..."
    with pytest.raises(ValueError, match=r"the servers run vLLM's nccl_m2n engine, which this job does not fit: "
                                         r"trainer rank 0: pipeline parallelism \(PP=2\): \.\.\.; start them with "
                                         r"the dense nccl engine \(rollout.weight_transfer: nccl"):
        resolve_mode("auto", "nccl_m2n", 4, m2n_unfit=lambda: why)
    with pytest.raises(ValueError, match="weight_sync.mode=gather cannot push into servers running vLLM's nccl_m2n"):
        resolve_mode("gather", "nccl_m2n", 4, m2n_unfit=fits)
    # dense nccl servers: multisource falls back to gather, saying why once; auto silently
    assert resolve_mode("auto", "nccl", 4) == "gather" and capsys.readouterr().out == ""
    assert resolve_mode("multisource", "nccl", 4) == resolve_mode("multisource", "nccl", 4) == "gather"
    assert capsys.readouterr().out == (
        "[weight_sync] mode=multisource falls back to gather on the nccl data plane: the servers run vLLM's dense "
        "nccl engine; on GPU the multi-source push goes through vLLM's nccl_m2n engine (servers started with "
        "--weight-transfer nccl_m2n, which needs the nccl-extensions package)\n")
    multisource._FALLBACK_SAID.clear()


def _m2n_form(weights: dict[str, torch.Tensor]) -> tuple[list, dict[str, list[int]]]:
    """Checkpoint tensors in the form `describe` sends them: a layer's experts as vLLM's fused
    gate_up_proj [E, 2I, H] / down_proj [E, H, I], rank-4 tensors with their trailing dims merged."""
    import re

    out, flat, experts = [], {}, {}
    for n, t in weights.items():
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", n)
        if m:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        elif t.dim() > 3:
            flat[n] = list(t.shape)
            out.append((n, t.reshape(*t.shape[:2], -1)))
        else:
            out.append((n, t))
    for prefix, parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        gate_up = [torch.cat([parts[e, "gate"], parts[e, "up"]]) for e in range(n)]
        out.append((f"{prefix}.gate_up_proj", torch.stack(gate_up)))
        out.append((f"{prefix}.down_proj", torch.stack([parts[e, "down"] for e in range(n)])))
    return out, flat


@pytest.mark.slow  # ~15 s with the session server up (three pushes of the tiny model)
def test_vllm_server_loads_the_m2n_forms_as_the_checkpoint_forms(vllm_server, tiny_ckpt):
    """What an nccl_m2n worker does with our pieces, on the real vLLM CPU server: every Qwen3-Omni
    parameter takes vLLM's fallback (full tensor -> `load_weights`), so loading the m2n forms (fused
    experts, flattened convolutions through `mgrpo_unflatten_on_load`) must leave every server
    parameter equal, bit for bit (vLLM's /weight_checker checksums), to loading the checkpoint forms."""
    import json
    import zlib

    import requests
    from conftest import checkpoint_weights, restore_checkpoint_weights

    from megatron_grpo.weight_sync import WeightReceiver, push

    url = vllm_server.url

    def checksums():
        r = requests.post(f"{url}/weight_checker", json={"action": "checksum"}, timeout=120)
        assert r.status_code == 200, r.text[:500]
        return r.json()["checksums"]

    def rpc(method, *args):
        r = requests.post(f"{url}/collective_rpc", json={"method": method, "args": list(args)}, timeout=60)
        assert r.status_code == 200, r.text[:500]
        return r.json()

    weights = {}
    for n, t in checkpoint_weights(tiny_ckpt):
        g = torch.Generator().manual_seed(zlib.crc32(n.encode()))
        weights[n] = t + 0.3 * t.float().std().nan_to_num() * torch.randn(t.shape, generator=g).to(t.dtype) \
            if t.is_floating_point() and t.numel() > 1 else t
    m2n_form, flat = _m2n_form(weights)
    assert sorted(flat) == [f"thinker.audio_tower.conv2d{i}.weight" for i in (1, 2, 3)]
    rx = WeightReceiver(url, backend="gloo", transfer_timeout_s=120)
    try:
        before = checksums()
        assert rpc("mgrpo_unflatten_on_load", json.dumps(flat))["results"] == [{"unflattened": 3}]
        push(m2n_form, "m2n-form", [rx])
        via_m2n = checksums()
        assert rpc("mgrpo_unflatten_on_load", "{}")["results"] == [{"unflattened": 0}]
        push(weights.items(), "checkpoint-form", [rx])
        via_checkpoint = checksums()
    finally:
        rx.close()
        rpc("mgrpo_unflatten_on_load", "{}")
        restore_checkpoint_weights(vllm_server)
    changed = [k for k in before if before[k] != via_checkpoint[k]]
    assert any("experts" in k for k in changed) and any("conv2d1" in k for k in changed), changed[:5]
    assert via_m2n == via_checkpoint, [k for k in via_m2n if via_m2n[k] != via_checkpoint.get(k)][:5]


def _full_width_on_device(layers: int, device: str = "cuda"):
    """Rank body: two full-width layers on one GPU (the release's widths, random bf16): every m2n
    piece, read on the device, against `export_hf` bit for bit (one rank: all replicated)."""
    from test_multisource import random_model

    from megatron_grpo.weight_sync.m2n import describe
    from model_bridge.export import export_hf

    model, spec = random_model(device, device == "cpu", layers)
    ref = dict(export_hf(model, spec))
    plan = describe(model, spec)
    differ = []
    for piece in plan.pieces:
        x, r = piece.local(), ref[piece.name]
        if not (x.device.type == device and piece.placements is None and tuple(x.shape) == piece.shape
                == tuple(r.shape) and _bytes(x) == _bytes(r)):
            differ.append(piece.name)
    return {"mesh": plan.mesh_dims, "names_equal": sorted(p.name for p in plan.pieces) == sorted(ref),
            "differ": differ, "pieces": len(plan.pieces)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_m2n_pieces_are_the_export_full_width():
    res = run_ranks(_full_width_on_device, 1, 2, timeout=600)[0]
    assert res["mesh"] == (1, 1) and res["names_equal"] and res["differ"] == [], res
    assert res["pieces"] > 2 * 3 * 128, res
