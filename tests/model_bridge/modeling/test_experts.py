"""Grouped-GEMM experts and the ``"torch"`` layer-spec backend against megatron's references.

CPU (fp32, gloo ranks):

* :func:`sort_by_expert` / :func:`unsort_combine` == megatron's ``permute`` / ``unpermute``
  (rows, probabilities, output and input gradients);
* :class:`TorchGroupedMLP` == ``SequentialMLP`` with the same weights (output, gradients of the
  tokens, the probabilities and every expert weight), with an expert that gets no token and with
  no token at all; bf16 on CPU within bf16 rounding;
* the Triton kernels of the fast path (fused SwiGLU, gather-sum combine, fused RoPE) through
  Triton's interpreter on CPU tensors == float64 eager math, and the whole thinker comparison
  below with those kernels on;
* the whole thinker with ``backend="torch"`` == ``backend="local"`` after ``load_hf`` of the same
  checkpoint (packed micro-batch with audio, logits and every parameter's gradient in HF naming)
  at EP1, EP2 (two ranks) and TP2 with ETP2 (+SP, two ranks); ``export_hf`` of the torch model gives
  back the checkpoint's tensors; the dist checkpoint of both backends has the same shards, and a
  checkpoint saved by one loads into the other.

GPU (``gpu`` marker): bf16 grouped experts vs the per-expert loop on CUDA at the real expert
shape, tolerances stated in the test.
"""
from __future__ import annotations

import time

import pytest
import torch

from model_bridge.spawn import run_ranks
from megatron_grpo.testing.grads import grads_by_hf_name

FP32_TOL = 2e-5  # relative to the largest magnitude of the compared tensor


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


# ------------------------------------------------------------------------------------------------
# permutation (no megatron parallel state needed)
# ------------------------------------------------------------------------------------------------

def _routing(T: int, E: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    top = logits.topk(k, dim=1)
    probs = torch.zeros(T, E).scatter(1, top.indices, torch.softmax(top.values, -1))
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, top.indices, True)
    return probs, routing_map


def test_sort_by_expert_matches_megatron_permute():
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    from model_bridge.modeling.permute import sort_by_expert, topk_indices, unsort_combine

    T, E, k, H = 37, 8, 3, 16
    probs, rmap = _routing(T, E, k, 0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g)
    w_out = torch.randn(T * k, H, generator=g)  # a per-row transform between permute and unpermute
    gy = torch.randn(T, H, generator=g)

    def run(ours: bool):
        xx = x.clone().requires_grad_()
        pp = probs.clone().requires_grad_()
        if ours:
            rows, rprobs, plan = sort_by_expert(xx, topk_indices(rmap, k), pp)
        else:
            rows, rprobs, sorted_idx, *_ = permute(xx, rmap, probs=pp, num_out_tokens=T * k)
        y = rows * w_out * rprobs.unsqueeze(-1)
        out = unsort_combine(y, plan) if ours else unpermute(y, sorted_idx, restore_shape=xx.shape, routing_map=rmap)
        out.backward(gy)
        return rows.detach(), rprobs.detach(), out.detach(), xx.grad, pp.grad

    ours, ref = run(True), run(False)
    for name, a, b in zip(("rows", "probs", "out", "grad_x", "grad_probs"), ours, ref):
        assert a.shape == b.shape, name
        assert _rel(a, b) < 1e-6, f"{name}: rel diff {_rel(a, b):.2e}"


# ------------------------------------------------------------------------------------------------
# experts module vs SequentialMLP (one rank)
# ------------------------------------------------------------------------------------------------

def _expert_config(dtype=torch.float32, E=4, H=32, F=24):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=F, moe_ffn_hidden_size=F,
        num_moe_experts=E, moe_router_topk=2, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=True,
        bias_activation_fusion=False, gradient_accumulation_fusion=False, hidden_dropout=0.0,
        attention_dropout=0.0, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False)


