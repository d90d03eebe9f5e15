"""Safetensors reads with plain file I/O into tensors that own their memory (:class:`_DirectReader`),
and :func:`_byte_view`, the raw byte view of a tensor that such reads and writes go through."""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from model_bridge.io import CheckpointError


def _byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory. Not ``t.numpy()``: that marks
    the storage non-resizable for good, and ``_LazyTensors`` frees storages by resizing them."""
    import ctypes

    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    if not t.is_contiguous():
        raise ValueError("byte view of a non-contiguous tensor")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class _DirectReader:
    """A SafetensorsReader whose data reads go through ``os.preadv`` into fresh tensors.

    safetensors' ``safe_open`` maps each file and hands out views of the mapping: the pages read
    stay resident (and count as this process's RSS) as long as any tensor viewing the file is
    alive, so a streaming converter would grow to the size of the checkpoint. Reading the bytes
    with plain file I/O gives tensors that own their memory (freed when dropped) and costs the
    same one copy out of the page cache. Names, shapes, dtypes and all checks come from the
    wrapped reader (``model_bridge.io.SafetensorsReader``), so errors are the same.
    """

    def __init__(self, reader):
        self._r = reader
        self._headers: dict[str, tuple[int, dict]] = {}
        self._fds: dict[str, int] = {}

    def __getattr__(self, name):
        return getattr(self._r, name)

    def __contains__(self, key):
        return key in self._r

    def _header(self, fname: str) -> tuple[int, dict]:
        h = self._headers.get(fname)
        if h is None:
            path = self._r.dir / fname
            try:
                with open(path, "rb") as f:
                    n = int.from_bytes(f.read(8), "little")
                    meta = json.loads(f.read(n))
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{path}: corrupt or unreadable safetensors header ({e})") from e
            h = (8 + n, {k: tuple(v["data_offsets"]) for k, v in meta.items() if k != "__metadata__"})
            self._headers[fname] = h
        return h

    def _fd(self, fname: str) -> int:
        fd = self._fds.get(fname)
        if fd is None:
            fd = self._fds[fname] = os.open(self._r.dir / fname, os.O_RDONLY)
        return fd

    def _pread_into(self, fname: str, offset: int, t: torch.Tensor, key: str) -> None:
        buf = _byte_view(t)
        done = 0
        fd = self._fd(fname)
        while done < len(buf):
            n = os.preadv(fd, [buf[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(f"{self._r.dir / fname}: file ends inside {key} (truncated?)")
            done += n

    def read(self, key: str, dim: int = 0, start: Optional[int] = None, stop: Optional[int] = None,
             expect_shape=None) -> torch.Tensor:
        if expect_shape is not None:
            self._r.check_shape(key, expect_shape)
        shape = tuple(self._r.shape(key))
        dtype = self._r.dtype(key)
        fname = self._r.file_of(key)
        data_start, offsets = self._header(fname)
        if key not in offsets:
            raise CheckpointError(f"{self._r.source} maps {key!r} to {fname}, but that file has no such tensor")
        begin, end = offsets[key]
        if start is None and stop is None:
            t = torch.empty(shape, dtype=dtype)
            if t.numel() * t.element_size() != end - begin:
                raise CheckpointError(f"{self._r.dir / fname}: {key} has {end - begin} bytes, shape {list(shape)} "
                                      f"needs {t.numel() * t.element_size()}")
            self._pread_into(fname, data_start + begin, t, key)
        else:
            if dim not in (0, 1) or len(shape) <= dim:
                raise CheckpointError(f"{key}: cannot slice dim {dim} of shape {list(shape)}")
            n = shape[dim]
            a, b = 0 if start is None else start, n if stop is None else stop
            if not 0 <= a <= b <= n:
                raise CheckpointError(f"{key}: slice [{a}, {b}) along dim {dim} is out of its shape {list(shape)}")
            if dim == 0:
                row = (end - begin) // max(n, 1)
                t = torch.empty((b - a, *shape[1:]), dtype=dtype)
                self._pread_into(fname, data_start + begin + a * row, t, key)
            else:  # columns: read the rows whole, keep the slice (conversion reads full tensors anyway)
                full = torch.empty(shape, dtype=dtype)
                self._pread_into(fname, data_start + begin, full, key)
                t = full[:, a:b].contiguous()
        self._r.reads[key] += 1
        self._r.read_bytes += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._r.close()
