"""gloo transport: weight bytes from the trainer (rank 0) to vLLM workers over TCP, for CPU machines.

Both sides live here so they cannot drift: the trainer side (`GlooTransport`, used by
`push.WeightReceiver`) and the helpers the vLLM-side engine in `megatron_grpo.rollout.vllm_ext`
calls (`join_gloo_group`, `recv_bucket`).

Wire protocol (per `/update_weights` call = one bucket): the trainer packs the bucket's tensors into
one uint8 buffer (`buckets.pack_bucket`) and broadcasts it from rank 0; every worker allocates the
same buffer from the metadata it got over HTTP, receives it and unpacks views. One collective per
bucket, not per tensor.

Rendezvous: the trainer binds a listening socket on `master_address` (port 0 picks a free one; the
socket is handed to the TCPStore, so there is no window where another process could take the port)
and tells the workers the address over HTTP (`/init_weight_transfer_engine`). Workers join as ranks
`1..world_size-1`. gloo then opens direct TCP connections between the ranks; on a loopback master
address every rank binds loopback, elsewhere the interface that routes to the master (or
`GLOO_SOCKET_IFNAME`).
"""
from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
from torch.distributed import ProcessGroupGloo, TCPStore

from megatron_grpo.weight_sync.buckets import (
    Bucket,
    dtype_from_name,
    pack_bucket,
    packed_layout,
    unpack_bucket,
)

__all__ = ["GlooTransport", "join_gloo_group", "recv_bucket", "recv_sources", "send_to", "TransportError",
           "ABORT_KEY"]

DEFAULT_TIMEOUT_S = 600.0
ABORT_KEY = "mgrpo/abort"
"""Multi-source pushes: the group's store key any member sets (to the reason) to make every other
member's pending transfer fail now instead of at the group timeout."""
P2P_TAG = 7


