"""NCCL transport against vLLM's own receive path (packed consumer), two GPUs, no server.

Needs 2 CUDA devices and `vllm` importable: never run on the CPU development machines.
"""
import multiprocessing as mp

import pytest
import torch

pytestmark = pytest.mark.gpu


def _weights(device="cpu"):
    g = torch.Generator().manual_seed(0)
    return [("a", torch.randn(300, 7, generator=g)), ("b", torch.randn(5, generator=g).to(torch.bfloat16)),
            ("c", torch.randn(1024, 1024, generator=g))]


def _receiver(init, metas, q):
    try:
        torch.cuda.set_device(1)
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

        comm = stateless_init_process_group(init["master_address"], init["master_port"], 1,
                                            init["world_size"], device=1)
        got = []
        for m in metas:
            def info():
                for n, d, s in zip(m["names"], m["dtype_names"], m["shapes"]):
                    yield n, (s, getattr(torch, d))
            packed_nccl_broadcast_consumer(
                iterator=info(), group=comm, src=0,
                post_unpack_func=lambda pairs: got.extend((n, t.cpu().clone()) for n, t in pairs),
                buffer_size_bytes=init["packed_buffer_size_bytes"],
                num_buffers=init["packed_num_buffers"], device=torch.device("cuda", 1))
        q.put(got)
    except BaseException as e:  # noqa: BLE001
        q.put(repr(e))


def test_nccl_round_trip_into_vllm_consumer():
    pytest.importorskip("vllm")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from megatron_grpo.weight_sync.buckets import iter_buckets
    from megatron_grpo.weight_sync.nccl import NcclTransport

    torch.cuda.set_device(0)
    weights = _weights()
    buckets = list(iter_buckets(weights, bucket_bytes=64 * 1024))
    tr = NcclTransport(packed_buffer_size_bytes=64 * 1024)
    init = tr.prepare(world_size=2)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_receiver, args=(init, [b.metadata() for b in buckets], q))
    p.start()
    try:
        tr.connect()
        for b in buckets:
            tr.send(tr.pack(b))
        got = q.get(timeout=300)
    finally:
        tr.close()
        p.join(60)
    assert not isinstance(got, str), got
    assert [n for n, _ in got] == [n for n, _ in weights]
    for (_, x), (_, y) in zip(got, weights):
        assert torch.equal(x, y)
