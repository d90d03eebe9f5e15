"""megatron-core on CPU (gloo) through model_bridge.mcore_cpu / model_bridge.parallel.

A tiny GPT-MoE (megatron GPTModel, local spec, fp32, RMSNorm, qk-norm, GQA, 4 experts top-2,
2 layers) is run once on a single rank; the same weights, resharded into each rank's layout, are
then run at TP2 + sequence parallel (expert TP 2), EP2 (alltoall dispatcher) and PP2 (1F1B, two
micro-batches) on two real gloo processes, with megatron DDP + finalize_model_grads. Loss and
every gradient must match the single-rank run.
"""
from __future__ import annotations

import re

import pytest

from model_bridge.spawn import run_ranks

VOCAB, SEQ, BATCH = 128, 16, 2
TOL = 1e-6
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}  # the CPU path, also on a CUDA machine


# ------------------------------------------------------------------------------------------------
# helpers that run inside the rank processes (top level: pickled by name)
# ------------------------------------------------------------------------------------------------

def _config(tp=1, ep=1, etp=None, pp=1):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        ffn_hidden_size=128, normalization="RMSNorm", layernorm_epsilon=1e-6, qk_layernorm=True,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_grouped_gemm=False,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.0,
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1, expert_model_parallel_size=ep,
        pipeline_model_parallel_size=pp,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        bf16=False, fp16=False, init_method_std=0.02,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
    )
    if etp is not None:
        kw["expert_tensor_parallel_size"] = etp
    return TransformerConfig(**kw)


def _model(cfg):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    spec = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, moe_grouped_gemm=False,
                                    qk_layernorm=True, normalization="RMSNorm")
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=SEQ, pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage(), position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)


def _batch():
    import torch

    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    pos = torch.arange(SEQ).expand(BATCH, SEQ).contiguous()
    return tokens, labels, pos


def _reference_run():
    """Single rank: loss, params and grads of the tiny model on the full batch (no DDP)."""
    from model_bridge.mcore_cpu import apply_cpu_patches
    from model_bridge.parallel import destroy_parallel, init_parallel

    layout = init_parallel(seed=1234)
    patches, again = apply_cpu_patches(), apply_cpu_patches()
    model = _model(_config())
    tokens, labels, pos = _batch()
    loss = model(tokens, pos, attention_mask=None, labels=labels).double().mean()
    loss.backward()
    out = {
        "loss": loss.item(),
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
        "patches": patches, "patches_again": again, "backend": layout.backend,
    }
    destroy_parallel()
    return out


def _global_name(name, layer_offset, expert_offset):
    name = re.sub(r"decoder\.layers\.(\d+)\.",
                  lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name)
    return re.sub(r"local_experts\.(\d+)\.",
                  lambda m: f"local_experts.{int(m.group(1)) + expert_offset}.", name)


def _shard(name, full, local_shape, layout):
    """This rank's piece of a single-rank tensor (megatron's TP layout: contiguous chunks, the
    gated fc1 [gate; up] chunked per half)."""
    if tuple(full.shape) == tuple(local_shape):
        return full
    rank, size = (layout.etp_rank, layout.etp) if ".experts." in name else (layout.tp_rank, layout.tp)
    dims = [d for d, (a, b) in enumerate(zip(full.shape, local_shape)) if a != b]
    assert len(dims) == 1 and full.shape[dims[0]] == size * local_shape[dims[0]], \
        (name, tuple(full.shape), tuple(local_shape))
    if name.endswith("linear_fc1.weight"):
        return __import__("torch").cat([half.chunk(size, 0)[rank] for half in full.chunk(2, 0)], 0)
    return full.chunk(size, dims[0])[rank]


def _setup(ref, tp=1, ep=1, etp=None, pp=1, load_reference=True):
    """init_parallel + this rank's model, holding the reference weights resharded (by default)."""
    import torch

    from model_bridge.parallel import init_parallel

    layout = init_parallel(tp=tp, ep=ep, etp=etp, pp=pp, seed=1234)
    cfg = _config(tp=tp, ep=ep, etp=etp, pp=pp)
    module = _model(cfg)
    layer_offset = module.decoder.layers[0].layer_number - 1
    expert_offset = layout.ep_rank * cfg.num_moe_experts // ep

    def ref_of(store, name, shape):
        return _shard(name, store[_global_name(name, layer_offset, expert_offset)], shape, layout)

    if load_reference:
        with torch.no_grad():
            for n, p in module.named_parameters():
                p.copy_(ref_of(ref["params"], n, p.shape))
    return layout, cfg, module, ref_of