def _pair(config, device="cpu"):
    """(SequentialMLP, TorchGroupedMLP) with identical weights."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from model_bridge.modeling.experts import TorchGroupedMLP

    pgs = ProcessGroupCollection.use_mpu_process_groups()
    E = config.num_moe_experts
    ref = SequentialMLP(E, config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                        pg_collection=pgs)
    ours = TorchGroupedMLP(E, config, pg_collection=pgs)
    with torch.no_grad():
        for e, ex in enumerate(ref.local_experts):
            ours.weight1[e].copy_(ex.linear_fc1.weight)
            ours.weight2[e].copy_(ex.linear_fc2.weight)
    return ref.to(device), ours.to(device)


def _compare_experts(ref, ours, counts, dtype, device, seed=0):
    H = ref.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    N = sum(counts)
    x = torch.randn(N, H, generator=g).to(device, dtype)
    probs = torch.rand(N, generator=g).to(device)
    gy = torch.randn(N, H, generator=g).to(device, dtype)
    tpe = torch.tensor(counts)
    res = []
    for mod in (ref, ours):
        mod.zero_grad(set_to_none=True)
        xx, pp = x.clone().requires_grad_(), probs.clone().requires_grad_()
        out, bias = mod(xx, tpe, pp)
        assert bias is None
        out.backward(gy)
        if mod is ref:
            w1 = torch.stack([ex.linear_fc1.weight.grad for ex in mod.local_experts])
            w2 = torch.stack([ex.linear_fc2.weight.grad for ex in mod.local_experts])
        else:
            w1, w2 = mod.weight1.grad, mod.weight2.grad
        res.append({"out": out.detach(), "grad_x": xx.grad, "grad_probs": pp.grad, "grad_w1": w1, "grad_w2": w2})
    return {k: _rel(res[1][k], res[0][k]) for k in res[0]}


def _rank_experts_vs_sequential():
    from model_bridge.parallel import destroy_parallel, init_parallel

    torch.set_num_threads(1)
    init_parallel(seed=7)
    out = {}
    ref, ours = _pair(_expert_config())
    out["fp32"] = _compare_experts(ref, ours, [5, 0, 9, 3], torch.float32, "cpu")
    out["fp32_one_expert_all"] = _compare_experts(ref, ours, [0, 0, 11, 0], torch.float32, "cpu", seed=1)
    # no token at all: zero output rows, zero (not None) weight grads
    ours.zero_grad(set_to_none=True)
    x = torch.zeros(0, ref.config.hidden_size, requires_grad=True)
    y, _ = ours(x, torch.zeros(4, dtype=torch.long), torch.zeros(0, requires_grad=True))
    (y.sum() + 0.0).backward()
    out["empty"] = (tuple(y.shape), ours.weight1.grad is not None and float(ours.weight1.grad.abs().sum()) == 0.0)
    refb, oursb = _pair(_expert_config(torch.bfloat16))
    out["bf16"] = _compare_experts(refb, oursb, [7, 2, 0, 12], torch.bfloat16, "cpu", seed=2)
    out["attrs"] = {n: (p.allreduce, p.tensor_model_parallel, p.partition_dim) for n, p in ours.named_parameters()}
    destroy_parallel()
    return out


def test_grouped_mlp_matches_sequential_mlp():
    res = run_ranks(_rank_experts_vs_sequential, 1, timeout=300)[0]
    print(f"\n[experts vs SequentialMLP] {res}")
    for case in ("fp32", "fp32_one_expert_all"):
        for k, v in res[case].items():
            assert v < FP32_TOL, f"{case} {k}: rel diff {v:.2e}"
    for k, v in res["bf16"].items():  # both in bf16; different rounding points -> a few bf16 ulps
        assert v < 3e-2, f"bf16 {k}: rel diff {v:.2e}"
    assert res["empty"] == ((0, 32), True)
    assert res["attrs"] == {"weight1": (True, True, 1), "weight2": (True, True, 2)}


def _rank_triton_glu_interpreted():
    """Triton's interpreter (CPU tensors): the fused kernels == float64 eager math."""
    import model_bridge.modeling.experts as ex
    import model_bridge.modeling.permute as pm

    from model_bridge.modeling._triton import TRITON_ON_CPU

    if ex._triton_kernels() is None or not TRITON_ON_CPU:
        return None
    g = torch.Generator().manual_seed(0)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for n, f, has_p in ((37, 24, True), (5, 768, True), (9, 40, False), (0, 16, True)):
            h = torch.randn(n, 2 * f, generator=g).to(dtype)
            p = torch.rand(n, generator=g) if has_p else None
            go = torch.randn(n, f, generator=g).to(dtype)
            o = ex._glu_fwd_triton(h, p)
            dh, dp = ex._glu_bwd_triton(h, p, go)
            hr = h.double().requires_grad_()
            pr = p.double().requires_grad_() if has_p else None
            gg, uu = hr.chunk(2, -1)
            a = torch.nn.functional.silu(gg) * uu
            if has_p:
                a = a * pr[:, None]
            a.backward(go.double())
            errs = [_rel(o, a.detach()) if n else 0.0, _rel(dh, hr.grad) if n else 0.0]
            if has_p and n:
                errs.append(_rel(dp, pr.grad))
            out[f"{dtype}-{n}x{f}-{'p' if has_p else 'nop'}"] = max(errs)
    # gather-sum (the combine of the k expert rows of each token)
    for dtype in (torch.float32, torch.bfloat16):
        T, k, H = 13, 3, 40
        y = torch.randn(T * k + 5, H, generator=g).to(dtype)
        idx = torch.randperm(T * k, generator=g)
        got = pm.gather_sum(y, idx, k)
        ref = y.double().index_select(0, idx).view(T, k, H).sum(1)
        out[f"gather_sum-{dtype}"] = _rel(got, ref)
        # empty slots (-1), as the EP exchange has for tokens with fewer than k rows on a rank
        idx_e = idx.clone()
        idx_e[::4] = -1
        got = pm.gather_sum(y, idx_e, k, has_empty=True)
        keep = (idx_e >= 0).double().view(T, k, 1)
        ref = (y.double().index_select(0, idx_e.clamp(min=0)).view(T, k, H) * keep).sum(1)
        out[f"gather_sum_empty-{dtype}"] = _rel(got, ref)
    # fused RoPE vs megatron's unfused BSHD RoPE (float64 reference), forward and backward
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    import model_bridge.modeling.rope as rp

    for dtype in (torch.float32, torch.bfloat16):
        T, n, d = 11, 5, 16
        x = torch.randn(T, n, d, generator=g).to(dtype)
        freqs = torch.randn(T, 1, 1, d, generator=g)
        go = torch.randn(T, n, d, generator=g).to(dtype)
        cos, sin = rp._cos_sin(freqs, 1.0)
        xx = x.clone().requires_grad_()
        y = rp._FusedRope.apply(xx, cos, sin)
        y.backward(go)
        xr = x.double().requires_grad_()
        yr = _apply_rotary_pos_emb_bshd(xr.unsqueeze(1), freqs.double()).squeeze(1)
        yr.backward(go.double())
        out[f"rope-{dtype}"] = max(_rel(y, yr.detach()), _rel(xx.grad, xr.grad))
    return out


