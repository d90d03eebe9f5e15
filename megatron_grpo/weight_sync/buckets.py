"""Group a stream of named tensors into size-bounded buckets, and pack a bucket into one byte buffer.

A bucket is the unit of a weight push: its names, dtypes and shapes travel over HTTP in one
`/update_weights` call, its bytes travel through the transport (gloo / NCCL) as one packed buffer.
Bounding a bucket bounds the memory both sides hold at once; a tensor larger than the bound goes
alone in its own bucket (it is never split: vLLM's `load_weights` takes whole checkpoint tensors).

The packed layout (`packed_layout`) is computed identically on both sides from the bucket's
metadata, so only the bytes travel: each tensor starts at a multiple of `ALIGN` bytes, so that
`view(dtype)` of any slice is legal whatever the mix of dtypes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

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


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32 (the spelling vLLM's update_info uses)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dt


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class Bucket:
    """Named tensors sent together: one `/update_weights` call, one packed transfer."""

    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    """Sum of the tensors' sizes (without packing alignment)."""

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.names.append(name)
        self.tensors.append(tensor)
        self.nbytes += _nbytes(tensor)

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
        size = _nbytes(tensor)
        if len(bucket) and bucket.nbytes + size > bucket_bytes:
            yield bucket
            bucket = Bucket()
        bucket.add(name, tensor)
        if bucket.nbytes >= bucket_bytes:  # full (or one oversized tensor): send it now
            yield bucket
            bucket = Bucket()
    if len(bucket):
        yield bucket


def packed_layout(dtypes: list[torch.dtype], shapes: list[list[int]], align: int = ALIGN
                  ) -> tuple[list[int], list[int], int]:
    """(byte offsets, byte sizes, total bytes) of tensors packed back to back, each offset aligned."""
    offsets, sizes, pos = [], [], 0
    for dt, shape in zip(dtypes, shapes, strict=True):
        n = 1
        for s in shape:
            n *= int(s)
        size = n * torch.empty((), dtype=dt).element_size()
        pos = -(-pos // align) * align
        offsets.append(pos)
        sizes.append(size)
        pos += size
    return offsets, sizes, pos


def pack_bucket(tensors: list[torch.Tensor], device: torch.device | str | None = None) -> torch.Tensor:
    """One contiguous uint8 buffer holding `tensors` in `packed_layout` order (a copy)."""
    offsets, sizes, total = packed_layout([t.dtype for t in tensors], [list(t.shape) for t in tensors])
    if device is None:
        device = tensors[0].device if tensors else "cpu"
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    for t, off, size in zip(tensors, offsets, sizes):
        if size:
            src = t.detach().contiguous().reshape(-1).view(torch.uint8)
            buf[off:off + size].copy_(src, non_blocking=True)
    return buf


def unpack_bucket(buf: torch.Tensor, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]
                  ) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into `buf` (no copy), inverse of `pack_bucket`."""
    offsets, sizes, total = packed_layout(dtypes, shapes)
    if buf.numel() != total:
        raise ValueError(f"packed buffer has {buf.numel()} bytes, the layout needs {total}")
    return [(name, buf[off:off + size].view(dt).view(shape))
            for name, dt, shape, off, size in zip(names, dtypes, shapes, offsets, sizes)]
