"""model_bridge/modeling/routing.py: the fused softmax top-k routing (Triton's interpreter on CPU
tensors, and the GPU) against megatron's ``topk_routing_with_score_function`` and float64 math.

Shapes: ``T`` tokens, ``E`` experts, ``k`` experts per token.

Tolerances: the selection (routing map) is compared exactly. Probabilities and gradients are not
bit-exact: the kernel's ``tl.exp`` (numpy's in the interpreter, ``ex2.approx`` on CUDA) and its
sum order are not torch's (Sleef on CPU, ``expf`` on CUDA), a few fp32 ulps apart; after a bf16
cast that is equal or one bf16 ulp apart (two in Triton's interpreter, whose fp32 -> bf16 casts
truncate; on an H200 against megatron-core 0.19, bf16, mostly bit-exact). megatron-core 0.16 (installed here) also rounds to bf16
before its scaling and before its pre-softmax top-k, where 0.19 and the kernel round once at the
end: a second bf16 ulp. Errors are in units of the dtype's epsilon (fp32 2^-23, bf16 2^-7),
relative to the value for probabilities and to the largest gradient for gradients (the softmax
backward cancels).
"""
from __future__ import annotations

import pytest
import torch

from megatron_grpo.testing.interpreted import run_interpreted

_EPS = {dt: torch.finfo(dt).eps for dt in (torch.float32, torch.bfloat16, torch.float16)}
_PROBS_EPS = {torch.float32: 16.0, torch.bfloat16: 2.0, torch.float16: 2.0}
"""Largest probability error, in epsilons of the value: fp32 a few ulps of exp and sum order (16:
margin for CUDA's ``ex2.approx``); bf16 one ulp from a straddled rounding, one more from
megatron-core 0.16's rounding before the scaling."""
_GRAD_EPS = {torch.float32: 16.0, torch.bfloat16: 2.0, torch.float16: 2.0}
"""Largest gradient error, in epsilons of the largest gradient (same causes)."""
_EXACT_EPS = {torch.float32: 16.0, torch.bfloat16: 0.5 + 1e-3}
"""Largest error against float64 math: fp32 as above; bf16 half an ulp (at most half an epsilon
of the value) plus the fp32 math's own error: one rounding, to nearest, at the end (CUDA)."""
_INTERPRETED_BF16_EPS = 1.0 + 1e-3
"""The same in Triton's interpreter, whose fp32 -> bf16 casts truncate (not to nearest): an ulp."""


