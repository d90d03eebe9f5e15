"""weight_sync/direct.py: the plan and its global order, the stream checks of `send_direct`, and real gloo
processes (two senders + one receiver over `p2p_group`) moving mixed-dtype streams bit-exactly, pipelined and
serial; `local_buckets` on meta models (EP2: each rank its own experts; TP2: refused).
The model-level run (EP2/EP4 against the single-rank export_hf) is tests/launch/test_bench_sync.py.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from model_bridge.spawn import run_ranks
from megatron_grpo.weight_sync.direct import (DirectLayoutError, DirectPlan, bucket_plan, local_buckets, p2p_group,
                                              recv_direct, send_direct, warm_up)


def _meta(names, shapes, dtype="float32"):
    return {"names": list(names), "dtype_names": [dtype] * len(names), "shapes": [list(s) for s in shapes]}


def test_plan_order_is_round_robin_and_checked():
    a = [_meta(["a0"], [[4]]), _meta(["a1", "a2"], [[4], [2]]), _meta(["a3"], [[1]])]
    b = [_meta(["b0"], [[3]])]
    plan = DirectPlan({2: b, 0: a, 5: []}, receiver=1)
    assert list(plan.senders) == [0, 2]  # rank order; empty senders dropped
    assert plan.order() == [(0, 0), (2, 0), (0, 1), (0, 2)]
    assert plan.tensors() == 5
    assert plan.payload_bytes() == 4 * (4 + 4 + 2 + 1 + 3) and plan.payload_bytes(2) == 12
    assert plan.packed_bytes(0) == 16 + (64 + 8) + 4
    with pytest.raises(ValueError, match="sent by both"):
        DirectPlan({0: a, 2: [_meta(["a2"], [[2]])]}, receiver=1)
    with pytest.raises(ValueError, match="is the receiver"):
        DirectPlan({0: a, 1: b}, receiver=1)


def test_bucket_plan_cuts_like_iter_buckets():
    from megatron_grpo.weight_sync.buckets import iter_buckets

    spec = [("x", (10,), torch.float32), ("y", (100,), torch.bfloat16), ("z", (3, 5), torch.int64),
            ("w", (2,), torch.float32)]
    real = [b.metadata() for b in iter_buckets(((n, torch.zeros(s, dtype=d)) for n, s, d in spec), 120)]
    assert bucket_plan(spec, 120) == real == bucket_plan([(n, s, str(d)[6:]) for n, s, d in spec], 120)
    assert [m["names"] for m in real] == [["x"], ["y"], ["z"], ["w"]]  # y > 120 B alone, z (120 B) fills one


class _FakeGroup:
    """Records sends; every work is done at once."""

    class _Work:
        def wait(self):
            return True

        def is_completed(self):
            return True

    def __init__(self):
        self.sent = []

    def send(self, tensors, dst, tag):
        self.sent.append((dst, tag, tensors[0].clone()))
        return self._Work()


def test_send_direct_checks_the_stream_against_the_plan():
    t = [("a", torch.ones(4)), ("b", torch.zeros(2, dtype=torch.bfloat16)), ("c", torch.arange(3))]
    plan = bucket_plan([(n, x.shape, x.dtype) for n, x in t], 16)
    g = _FakeGroup()
    ph = {}
    st = send_direct(iter(t), plan, g, 7, phases=ph)
    assert st == {"buckets": len(plan), "tensors": 3, "bytes": sum(x.numel() for _, _, x in g.sent)}
    assert [(d, k) for d, k, _ in g.sent] == [(7, k) for k in range(len(plan))]
    assert set(ph) == {"export", "pack", "send"}
    with pytest.raises(RuntimeError, match="the plan says 'a'"):
        send_direct(iter([("x", torch.ones(4))] + t[1:]), plan, _FakeGroup(), 7)
    with pytest.raises(RuntimeError, match=r"\(4,\) float32, the plan says 'a' \(5,\)"):
        send_direct(iter(t), bucket_plan([("a", (5,), torch.float32)], 16), _FakeGroup(), 7)
    with pytest.raises(RuntimeError, match="the stream ended at 'c'"):
        send_direct(iter(t[:2]), plan, _FakeGroup(), 7)
    with pytest.raises(RuntimeError, match="'d' beyond the plan's 3 tensors"):
        send_direct(iter(t + [("d", torch.ones(1))]), plan, _FakeGroup(), 7)


def _stream(rank: int, n: int):
    """Sender ``rank``'s tensors: mixed dtypes, one larger than the bucket, a non-contiguous one."""
    g = torch.Generator().manual_seed(rank)
    out = []
    for i in range(n):
        dt = (torch.float32, torch.bfloat16, torch.int64, torch.float16)[i % 4]
        shape = (1 + (i * 7 + rank) % 13, 3) if i != 5 else (300, 4)
        x = torch.randn(shape, generator=g) * 100
        x = x.to(dt)
        if i == 3:
            x = x.t()  # non-contiguous
        out.append((f"r{rank}.t{i}", x))
    return out


