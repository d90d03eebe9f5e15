"""Safetensors shards written as the tensors arrive, from a known plan (:class:`StreamingShardWriter`)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import torch

from model_bridge.dist_ckpt.direct_reader import _byte_view
from model_bridge.io import CheckpointError

_ST_DTYPE = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}


class StreamingShardWriter:
    """Write tensors that arrive in a known order straight into safetensors shards, no buffering.

    ``plan`` is the full list of ``(name, shape, dtype)`` in arrival order; it is cut into shards
    of at most ``max_shard_bytes`` (a bigger tensor gets a shard of its own), so each shard's
    header is known before its first tensor arrives and every tensor goes to disk as soon as it
    is added. With ``background=True`` a writer thread does the file writes while the caller
    produces the next tensors; ``add`` blocks while more than ``max_pending_bytes`` wait (memory:
    about that much plus the tensor being written). ``close()`` checks that everything arrived,
    names the shards ``{prefix}-0000i-of-0000n.safetensors`` and writes the index.
    """

    def __init__(self, out_dir, plan: list, max_shard_bytes: int, prefix: str = "model",
                 metadata: Optional[dict] = None, background: bool = False, max_pending_bytes: int = 256 * 2**20):
        import threading

        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metadata = dict(metadata or {"format": "pt"})
        self.plan = [(n, tuple(int(x) for x in shape), dt) for n, shape, dt in plan]
        names = [n for n, _, _ in self.plan]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise CheckpointError(f"tensor name(s) planned twice: {dup[:5]}")
        for n, _, dt in self.plan:
            if dt not in _ST_DTYPE:
                raise CheckpointError(f"{n}: dtype {dt} cannot be written to safetensors")
        self.shard_of: list[int] = []
        self.shards: list[list[int]] = []
        cur, cur_bytes = [], 0
        for i, (_, shape, dt) in enumerate(self.plan):
            nb = _numel(shape) * torch.empty((), dtype=dt).element_size()
            if cur and cur_bytes + nb > max_shard_bytes:
                self.shards.append(cur)
                cur, cur_bytes = [], 0
            cur.append(i)
            self.shard_of.append(len(self.shards))
            cur_bytes += nb
        if cur:
            self.shards.append(cur)
        self.nshards = len(self.shards)
        self.prefix = prefix
        self.total_size = 0
        self.write_seconds = 0.0
        self._next = 0
        self._shard = -1
        self._file = None
        self._tmp: list[Path] = []
        self.weight_map: dict[str, str] = {}
        self._background = background
        self._max_pending = max_pending_bytes
        self._pending: list = []
        self._pending_bytes = 0
        self._error: Optional[BaseException] = None
        self._stop = False
        self._cv = threading.Condition()
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._worker, name="mgrpo-shard-writer", daemon=True)
            self._thread.start()

    def _final_name(self, i: int) -> str:
        return f"{self.prefix}-{i + 1:05d}-of-{self.nshards:05d}.safetensors"

    def _open_shard(self, i: int) -> None:
        header, off = {"__metadata__": self.metadata}, 0
        for j in self.shards[i]:
            name, shape, dt = self.plan[j]
            nb = _numel(shape) * torch.empty((), dtype=dt).element_size()
            header[name] = {"dtype": _ST_DTYPE[dt], "shape": list(shape), "data_offsets": [off, off + nb]}
            off += nb
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        tmp = self.dir / f".{self._final_name(i)}.tmp"
        self._file = open(tmp, "wb")
        self._file.write(len(blob).to_bytes(8, "little"))
        self._file.write(blob)
        self._tmp.append(tmp)
        self._shard = i

    def _write(self, shard: int, t: torch.Tensor) -> None:
        t0 = time.perf_counter()
        if shard != self._shard:
            if self._file is not None:
                self._file.close()
            self._open_shard(shard)
        if t.numel():
            self._file.write(_byte_view(t))
        self.write_seconds += time.perf_counter() - t0

    def _worker(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._stop:
                    self._cv.wait()
                if not self._pending:
                    return
                shard, t = self._pending[0]
            try:
                if self._error is None:
                    self._write(shard, t)
            except BaseException as e:  # noqa: BLE001 - handed to the caller at its next add/close
                self._error = e
            with self._cv:
                self._pending.pop(0)
                self._pending_bytes -= t.numel() * t.element_size()
                self._cv.notify_all()
            del t

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            raise CheckpointError(f"writing {self.dir} failed: {type(self._error).__name__}: {self._error}") \
                from self._error

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._raise_pending_error()
        if self._next >= len(self.plan):
            raise CheckpointError(f"{name}: more tensors than planned ({len(self.plan)})")
        want, shape, dt = self.plan[self._next]
        t = tensor.detach()
        if name != want or tuple(t.shape) != shape or t.dtype != dt:
            raise CheckpointError(f"tensor #{self._next} is {name} {list(t.shape)} {t.dtype}, the plan says {want} "
                                  f"{list(shape)} {dt}")
        shard = self.shard_of[self._next]
        t = t.to("cpu").contiguous()
        nb = t.numel() * t.element_size()
        if self._background:
            with self._cv:
                while self._pending and self._pending_bytes + nb > self._max_pending and self._error is None:
                    self._cv.wait()
                self._pending.append((shard, t))
                self._pending_bytes += nb
                self._cv.notify_all()
        else:
            self._write(shard, t)
        self.weight_map[name] = self._final_name(shard)
        self.total_size += nb
        self._next += 1

    def _drain(self) -> None:
        if self._thread is not None:
            with self._cv:
                self._stop = True
                self._cv.notify_all()
            self._thread.join()
            self._thread = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self) -> dict[str, str]:
        from model_bridge.io import write_index

        self._drain()
        self._raise_pending_error()
        if self._next != len(self.plan):
            missing = [n for n, _, _ in self.plan[self._next:]]
            raise CheckpointError(f"{len(missing)} planned tensor(s) never arrived: {missing[:5]}")
        for i, tmp in enumerate(self._tmp):
            tmp.replace(self.dir / self._final_name(i))
            (self.dir / self._final_name(i)).chmod(0o644)
        write_index(self.dir, self.weight_map, self.total_size)
        return self.weight_map

    def abort(self) -> None:
        """Stop (queued tensors are dropped) and remove the partial shards."""
        if self._error is None:
            self._error = CheckpointError("aborted")
        self._drain()
        for tmp in self._tmp:
            tmp.unlink(missing_ok=True)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