def test_triton_weighted_swiglu_kernels_interpreted():
    pytest.importorskip("triton")
    res = run_ranks(_rank_triton_glu_interpreted, 1, timeout=300,
                    env={"TRITON_INTERPRET": "1", "MGRPO_TRITON_GLU_CPU": "1"})[0]
    if res is None:
        pytest.skip("Triton's interpreter is not usable here")
    print(f"\n[triton swiglu, interpreted] {res}")
    for k, v in res.items():  # fp32: rounding only; bf16: one rounding of the output (2^-8)
        assert v < (1e-6 if "float32" in k else 8e-3), f"{k}: {v:.2e}"


@pytest.mark.parametrize("qk_norm_rope", [False, True], ids=["rope", "qk_norm_rope"])
def test_torch_backend_with_triton_kernels_interpreted(tiny_ckpt, qk_norm_rope):
    """The thinker-level comparison of the next test with the Triton paths on (fused SwiGLU,
    gather-sum combine, fused RoPE; or the q/k RMSNorms fused into the RoPE), run by Triton's
    interpreter on CPU tensors."""
    pytest.importorskip("triton")
    v = run_ranks(_rank_backends, 1, str(tiny_ckpt), 1, 1, None, timeout=900,
                  env={"TRITON_INTERPRET": "1", "MGRPO_TRITON_GLU_CPU": "1",
                       "MGRPO_TRITON_QK_NORM_ROPE": "1" if qk_norm_rope else "0"})[0]
    print(f"\n[torch vs local backend, Triton interpreted] logits rel {v['logits_rel']:.2e}, grads rel max "
          f"{v['grad_rel_max']:.2e}, worst {v['grad_worst']}, triton paths {v['triton_paths']}")
    assert v["triton_paths"] == {"glu": True, "gather_sum": True, "rope": not qk_norm_rope,
                                 "norm_rope": qk_norm_rope, "grouped_q": qk_norm_rope, "routing": False,
                                 "routing_aux": True, "counting_sort": True}, v["triton_paths"]
    assert v["logits_rel"] < FP32_TOL and v["grad_rel_max"] < 1e-4, v


