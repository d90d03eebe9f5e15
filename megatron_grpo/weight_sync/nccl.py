"""NCCL transport: weight bytes from the trainer's GPU to vLLM's GPU workers (vLLM's own "nccl" engine).

Same interface as `gloo.GlooTransport` (`prepare` / `connect` / `send` / `close`), driven by
`push.WeightReceiver`. The server side is vLLM's built-in dense NCCL engine
(``--weight-transfer-config '{"backend": "nccl"}'``); this file only speaks its wire protocol:
rendezvous through vLLM's `StatelessProcessGroup` + `PyNcclCommunicator` (trainer = rank 0), then
per `/update_weights` call either one broadcast per tensor or vLLM's packed broadcast (chunks of
`packed_buffer_size_bytes`, double-buffered), which both sides agree on at the handshake.

Differences from gloo that matter on failure: vLLM's engine loads every bucket as it arrives, so a
push that dies midway leaves the server with a partial update (`push` then leaves it paused and
says so); the trainer needs `vllm` importable (for `PyNcclCommunicator`).

Not testable on CPU machines: its tests are marked `gpu`.
"""
from __future__ import annotations

from typing import Callable

import torch

from megatron_grpo.weight_sync.buckets import Bucket
from model_bridge.spawn import free_port

__all__ = ["NcclTransport"]

DEFAULT_PACKED_BUFFER_BYTES = 512 * 1024**2
DEFAULT_PACKED_NUM_BUFFERS = 2


class NcclTransport:
    """Trainer side of vLLM's dense NCCL weight transfer for one server (one communicator per server)."""

    backend = "nccl"

    def __init__(self, master_address: str = "127.0.0.1", master_port: int = 0, packed: bool = True,
                 packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_BYTES,
                 packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS):
        self.master_address = master_address
        self.master_port = master_port
        self.packed = packed
        self.packed_buffer_size_bytes = packed_buffer_size_bytes
        self.packed_num_buffers = packed_num_buffers
        self.comm = None
        self._init: dict | None = None

    @property
    def connected(self) -> bool:
        return self.comm is not None

    def prepare(self, world_size: int) -> dict:
        self.close()
        port = self.master_port or free_port(self.master_address)
        self._init = {"master_address": self.master_address, "master_port": port, "rank_offset": 1,
                      "world_size": world_size, "packed": self.packed,
                      "packed_buffer_size_bytes": self.packed_buffer_size_bytes,
                      "packed_num_buffers": self.packed_num_buffers}
        return dict(self._init)

    def connect(self) -> None:
        if self._init is None:
            raise RuntimeError("NcclTransport.connect() before prepare()")
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.comm = trainer_init(self._init, rank=0)

    def pack(self, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
        """The bucket's tensors on this rank's GPU (CPU tensors are copied over)."""
        device = torch.device("cuda", torch.cuda.current_device())
        return [(n, t if t.device == device else t.to(device, non_blocking=True))
                for n, t in zip(bucket.names, bucket.tensors)]

    def send(self, pairs: list[tuple[str, torch.Tensor]], poll: Callable[[], None] | None = None) -> None:
        """Broadcast one bucket (NCCL calls are enqueued; `poll` is checked once they have run)."""
        if self.comm is None:
            raise RuntimeError("NcclTransport.send() before connect()")
        try:
            if self.packed:
                from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

                packed_nccl_broadcast_producer(iterator=iter(pairs), group=self.comm, src=0,
                                               post_iter_func=lambda item: item[1],
                                               buffer_size_bytes=self.packed_buffer_size_bytes,
                                               num_buffers=self.packed_num_buffers)
            else:
                stream = torch.cuda.current_stream()
                for _, t in pairs:
                    self.comm.broadcast(t if t.is_contiguous() else t.contiguous(), src=0, stream=stream)
            torch.cuda.current_stream().synchronize()
            if poll is not None:
                poll()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        comm, self.comm = self.comm, None
        if comm is not None:
            try:
                comm.destroy()
            except Exception:  # noqa: BLE001 - dropping it anyway
                pass
