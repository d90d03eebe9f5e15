"""A torch_dist save strategy that asks for each tensor's bytes only when the writer writes it
(:class:`_LazyTensors`: one parameter at a time, converted ahead in a worker thread)."""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from model_bridge.io import CheckpointError


class _LazyTensors:
    """Materialises checkpoint chunks on demand for the DCP writer, one parameter at a time.

    ``materialize(param_name) -> tensor`` gives a parameter's local value; chunks are views of it
    (``_param_views``). A parameter cut into several chunks (gated fc1: gate and up halves) is
    kept until its last chunk is written. Every tensor handed to the writer owns its storage and is
    freed (storage resized to 0) at the next request: the writer keeps a reference to the last
    tensor of every checkpoint key, which would otherwise hold ~ the embedding and output layer.

    Once the writer's order is known (``set_order``, from the final save plan), the next
    parameters (up to ``prefetch_bytes`` ahead, at least one) are read and converted in a worker
    thread while the current one is written: file reads and torch copies release the GIL, so
    reading overlaps writing.
    """

    def __init__(self, views: dict, materialize: Callable[[str], torch.Tensor], param_shapes: dict,
                 progress=None, prefetch_bytes: int = 64 * 2**20, param_bytes: Optional[dict] = None):
        self.views = views
        self.materialize = materialize
        self.param_shapes = param_shapes
        self.param_bytes = param_bytes or {}
        self.remaining: dict[str, int] = {}
        for name, *_ in views.values():
            self.remaining[name] = self.remaining.get(name, 0) + 1
        self.cache: dict[str, torch.Tensor] = {}
        self.handed: list[torch.Tensor] = []
        self.progress = progress
        self.bytes = 0
        self.seconds = 0.0
        self.wait_seconds = 0.0
        self.prefetch_bytes = prefetch_bytes
        self.order: list[str] = []
        self.pos: dict[str, int] = {}
        self.started: set[str] = set()
        self.futures: dict = {}
        self.inflight_bytes = 0
        self.next_idx = 0
        self.pool = None

    def set_order(self, keys) -> None:
        """The chunk keys in the order the writer will ask for them (enables prefetching)."""
        from concurrent.futures import ThreadPoolExecutor

        seen, order = set(), []
        for k in keys:
            v = self.views.get(k)
            if v is not None and v[0] not in seen:
                seen.add(v[0])
                order.append(v[0])
        self.order, self.pos = order, {n: i for i, n in enumerate(order)}
        if self.prefetch_bytes > 0 and self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mgrpo-convert-prefetch")

    def _checked(self, name: str) -> torch.Tensor:
        full = self.materialize(name).contiguous()
        want = self.param_shapes[name]
        if tuple(full.shape) != tuple(want):
            raise CheckpointError(f"{name}: converted value has shape {list(full.shape)}, the parameter is {list(want)}")
        return full

    def _prefetch_after(self, name: str) -> None:
        """Keep up to ``prefetch_bytes`` (at least one parameter, at most 16) converting ahead of
        the parameter the writer is on."""
        i = self.pos.get(name)
        if self.pool is None or i is None:
            return
        self.next_idx = max(self.next_idx, i + 1)
        while self.next_idx < len(self.order) and len(self.futures) < 16 and (
                not self.futures or self.inflight_bytes < self.prefetch_bytes):
            n = self.order[self.next_idx]
            self.next_idx += 1
            if n not in self.started:
                self.started.add(n)
                self.futures[n] = self.pool.submit(self._checked, n)
                self.inflight_bytes += self.param_bytes.get(n, 0)

    def _free_handed(self) -> None:
        for t in self.handed:
            st = t.untyped_storage()
            if st.resizable():  # tensors straight from safetensors are not; they are small here
                st.resize_(0)
        self.handed.clear()

    def __call__(self, write_item) -> torch.Tensor:
        t0 = time.perf_counter()
        self._free_handed()
        key = (write_item.index.fqn, tuple(int(x) for x in write_item.index.offset))
        if key not in self.views:
            raise CheckpointError(f"the checkpoint writer asked for {key}, which no parameter provides")
        name, size, stride, offset = self.views[key]
        full = self.cache.pop(name, None)
        if full is None:
            fut = self.futures.pop(name, None)
            if fut is not None:
                self.inflight_bytes -= self.param_bytes.get(name, 0)
                t1 = time.perf_counter()
                full = fut.result()
                self.wait_seconds += time.perf_counter() - t1
            else:
                self.started.add(name)
                full = self._checked(name)
            self._prefetch_after(name)
        self.remaining[name] -= 1
        whole = size == tuple(full.shape) and stride == tuple(full.stride()) and offset == 0
        if whole and self.remaining[name] == 0:
            chunk = full
        else:
            chunk = full.as_strided(size, stride, offset).clone()
            if self.remaining[name] > 0:
                self.cache[name] = full
        del full
        chunk = chunk.view(tuple(write_item.tensor_data.chunk.sizes))
        self.handed.append(chunk)
        n = chunk.numel() * chunk.element_size()
        self.bytes += n
        if self.progress is not None:
            self.progress.update(n)
        self.seconds += time.perf_counter() - t0
        return chunk

    def close(self) -> None:
        for f in self.futures.values():
            f.cancel()
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        self.futures.clear()
        self._free_handed()
        self.cache.clear()


def _lazy_save_strategy(lazy: _LazyTensors):
    """A megatron SaveShardedStrategy ('torch_dist', 1) that writes with torch's FileSystemWriter
    (one file per rank, serial), asking ``lazy`` for each tensor's bytes as it is written."""
    from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
    from megatron.core.dist_checkpointing.strategies.torch import (MCoreSavePlanner,
                                                                   _replace_state_dict_keys_with_sharded_keys,
                                                                   mcore_to_pyt_state_dict)
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.planner import WriteItemType

    class LazyPlanner(MCoreSavePlanner):
        def finish_plan(self, new_plan):
            plan = super().finish_plan(new_plan)
            lazy.set_order([(i.index.fqn, tuple(int(x) for x in i.index.offset)) for i in plan.items
                            if i.type != WriteItemType.BYTE_IO])
            return plan

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            return lazy(write_item)

    class LazyTorchDistSave(SaveShardedStrategy):
        def __init__(self):
            super().__init__("torch_dist", 1)

        @property
        def can_handle_sharded_objects(self):
            return True

        def save(self, sharded_state_dict, checkpoint_dir):
            sd, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica=True)
            pyt = mcore_to_pyt_state_dict(sd, False)
            writer = FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True, sync_files=True,
                                      thread_count=1, per_thread_copy_ahead=0)
            dcp_save(pyt, storage_writer=writer,
                     planner=LazyPlanner(dedup_replicated_tensors=False, flatten_state_dict=False))

    return LazyTorchDistSave()