# ------------------------------------------------------------------------------------------------
# the whole thinker: torch backend == local backend (EP1, EP2, TP2/ETP2)
# ------------------------------------------------------------------------------------------------

def _packed_batch(spec, device="cpu"):
    """(ids [1, T], positions [3, 1, T], PackedSeqParams, features, feature lens, T) of 3 samples + padding."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from model_bridge.modeling.audio import audio_output_lengths
    from model_bridge.modeling.thinker import mrope_position_ids

    g = torch.Generator().manual_seed(3)
    frames = [130]
    n_audio = int(audio_output_lengths(torch.tensor(frames[0]), spec.audio.n_window))
    samples = [
        torch.randint(0, 400, (19,), generator=g).tolist(),
        torch.randint(0, 400, (5,), generator=g).tolist() + [spec.audio_start_token_id]
        + [spec.audio_token_id] * n_audio + [spec.audio_end_token_id] + torch.randint(0, 400, (4,), generator=g).tolist(),
        torch.randint(0, 400, (11,), generator=g).tolist(),
    ]
    lens = [len(s) for s in samples]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    T = (int(cu[-1]) + 3 + 1) // 2 * 2  # trailing padding; even for TP2 + SP
    ids = torch.tensor([sum(samples, []) + [0] * (T - int(cu[-1]))])
    pos = mrope_position_ids(ids, spec, cu_seqlens=cu).unsqueeze(1)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu.to(device), cu_seqlens_kv=cu.to(device),
                          max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
    feats = torch.randn(spec.audio.num_mel_bins, frames[0], generator=g)
    return ids.to(device), pos.to(device), psp, feats.to(device), torch.tensor(frames).to(device), int(cu[-1])


def _rank_backends(hf_dir: str, tp: int, ep: int, check_ckpt_dir: str | None):
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from model_bridge.checkpoint import load_model, model_sharded_state_dict, save_model
    from model_bridge.config import ParallelLayout, read_omni_config
    from model_bridge.export import export_hf
    from model_bridge.io import SafetensorsReader
    from model_bridge.load import load_hf
    from model_bridge.modeling.thinker import build_thinker, gather_logits
    from model_bridge.parallel import destroy_parallel, init_parallel

    torch.set_num_threads(1)
    init_parallel(tp=tp, ep=ep, seed=1234)
    spec = read_omni_config(hf_dir)
    V = spec.text.vocab_size
    ids, pos, psp, feats, flens, n_real = _packed_batch(spec)
    g = torch.Generator().manual_seed(11)
    w_logits = torch.randn(ids.shape[1], V, generator=g)
    w_logits[n_real:] = 0.0
    res: dict = {"layout": (tp, ep)}
    import model_bridge.modeling.experts as ex
    import model_bridge.modeling.permute as pm
    import model_bridge.modeling.rope as rp

    import model_bridge.modeling.router as rt

    used = {"glu": False, "gather_sum": False, "rope": False, "norm_rope": False, "grouped_q": False,
            "routing": False, "routing_aux": False, "counting_sort": False}
    orig = (ex._glu_fwd_triton, pm.gather_sum, rp._rope_launch, rp._norm_rope_fwd)
    orig_routing = (rt.fused_topk_routing, pm._sort_plan_counting, rt.fused_topk_routing_with_aux)

    def spy(key, fn):
        def wrapped(*a, **k):
            used[key] = True
            return fn(*a, **k)
        return wrapped

    ex._glu_fwd_triton, rp._rope_launch = spy("glu", orig[0]), spy("rope", orig[2])
    def norm_rope_spy(x, w, *a, **k):  # the query read in place: [T, groups, hpg * d], heads wider than w
        used["grouped_q"] |= x.shape[-1] != w.shape[0]
        return spy("norm_rope", orig[3])(x, w, *a, **k)

    rp._norm_rope_fwd = norm_rope_spy
    rt.fused_topk_routing, pm._sort_plan_counting = spy("routing", orig_routing[0]), spy("counting_sort", orig_routing[1])
    rt.fused_topk_routing_with_aux = spy("routing_aux", orig_routing[2])  # training with the aux loss on
    ex_gs = pm._triton_gather_sum_kernel

    def gs_spy():
        kern = ex_gs()
        if kern is not None:
            used["gather_sum"] = True
        return kern

    pm._triton_gather_sum_kernel = gs_spy
    models, outs = {}, {}
    for backend in ("local", "torch"):
        model = build_thinker(spec, ParallelLayout(tp=tp, ep=ep), torch.float32, backend=backend)
        load_hf(model, hf_dir)
        model.train()
        logits = gather_logits(model(ids, pos, psp, audio_features=feats, audio_feature_lens=flens), V)
        (logits * w_logits).sum().backward()
        outs[backend] = {"logits": logits.detach()[:n_real], "grads": grads_by_hf_name(model, spec)}
        models[backend] = model
    res["triton_paths"] = dict(used)
    ex._glu_fwd_triton, pm._triton_gather_sum_kernel, rp._rope_launch, rp._norm_rope_fwd = orig[0], ex_gs, *orig[2:]
    rt.fused_topk_routing, pm._sort_plan_counting, rt.fused_topk_routing_with_aux = orig_routing
    res["expert_param_names"] = sorted({n.split("mlp.experts.")[1] for n, _ in models["torch"].named_parameters()
                                        if "mlp.experts." in n})
    res["logits_rel"] = _rel(outs["torch"]["logits"], outs["local"]["logits"])
    gl, gt = outs["local"]["grads"], outs["torch"]["grads"]
    res["grad_keys_equal"] = sorted(gl) == sorted(gt)
    res["n_grads"] = len(gt)
    # per tensor, relative to its own scale or 1e-3 of the largest gradient (some are ~0 by symmetry:
    # the audio k_proj bias, whose exact gradient is zero, holds rounding noise in both)
    gmax = max((v.abs().max().item() for v in gl.values()), default=0.0)
    errs = {k: (gt[k] - gl[k]).abs().max().item() / max(gl[k].abs().max().item(), 1e-3 * gmax, 1e-30) for k in gl}
    res["grad_rel_max"] = max(errs.values(), default=0.0)
    res["grad_worst"] = [(k, f"{errs[k]:.2e}") for k in sorted(errs, key=errs.get)[-3:]]
    res["expert_grad_nonzero"] = any(gt[k].abs().max() > 0 for k in gt if ".mlp.experts." in k)

    # export_hf of the torch model gives back the checkpoint's tensors (ExpertStacked merge + names)
    reader = SafetensorsReader(hf_dir)
    exported = dict(export_hf(models["torch"], spec))
    res["export_mismatch"] = [k for k, v in exported.items() if not torch.equal(v, reader.read(k).to(v.dtype))]
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(exported))
    all_names = set().union(*map(set, names))
    owned = {k for k in reader.keys() if k.startswith(("thinker.model.", "thinker.lm_head.", "thinker.audio_tower."))}
    res["export_covers_checkpoint"] = all_names == owned

    # dist checkpoint: identical shards (keys, offsets, replica ids, data) for both backends
    def shards(model):
        sd = model_sharded_state_dict(model)
        apply_factories(sd)
        flat = {}

        def visit(x):
            if isinstance(x, dict):
                for v in x.values():
                    visit(v)
            elif isinstance(x, (list, tuple)):
                for v in x:
                    visit(v)
            elif isinstance(x, ShardedTensor) and ".mlp." in x.key:
                flat[(x.key, tuple(x.global_offset))] = (tuple(x.global_shape), tuple(x.local_shape),
                                                         tuple(x.replica_id), x.prepend_axis_num, x.data.clone())
        visit(sd)
        return flat

    sl, st = shards(models["local"]), shards(models["torch"])
    res["shard_keys_equal"] = sorted(sl) == sorted(st)
    res["n_mlp_shards"] = len(st)
    res["shard_meta_equal"] = all(sl[k][:4] == st[k][:4] for k in sl if k in st)
    res["shard_data_equal"] = all(torch.equal(sl[k][4], st[k][4]) for k in sl if k in st)

    if check_ckpt_dir is not None:  # save with the local backend, load into a fresh torch-backend model
        save_model(models["local"], check_ckpt_dir)
        fresh = build_thinker(spec, ParallelLayout(tp=tp, ep=ep), torch.float32, backend="torch")
        load_model(fresh, check_ckpt_dir)
        a = dict(export_hf(fresh, spec))
        res["ckpt_roundtrip_mismatch"] = [k for k, v in a.items() if not torch.equal(v, exported[k])]
    destroy_parallel()
    return res


@pytest.mark.parametrize("tp,ep", [pytest.param(1, 1, id="ep1"), pytest.param(1, 2, id="ep2"),
                                   pytest.param(2, 1, id="tp2-etp2-sp")])
def test_torch_backend_matches_local_spec(tiny_ckpt, tmp_path, tp, ep):
    world = max(tp, ep * tp)
    t0 = time.time()
    ckpt = str(tmp_path / "ckpt") if (tp, ep) in ((1, 1), (1, 2)) else None
    values = run_ranks(_rank_backends, world, str(tiny_ckpt), tp, ep, ckpt, timeout=900)
    print(f"\n[torch vs local backend tp{tp} ep{ep}] " + "; ".join(
        f"rank {i}: logits rel {v['logits_rel']:.2e}, grads rel max {v['grad_rel_max']:.2e} over {v['n_grads']}, "
        f"{v['n_mlp_shards']} mlp shards, worst grads {v['grad_worst']}" for i, v in enumerate(values)) + f" ({time.time() - t0:.1f} s)")
    assert sum(v["n_grads"] for v in values) > 0 and any(v["expert_grad_nonzero"] for v in values)
    for v in values:
        assert v["expert_param_names"] == ["weight1", "weight2"], v["expert_param_names"]
        assert v["logits_rel"] < FP32_TOL, v
        assert v["grad_keys_equal"]
        assert v["grad_rel_max"] < 1e-4, v  # fp32; summation order differs (sorted vs scatter_add)
        assert v["export_mismatch"] == [], v["export_mismatch"][:5]
        assert v["export_covers_checkpoint"]
        assert v["shard_keys_equal"] and v["shard_meta_equal"] and v["shard_data_equal"], v
        if ckpt is not None:
            assert v["ckpt_roundtrip_mismatch"] == [], v["ckpt_roundtrip_mismatch"][:5]


def test_auto_backend_resolution():
    from model_bridge.modeling.specs import available_backends, resolve_backend, te_available

    assert "torch" in available_backends()
    assert resolve_backend("torch") == "torch"
    want = "te" if te_available() else ("torch" if torch.cuda.is_available() else "local")
    assert resolve_backend("auto") == want


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------

def _rank_experts_cuda():
    from model_bridge.modeling.experts import grouped_mm_available
    from model_bridge.parallel import destroy_parallel, init_parallel

    init_parallel(seed=7)
    out = {"grouped_mm_bf16": grouped_mm_available("cuda", torch.bfloat16),
           "grouped_mm_fp32": grouped_mm_available("cuda", torch.float32)}
    # the release's expert shape, 16 local experts (128 / EP8), uneven counts with an empty expert
    E, H, F = 16, 2048, 768
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 700, (E,), generator=g)
    counts[3] = 0
    for dtype, key in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        ref, ours = _pair(_expert_config(dtype, E=E, H=H, F=F), "cuda")
        out[key] = _compare_experts(ref, ours, counts.tolist(), dtype, "cuda", seed=3)
    destroy_parallel()
    return out


@pytest.mark.gpu
def test_grouped_mlp_cuda_matches_sequential_mlp():
    res = run_ranks(_rank_experts_cuda, 1, timeout=600)[0]
    print(f"\n[experts cuda] {res}")
    assert res["grouped_mm_bf16"], "F.grouped_mm is not usable for bf16 on this GPU"
    for k, v in res["fp32"].items():  # TF32 off by default for matmuls: fp32 accumulation order only
        assert v < 1e-4, f"fp32 {k}: rel diff {v:.2e}"
    for k, v in res["bf16"].items():  # bf16 inputs/outputs, fp32 accumulation in both; rounding points differ
        assert v < 2e-2, f"bf16 {k}: rel diff {v:.2e}"


def test_expert_offsets_use_the_attached_sums_and_compute_them_otherwise():
    from model_bridge.modeling.experts import expert_offsets, with_offsets

    counts = torch.tensor([3, 0, 5, 2], dtype=torch.int32)
    attached = torch.tensor([3, 3, 8, 10], dtype=torch.int32)
    assert expert_offsets(with_offsets(counts.clone(), attached), torch.device("cpu")) is attached
    got = expert_offsets(counts, torch.device("cpu"))
    assert got.dtype == torch.int32 and got.tolist() == [3, 3, 8, 10]
    assert expert_offsets([3, 0, 5, 2], torch.device("cpu")).tolist() == [3, 3, 8, 10]
