"""Chunked vocab-parallel logprobs / entropy == torch.log_softmax on the gathered full logits.

TP1 runs in this process (no process group: the TP size is 1); TP2 on two gloo ranks, each holding
its vocab shard. Checked: values and gradients (logprob and entropy terms) to 1e-6 in fp32, vocab
padding columns never leak (even with large logits in them) and get zero gradient, the token
alignment on a packed micro-batch, and the memory bound: no float32 temporary larger than
``chunk x V/tp`` in forward or backward.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_grpo.engine.logprobs import segment_starts, token_logprobs, vocab_parallel_logprobs
from model_bridge.spawn import run_ranks

TOL = 1e-6


def _logits(T, Vp, V, seed=0, dtype=torch.float32, pad_value=None):
    g = torch.Generator().manual_seed(seed)
    x = 2.0 * torch.randn(T, 1, Vp, generator=g)
    if pad_value is not None:
        x[..., V:] = pad_value
    return x.to(dtype)


def _reference(full_TV, targets_T, V):
    """(logprobs, entropy) from torch.log_softmax over the real vocab, in the logits' dtype."""
    logsm = torch.log_softmax(full_TV[:, :V], dim=-1)
    return logsm.gather(1, targets_T[:, None])[:, 0], -(logsm.exp() * logsm).sum(-1)


def _check_against_reference(logits, V, chunk, targets, rows=None):
    """Max |diff| of values and gradients against torch.log_softmax in the same dtype (logits of
    shape [T, 1, Vp], the full vocab on this process)."""
    w_lp = torch.linspace(-1.0, 2.0, targets.shape[0], dtype=logits.dtype)
    w_h = torch.linspace(0.5, -1.5, targets.shape[0], dtype=logits.dtype)
    a = logits.detach().clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(a, targets, vocab_size=V, rows=rows, chunk_size=chunk, with_entropy=True)
    ((lp * w_lp).sum() + (ent * w_h).sum()).backward()
    b = logits.detach().clone().requires_grad_(True)
    full = b[:, 0]
    rl, re = _reference(full if rows is None else full[rows], targets, V)
    ((rl * w_lp).sum() + (re * w_h).sum()).backward()
    return {"lp": (lp.double() - rl).abs().max().item(), "ent": (ent.double() - re).abs().max().item(),
            "grad": (a.grad.double() - b.grad).abs().max().item(),
            "pad_grad": a.grad[..., V:].abs().max().item() if logits.shape[-1] > V else 0.0}


