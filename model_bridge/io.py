"""Streaming safetensors I/O for HF checkpoints: a lazy, index-aware reader and a bounded-size writer.

``SafetensorsReader(hf_dir)`` opens ``model.safetensors.index.json`` (or a single
``model.safetensors``) and reads one tensor, or a slice of one, at a time through ``safe_open``: only
the bytes asked for leave the disk, so a rank reads just what it owns. Every read is counted
(``reads``, ``read_bytes``) so tests can prove laziness. Problems raise ``CheckpointError`` naming
the file and key: a shard the index lists but the directory lacks, a key the checkpoint does not
have (with near names), a corrupt safetensors header, a shape other than the expected one.

``ShardedWriter(out_dir, max_shard_bytes)`` takes ``(name, tensor)`` pairs as they stream in,
writes a shard each time the buffered bytes would pass the bound (so at most one shard is held),
and on ``close()`` names the shards ``{prefix}-0000i-of-0000n.safetensors`` and writes
``model.safetensors.index.json``. Several writers (one per rank) can write into one directory with
different prefixes and ``index_name=None``; ``write_index`` then merges their weight maps.
"""
from __future__ import annotations

import difflib
import json
import os
from collections import Counter
from pathlib import Path
from typing import Iterable, Mapping

import torch

__all__ = ["CheckpointError", "SafetensorsReader", "ShardedWriter", "write_index", "INDEX_NAME",
           "SINGLE_FILE", "DEFAULT_MAX_SHARD_BYTES"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 4 * 2**30
SHARD_METADATA = {"format": "pt"}

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_F8 = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
for _k, _v in _F8.items():
    if hasattr(torch, _v):
        _ST_DTYPES[_k] = getattr(torch, _v)


class CheckpointError(ValueError):
    """An HF checkpoint directory that cannot be read as asked; the message names file and key."""


class SafetensorsReader:
    """Lazy reader over the safetensors shards of one HF checkpoint directory."""

    def __init__(self, hf_dir: str | os.PathLike):
        self.dir = Path(hf_dir)
        self._handles: dict[str, object] = {}
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir} is not a directory (expected an HF checkpoint directory)")
        index = self.dir / INDEX_NAME
        if index.is_file():
            try:
                data = json.loads(index.read_text())
                weight_map = data["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from e
            self.weight_map: dict[str, str] = dict(weight_map)
            self.source = index
        elif (self.dir / SINGLE_FILE).is_file():
            self.weight_map = {k: SINGLE_FILE for k in self._open(SINGLE_FILE).keys()}
            self.source = self.dir / SINGLE_FILE
        else:
            raise CheckpointError(f"{self.dir} has neither {INDEX_NAME} nor {SINGLE_FILE}: "
                                  "not an HF safetensors checkpoint")
        missing = sorted({f for f in self.weight_map.values() if not (self.dir / f).is_file()})
        if missing:
            n = sum(1 for f in self.weight_map.values() if f in missing)
            raise CheckpointError(f"{self.source} lists shard file(s) missing from {self.dir}: "
                                  f"{', '.join(missing)} ({n} tensors); the checkpoint is incomplete")
        self.reads: Counter[str] = Counter()
        """Tensor reads by key (a slice counts as one read of its key)."""
        self.read_bytes = 0
        """Bytes of tensor data read so far."""

    # ------------------------------------------------------------------ lookup
    def _open(self, fname: str):
        h = self._handles.get(fname)
        if h is not None:
            return h
        from safetensors import SafetensorError, safe_open

        path = self.dir / fname
        if not path.is_file():
            raise CheckpointError(f"shard {path} is missing")
        try:
            h = safe_open(str(path), framework="pt", device="cpu")
        except SafetensorError as e:
            raise CheckpointError(f"{path}: corrupt or unreadable safetensors header ({e})") from e
        except OSError as e:
            raise CheckpointError(f"{path}: cannot open ({e})") from e
        self._handles[fname] = h
        return h

    def keys(self) -> list[str]:
        return sorted(self.weight_map)

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def __len__(self) -> int:
        return len(self.weight_map)

    def file_of(self, key: str) -> str:
        try:
            return self.weight_map[key]
        except KeyError:
            near = difflib.get_close_matches(key, self.weight_map.keys(), n=3, cutoff=0.8)
            hint = f"; near names: {', '.join(near)}" if near else ""
            raise CheckpointError(f"tensor {key!r} is not in the checkpoint {self.source} "
                                  f"({len(self.weight_map)} tensors){hint}") from None

    def _slice(self, key: str):
        fname = self.file_of(key)
        h = self._open(fname)
        try:
            return h.get_slice(key)
        except Exception as e:  # SafetensorError: the index and the file disagree
            raise CheckpointError(f"{self.source} maps {key!r} to {fname}, but {self.dir / fname} has no "
                                  f"such tensor ({e})") from e

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype:
        st = self._slice(key).get_dtype()
        if st not in _ST_DTYPES:
            raise CheckpointError(f"{key}: safetensors dtype {st} is not supported")
        return _ST_DTYPES[st]

    def check_shape(self, key: str, expected: Iterable[int], why: str = "") -> tuple[int, ...]:
        """Raise ``CheckpointError`` unless ``key``'s on-disk shape is ``expected``."""
        found, expected = self.shape(key), tuple(int(x) for x in expected)
        if found != expected:
            raise CheckpointError(f"shape mismatch for {key} (in {self.file_of(key)}): expected "
                                  f"{list(expected)}, found {list(found)}{' ' + why if why else ''}")
        return found

    # ------------------------------------------------------------------ reads
    def read(self, key: str, dim: int = 0, start: int | None = None, stop: int | None = None,
             expect_shape: Iterable[int] | None = None) -> torch.Tensor:
        """Tensor ``key``, or only ``[start, stop)`` along ``dim`` (0 or 1), as a CPU tensor.

        ``expect_shape`` (the full on-disk shape) is checked against the header before reading.
        """
        if expect_shape is not None:
            self.check_shape(key, expect_shape)
        sl = self._slice(key)
        shape = tuple(sl.get_shape())
        try:
            if start is None and stop is None:
                t = sl[:] if shape else self._open(self.file_of(key)).get_tensor(key)
            else:
                n = shape[dim]
                a, b = 0 if start is None else start, n if stop is None else stop
                if not 0 <= a <= b <= n:
                    raise CheckpointError(f"{key}: slice [{a}, {b}) along dim {dim} is out of its shape "
                                          f"{list(shape)}")
                if dim == 0:
                    t = sl[a:b]
                elif dim == 1 and len(shape) >= 2:
                    t = sl[:, a:b]
                else:
                    raise CheckpointError(f"{key}: cannot slice dim {dim} of shape {list(shape)}")
        except CheckpointError:
            raise
        except Exception as e:  # truncated data, etc.
            raise CheckpointError(f"{self.dir / self.file_of(key)}: cannot read {key} ({e})") from e
        self.reads[key] += 1
        self.read_bytes += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_index(out_dir: str | os.PathLike, weight_map: Mapping[str, str], total_size: int,
                index_name: str = INDEX_NAME) -> Path:
    """Write an HF safetensors index (``metadata.total_size`` and sorted ``weight_map``)."""
    path = Path(out_dir) / index_name
    data = {"metadata": {"total_size": int(total_size)}, "weight_map": dict(sorted(weight_map.items()))}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


class ShardedWriter:
    """Write streamed tensors into safetensors shards of at most ``max_shard_bytes`` each.

    A tensor larger than the bound gets a shard of its own. Names must be unique. Use as a context
    manager or call ``close()``; ``close()`` returns the weight map (tensor name -> shard file).
    """

    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 prefix: str = "model", index_name: str | None = INDEX_NAME,
                 metadata: Mapping[str, str] | None = None):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = int(max_shard_bytes)
        self.prefix = prefix
        self.index_name = index_name
        self.metadata = dict(metadata or SHARD_METADATA)
        self._buf: dict[str, torch.Tensor] = {}
        self._buf_bytes = 0
        self._tmp_files: list[Path] = []
        self._names_per_file: list[list[str]] = []
        self._seen: set[str] = set()
        self.total_size = 0
        self.weight_map: dict[str, str] | None = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.weight_map is not None:
            raise RuntimeError("ShardedWriter.add after close()")
        if name in self._seen:
            raise ValueError(f"tensor {name!r} written twice")
        self._seen.add(name)
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        if self._buf and self._buf_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buf[name] = t
        self._buf_bytes += nbytes
        self.total_size += nbytes

    def add_all(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in items:
            self.add(name, tensor)

    def _flush(self) -> None:
        if not self._buf:
            return
        from safetensors.torch import save_file

        path = self.dir / f".{self.prefix}-part{len(self._tmp_files) + 1:05d}.safetensors.tmp"
        save_file(self._buf, str(path), metadata=self.metadata)
        self._tmp_files.append(path)
        self._names_per_file.append(list(self._buf))
        self._buf, self._buf_bytes = {}, 0

    def close(self) -> dict[str, str]:
        """Flush, give the shards their final names, write the index; return the weight map."""
        if self.weight_map is not None:
            return self.weight_map
        self._flush()
        n = len(self._tmp_files)
        weight_map: dict[str, str] = {}
        for i, (tmp, names) in enumerate(zip(self._tmp_files, self._names_per_file), 1):
            fname = f"{self.prefix}-{i:05d}-of-{n:05d}.safetensors"
            tmp.replace(self.dir / fname)
            weight_map.update({k: fname for k in names})
        self.weight_map = weight_map
        if self.index_name is not None:
            write_index(self.dir, weight_map, self.total_size, self.index_name)
        return weight_map

    def __enter__(self) -> "ShardedWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:  # leave no half-written checkpoint that looks complete
            for tmp in self._tmp_files:
                tmp.unlink(missing_ok=True)
