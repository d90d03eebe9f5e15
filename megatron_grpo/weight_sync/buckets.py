"""Group a stream of named tensors into size-bounded buckets, and pack a bucket into one byte buffer.

A bucket is the unit of a weight push: its names, dtypes and shapes travel over HTTP in one
`/update_weights` call, its bytes travel through the transport (gloo / NCCL) as one packed buffer.
Bounding a bucket bounds the memory both sides hold at once; a tensor larger than the bound goes
alone in its own bucket (it is never split: vLLM's `load_weights` takes whole checkpoint tensors).

The packed layout (`packed_layout`) is computed identically on both sides from the bucket's
metadata, so only the bytes travel: each tensor starts at a multiple of `ALIGN` bytes, so that
`view(dtype)` of any slice is legal whatever the mix of dtypes.

Host cost per tensor matters (the 30B thinker is ~19,400 tensors per push): packing copies runs of
tensors that lie back to back in one storage (a layer's experts, exported as views of one stacked
parameter) with one copy per run, and unpacking makes one strided view per tensor.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import torch

__all__ = ["ALIGN", "Bucket", "default_bucket_bytes", "iter_buckets", "packed_layout", "pack_bucket",
           "unpack_bucket", "dtype_name", "dtype_from_name"]

ALIGN = 64
"""Byte alignment of every tensor inside a packed bucket (>= any dtype's element size)."""

GPU_BUCKET_BYTES = 512 * 1024**2
CPU_BUCKET_BYTES = 64 * 1024**2


def default_bucket_bytes(device: torch.device | str | None = None) -> int:
    """512 MiB when the weights live on a GPU (NCCL), 64 MiB on CPU (gloo copies through host memory)."""
    if device is None:
        on_gpu = torch.cuda.is_available()
    else:
        on_gpu = torch.device(device).type == "cuda"
    return GPU_BUCKET_BYTES if on_gpu else CPU_BUCKET_BYTES


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32 (the spelling vLLM's update_info uses)."""
    return str(dtype).removeprefix("torch.")


@functools.cache
def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dt


@dataclass
class Bucket:
    """Named tensors sent together: one `/update_weights` call, one packed transfer."""

    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    """Sum of the tensors' sizes (without packing alignment)."""

    def add(self, name: str, tensor: torch.Tensor, nbytes: int | None = None) -> None:
        self.names.append(name)
        self.tensors.append(tensor)
        self.nbytes += tensor.nbytes if nbytes is None else nbytes

    def __len__(self) -> int:
        return len(self.names)

    def metadata(self) -> dict:
        """{'names', 'dtype_names', 'shapes'}: the per-bucket update_info vLLM's engines take."""
        return {"names": list(self.names),
                "dtype_names": [dtype_name(t.dtype) for t in self.tensors],
                "shapes": [list(t.shape) for t in self.tensors]}


def iter_buckets(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int | None = None
                 ) -> Iterator[Bucket]:
    """Consume `weights` lazily and yield buckets of at most `bucket_bytes` bytes each.

    Order is preserved (vLLM's layerwise reload processes a layer as soon as all its tensors
    arrived, so keeping a layer's tensors together keeps the server's staging memory small).
    A tensor bigger than `bucket_bytes` is yielded alone. Duplicate names are an error: vLLM
    would load the later one over the earlier one silently.
    """
    if bucket_bytes is None:
        bucket_bytes = default_bucket_bytes()
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    seen: set[str] = set()
    bucket = Bucket()
    for name, tensor in weights:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if name in seen:
            raise ValueError(f"weight {name!r} appears twice in the weight stream")
        seen.add(name)
        size = tensor.nbytes
        if len(bucket) and bucket.nbytes + size > bucket_bytes:
            yield bucket
            bucket = Bucket()
        bucket.add(name, tensor, size)
        if bucket.nbytes >= bucket_bytes:  # full (or one oversized tensor): send it now
            yield bucket
            bucket = Bucket()
    if len(bucket):
        yield bucket


def _offsets(sizes: Sequence[int], align: int = ALIGN) -> tuple[list[int], int]:
    """(byte offsets, total bytes) of blocks of `sizes` bytes packed back to back, each offset aligned."""
    offsets, pos = [], 0
    for size in sizes:
        pos = -(-pos // align) * align
        offsets.append(pos)
        pos += size
    return offsets, pos


def packed_layout(dtypes: list[torch.dtype], shapes: list[list[int]], align: int = ALIGN
                  ) -> tuple[list[int], list[int], int]:
    """(byte offsets, byte sizes, total bytes) of tensors packed back to back, each offset aligned."""
    if len(dtypes) != len(shapes):
        raise ValueError(f"packed_layout: {len(dtypes)} dtypes for {len(shapes)} shapes")
    sizes = [math.prod(shape) * dt.itemsize for dt, shape in zip(dtypes, shapes)]
    offsets, total = _offsets(sizes, align)
    return offsets, sizes, total


def _byte_view(storage: torch.UntypedStorage, offset: int, size: int) -> torch.Tensor:
    """uint8 tensor over bytes [offset, offset + size) of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, offset, (size,))


def pack_bucket(tensors: list[torch.Tensor], device: torch.device | str | None = None) -> torch.Tensor:
    """One contiguous uint8 buffer holding `tensors` in `packed_layout` order (a copy).

    Contiguous tensors that follow each other in one storage, with no alignment gap between them
    in the layout either (e.g. the experts of a layer, views of one stacked parameter), are copied
    as one block: one copy per run instead of one per tensor."""
    sizes = [t.nbytes for t in tensors]
    offsets, total = _offsets(sizes)
    if device is None:
        device = tensors[0].device if tensors else "cpu"
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    run = None  # [storage, first byte in storage, byte count, offset in buf] of the pending block

    def flush():
        st, start, n, off = run
        buf[off:off + n].copy_(_byte_view(st, start, n), non_blocking=True)

    for t, off, size in zip(tensors, offsets, sizes):
        if not size:
            continue
        if not t.is_contiguous():
            if run is not None:
                flush()
                run = None
            buf[off:off + size].view(t.dtype).view(t.shape).copy_(t.detach(), non_blocking=True)
            continue
        st = t.untyped_storage()
        start = t.data_ptr() - st.data_ptr()
        if (run is not None and off == run[3] + run[2] and start == run[1] + run[2]
                and st.data_ptr() == run[0].data_ptr() and st.device == run[0].device):
            run[2] += size  # the next bytes of the same storage go to the next bytes of buf
            continue
        if run is not None:
            flush()
        run = [st, start, size, off]
    if run is not None:
        flush()
    return buf


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def unpack_bucket(buf: torch.Tensor, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]
                  ) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into `buf` (no copy), inverse of `pack_bucket`."""
    offsets, sizes, total = packed_layout(dtypes, shapes)
    if buf.numel() != total:
        raise ValueError(f"packed buffer has {buf.numel()} bytes, the layout needs {total}")
    typed: dict[torch.dtype, tuple[torch.Tensor, int]] = {}  # dtype -> (buf viewed as it, its offset)
    out = []
    for name, dt, shape, off in zip(names, dtypes, shapes, offsets):
        if dt not in typed:
            isz = dt.itemsize
            tb = buf[:total - total % isz].view(dt)
            typed[dt] = (tb, tb.storage_offset())
        tb, base = typed[dt]
        shape = tuple(shape)
        # offsets are multiples of ALIGN, so of the element size: one strided view of buf per tensor
        out.append((name, tb.as_strided(shape, _contiguous_strides(shape), base + off // dt.itemsize)))
    return out