@pytest.mark.parametrize("pad_value", [-1.0e4, 50.0], ids=["masked-pad", "unmasked-large-pad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_tp1_equals_log_softmax_values_and_grads(pad_value, dtype):
    T, Vp, V = 45, 128, 100  # 28 padding columns; chunk 8 does not divide T (last chunk of 5)
    logits = _logits(T, Vp, V, pad_value=pad_value, dtype=dtype)
    targets = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(1))
    d = _check_against_reference(logits, V, chunk=8, targets=targets)
    tol = TOL if dtype == torch.float32 else 1e-12
    print(f"\n[tp1 {dtype} pad={pad_value}] max|d logp| {d['lp']:.1e}, max|d entropy| {d['ent']:.1e}, "
          f"max|d grad| {d['grad']:.1e}")
    assert d["lp"] < tol and d["ent"] < tol, d
    assert d["grad"] < tol, d
    assert d["pad_grad"] == 0.0, d  # padding columns get no gradient, even with large logits in them


def test_rows_subset_and_bf16_inputs():
    T, Vp, V = 40, 96, 90
    logits = _logits(T, Vp, V, seed=3, pad_value=-1.0e4)
    rows = torch.tensor([3, 7, 8, 20, 39, 0])
    targets = torch.randint(0, V, (rows.numel(),), generator=torch.Generator().manual_seed(2))
    d = _check_against_reference(logits, V, chunk=4, targets=targets, rows=rows)
    assert max(d["lp"], d["ent"], d["grad"]) < TOL, d
    # bf16 logits: math in fp32 on the bf16 values, result float32
    lb = logits.to(torch.bfloat16)
    lp, _ = vocab_parallel_logprobs(lb, targets, vocab_size=V, rows=rows, chunk_size=4)
    rl, _ = _reference(lb[:, 0].double()[rows], targets, V)
    assert lp.dtype == torch.float32 and (lp.double() - rl).abs().max() < 1e-5


def test_token_alignment_on_packed_microbatch():
    from megatron_grpo.packing import PackLimits, build_microbatch

    g = torch.Generator().manual_seed(4)
    V, Vp = 60, 64
    ids = [torch.randint(0, V, (n,), generator=g) for n in (7, 5, 9)]
    masks = [torch.tensor([0, 0, 1, 1, 0, 1, 1]), torch.tensor([0, 1, 1, 1, 1]), torch.tensor([0] * 4 + [1] * 5)]
    mb = build_microbatch([2, 0, 1], ids, masks, PackLimits(max_tokens_per_microbatch=24, pad_multiple=8))
    T = mb.num_tokens  # 21 real + 3 padding
    logits = _logits(T, Vp, V, seed=5, pad_value=-1.0e4)
    lp_T, ent_T = token_logprobs(logits, mb.input_ids_T, mb.cu_seqlens_S, vocab_size=V, chunk_size=4,
                                 with_entropy=True)
    logsm = torch.log_softmax(logits[:, 0, :V].double(), -1)
    cu = mb.cu_seqlens_S.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        assert lp_T[a] == 0.0 and ent_T[a] == 0.0  # a segment's first token has no prediction
        for t in range(a + 1, b):  # token t is predicted by the logits at t - 1
            assert abs(lp_T[t].item() - logsm[t - 1, mb.input_ids_T[t]].item()) < TOL
            assert abs(ent_T[t].item() + (logsm[t - 1].exp() * logsm[t - 1]).sum().item()) < TOL
    # restricted to the loss mask: same values there, 0 elsewhere; the mask is token-aligned
    lp_m, _ = token_logprobs(logits, mb.input_ids_T, mb.cu_seqlens_S, vocab_size=V, token_mask_T=mb.loss_mask_T,
                             chunk_size=4)
    assert torch.equal(lp_m[mb.loss_mask_T], lp_T[mb.loss_mask_T])
    assert (lp_m[~mb.loss_mask_T] == 0).all()
    # the host's count of those tokens (carried to the device by MicroBatch.to) finds the same ones
    assert mb.scored_tokens == int(mb.loss_mask_T.sum()) == 13 and mb.to("cpu").scored_tokens == 13
    lp_n, _ = token_logprobs(logits, mb.input_ids_T, mb.cu_seqlens_S, vocab_size=V, token_mask_T=mb.loss_mask_T,
                             chunk_size=4, num_scored=mb.scored_tokens)
    assert torch.equal(lp_n, lp_m)


def test_segment_starts_ignores_empty_trailing_segments():
    # offsets equal to T (empty segments at the end, as padding-free buckets leave) mark nothing
    cu = torch.tensor([0, 3, 3, 7, 10, 10], dtype=torch.int32)
    want = torch.zeros(10, dtype=torch.bool)
    want[[0, 3, 7]] = True
    assert torch.equal(segment_starts(cu, 10), want)
    assert torch.equal(segment_starts(torch.tensor([0, 4]), 4), torch.tensor([True, False, False, False]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_token_logprobs_with_host_count_never_syncs():
    from megatron_grpo.packing import PackLimits, build_microbatch

    g = torch.Generator().manual_seed(4)
    V, Vp = 60, 64
    ids = [torch.randint(0, V, (n,), generator=g) for n in (7, 5, 9)]
    masks = [torch.tensor([0, 0, 1, 1, 0, 1, 1]), torch.tensor([0, 1, 1, 1, 1]), torch.tensor([0] * 4 + [1] * 5)]
    mb = build_microbatch([2, 0, 1], ids, masks, PackLimits(max_tokens_per_microbatch=24, pad_multiple=8)).to("cuda")
    logits = _logits(mb.num_tokens, Vp, V, seed=5, pad_value=-1.0e4).cuda()
    want, _ = token_logprobs(logits, mb.input_ids_T, mb.cu_seqlens_S, vocab_size=V, token_mask_T=mb.loss_mask_T,
                             chunk_size=4)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host read raises
    try:
        got, _ = token_logprobs(logits, mb.input_ids_T, mb.cu_seqlens_S, vocab_size=V, token_mask_T=mb.loss_mask_T,
                                chunk_size=4, num_scored=mb.scored_tokens)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(got, want)


class _Allocations(TorchDispatchMode):
    """Records (dtype, shape) of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(x, torch.Tensor):
                self.seen.append((x.dtype, tuple(x.shape), str(func)))
        return out


def test_memory_bound_chunk_times_local_vocab():
    T, Vp, V, chunk = 96, 160, 150, 16  # chunk divides T: 6 chunks
    logits = _logits(T, Vp, V, seed=6, pad_value=-1.0e4, dtype=torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(7))
    rec = _Allocations()
    with rec:
        lp, ent = vocab_parallel_logprobs(logits, targets, vocab_size=V, chunk_size=chunk, with_entropy=True)
        (lp.sum() + ent.sum()).backward()
    fp32 = [(s, f) for d, s, f in rec.seen if d == torch.float32]
    biggest = max(torch.Size(s).numel() for s, _ in fp32)
    full = [(d, s, f) for d, s, f in rec.seen if torch.Size(s).numel() >= T * V]
    assert any("scatter_add" in f for _, _, f in rec.seen), "the backward's ops were not recorded"
    assert biggest <= chunk * Vp, (biggest, chunk * Vp)
    # the only [T, Vp]-sized tensors are the gradient of the logits, in the logits' dtype
    assert full and all(d == torch.bfloat16 for d, _, _ in full), full
    assert logits.grad.dtype == torch.bfloat16 and logits.grad.shape == logits.shape


# ------------------------------------------------------------------------------------------------
# TP2 on two gloo ranks
# ------------------------------------------------------------------------------------------------

def _tp2_rank(cases):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = [_tp2_case(*c) for c in cases]
    dist.destroy_process_group()
    return out


def _tp2_case(T, Vp, V, chunk, seed):
    import torch.distributed as dist

    rank, tp = dist.get_rank(), dist.get_world_size()
    full = _logits(T, Vp, V, seed=seed, pad_value=-1.0e4)
    targets = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(seed + 1))
    Vl = Vp // tp
    shard = full[..., rank * Vl:(rank + 1) * Vl].clone().requires_grad_(True)
    w_lp = torch.linspace(-1.0, 2.0, T)
    w_h = torch.linspace(0.5, -1.5, T)
    lp, ent = vocab_parallel_logprobs(shard, targets, vocab_size=V, chunk_size=chunk, with_entropy=True,
                                      group=dist.group.WORLD)
    ((lp * w_lp).sum() + (ent * w_h).sum()).backward()
    b = full.clone().requires_grad_(True)
    rl, re = _reference(b[:, 0], targets, V)
    ((rl * w_lp).sum() + (re * w_h).sum()).backward()
    ref_grad = b.grad[..., rank * Vl:(rank + 1) * Vl]
    pad_start = min(Vl, max(0, V - rank * Vl))  # first local column that is vocab padding
    out = {"lp": (lp - rl).abs().max().item(), "ent": (ent - re).abs().max().item(),
           "grad": (shard.grad - ref_grad).abs().max().item(), "has_padding": pad_start < Vl,
           "pad_grad": shard.grad[..., pad_start:].abs().max().item() if pad_start < Vl else 0.0}
    return out


def test_tp2_equals_log_softmax_of_gathered_logits():
    # V=100: rank 1 holds 36 real + 28 padding columns; V=60: rank 1 holds only padding
    cases = [(37, 128, 100, 8, 11), (37, 128, 60, 8, 12)]
    res = run_ranks(_tp2_rank, 2, cases, timeout=120, env={"CUDA_VISIBLE_DEVICES": ""})
    for k, (T, Vp, V, _, _) in enumerate(cases):
        per_rank = [r[k] for r in res]
        print(f"\n[tp2 Vp={Vp} V={V}] " + "; ".join(
            f"rank {i}: max|d logp| {r['lp']:.1e}, max|d entropy| {r['ent']:.1e}, max|d grad| {r['grad']:.1e}"
            for i, r in enumerate(per_rank)))
        assert per_rank[1]["has_padding"]
        for r in per_rank:
            assert r["lp"] < TOL and r["ent"] < TOL and r["grad"] < TOL, per_rank
            assert r["pad_grad"] == 0.0, per_rank
