"""model_bridge/modeling/permute.py: the routed experts of each token, read from the routing map."""
import pytest
import torch

from megatron_grpo.testing.interpreted import run_interpreted
from model_bridge.modeling.permute import topk_indices


@pytest.mark.parametrize("T,E,k", [(1, 4, 1), (37, 8, 3), (513, 128, 8), (64, 16, 16)])
def test_topk_indices_are_each_rows_routed_experts_ascending(T, E, k):
    """Exactly the row's True columns, ascending, as int64 ``[T, k]`` (contiguous): the same sets a
    top-k over the map finds, k == E included (no spill column is ever read)."""
    g = torch.Generator().manual_seed(T + E + k)
    chosen_TK = torch.rand(T, E, generator=g).topk(k, dim=1).indices
    rmap_TE = torch.zeros(T, E, dtype=torch.bool).scatter_(1, chosen_TK, True)
    got_TK = topk_indices(rmap_TE, k)
    assert got_TK.dtype == torch.long and got_TK.shape == (T, k) and got_TK.is_contiguous()
    assert torch.equal(got_TK, chosen_TK.sort(dim=1).values)
    assert torch.equal(got_TK, torch.topk(rmap_TE.to(torch.int8), k, dim=1).indices.sort(dim=1).values)


def test_topk_indices_of_no_tokens():
    assert topk_indices(torch.zeros(0, 8, dtype=torch.bool), 2).shape == (0, 2)



def _select_rows_cases(device: str) -> list:
    """``(case, select_rows == index_select bit for bit, output shape)``: bf16 and fp32, repeated
    rows, a width that is not a multiple of the kernel's block, and no rows."""
    from model_bridge.modeling.permute import select_rows

    g = torch.Generator().manual_seed(0)
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(23, 1500, generator=g).to(dtype).to(device)
        rows = torch.randint(0, 23, (57,), generator=g).to(device)
        for name, r in (("rows", rows), ("none", rows[:0])):
            got = select_rows(x, r)
            out.append((f"{dtype}-{name}", got.dtype == dtype and torch.equal(got, x.index_select(0, r)),
                        tuple(got.shape)))
    return out


def test_select_rows_is_index_select_bit_for_bit_interpreted():
    """The Triton row gather through Triton's interpreter on CPU tensors."""
    from model_bridge.modeling.permute import _triton_select_rows_kernel

    res = run_interpreted(_triton_select_rows_kernel, _select_rows_cases, "cpu")
    assert [ok for _, ok, _ in res] == [True] * 4, res
    assert [shape for _, _, shape in res] == [(57, 1500), (0, 1500)] * 2


@pytest.mark.gpu
def test_select_rows_is_index_select_bit_for_bit_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    res = _select_rows_cases("cuda")
    assert [ok for _, ok, _ in res] == [True] * 4, res


CASES = ((1, 4, 1), (37, 8, 3), (700, 128, 8), (33, 16, 16), (2500, 16, 2))
"""(T, E, k) at the kernels' own block sizes; the last has T > a scan block (1024 tokens)."""
INTERPRETED_BLOCKS = (64, 128)
"""(scan block, sort-plan block) under Triton's interpreter, which runs every program in Python:
small blocks give the same code paths - a scan over several blocks with a carry, several
sort-plan programs with a masked tail - at a tenth of the tokens (the row gather and combine
kernels on the plan are what cost: 2500 tokens took ~100 s)."""
INTERPRETED_CASES = ((1, 4, 1), (37, 8, 3), (40, 128, 8), (33, 16, 16), (300, 16, 2))
"""The last has T = 300 > 64 (5 scan blocks with a carry) and 600 pairs > 128 (5 sort programs,
the last masked); (40, 128, 8) is the model's 128 experts top-8 (3 sort programs)."""


def _counting_vs_argsort(device: str, cases=CASES, blocks=None) -> dict:
    """``sort_by_expert`` with the routing map (the counting sort) against the argsort path on the
    same routing: rows, probabilities, plan, combine and gradients, bit for bit, per (T, E, k).
    ``blocks``: (scan block, sort-plan block) in place of the module's (in a child process only)."""
    from model_bridge.modeling import permute
    from model_bridge.modeling.permute import sort_by_expert, unsort_combine

    if blocks is not None:
        permute._SCAN_BLOCK_T, permute._SORT_PLAN_BLOCK = blocks
    g = torch.Generator().manual_seed(7)
    out = {}
    for T, E, k in cases:
        chosen_TK = torch.rand(T, E, generator=g).topk(k, dim=1).indices.sort(dim=1).values
        rmap_TE = torch.zeros(T, E, dtype=torch.bool).scatter_(1, chosen_TK, True)
        probs_TE = torch.rand(T, E, generator=g) * rmap_TE
        x = torch.randn(T, 24, generator=g)
        gy = torch.randn(T, 24, generator=g)
        w = torch.randn(T * k, 24, generator=g)
        res = []
        for rmap in (rmap_TE, None):
            xx = x.to(device).requires_grad_()
            pp = probs_TE.to(device).requires_grad_()
            rows, rp, plan = sort_by_expert(xx, chosen_TK.to(device), pp, None if rmap is None else rmap.to(device))
            y = unsort_combine(rows * w.to(device) * rp.unsqueeze(-1), plan)
            y.backward(gy.to(device))
            res.append([t.detach().cpu() for t in (rows, rp, plan["inv"], plan["src_rows"], plan["experts_sorted"],
                                                   y, xx.grad, pp.grad)])
            if rmap is not None:  # the counting sort's rows per expert and their sums (the experts' offsets)
                counts, offs = plan["counts"].cpu(), plan["offsets"].cpu()
                counts_ok = torch.equal(counts.long(), rmap_TE.sum(0)) and offs.dtype == torch.int32 \
                    and torch.equal(offs.long(), rmap_TE.sum(0).cumsum(0))
        out[f"{T}x{E}x{k}"] = [torch.equal(a, b) for a, b in zip(*res)] + [counts_ok]
    return out


def test_counting_sort_equals_argsort_interpreted():
    from model_bridge.modeling.permute import _triton_sort_plan_kernel

    scan_block, plan_block = INTERPRETED_BLOCKS
    T, E, k = INTERPRETED_CASES[-1]
    assert T > scan_block and T * k > plan_block and (T * k) % plan_block  # the paths named above
    res = run_interpreted(_triton_sort_plan_kernel, _counting_vs_argsort, "cpu", INTERPRETED_CASES,
                          INTERPRETED_BLOCKS)
    assert list(res) == [f"{T}x{E}x{k}" for T, E, k in INTERPRETED_CASES]
    assert all(all(v) for v in res.values()), res


@pytest.mark.gpu
def test_counting_sort_equals_argsort_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    res = _counting_vs_argsort("cuda")
    assert all(all(v) for v in res.values()), res