def _ddp(cfg, module, distributed_optimizer=False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=distributed_optimizer)
    model = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=module)
    cfg.finalize_model_grads_func = finalize_model_grads
    model.zero_grad_buffer()
    return model


def _forward_backward(model, layout):
    """One forward/backward of the global batch (split over data-parallel ranks; micro-batches of
    one sequence under PP), grads finalized; returns the global mean loss (None off the last stage)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens, labels, pos = _batch()
    per = BATCH // layout.dp  # data-parallel ranks take different sequences
    rows = slice(layout.dp_rank * per, (layout.dp_rank + 1) * per)
    tokens, labels, pos = tokens[rows], labels[rows], pos[rows]

    if layout.pp == 1:
        local = model(tokens, pos, attention_mask=None, labels=labels).double().mean()
        local.backward()  # DDP averages over the data-parallel ranks
        finalize_model_grads([model])
        total = local.detach().clone()
        dist.all_reduce(total, group=ps.get_data_parallel_group())
        return (total / layout.dp).item()

    micro = [dict(tokens=tokens[i:i + 1], labels=labels[i:i + 1], pos=pos[i:i + 1])
             for i in range(tokens.shape[0])]

    def forward_step(data_iterator, chunk):
        d = next(data_iterator)
        out = chunk(d["tokens"], d["pos"], attention_mask=None, labels=d["labels"])

        def loss_func(output):
            mb_loss = output.double().mean()
            return mb_loss, {"loss": mb_loss.detach().clone()}  # the schedule divides by #micro

        return out, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro), model=[model],
        num_microbatches=len(micro), seq_length=SEQ, micro_batch_size=1, forward_only=False)
    if not ps.is_pipeline_last_stage():
        return None
    return torch.stack([x["loss"] for x in losses]).mean().item()


def _parallel_run(ref, tp=1, ep=1, etp=None, pp=1):
    """Reference weights in this rank's layout, one DDP forward/backward; compare with ref."""
    from model_bridge.parallel import destroy_parallel

    layout, cfg, module, ref_of = _setup(ref, tp=tp, ep=ep, etp=etp, pp=pp)
    model = _ddp(cfg, module)
    loss = _forward_backward(model, layout)

    worst, worst_name, missing = 0.0, None, []
    for n, p in module.named_parameters():
        grad = getattr(p, "main_grad", None)
        if grad is None:
            missing.append(n)
            continue
        diff = (grad - ref_of(ref["grads"], n, p.shape)).abs().max().item()
        if diff >= worst:
            worst, worst_name = diff, n
    result = dict(rank=layout.rank, loss=loss, max_grad_diff=worst, worst=worst_name,
                  missing=missing, n_params=sum(1 for _ in module.parameters()),
                  layout=(layout.tp, layout.pp, layout.ep, layout.etp, layout.dp))
    destroy_parallel()
    return result


