"""The transports of :mod:`launch.bench.sync`: a two-rank process group (both ends) and the product's
gloo transport (trainer side, receiver side)."""
from __future__ import annotations

import time

from launch.bench._sync_common import _Ctrl, _sync


class _PgTransport:
    """Both ends of a two-rank torch process group (NCCL on CUDA, gloo on CPU) carrying packed buckets.

    ``send`` / ``recv`` start a broadcast and return its work; ``done`` says (without blocking) whether
    it finished; the receiver's current stream waits for its buffer before anything reads it."""

    name = "pg"

    def __init__(self, ctrl: _Ctrl, rank: int, device, timeout_s: float):
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from torch.distributed import ProcessGroup

        self.device = device
        # a stateless two-rank group (the same construction as vLLM's stateless process groups): the
        # trainer's own torch.distributed world stays untouched
        store = dist.PrefixStore("bench_sync_pg", ctrl.store)
        timeout = timedelta(seconds=timeout_s)
        pg = ProcessGroup(store, rank, 2)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            backend = dist.ProcessGroupNCCL(store, rank, 2, opts)
            kind, self.backend = ProcessGroup.BackendType.NCCL, "nccl"
        else:
            backend = dist.ProcessGroupGloo(store, rank, 2, timeout=timeout)
            kind, self.backend = ProcessGroup.BackendType.GLOO, "gloo"
        pg._set_default_backend(kind)
        backend._set_sequence_number_for_group()
        pg._register_backend(torch.device(device.type), kind, backend)
        self.pg = pg
        self._opts = dist.BroadcastOptions()
        self._opts.rootRank = 0
        self._opts.rootTensor = 0
        warm = torch.ones(1024, dtype=torch.uint8, device=device)  # creates the communicator
        self.pg.broadcast([warm], self._opts).wait()
        _sync(device)

    def send(self, buf):
        return self.pg.broadcast([buf], self._opts)

    def recv(self, buf):
        work = self.pg.broadcast([buf], self._opts)
        work.wait()  # NCCL: the current stream waits for the bytes (the host does not); gloo: blocks
        return work

    def done(self, work) -> bool:
        if self.device.type == "cuda":
            return work.is_completed()
        work.wait()  # gloo: a blocking wait is the only way to finish it
        return True

    def wait(self, work) -> None:
        while not self.done(work):
            time.sleep(0)

    def close(self) -> None:
        self.pg = None


class _GlooProductTrainer:
    """The product's CPU transport, trainer side (``GlooTransport``: prepare -> connect -> send)."""

    name = "gloo"

    def __init__(self, ctrl: _Ctrl, timeout_s: float):
        from megatron_grpo.weight_sync.gloo import GlooTransport

        self.tr = GlooTransport(master_address="127.0.0.1", timeout_s=timeout_s)
        ctrl.put("gloo_init", self.tr.prepare(world_size=2))
        self.tr.connect()
        self.backend = "gloo"

    def send(self, buf):
        self.tr.send(buf)  # blocks until the receiver has the bytes
        return None

    def done(self, work) -> bool:
        return True

    def wait(self, work) -> None:
        pass

    def close(self) -> None:
        self.tr.close()


class _GlooProductReceiver:
    """The product's CPU transport, vLLM-worker side (``join_gloo_group`` + ``recv_bucket``)."""

    name = "gloo"

    def __init__(self, ctrl: _Ctrl):
        from megatron_grpo.weight_sync.gloo import join_gloo_group

        info = ctrl.get("gloo_init")
        self.pg = join_gloo_group(info["master_address"], info["master_port"], 1, info["world_size"],
                                  info["timeout_s"])

    def recv_bucket(self, meta):
        from megatron_grpo.weight_sync.gloo import recv_bucket

        return recv_bucket(self.pg, meta["names"], meta["dtype_names"], meta["shapes"])

    def close(self) -> None:
        self.pg = None