def _p2p_body(runs):
    import torch.distributed as dist

    from datetime import timedelta

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, is_master=rank == 0,
                          timeout=timedelta(seconds=60))
    receiver = world - 1
    counts = {s: 8 + 3 * s for s in range(receiver)}
    plans = {s: bucket_plan([(n, t.shape, t.dtype) for n, t in _stream(s, counts[s])], 2000) for s in counts}
    plan = DirectPlan(plans, receiver=receiver)
    group = p2p_group(store, rank, world, torch.device("cpu"), 60, prefix="t")
    warm_up(plan, group, rank, "cpu")
    out = []
    for buffers, serial in runs:
        if rank == receiver:
            got, order = {}, []

            def consume(s, k, pairs):
                order.append((s, k))
                for n, t in pairs:
                    got[n] = t.clone()

            ph = {}
            st = recv_direct(plan, group, consume, buffers=buffers, serial=serial, phases=ph)
            out.append({"got": got, "order": order, "stats": st, "phases": set(ph)})
        else:
            send_direct(iter(_stream(rank, counts[rank])), plans[rank], group, receiver, buffers=buffers,
                        serial=serial)
            out.append(None)
        store.add(f"done/{len(out)}", 1)  # nothing else between two transfers: the next starts after all
        while store.add(f"done/{len(out)}", 0) < world:
            time.sleep(0.001)
    return {"plan_order": plan.order(), "runs": out}


@pytest.mark.parametrize("runs", [[(2, False), (1, True), (3, False)]])
def test_two_senders_one_receiver_over_gloo_bit_exact(runs):
    res = run_ranks(_p2p_body, 3, runs, timeout=120, env={"CUDA_VISIBLE_DEVICES": ""})
    rx = res[2]
    plans = {s: bucket_plan([(n, t.shape, t.dtype) for n, t in _stream(s, 8 + 3 * s)], 2000) for s in (0, 1)}
    expected = {n: t for s in (0, 1) for n, t in _stream(s, 8 + 3 * s)}
    for r in rx["runs"]:
        assert r["order"] == rx["plan_order"]  # consumed in the global order
        assert list(r["got"]) == [n for s, k in r["order"] for n in plans[s][k]["names"]]
        assert set(r["got"]) == set(expected)
        for n, t in expected.items():
            g = r["got"][n]
            assert g.dtype == t.dtype and g.shape == t.shape and torch.equal(g, t), n
        assert r["stats"]["tensors"] == len(expected) and r["phases"] == {"receive", "unpack"}
    assert len(rx["plan_order"]) > 4 and {s for s, _ in rx["plan_order"]} == {0, 1}


def _local_buckets_body(hf_cfg, tp, ep):
    from model_bridge.config import ParallelLayout, parse_omni_config
    from model_bridge.export import export_plan
    from model_bridge.modeling import build_thinker
    from model_bridge.parallel import destroy_parallel, init_parallel

    init_parallel(tp=tp, ep=ep)
    spec = parse_omni_config(hf_cfg, where="test")
    with torch.device("meta"):
        model = build_thinker(spec, ParallelLayout(tp=tp, ep=ep), torch.bfloat16, dummy_audio=False,
                              perform_initialization=False)
    try:
        buckets = local_buckets(model, 1 << 14, spec=spec)
    except DirectLayoutError as e:
        destroy_parallel()
        return {"error": str(e)}
    names = [n for m in buckets for n in m["names"]]
    plan_names = [n for n, _, _ in export_plan(model, spec)]
    destroy_parallel()
    return {"names": names, "plan_names": plan_names, "buckets": len(buckets)}


def test_local_buckets_ep2_own_experts_and_tp2_refused():
    from launch.bench.sync import sync_config

    cfg = sync_config(2, 1, tiny=True)
    ep = run_ranks(_local_buckets_body, 2, cfg, 1, 2, timeout=180, env={"CUDA_VISIBLE_DEVICES": ""})
    for r, x in enumerate(ep):
        assert x["names"] == x["plan_names"] and x["buckets"] >= 1
        experts = {int(n.split(".mlp.experts.")[1].split(".")[0]) for n in x["names"] if ".mlp.experts." in n}
        assert experts == set(range(4 * r, 4 * r + 4))  # 8 experts, EP2: its own, global indices
    assert any("embed_tokens" in n for n in ep[0]["names"])
    assert all(".mlp.experts." in n for n in ep[1]["names"])  # the dense tensors come from EP rank 0 only
    tp = run_ranks(_local_buckets_body, 2, cfg, 2, 1, timeout=180, env={"CUDA_VISIBLE_DEVICES": ""})
    assert all("use gather.export_to_rank0" in x["error"] for x in tp)