def _tie_free_logits(T: int, E: int, k: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """``[T, E]`` logits whose k-th and (k+1)-th largest differ in every row (the selected set is
    unique). fp32: ``randn * 3``. bf16: a random permutation of multiples of 1/16 per row (exact in
    bf16, ~6% apart after a softmax: no bf16 rounding of the scores (megatron 0.16) ties them)."""
    if dtype == torch.float32:
        x_TE = torch.randn(T, E, generator=g) * 3
    else:
        perm_TE = torch.rand(T, E, generator=g).argsort(1)
        shift_T1 = torch.randint(-32, 33, (T, 1), generator=g)
        x_TE = ((perm_TE + shift_T1 - E // 2).float() / 16).to(dtype)
    top_Tk1 = x_TE.float().topk(k + 1, dim=1).values
    assert bool((top_Tk1[:, k - 1] > top_Tk1[:, k]).all())
    return x_TE


def _err(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, per_value: bool) -> float:
    """Max ``|a - b|`` in epsilons of ``dtype``: of ``|b|`` elementwise, or of ``max |b|``."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    scale = b.abs().clamp_min(1e-30) if per_value else b.abs().max().clamp_min(1e-30)
    return float(((a - b).abs() / scale).max()) / _EPS[dtype] if a.numel() else 0.0


def _reference64(x_TE: torch.Tensor, sel_TE: torch.Tensor, go_TE: torch.Tensor, pre: bool, scaling) -> tuple:
    """float64 ``(probs [T, E], logits' gradient [T, E])`` of the routing with the selection
    ``sel_TE`` (bool), for the upstream gradient ``go_TE``."""
    x_TE, go_TE = x_TE.double().cpu(), go_TE.double().cpu()
    sel_TE = sel_TE.cpu()
    c = float(scaling) if scaling else 1.0
    if pre:
        p_TE = torch.softmax(x_TE, dim=1)  # the scores over all E; the gradient reaches every logit
    else:
        p_TE = torch.softmax(x_TE.masked_fill(~sel_TE, float("-inf")), dim=1)
    gs_TE = torch.where(sel_TE, go_TE * c, 0.0)
    dx_TE = p_TE * (gs_TE - (p_TE * gs_TE).sum(1, keepdim=True))
    return torch.where(sel_TE, p_TE * c, 0.0), dx_TE if pre else torch.where(sel_TE, dx_TE, 0.0)


def _vs_megatron(device: str) -> dict:
    """Per case ``(dtype, E, k, pre_softmax, scaling)``: the routing map equal to megatron's, and
    the probability and gradient errors (module docstring)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from model_bridge.modeling.permute import topk_indices
    from model_bridge.modeling.routing import fused_routing_ok, fused_topk_routing

    g = torch.Generator().manual_seed(0)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for E, k in ((128, 8), (60, 4)):
            T = 53  # not a multiple of a program's rows
            x_TE = _tie_free_logits(T, E, k, dtype, g)
            go_TE = torch.randn(T, E, generator=g).to(dtype)
            for pre in (False, True):
                for scaling in (None, 2.5):
                    kw = {"use_pre_softmax": pre, "scaling_factor": scaling}
                    ours_TE = x_TE.to(device).clone().requires_grad_()
                    assert fused_routing_ok(ours_TE, k, **kw)
                    probs_TE, map_TE = fused_topk_routing(ours_TE, k, pre, scaling)
                    probs_TE.backward(go_TE.to(device))
                    ref_TE = x_TE.clone().requires_grad_()  # x_TE never requires grad: a leaf
                    rprobs_TE, rmap_TE = topk_routing_with_score_function(ref_TE, k, **kw)
                    rprobs_TE.backward(go_TE)
                    sel_TE = rmap_TE  # the probabilities compared where megatron routes
                    probs64_TE, grad64_TE = _reference64(x_TE, rmap_TE, go_TE.float(), pre, scaling)
                    out[(str(dtype).split(".")[-1], E, k, pre, scaling)] = {
                        "map_equal": torch.equal(map_TE.cpu(), rmap_TE),
                        # the experts the dispatcher reads off the map: ascending, int64
                        "asc_idx": torch.equal(map_TE._mgrpo_topk_idx.cpu(), topk_indices(rmap_TE, k)),
                        "dtypes": (probs_TE.dtype, map_TE.dtype, ours_TE.grad.dtype) == (dtype, torch.bool, dtype),
                        "zeros_elsewhere": bool((probs_TE.cpu()[~rmap_TE] == 0).all()),
                        "probs": _err(probs_TE[sel_TE.to(device)], rprobs_TE[sel_TE], dtype, True),
                        "grad": _err(ours_TE.grad, ref_TE.grad, dtype, False),
                        "probs64": _err(probs_TE[sel_TE.to(device)], probs64_TE[sel_TE], dtype, True),
                        "grad64": _err(ours_TE.grad, grad64_TE, dtype, False),
                        "bitexact": (torch.equal(probs_TE.cpu(), rprobs_TE)
                                     and torch.equal(ours_TE.grad.cpu(), ref_TE.grad)),
                    }
    return out


def _check_vs_megatron(res: dict, interpreted: bool) -> None:
    for case, r in res.items():
        dtype = torch.float32 if case[0] == "float32" else torch.bfloat16
        assert r["map_equal"] and r["asc_idx"] and r["dtypes"] and r["zeros_elsewhere"], (case, r)
        assert r["probs"] <= _PROBS_EPS[dtype] and r["grad"] <= _GRAD_EPS[dtype], (case, r)
        # one rounding of (nearly exact) fp32 math: half an ulp in bf16
        exact = _INTERPRETED_BF16_EPS if interpreted and dtype == torch.bfloat16 else _EXACT_EPS[dtype]
        assert r["probs64"] <= exact and r["grad64"] <= exact, (case, r)


def test_fused_routing_matches_megatron_interpreted():
    from model_bridge.modeling.routing import _kernels

    res = run_interpreted(_kernels, _vs_megatron, "cpu")
    print("\n[fused routing vs megatron, interpreted]")
    for case, r in res.items():
        print(f"  {case}: probs {r['probs']:.2f} eps, grad {r['grad']:.2f} eps (float64: {r['probs64']:.2f}, "
              f"{r['grad64']:.2f}), bit-exact {r['bitexact']}")
    _check_vs_megatron(res, interpreted=True)


@pytest.mark.gpu
def test_fused_routing_matches_megatron_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    res = _vs_megatron("cuda")
    print(f"\n[fused routing vs megatron, GPU] {res}")
    _check_vs_megatron(res, interpreted=False)


_AUX_EPS = 16.0
"""Largest error of the fused aux loss (of its value) and of the logits gradient with it (of the
largest gradient or of the aux term before its cancellation), in fp32 epsilons against float64:
exp and sum order (the programs' partial sums)."""


def _aux_vs_float64(device: str) -> dict:
    """``fused_topk_routing_with_aux`` against float64 math per case ``(E, k, pre_softmax, scaling,
    probabilities used)``: the routing as without the aux loss, the counts per expert, the loss
    ``aux_scale * sum_e (sum_t softmax(x)_te) * count_e`` and the logits gradient of
    ``sum(probs * G) + aux * g_aux`` (or of ``aux * g_aux`` alone)."""
    from model_bridge.modeling.routing import fused_topk_routing, fused_topk_routing_with_aux

    g = torch.Generator().manual_seed(3)
    out = {}
    # T = 301: several programs, the last one partial; T = 1100 at E = 128: 69 programs, so the
    # aux sums' reduction runs three first-stage groups (the last one partial) and a final one
    for E, k, pre, scaling, T in ((8, 2, False, None, 301), (60, 4, True, 2.5, 301), (128, 8, False, None, 301),
                                  (128, 8, True, None, 1100)):
        x_TE = _tie_free_logits(T, E, k, torch.float32, g)
        go_TE = torch.randn(T, E, generator=g)
        g_aux = 3.0  # the gradient arriving at the loss (megatron's autoscaler: the loss scale)
        aux_scale = E * 0.01 / (k * T * T)
        for use_probs in (True, False):
            ours_TE = x_TE.to(device).clone().requires_grad_()
            probs_TE, map_TE, aux, cnt_E = fused_topk_routing_with_aux(ours_TE, k, aux_scale, pre, scaling)
            loss = aux * g_aux + ((probs_TE * go_TE.to(device)).sum() if use_probs else 0.0)
            loss.backward()
            plain_TE = x_TE.to(device).clone()
            pprobs_TE, pmap_TE = fused_topk_routing(plain_TE, k, pre, scaling)
            sel_TE = map_TE.cpu()
            x64_TE = x_TE.double().requires_grad_()
            aux64 = aux_scale * (torch.softmax(x64_TE, dim=1).sum(0) * sel_TE.sum(0).double()).sum()
            (aux64 * g_aux).backward()
            term = float((torch.softmax(x64_TE.detach(), dim=1) * (g_aux * aux_scale * sel_TE.sum(0).double())).abs().max())
            probs64_TE, grad64_TE = _reference64(x_TE, sel_TE, go_TE if use_probs else torch.zeros(T, E), pre, scaling)
            out[(E, k, pre, scaling, use_probs)] = {
                "routing_unchanged": torch.equal(map_TE.cpu(), pmap_TE.cpu()) and torch.equal(probs_TE.cpu(), pprobs_TE.cpu()),
                "counts": torch.equal(cnt_E.cpu().long(), sel_TE.sum(0)) and cnt_E.dtype == torch.int32,
                "aux_eps": abs(float(aux) - float(aux64)) / abs(float(aux64)) / _EPS[torch.float32],
                # of the largest gradient, or of the aux term's products s_te * c_e before the
                # softmax backward's cancellation (the aux loss alone: c_e - sum_e' s c nearly cancel)
                "grad_eps": float((ours_TE.grad.cpu().double() - (grad64_TE + x64_TE.grad)).abs().max()
                                  / max(float((grad64_TE + x64_TE.grad).abs().max()), term) / _EPS[torch.float32]),
            }
    return out


def _check_aux(res: dict) -> None:
    for case, r in res.items():
        assert r["routing_unchanged"] and r["counts"], (case, r)
        assert r["aux_eps"] <= _AUX_EPS and r["grad_eps"] <= _AUX_EPS, (case, r)


def test_fused_routing_with_aux_loss_matches_float64_interpreted():
    from model_bridge.modeling.routing import _kernels

    _check_aux(run_interpreted(_kernels, _aux_vs_float64, "cpu"))


@pytest.mark.gpu
def test_fused_routing_with_aux_loss_matches_float64_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check_aux(_aux_vs_float64("cuda"))


def _expected_map(x_TE: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest of each row, NaN above everything, ties to the lowest index: the first k of a
    stable descending sort (NaN made the largest)."""
    finite_TE = torch.nan_to_num(x_TE.double(), nan=0.0, posinf=1e308, neginf=-1e308)  # +-inf: finite keys
    key_TE = torch.where(torch.isnan(x_TE), float("inf"), finite_TE)
    first_Tk = key_TE.sort(dim=1, descending=True, stable=True).indices[:, :k]
    return torch.zeros_like(x_TE, dtype=torch.bool).scatter_(1, first_Tk, True)


def _saved_indices_ok(probs_TE: torch.Tensor, map_TE: torch.Tensor, k: int) -> bool:
    """The ``[T, k]`` indices the backward uses: in range, distinct, the routing map's columns."""
    idx_Tk = probs_TE.grad_fn.saved_tensors[0].long().cpu()
    E = map_TE.shape[1]
    if idx_Tk.shape != (map_TE.shape[0], k) or not bool(((idx_Tk >= 0) & (idx_Tk < E)).all()):
        return False
    return torch.equal(torch.zeros(map_TE.shape, dtype=torch.bool).scatter_(1, idx_Tk, True), map_TE.cpu())


def _selection_cases(device: str) -> dict:
    """Ties, -inf, NaN and the edges: per case, whether the selection is the expected one and the
    values are right (each entry a bool, or a tuple of them)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from model_bridge.modeling.permute import topk_indices
    from model_bridge.modeling.routing import fused_routing_ok, fused_topk_routing

    g = torch.Generator().manual_seed(1)
    out = {}

    def run(x_TE, k, pre, scaling=None, go_TE=None):
        xx_TE = x_TE.to(device).clone().requires_grad_()
        probs_TE, map_TE = fused_topk_routing(xx_TE, k, pre, scaling)
        idx_ok = _saved_indices_ok(probs_TE, map_TE, k)  # before the backward frees them
        go_TE = torch.randn(x_TE.shape, generator=g) if go_TE is None else go_TE
        probs_TE.backward(go_TE.to(device=device, dtype=x_TE.dtype))
        return probs_TE.detach().cpu(), map_TE.cpu(), xx_TE.grad.cpu(), go_TE, idx_ok

    for dtype in (torch.float32, torch.bfloat16):
        dt = str(dtype).split(".")[-1]
        # ties: few distinct values (exact in bf16), a row all equal, a row of +-0.0; the k largest,
        # ties to the lowest index; values and gradients against float64 on that selection
        for E, k in ((128, 8), (60, 4)):
            x_TE = torch.randint(0, 4, (41, E), generator=g).to(dtype)
            x_TE[0] = 1.0
            x_TE[1] = torch.where(torch.arange(E) % 3 == 0, 0.0, -0.0)  # -0.0 ties with +0.0
            for pre in (False, True):
                probs_TE, map_TE, grad_TE, go_TE, idx_ok = run(x_TE, k, pre, 2.0)
                p64_TE, g64_TE = _reference64(x_TE, map_TE, go_TE.to(dtype), pre, 2.0)
                exact = _INTERPRETED_BF16_EPS if device == "cpu" and dtype == torch.bfloat16 else _EXACT_EPS[dtype]
                out[("ties", dt, E, k, pre)] = (
                    torch.equal(map_TE, _expected_map(x_TE, k)), idx_ok,
                    _err(probs_TE[map_TE], p64_TE[map_TE], dtype, True) <= exact,
                    _err(grad_TE, g64_TE, dtype, False) <= exact)
        # -inf and NaN rows (E = 60, k = 4): 2 finite; all -inf; one NaN; all NaN; +inf; a plain row
        E, k = 60, 4
        x_TE = (torch.randn(6, E, generator=g) * 3).to(dtype)
        x_TE[0, 2:] = float("-inf")
        x_TE[0, [17, 40]] = torch.tensor([1.5, -0.5], dtype=dtype)
        x_TE[0, :2] = float("-inf")
        x_TE[1] = float("-inf")
        x_TE[2, 7] = float("nan")
        x_TE[3] = float("nan")
        x_TE[4, 11] = float("inf")
        for pre in (False, True):
            probs_TE, map_TE, grad_TE, go_TE, idx_ok = run(x_TE, k, pre)
            expected_TE = _expected_map(x_TE, k)
            finite = [0, 5]  # rows whose softmax is defined
            p64_TE, g64_TE = _reference64(x_TE[finite], map_TE[finite], go_TE[finite].to(dtype), pre, None)
            exact = _INTERPRETED_BF16_EPS if device == "cpu" and dtype == torch.bfloat16 else _EXACT_EPS[dtype]
            sel_FE = map_TE[finite]
            out[("inf-nan", dt, pre)] = (
                torch.equal(map_TE, expected_TE), idx_ok, bool((map_TE.sum(1) == k).all()),
                map_TE[0].nonzero().flatten().tolist() == [0, 1, 17, 40],  # the finite two, then the first -inf
                map_TE[1].nonzero().flatten().tolist() == [0, 1, 2, 3],
                bool(map_TE[2, 7]), map_TE[3].nonzero().flatten().tolist() == [0, 1, 2, 3], bool(map_TE[4, 11]),
                _err(probs_TE[finite][sel_FE], p64_TE[sel_FE], dtype, True) <= exact,
                _err(grad_TE[finite], g64_TE, dtype, False) <= exact,
                # no NaN from the other rows reaches a defined one
                bool(torch.isfinite(probs_TE[finite]).all() and torch.isfinite(grad_TE[finite]).all()),
                bool((probs_TE[0, [0, 1]] == 0).all()))
        # megatron on the same rows: the dense outputs agree where the softmax is defined (which
        # -inf columns torch.topk takes is its own tie order; their probabilities are 0 either way)
        for pre in (False, True):
            ours_TE = x_TE[[0, 5]].to(device).clone().requires_grad_()
            probs_TE, _ = fused_topk_routing(ours_TE, k, pre, None)
            ref_TE = x_TE[[0, 5]].clone().requires_grad_()
            rprobs_TE, _ = topk_routing_with_score_function(ref_TE, k, use_pre_softmax=pre)
            go_TE = torch.randn(2, E, generator=g).to(dtype)
            probs_TE.backward(go_TE.to(device))
            rprobs_TE.backward(go_TE)
            out[("inf-megatron", dt, pre)] = (_err(probs_TE, rprobs_TE, dtype, False) <= _PROBS_EPS[dtype],
                                              _err(ours_TE.grad, ref_TE.grad, dtype, False) <= _GRAD_EPS[dtype])

    # edges (fp32): no tokens; k = E; k = 1; E = 512 (the widest); a row stride that is not E; a
    # last-dim stride that is not 1; a scaling factor of 0 (megatron: no scaling); fp16
    cases = {"k=E": (torch.randn(19, 8, generator=g), 8, {}),
             "k=1": (torch.randn(19, 60, generator=g), 1, {}),
             "E=512": (torch.randn(11, 512, generator=g), 8, {"scaling_factor": 1.5}),
             "row-stride": (torch.randn(19, 70, generator=g)[:, 3:63], 4, {}),
             "col-stride": (torch.randn(60, 19, generator=g).t(), 4, {"use_pre_softmax": True}),
             "scaling=0": (torch.randn(19, 60, generator=g), 4, {"scaling_factor": 0.0}),
             "fp16": (torch.randn(19, 60, generator=g).half(), 4, {"use_pre_softmax": True})}
    for name, (x_TE, k, kw) in cases.items():
        ok = fused_routing_ok(x_TE.to(device), k, **kw)
        ours_TE = x_TE.to(device).clone().requires_grad_()
        probs_TE, map_TE = fused_topk_routing(ours_TE, k, kw.get("use_pre_softmax", False), kw.get("scaling_factor"))
        ref_TE = x_TE.clone().requires_grad_()
        rprobs_TE, rmap_TE = topk_routing_with_score_function(ref_TE, k, **kw)
        go_TE = torch.randn(x_TE.shape, generator=g).to(x_TE.dtype)
        probs_TE.backward(go_TE.to(device))
        rprobs_TE.backward(go_TE)
        dt = x_TE.dtype
        out[("edge", name)] = (ok, torch.equal(map_TE.cpu(), rmap_TE),
                               torch.equal(map_TE._mgrpo_topk_idx.cpu(), topk_indices(rmap_TE, k)),
                               _err(probs_TE, rprobs_TE, dt, False) <= _PROBS_EPS[dt],
                               _err(ours_TE.grad, ref_TE.grad, dt, False) <= _GRAD_EPS[dt])
    x_TE = torch.randn(0, 128).to(device).requires_grad_()
    probs_TE, map_TE = fused_topk_routing(x_TE, 8, False, None)
    probs_TE.sum().backward()
    out[("edge", "T=0")] = (probs_TE.shape == (0, 128), map_TE.shape == (0, 128), x_TE.grad.shape == (0, 128))

    # what fused_routing_ok takes: megatron's arguments of the case, nothing else
    x_TE = torch.randn(4, 16).to(device)
    no = {"sigmoid": ({"score_function": "sigmoid"}, x_TE, 2), "bias": ({"expert_bias": torch.zeros(16)}, x_TE, 2),
          "groups": ({"num_groups": 4, "group_topk": 2}, x_TE, 2), "te-fused": ({"fused": True}, x_TE, 2),
          "replay": ({"router_replay": object()}, x_TE, 2), "dense-output": ({"dense_output": True}, x_TE, 2),
          "precomputed": ({"precomputed_indices": torch.zeros(4, 2, dtype=torch.long)}, x_TE, 2),
          "unknown-kwarg": ({"padding_mask": None}, x_TE, 2), "fp64": ({}, x_TE.double(), 2),
          "k>E": ({}, x_TE, 17), "k=0": ({}, x_TE, 0), "E>512": ({}, torch.randn(4, 513).to(device), 2),
          "3-D": ({}, x_TE[None], 2)}
    yes = {"plain": {}, "all-defaults": {"use_pre_softmax": True, "num_groups": None, "group_topk": None,
                                         "scaling_factor": 2.0, "score_function": "softmax", "expert_bias": None,
                                         "fused": False, "router_replay": None, "dense_output": False,
                                         "precomputed_indices": None}}
    out[("ok", "refused")] = tuple(not fused_routing_ok(x, k, **kw) for kw, x, k in no.values())
    out[("ok", "taken")] = tuple(fused_routing_ok(x_TE, 2, **kw) for kw in yes.values())
    return out


def _check_selection(res: dict) -> None:
    for case, oks in res.items():
        oks = oks if isinstance(oks, tuple) else (oks,)
        assert all(oks), (case, oks)


def test_fused_routing_selection_ties_inf_nan_and_edges_interpreted():
    """Ties go to the lowest index; -inf and NaN rows still get k distinct in-range experts (NaN
    first, as in torch.topk); the defined rows are unaffected; the edges match megatron."""
    from model_bridge.modeling.routing import _kernels

    _check_selection(run_interpreted(_kernels, _selection_cases, "cpu"))


@pytest.mark.gpu
def test_fused_routing_selection_ties_inf_nan_and_edges_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check_selection(_selection_cases("cuda"))


def test_switch_off_and_cpu_tensors_take_megatrons_function(monkeypatch):
    """``MGRPO_TRITON_ROUTING=0``: no kernels; CPU tensors outside the interpreter: not fused."""
    from model_bridge.modeling.routing import _kernels, fused_routing_ok

    assert not fused_routing_ok(torch.randn(4, 16), 2)  # CPU, no interpreter
    monkeypatch.setenv("MGRPO_TRITON_ROUTING", "0")
    _kernels.cache_clear()
    try:
        assert _kernels() is None
    finally:
        _kernels.cache_clear()
