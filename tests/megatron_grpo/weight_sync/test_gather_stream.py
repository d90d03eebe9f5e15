"""export_to_rank0 (weight_sync/gather.py) on real gloo ranks with the tiny model: rank 0's stream
equals the single-rank export_hf bit for bit (names, order, dtypes, bytes) at EP2, PP2, TP2xEP2
(etp 1: the expert sender is in rank 0's TP group), and at 4 ranks TP2xEP2xETP2 and PP2xEP2;
non-zero ranks never allocate a send buffer above max(bucket, largest tensor); small buckets
(many pieces, oversized tensors alone) and export_kw (dtype) pass through. Plus the plan's error
path (a rank that cannot plan makes every rank raise, before any export collective).
"""
from __future__ import annotations

import pytest
import torch

from model_bridge.spawn import run_ranks

SMALL_BUCKET = 3000  # bytes: most tiny tensors are 1-16 KiB, so pieces of 1..few tensors


def _build(hf_dir, tp, ep, etp, pp):
    from model_bridge.config import ParallelLayout, read_omni_config
    from model_bridge.load import load_hf
    from model_bridge.modeling import build_thinker
    from model_bridge.parallel import init_parallel

    init_parallel(tp=tp, ep=ep, etp=etp, pp=pp)
    spec = read_omni_config(hf_dir)
    model = build_thinker(spec, ParallelLayout(tp=tp, ep=ep, etp=etp, pp=pp))
    load_hf(model, hf_dir)
    return model


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def _reference(hf_dir):
    from model_bridge.export import export_hf

    model = _build(hf_dir, 1, 1, 1, 1)
    return {dt: [(n, t.dtype, _bytes(t)) for n, t in export_hf(model, dtype=dt)]
            for dt in (None, torch.bfloat16)}


def _gather(hf_dir, runs):
    """Rank body: per (layout, bucket_bytes, dtype): rank 0's stream (name, dtype, bytes), stats."""
    import torch.distributed as dist

    from megatron_grpo.weight_sync.gather import export_to_rank0

    out = []
    for layout, bucket, dtype in runs:
        model = _build(hf_dir, *layout)
        stats = {}
        stream = [(n, t.dtype, _bytes(t)) for n, t in
                  export_to_rank0(model, bucket_bytes=bucket, stats=stats, dtype=dtype)]
        assert dist.get_rank() == 0 or stream == []
        out.append(dict(stream=stream, stats=stats))
    return out


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    return run_ranks(_reference, 1, str(tiny_ckpt), timeout=300)[0]


def _check(per_rank, runs, reference):
    for i, (layout, bucket, dtype) in enumerate(runs):
        ref = reference[dtype]
        got = per_rank[0][i]["stream"]
        assert [n for n, _, _ in got] == [n for n, _, _ in ref], f"{layout}: names or order differ"
        for (n, dt, b), (_, rdt, rb) in zip(got, ref):
            assert dt == rdt and b == rb, f"{layout}: {n} differs"
        biggest = max(len(b) for _, _, b in ref)
        sent = 0
        for r, res in enumerate(per_rank):
            st = res[i]["stats"]
            assert st["bucket_bytes"] == bucket
            if r:
                assert st["max_send_buffer_bytes"] <= max(bucket, st["max_sent_tensor_bytes"]) <= bucket + biggest
                sent += st["sent_bytes"]
        assert per_rank[0][i]["stats"]["recv_bytes"] == sent
        yield layout, [res[i]["stats"] for res in per_rank]


# (tp, ep, etp, pp), bucket bytes, export dtype
TWO_RANK = [((1, 2, 1, 1), 64 << 20, None), ((1, 2, 1, 1), SMALL_BUCKET, torch.bfloat16),
            ((1, 1, 1, 2), SMALL_BUCKET, None), ((2, 2, 1, 1), SMALL_BUCKET, None)]


def test_two_ranks_ep2_pp2_tp2xep2_equal_single_rank_export(tiny_ckpt, reference):
    per_rank = run_ranks(_gather, 2, str(tiny_ckpt), TWO_RANK, timeout=300)
    checked = dict((lay, st) for lay, st in _check(per_rank, TWO_RANK, reference))
    assert len(checked) == 3
    # EP2, one bucket per run of rank 1's tensors; EP2 small buckets: many
    big, small = per_rank[1][0]["stats"], per_rank[1][1]["stats"]
    assert 0 < big["sent_buckets"] < small["sent_buckets"]


FOUR_RANK = [((2, 2, 2, 1), SMALL_BUCKET, None), ((1, 2, 1, 2), SMALL_BUCKET, None)]


@pytest.mark.slow  # ~15-20 s on 2 shared cores
def test_four_ranks_tp2xep2xetp2_and_pp2xep2(tiny_ckpt, reference):
    per_rank = run_ranks(_gather, 4, str(tiny_ckpt), FOUR_RANK, timeout=300)
    senders = {}
    for layout, stats in _check(per_rank, FOUR_RANK, reference):
        senders[layout] = [r for r, st in enumerate(stats) if st["sent_buckets"]]
    assert len(senders[(2, 2, 2, 1)]) == 1  # the ETP-rank-0 of EP rank 1
    assert len(senders[(1, 2, 1, 2)]) == 3  # EP rank 1 of stage 0, both EP ranks of stage 1


def test_schedule_errors_and_pieces():
    from megatron_grpo.weight_sync.gather import build_schedule

    ok = {"stage": 0, "ntasks": 2, "error": None, "paths": {0: ("a", "w"), 1: ("b", "w")},
          "yields": [(0, "a.w", (4,), "float32"), (1, "b.w", (4,), "float32")]}
    other = {"stage": 1, "ntasks": 1, "error": None, "paths": {0: ("c", 1, "w")},
             "yields": [(0, "c.1.w", (100,), "float32"), (0, "c.1.v", (3,), "bfloat16"),
                        (0, "c.1.u", (3,), "int64")]}
    with pytest.raises(RuntimeError, match="rank 1: ValueError: boom"):
        build_schedule([ok, {**other, "error": "ValueError: boom"}], 1024)
    s = build_schedule([ok, other], 400)
    # a[0] b[0] then rank 1 (stage 1: model order puts 'c' after 'b'); 400 B + 6 B > 400: two pieces
    assert s.order == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    assert [(p.first, p.last, p.nbytes) for p in s.pieces[1]] == [(0, 0, 400), (1, 2, 64 + 24)]
    assert s.queues[1] == s.pieces[1] and not s.forced
    with pytest.raises(RuntimeError, match="different task counts"):
        build_schedule([ok, {**other, "stage": 0}], 400)
