"""Transport handle for a vLLM server started with the ``nccl_m2n`` weight-transfer backend.

`push.WeightReceiver` holds one per such server (rank 0's vLLM trainer engine for it); the transfer
itself is `m2n.push_m2n`, collective over every trainer rank. Kept apart from `m2n` so that `push`
can build it without importing the m2n driver (which imports `push`).
"""
from __future__ import annotations

__all__ = ["M2NLink", "shutdown_engine"]


class M2NLink:
    """`WeightReceiver` transport for a server started with ``--weight-transfer-config
    '{"backend": "nccl_m2n"}'``: holds rank 0's vLLM trainer engine for that server. Pushes go
    through `push_m2n` (every trainer rank), never through `push.push`."""

    backend = "nccl_m2n"

    def __init__(self, master_address: str = "127.0.0.1"):
        self.master_address = master_address
        self.engine = None
        self.names: list[str] = []
        """The parameters the engine announced at init (a new list needs a new engine)."""
        self.sender_ranks = [0]

    @property
    def connected(self) -> bool:
        return self.engine is not None

    def prepare(self, world_size: int) -> dict:
        raise NotImplementedError("an nccl_m2n server takes pushes from every trainer rank: use "
                                  "weight_sync.m2n.push_m2n (weight_sync.mode multisource), not push()")

    def close(self) -> None:
        engine, self.engine = self.engine, None
        shutdown_engine(engine)


def shutdown_engine(engine) -> None:
    """Shut vLLM's trainer engine down if there is one; a failing shutdown is ignored (it is dropped)."""
    if engine is not None:
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 - dropping it anyway
            pass
