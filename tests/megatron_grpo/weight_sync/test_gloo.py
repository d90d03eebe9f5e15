"""gloo transport without vLLM: a second process plays the worker (join_gloo_group + recv_bucket)."""
import io
import multiprocessing as mp
import time

import pytest
import torch

from megatron_grpo.weight_sync.buckets import iter_buckets
from megatron_grpo.weight_sync.gloo import GlooTransport, join_gloo_group, recv_bucket


def _weights():
    g = torch.Generator().manual_seed(0)
    return [("a", torch.randn(300, 7, generator=g)), ("b", torch.randn(5, generator=g).to(torch.bfloat16)),
            ("c", torch.randint(0, 9, (11,), generator=g)), ("d", torch.randn(64, 64, generator=g))]


def _worker(init_info, metas, q):
    try:
        pg = join_gloo_group(init_info["master_address"], init_info["master_port"], 1,
                             init_info["world_size"], 60)
        got = []
        for m in metas:
            got += [(n, t.clone()) for n, t in recv_bucket(pg, **m)]
        # as bytes: tensors put on a queue travel as shared-memory handles that this process serves,
        # and it may have exited before the test reads them
        buf = io.BytesIO()
        torch.save(got, buf)
        q.put(buf.getvalue())
    except BaseException as e:  # noqa: BLE001
        q.put(repr(e))


def test_gloo_round_trip_is_bit_exact():
    weights = _weights()
    buckets = list(iter_buckets(weights, bucket_bytes=9000))
    assert len(buckets) >= 2
    tr = GlooTransport(master_address="127.0.0.1", timeout_s=60)
    info = tr.prepare(world_size=2)
    assert info["master_port"] > 0 and info["rank_offset"] == 1
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_worker, args=(info, [b.metadata() for b in buckets], q))
    p.start()
    try:
        tr.connect()
        for b in buckets:
            tr.send(tr.pack(b))
        got = q.get(timeout=120)
    finally:
        tr.close()
        p.join(30)
        if p.is_alive():
            p.kill()
    assert not isinstance(got, str), got
    got = torch.load(io.BytesIO(got))
    assert [n for n, _ in got] == [n for n, _ in weights]
    for (_, x), (_, y) in zip(got, weights):
        assert x.dtype == y.dtype and torch.equal(x, y)


def _silent_worker(init_info, done):
    pg = join_gloo_group(init_info["master_address"], init_info["master_port"], 1, 2, 60)
    done.wait(60)  # never receives
    del pg


def test_send_gives_up_when_the_receiver_fails():
    """While the bytes wait for a receiver, `poll` (the /update_weights call failing) ends the send."""
    tr = GlooTransport(timeout_s=60)
    info = tr.prepare(world_size=2)
    ctx = mp.get_context("spawn")
    done = ctx.Event()
    p = ctx.Process(target=_silent_worker, args=(info, done))
    p.start()
    try:
        tr.connect()
        (bucket,) = iter_buckets([("x", torch.ones(8_000_000))], 10**9)  # too big for socket buffers
        t0 = time.monotonic()

        def poll():
            if time.monotonic() - t0 > 0.5:
                raise RuntimeError("receiver said no")

        with pytest.raises(RuntimeError, match="receiver said no"):
            tr.send(tr.pack(bucket), poll)
        assert time.monotonic() - t0 < 10  # not the 60 s transfer timeout
    finally:
        done.set()
        tr.close()
        p.join(30)
    assert not tr.connected
