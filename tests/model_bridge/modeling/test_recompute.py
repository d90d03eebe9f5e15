"""``build_thinker(recompute=...)``: the experts' selective recomputation (``modeling/recompute.py``)
and megatron's full recomputation give the same gradients as saving everything, and the experts'
variant really drops the sorted input rows and the SwiGLU output from what autograd keeps.

Real megatron-core thinker (tiny checkpoint, torch backend, fp32) on gloo ranks: EP1 (the sort
dispatcher) and EP2 (the once-per-destination exchange, whose rows are gathered on the receiver).
"""
from __future__ import annotations

import weakref

import pytest
import torch

from model_bridge.spawn import run_ranks
from megatron_grpo.testing.grads import grads_by_hf_name
from test_experts import _packed_batch


def _rank_recompute(hf_dir: str, ep: int, device: str = "cpu", dtype=torch.float32):
    import model_bridge.modeling.experts as ex
    from model_bridge.config import ParallelLayout, read_omni_config
    from model_bridge.load import load_hf
    from model_bridge.modeling.experts import TorchGroupedMLP
    from model_bridge.modeling.thinker import build_thinker, gather_logits
    from model_bridge.parallel import destroy_parallel, init_parallel

    torch.set_num_threads(1)
    init_parallel(ep=ep, seed=1234)
    spec = read_omni_config(hf_dir)
    V = spec.text.vocab_size
    ids, pos, psp, feats, flens, n_real = _packed_batch(spec, device)
    feats = feats.to(dtype)
    w_logits = torch.randn(ids.shape[1], V, generator=torch.Generator().manual_seed(11)).to(device)
    res = {}
    for mode in ("none", "experts", "full"):
        model = build_thinker(spec, ParallelLayout(ep=ep), dtype, backend="torch", recompute=mode).to(device)
        load_hf(model, hf_dir)
        model.train()
        experts = [m for m in model.modules() if isinstance(m, TorchGroupedMLP)]
        rows = []

        def pre(mod, args):  # the sorted rows the experts get
            rows.append(weakref.ref(args[0]))

        hooks = [m.register_forward_pre_hook(pre) for m in experts]
        logits = gather_logits(model(ids, pos, psp, audio_features=feats, audio_feature_lens=flens), V)
        for h in hooks:
            h.remove()
        alive = sum(r() is not None for r in rows)
        glu_calls = [0]
        orig = ex._glu_forward

        def counted(*a):
            glu_calls[0] += 1
            return orig(*a)

        ex._glu_forward = counted  # in the backward only the recomputation runs the SwiGLU forward
        (logits.float() * w_logits).sum().backward()
        ex._glu_forward = orig
        res[mode] = {"logits": logits.detach()[:n_real].cpu(),
                     "grads": {k: v.cpu() for k, v in grads_by_hf_name(model, spec).items()},
                     "rows_alive_after_forward": alive, "n_rows": len(rows), "glu_in_backward": glu_calls[0],
                     "flag": [m.recompute_activations for m in experts]}
        del model, logits
    destroy_parallel()
    base = res["none"]
    out = {}
    for mode in ("experts", "full"):
        r = res[mode]
        out[mode] = {
            "logits_equal": torch.equal(r["logits"], base["logits"]),
            "grads_equal": sorted(r["grads"]) == sorted(base["grads"])
            and all(torch.equal(r["grads"][k], base["grads"][k]) for k in base["grads"]),
            "grad_max_abs_diff": max((r["grads"][k] - base["grads"][k]).abs().max().item() for k in base["grads"]),
            "grad_max_rel_diff": max(((r["grads"][k] - base["grads"][k]).abs().max()
                                      / base["grads"][k].abs().max().clamp_min(1e-30)).item() for k in base["grads"]),
            **{k: r[k] for k in ("rows_alive_after_forward", "n_rows", "flag", "glu_in_backward")}}
    out["none"] = {k: base[k] for k in ("rows_alive_after_forward", "n_rows", "flag", "glu_in_backward")}
    return out


@pytest.mark.parametrize("ep", [pytest.param(1, id="ep1"), pytest.param(2, id="ep2")])
def test_recompute_gives_the_same_gradients_and_frees_the_rows(tiny_ckpt, ep):
    _check(run_ranks(_rank_recompute, ep, str(tiny_ckpt), ep, timeout=900), f"ep{ep}")


@pytest.mark.gpu
def test_recompute_cuda_bf16(tiny_ckpt):
    """The same on one GPU in bf16 (grouped_mm, the Triton SwiGLU and gather-sum, varlen attention):
    the recomputation repeats deterministic kernels, so bf16 gradients are bit-identical too."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check(run_ranks(_rank_recompute, 1, str(tiny_ckpt), 1, "cuda", torch.bfloat16, timeout=900), "cuda bf16",
           grad_rel_tol=5e-2)


def _check(values: list, tag: str, grad_rel_tol: float = 0.0) -> None:
    """``grad_rel_tol`` 0: bit-identical gradients (CPU); > 0: flash attention's backward accumulates
    dQ with atomics on CUDA, so two identical backward passes already differ by bf16 rounding."""
    for rank, v in enumerate(values):
        print(f"\n[recompute {tag} rank {rank}] {v}")
        n = v["none"]["n_rows"]
        assert n > 0
        # without recomputation the grouped GEMM keeps every layer's sorted rows for its backward ...
        assert v["none"]["rows_alive_after_forward"] == n and not any(v["none"]["flag"])
        # ... with it none survives the forward (the backward gathers them again)
        assert v["experts"]["rows_alive_after_forward"] == 0 and all(v["experts"]["flag"])
        # the SwiGLU output is rebuilt once per MoE layer in the backward, never without the option
        assert v["none"]["glu_in_backward"] == 0 and v["experts"]["glu_in_backward"] == n, v
        # the recomputation runs the same kernels on the same inputs: bit-identical
        for mode in ("experts", "full"):
            assert v[mode]["logits_equal"], v[mode]
            if grad_rel_tol == 0.0:
                assert v[mode]["grads_equal"], v[mode]["grad_max_abs_diff"]
            else:
                assert v[mode]["grad_max_rel_diff"] < grad_rel_tol, v[mode]


def test_recompute_bad_choices_name_the_fix(tiny_ckpt):
    from model_bridge.config import ParallelLayout, read_omni_config
    from model_bridge.modeling.thinker import build_thinker

    spec = read_omni_config(tiny_ckpt)
    with pytest.raises(ValueError, match=r"recompute='sometimes': choose one of none, experts, full"):
        build_thinker(spec, ParallelLayout(), torch.float32, recompute="sometimes")
    v = run_ranks(_rank_local_experts_recompute, 1, str(tiny_ckpt), timeout=300)[0]
    assert v.startswith("recompute='experts' needs the torch backend's grouped experts, but backend='local' "
                        "built none: use backend='torch'"), v


def _rank_local_experts_recompute(hf_dir: str) -> str:
    from model_bridge.config import ParallelLayout, read_omni_config
    from model_bridge.modeling.thinker import build_thinker
    from model_bridge.parallel import destroy_parallel, init_parallel

    init_parallel(seed=1)
    try:
        build_thinker(read_omni_config(hf_dir), ParallelLayout(), torch.float32, backend="local", recompute="experts")
    except ValueError as e:
        return str(e)
    finally:
        destroy_parallel()
    return "no error"