class TransportError(RuntimeError):
    """The data plane failed (peer gone, timeout); the group is unusable and must be rebuilt."""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _local_address_towards(host: str) -> str:
    """The local IP address the kernel would use to reach `host` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def _gloo_device(master_address: str, is_master: bool):
    if _is_loopback(master_address):
        return ProcessGroupGloo.create_device(hostname="127.0.0.1")
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return ProcessGroupGloo.create_device(interface=os.environ["GLOO_SOCKET_IFNAME"].split(",")[0])
    return ProcessGroupGloo.create_device(
        hostname=master_address if is_master else _local_address_towards(master_address))


def _gloo_group(store, rank: int, world_size: int, master_address: str, timeout: timedelta):
    opts = ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [_gloo_device(master_address, is_master=rank == 0)]
    return ProcessGroupGloo(store, rank, world_size, opts)


def _bcast_opts():
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return opts


def _reap(pg, work, buf) -> None:
    """Drop a group whose broadcast never completed without blocking the caller.

    Destroying a gloo group (even after `abort()`) waits for its pending work, which only ends at
    the group timeout or when the peer goes away; a daemon thread waits for it instead.
    """
    def _wait(objs):
        try:
            objs[1].wait()
        except Exception:  # noqa: BLE001 - the failure is expected, we only wait for it
            pass
        objs.clear()

    threading.Thread(target=_wait, args=([pg, work, buf],), daemon=True,
                     name="mgrpo-gloo-reaper").start()


def join_gloo_group(master_address: str, master_port: int, rank: int, world_size: int,
                    timeout_s: float = DEFAULT_TIMEOUT_S, with_store: bool = False):
    """Join the group rank 0 (the trainer) formed, as `rank` (>= 1): a vLLM worker, or another
    trainer rank of a multi-source push. Returns the gloo process group (and its store with
    `with_store`, for `ABORT_KEY`)."""
    if rank < 1 or rank >= world_size:
        raise ValueError(f"rank {rank} outside 1..{world_size - 1}")
    timeout = timedelta(seconds=timeout_s)
    store = TCPStore(master_address, int(master_port), world_size, is_master=False, timeout=timeout)
    pg = _gloo_group(store, rank, world_size, master_address, timeout)
    return (pg, store) if with_store else pg


def abort_reason(store) -> str | None:
    """The reason a member of a multi-source push gave for aborting it, or None."""
    try:
        if store is not None and store.check([ABORT_KEY]):
            return store.get(ABORT_KEY).decode(errors="replace")
    except Exception:  # noqa: BLE001 - a store that is gone means the push is over as well
        return "the push's rendezvous store is gone (trainer rank 0 ended the push)"
    return None


def set_abort(store, reason: str) -> None:
    """Tell every member of a multi-source push that it failed (best effort)."""
    try:
        if store is not None:
            store.set(ABORT_KEY, reason)
    except Exception:  # noqa: BLE001 - the others then fail on their own timeout or peer loss
        pass


def _wait_all(works: list, poll: Callable[[], None] | None, what: Callable[[int], str], keep: list) -> None:
    """Wait for gloo p2p works, calling `poll()` (which raises to abandon them) meanwhile; a failed
    work raises TransportError(what(i)).

    A gloo send/recv work only completes inside `wait()` (its `is_completed()` stays False until
    then), so a daemon thread waits; an abandoned wait keeps `keep` (the buffers) alive until the
    transfer ends with the group or its peer."""
    errors: dict[int, BaseException] = {}

    def _waiter(objs):
        for i, w in enumerate(objs[0]):
            try:
                w.wait()
            except BaseException as e:  # noqa: BLE001 - reported by the caller
                errors[i] = e
        objs.clear()

    th = threading.Thread(target=_waiter, args=([works, keep],), daemon=True, name="mgrpo-gloo-p2p")
    th.start()
    while th.is_alive():
        if poll is not None:
            poll()
        th.join(0.02)
    for i in sorted(errors):
        raise TransportError(f"{what(i)}: {errors[i]}") from errors[i]


def _abandon(works: list, keep: list) -> None:
    """Leave posted works to a daemon thread that holds their buffers until they end (with the
    group or the peer): freeing a buffer gloo still writes into would corrupt memory."""
    def _wait(objs):
        for w in objs[0]:
            try:
                w.wait()
            except Exception:  # noqa: BLE001 - the failure is already reported
                pass
        objs.clear()

    if works:
        threading.Thread(target=_wait, args=([works, keep],), daemon=True, name="mgrpo-gloo-p2p-reaper").start()


def send_to(pg, buf: torch.Tensor, dsts: list[int], poll: Callable[[], None] | None = None) -> None:
    """Multi-source push, sender side: send one packed bucket to each of the group ranks `dsts`."""
    works = []
    for d in dsts:
        try:
            works.append(pg.send([buf], int(d), P2P_TAG))
        except RuntimeError as e:
            _abandon(works, [buf])
            raise TransportError(f"gloo send of {buf.numel() / 1e6:.1f} MB to group rank {d} failed: {e}") from e
    _wait_all(works, poll, lambda i: f"gloo send of {buf.numel() / 1e6:.1f} MB to group rank {dsts[i]} failed",
              [buf])


def recv_sources(pg, runs: list[tuple[int, list[str], list[str], list[list[int]]]],
                 label: Callable[[int], str], poll: Callable[[], None] | None = None
                 ) -> list[tuple[int, list[tuple[str, torch.Tensor]]]]:
    """Multi-source push, worker side: one packed bucket from each source of `runs` ((group rank,
    names, dtype names, shapes) each), received concurrently; returns (source, (name, view) pairs).
    `label(src)` names a source in errors (e.g. its trainer rank)."""
    bufs, works, layouts = [], [], []
    for src, names, dtype_names, shapes in runs:
        dtypes = [dtype_from_name(d) for d in dtype_names]
        _, _, total = packed_layout(dtypes, shapes)
        buf = torch.empty(total, dtype=torch.uint8)
        bufs.append(buf)
        layouts.append((names, dtypes, shapes))
        try:  # a source that is already gone fails here, not in the wait
            works.append(pg.recv([buf], int(src), P2P_TAG))
        except RuntimeError as e:
            _abandon(works, bufs)
            raise TransportError(f"gloo receive of {total / 1e6:.1f} MB from {label(src)} failed: {e}") from e
    _wait_all(works, poll, lambda i: f"gloo receive of {bufs[i].numel() / 1e6:.1f} MB from "
                                     f"{label(runs[i][0])} failed", bufs)
    return [(src, unpack_bucket(buf, *lay)) for (src, *_), buf, lay in zip(runs, bufs, layouts)]


def recv_bucket(pg, names: list[str], dtype_names: list[str], shapes: list[list[int]]
                ) -> list[tuple[str, torch.Tensor]]:
    """Worker side: receive one packed bucket and return (name, tensor) views into it."""
    dtypes = [dtype_from_name(d) for d in dtype_names]
    _, _, total = packed_layout(dtypes, shapes)
    buf = torch.empty(total, dtype=torch.uint8)
    try:
        pg.broadcast([buf], _bcast_opts()).wait()
    except RuntimeError as e:
        raise TransportError(f"gloo receive of {total / 1e6:.1f} MB failed: {e}") from e
    return unpack_bucket(buf, names, dtypes, shapes)


class GlooTransport:
    """Trainer side of the gloo data plane for one vLLM server (one group per server).

    Life cycle (driven by `push.WeightReceiver`): `prepare(world_size)` -> init_info for the
    server; `connect()` concurrently with the server's `/init_weight_transfer_engine`; per bucket
    `pack(bucket)`, then `send(packed, poll)` concurrently with its `/update_weights`; `close()`.
    """

    backend = "gloo"

    def __init__(self, master_address: str = "127.0.0.1", master_port: int = 0,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        self.master_address = master_address
        self.master_port = master_port
        self.timeout_s = timeout_s
        self.world_size: int | None = None
        self._sock: socket.socket | None = None
        self._store = None
        self.pg = None
        self._pending = None
        self.sender_ranks: list[int] = [0]
        """Trainer ranks that send (group ranks 0..S-1, in this order): [0] unless a multi-source
        push sets them before `prepare`; the server's workers take the group ranks after them."""

    @property
    def store(self):
        """The group's rendezvous store (rank 0 holds it), for `ABORT_KEY`."""
        return self._store

    @property
    def connected(self) -> bool:
        return self.pg is not None

    def prepare(self, world_size: int) -> dict:
        """Bind the rendezvous socket; return the server's init_info (our engine's fields)."""
        self.close()
        family = socket.AF_INET6 if ":" in self.master_address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.master_address, self.master_port))
        sock.listen(max(world_size, 8))
        self._sock = sock
        self.world_size = world_size
        return {"master_address": self.master_address, "master_port": sock.getsockname()[1],
                "rank_offset": len(self.sender_ranks), "world_size": world_size, "timeout_s": self.timeout_s,
                "sender_ranks": list(self.sender_ranks)}

    def connect(self) -> None:
        """Open the store on the bound socket and form the group as rank 0 (blocks until all join)."""
        if self._sock is None or self.world_size is None:
            raise RuntimeError("GlooTransport.connect() before prepare()")
        timeout = timedelta(seconds=self.timeout_s)
        port = self._sock.getsockname()[1]
        fd = self._sock.detach()
        self._sock = None
        try:
            self._store = TCPStore(self.master_address, port, self.world_size, is_master=True,
                                   timeout=timeout, wait_for_workers=False, master_listen_fd=fd)
        except Exception:
            socket.close(fd)
            raise
        self.pg = _gloo_group(self._store, 0, self.world_size, self.master_address, timeout)

    def pack(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's bytes, ready to send (done before the receiver is told to expect them)."""
        return pack_bucket(bucket.tensors, device="cpu")

    def send(self, buf: torch.Tensor, poll: Callable[[], None] | None = None) -> None:
        """Broadcast a packed bucket; `poll()` is called while the bytes wait for the receiver and
        raises if it failed (the send is then abandoned, and this transport closed)."""
        if self.pg is None:
            raise RuntimeError("GlooTransport.send() before connect()")
        try:
            work = self.pg.broadcast([buf], _bcast_opts())
        except RuntimeError as e:
            self.close()
            raise TransportError(f"gloo broadcast of {buf.numel() / 1e6:.1f} MB failed: {e}") from e
        self._pending = (work, buf)
        try:
            while not work.is_completed():
                if poll is not None:
                    poll()  # raises the receiver's error
                time.sleep(0.0005)
        except BaseException:
            self.close()
            raise
        self._pending = None  # completed, successfully or not
        try:
            work.wait()
        except RuntimeError as e:
            self.close()
            raise TransportError(f"gloo broadcast of {buf.numel() / 1e6:.1f} MB failed: {e}") from e

    def send_p2p(self, buf: torch.Tensor, poll: Callable[[], None] | None = None) -> None:
        """Multi-source push: send a packed bucket to every worker of the server (group ranks after
        the senders); on failure the transport is closed, as with `send`."""
        if self.pg is None or self.world_size is None:
            raise RuntimeError("GlooTransport.send_p2p() before connect()")
        try:
            send_to(self.pg, buf, list(range(len(self.sender_ranks), self.world_size)), poll)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        pg, self.pg = self.pg, None
        pending, self._pending = self._pending, None
        if pg is not None and pending is not None:
            _reap(pg, *pending)
        self._store = None