def _optimizer_and_checkpoint_run(ref, ckpt_dir):
    """EP2: dist_checkpointing save of the reference weights, then one distributed-optimizer Adam
    step (compared with the closed-form first step); TP2+SP: load that checkpoint into a fresh model."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from model_bridge.parallel import destroy_parallel

    lr, eps, clip = 1e-3, 1e-4, 1.0
    out = {}
    layout, cfg, module, ref_of = _setup(ref, ep=2)
    dist_checkpointing.save(module.sharded_state_dict(), ckpt_dir)

    model = _ddp(cfg, module, distributed_optimizer=True)
    out["loss"] = _forward_backward(model, layout)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, adam_eps=eps, clip_grad=clip,
                        bf16=False, fp16=False, params_dtype=torch.float32,
                        use_distributed_optimizer=True), [model])
    _, grad_norm, _ = opt.step()
    ref_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in ref["grads"].values())).item()
    scale = min(1.0, clip / (ref_norm + 1e-6))
    worst = 0.0
    for n, p in module.named_parameters():
        g = ref_of(ref["grads"], n, p.shape) * scale
        expected = ref_of(ref["params"], n, p.shape) - lr * g / (g.abs() + eps)
        worst = max(worst, (p.detach() - expected).abs().max().item())
    out.update(grad_norm=grad_norm, ref_norm=ref_norm, max_step_diff=worst,
               optimizer=type(opt).__name__)
    destroy_parallel(destroy_process_group=False)

    layout, cfg, module, ref_of = _setup(ref, tp=2, load_reference=False)
    state = dist_checkpointing.load(module.sharded_state_dict(), ckpt_dir)
    module.load_state_dict(state, strict=False)
    out["max_load_diff"] = max((p.detach() - ref_of(ref["params"], n, p.shape)).abs().max().item()
                               for n, p in module.named_parameters())
    destroy_parallel()
    return out


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference():
    return run_ranks(_reference_run, 1, timeout=240, env=CPU_ONLY)[0]


def test_reference_run_and_patches(reference):
    assert reference["backend"] == "gloo"
    assert reference["patches"] == reference["patches_again"]  # idempotent
    for name in ("cuda.current_device", "cuda_device_to_cpu_mode", "rng_tracker",
                 "alltoall_dispatcher_dtoh", "torch_norm.sequence_parallel"):
        assert name in reference["patches"]
    assert 4.0 < reference["loss"] < 6.0  # ~ln(128) for a fresh model


def _check(results, reference, expect_layout):
    for r in results:
        assert r["layout"] == expect_layout
        assert not r["missing"], r
        assert r["max_grad_diff"] <= TOL, r
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert losses, results
    for loss in losses:
        assert abs(loss - reference["loss"]) <= TOL, (loss, reference["loss"])
    print("\n" + "; ".join(f"rank {r['rank']}: |dloss|="
                           f"{abs(r['loss'] - reference['loss']) if r['loss'] is not None else 'n/a'}"
                           f" max|dgrad|={r['max_grad_diff']:.2e} ({r['worst']})" for r in results))


def test_tp2_sequence_parallel_matches_single_rank(reference):
    results = run_ranks(_parallel_run, 2, reference, tp=2, timeout=240, env=CPU_ONLY)
    _check(results, reference, expect_layout=(2, 1, 1, 2, 1))


def test_ep2_alltoall_matches_single_rank(reference):
    results = run_ranks(_parallel_run, 2, reference, ep=2, timeout=240, env=CPU_ONLY)
    _check(results, reference, expect_layout=(1, 1, 2, 1, 2))


def test_pp2_1f1b_matches_single_rank(reference):
    results = run_ranks(_parallel_run, 2, reference, pp=2, timeout=240, env=CPU_ONLY)
    _check(results, reference, expect_layout=(1, 2, 1, 1, 1))


def test_tp2_ep2_expert_tp2_on_four_ranks_matches_single_rank(reference):
    # EP > 1 with expert TP > 1: the dispatcher gathers uneven token splits over expert TP.
    results = run_ranks(_parallel_run, 4, reference, tp=2, ep=2, timeout=240, env=CPU_ONLY)
    _check(results, reference, expect_layout=(2, 1, 2, 2, 2))


# ------------------------------------------------------------------------------------------------
# layout validation (in-process: checked before torch.distributed is touched)
# ------------------------------------------------------------------------------------------------

def test_init_parallel_refuses_tp2_etp1_ep1(monkeypatch):
    from model_bridge.parallel import init_parallel

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"tp=2 with etp=1 and ep=1.*etp=tp \(2\) or ep>1"):
        init_parallel(tp=2, etp=1, ep=1)


def test_init_parallel_refuses_non_dividing_sizes(monkeypatch):
    from model_bridge.parallel import check_parallel_sizes, init_parallel

    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"world size 3 is not divisible by tp\*pp = 2\*1 = 2"):
        init_parallel(tp=2)
    with pytest.raises(ValueError, match=r"ep\*etp = 4\*1 = 4 must divide world size / pp = 4/2 = 2"):
        check_parallel_sizes(4, tp=1, ep=4, pp=2)
    with pytest.raises(ValueError, match=r"tp must be a positive integer"):
        check_parallel_sizes(2, tp=0)


def test_check_parallel_sizes_accepts_valid_layouts():
    from model_bridge.parallel import check_parallel_sizes

    lay = check_parallel_sizes(8, tp=2, ep=4, etp=1, pp=2)
    assert (lay.dp, lay.expert_dp, lay.etp) == (2, 1, 1)
    lay = check_parallel_sizes(4, tp=2)
    assert (lay.etp, lay.dp, lay.expert_dp) == (2, 2, 2)
    assert check_parallel_sizes(2, tp=2, ep=2, etp=1).expert_dp == 1


def test_distributed_optimizer_step_and_dist_checkpoint_reshard(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    results = run_ranks(_optimizer_and_checkpoint_run, 2, reference, str(ckpt), timeout=240,
                        env=CPU_ONLY)
    print("\n" + "; ".join(f"rank {i}: {r}" for i, r in enumerate(results)))
    for r in results:
        assert abs(r["loss"] - reference["loss"]) <= TOL
        assert abs(r["grad_norm"] - r["ref_norm"]) <= TOL * r["ref_norm"], r
        assert r["max_step_diff"] <= TOL, r
        assert r["max_load_diff"] == 0.0, r


# ------------------------------------------------------------------------------------------------
# CUDA: init_parallel picks NCCL and applies no CPU patch
# ------------------------------------------------------------------------------------------------

def _cuda_smoke():
    import torch

    from model_bridge.mcore_cpu import applied_patches
    from model_bridge.parallel import destroy_parallel, init_parallel

    layout = init_parallel(seed=1234)
    model = _model(_config()).cuda()
    tokens, labels, pos = (t.cuda() for t in _batch())
    loss = model(tokens, pos, attention_mask=None, labels=labels).mean()
    loss.backward()
    out = dict(backend=layout.backend, patches=applied_patches(), loss=loss.item(),
               cuda_device_is_patched=torch.cuda.current_device.__module__ != "torch.cuda")
    destroy_parallel()
    return out


@pytest.mark.gpu
def test_init_parallel_on_cuda_uses_nccl_without_cpu_patches():
    out = run_ranks(_cuda_smoke, 1, timeout=240)[0]
    assert out["backend"] == "nccl"
    assert not out["cuda_device_is_patched"]
    assert set(out["patches"]) <= {"moe_utils.te_general_gemm", "torch_norm.sequence_parallel", "local_multi_tensor_ops"}
    assert 4.0 < out["loss"] < 6.0


def test_multi_tensor_stand_ins_match_megatrons_without_host_reads():
    """The grad norm and the scaled copy the optimizer runs without TE/Apex: megatron's results
    (the norm to fp32 rounding, the copy bit-identical), and the norm reads nothing to the host."""
    import torch
    from torch.overrides import TorchFunctionMode

    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale
    from model_bridge.mcore_cpu import _l2_norm_without_sync, _scale_in_one_pass

    class HostReads(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("item", "tolist", "__float__", "__int__", "__bool__"):
                HostReads.n += 1
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=g) * s for n, s in ((7, 1.0), (1000, 1e-3), (33, 50.0))]
    with HostReads():
        ours, _ = _l2_norm_without_sync(2048 * 32, None, [grads], False)
    assert HostReads.n == 0
    want = torch.cat(grads).double().norm()
    if torch.cuda.is_available():
        theirs, _ = local_multi_tensor_l2_norm(2048 * 32, None, [[x.cuda() for x in grads]], False)
        assert abs(float(theirs) - float(want)) / float(want) < 1e-6
    assert ours.shape == (1,) and ours.dtype == torch.float32
    assert abs(float(ours) - float(want)) / float(want) < 1e-6

    src = [torch.randn(5, generator=g), torch.randn(300, generator=g)]
    for scale in (1.0, 0.37):
        a = [torch.empty(x.shape, dtype=torch.bfloat16) for x in src]
        b = [torch.empty(x.shape, dtype=torch.bfloat16) for x in src]
        _scale_in_one_pass(0, None, [src, a], scale)
        local_multi_tensor_scale(0, None, [src, b], scale)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    inplace = [x.clone() for x in src]
    _scale_in_one_pass(0, None, [inplace, inplace], 0.5)
    assert all(torch.equal(x, y * 0.5) for x, y in zip(inplace, src))
