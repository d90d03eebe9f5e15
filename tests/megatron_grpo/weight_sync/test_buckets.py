"""Buckets: size bound, order, oversized tensors alone, duplicates refused; packing is bit-exact."""
import pytest
import torch

from megatron_grpo.weight_sync.buckets import (
    ALIGN,
    CPU_BUCKET_BYTES,
    default_bucket_bytes,
    iter_buckets,
    pack_bucket,
    packed_layout,
    unpack_bucket,
)


def _w(name, numel, dtype=torch.float32):
    return name, torch.arange(numel, dtype=torch.float32).to(dtype)


def test_buckets_respect_the_bound_and_keep_order():
    weights = [_w(f"t{i}", n) for i, n in enumerate([10, 20, 30, 5, 40, 1, 24])]  # fp32: 4 bytes each
    buckets = list(iter_buckets(iter(weights), bucket_bytes=100))
    assert [n for b in buckets for n in b.names] == [n for n, _ in weights]
    assert all(b.nbytes <= 100 or len(b) == 1 for b in buckets)  # only a lone tensor may exceed it
    assert [b.names for b in buckets] == [["t0"], ["t1"], ["t2"], ["t3"], ["t4"], ["t5", "t6"]]
    assert [b.nbytes for b in buckets] == [40, 80, 120, 20, 160, 100]


def test_greedy_packing_and_oversized_tensor_alone():
    weights = [_w("a", 10), _w("b", 10), _w("big", 100), _w("c", 5), _w("d", 5)]  # 40 40 400 20 20 B
    buckets = list(iter_buckets(weights, bucket_bytes=100))
    assert [b.names for b in buckets] == [["a", "b"], ["big"], ["c", "d"]]
    assert [b.nbytes for b in buckets] == [80, 400, 40]


def test_a_full_bucket_is_sent_at_once():
    weights = [_w("a", 25), _w("b", 25), _w("c", 1)]  # 100 B, 100 B, 4 B
    assert [b.names for b in iter_buckets(weights, bucket_bytes=200)] == [["a", "b"], ["c"]]
    assert [b.names for b in iter_buckets(weights, bucket_bytes=100)] == [["a"], ["b"], ["c"]]


def test_stream_is_consumed_lazily():
    consumed = []

    def gen():
        for i in range(6):
            consumed.append(i)
            yield _w(f"t{i}", 25)  # 100 B each

    it = iter_buckets(gen(), bucket_bytes=200)
    first = next(it)
    assert first.names == ["t0", "t1"] and consumed == [0, 1]


def test_duplicates_and_non_tensors_refused():
    with pytest.raises(ValueError, match="appears twice"):
        list(iter_buckets([_w("a", 1), _w("a", 1)], bucket_bytes=100))
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        list(iter_buckets([("a", [1.0])], bucket_bytes=100))
    with pytest.raises(ValueError):
        list(iter_buckets([], bucket_bytes=0))
    assert list(iter_buckets([], bucket_bytes=10)) == []


def test_metadata_is_vllm_update_info():
    (b,) = iter_buckets([("x", torch.zeros(2, 3, dtype=torch.bfloat16)), ("y", torch.zeros(4))], 10**6)
    assert b.metadata() == {"names": ["x", "y"], "dtype_names": ["bfloat16", "float32"],
                            "shapes": [[2, 3], [4]]}


def test_default_bucket_bytes():
    assert default_bucket_bytes("cpu") == CPU_BUCKET_BYTES
    assert default_bucket_bytes("cuda") == 512 * 1024**2


def test_pack_unpack_round_trip_mixed_dtypes_is_bit_exact():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=g).to(torch.bfloat16),  # 30 B: next offset must realign
               torch.randn(7, generator=g),
               torch.randint(-5, 5, (3,), generator=g, dtype=torch.int64),
               torch.tensor(2.5, dtype=torch.float64),
               torch.zeros(0, 4),
               torch.randn(4, 6, generator=g).t()]  # non-contiguous view
    names = [f"t{i}" for i in range(len(tensors))]
    buf = pack_bucket(tensors)
    offsets, sizes, total = packed_layout([t.dtype for t in tensors], [list(t.shape) for t in tensors])
    assert buf.dtype == torch.uint8 and buf.numel() == total
    assert all(o % ALIGN == 0 for o in offsets)
    out = unpack_bucket(buf, names, [t.dtype for t in tensors], [list(t.shape) for t in tensors])
    for (name, got), want, n in zip(out, tensors, names):
        assert name == n and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="layout needs"):
        unpack_bucket(buf[:-1], names, [t.dtype for t in tensors], [list(t.shape) for t in tensors])


def test_pack_copies_runs_of_one_storage_bit_exactly():
    """Views that follow each other in one storage are packed as one block; gaps (in the storage or
    in the aligned layout), other storages and non-contiguous views end a block."""
    g = torch.Generator().manual_seed(1)
    stack = torch.randn(4, 8, 16, generator=g)  # 512 B per expert: back to back in the layout too
    odd = torch.randn(5, 3, generator=g).to(torch.bfloat16)  # 6 B rows: layout gaps between rows
    other = torch.randn(4, 8, 16, generator=g)
    tensors = [*stack.unbind(0),                       # one run of 4
               *odd.unbind(0),                         # 5 runs (each 6 B, realigned to 64)
               other[1], other[2], other[0], other[3],  # out of order: 3 runs
               stack[1], stack[3],                     # a gap in the storage: 2 runs
               other[0].t(),                           # non-contiguous
               stack[0, :2], stack[0, 2:],             # the halves of one expert
               torch.tensor([], dtype=torch.float32), stack[2, 1]]
    buf = pack_bucket(tensors)
    out = unpack_bucket(buf, [str(i) for i in range(len(tensors))], [t.dtype for t in tensors],
                        [list(t.shape) for t in tensors])
    for (_, got), want in zip(out, tensors):
        assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).contiguous().view(torch.uint8))
        assert got.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # views, no copy
