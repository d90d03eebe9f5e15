"""What both processes of :mod:`launch.bench.sync` share: the model config and its checkpoint
layout, the byte checks, the control store, the environment and the bucket sizes of a plan."""
from __future__ import annotations

import datetime
import math
import os
import pickle
import platform
import time

TARGET_SECONDS = 0.5
TARGET_GB = 61.0
TARGET_VS_RAW = 0.75
GB = 1e9


def sync_config(layers: int = 48, audio_layers: int = 32, tiny: bool = False, experts: int | None = None) -> dict:
    """config.json of the benchmarked model: Qwen3-Omni-30B-A3B's thinker (``launch.bench.convert``'s
    full-width builder) with ``layers`` decoder and ``audio_layers`` audio layers; ``tiny`` shrinks
    the widths (the layers bench's tiny text geometry, a 64-wide audio tower)."""
    from launch.bench.convert import bench_config

    cfg = bench_config(layers, audio_layers=max(1, audio_layers), vision_blocks=1)
    tc, ac = cfg["thinker_config"]["text_config"], cfg["thinker_config"]["audio_config"]
    if tiny:
        from launch.bench.layers import geometry

        g = geometry(layers, tiny=True)
        tc.update(hidden_size=g["hidden"], num_attention_heads=g["heads"], num_key_value_heads=g["kv_heads"],
                  head_dim=g["head_dim"], num_experts=g["experts"], num_experts_per_tok=g["topk"],
                  moe_intermediate_size=g["ffn"], intermediate_size=g["ffn"], vocab_size=g["vocab"])
        tc["rope_parameters"]["mrope_section"] = list(g["mrope_section"])
        ac.update(d_model=64, encoder_attention_heads=4, encoder_ffn_dim=128, downsample_hidden_size=16,
                  output_dim=g["hidden"])
    if experts:
        tc["num_experts"] = int(experts)
        tc["num_experts_per_tok"] = min(tc["num_experts_per_tok"], int(experts))
    return cfg


def _checkpoint_layout(cfg: dict, audio: bool) -> dict[str, tuple[int, ...]]:
    """name -> shape of the tensors the trainer pushes, from the checkpoint's on-disk layout
    (``convert.hf_tensor_specs``): the thinker without the vision tower (not trained, never pushed)."""
    from launch.bench.convert import hf_tensor_specs

    out = {}
    for name, shape in hf_tensor_specs(cfg):
        if name.startswith("thinker.visual.") or (not audio and name.startswith("thinker.audio_tower.")):
            continue
        out[name] = tuple(shape)
    return out


_DIGEST_CHUNK = 1 << 24


def tensor_digest(t):
    """Two integer checksums of ``t``'s raw bytes (sum, and sum weighted by position mod 65521), as an
    int64 tensor [2] on ``t``'s device (no host sync): equal bytes give equal digests, and a changed,
    swapped or shifted byte changes them."""
    import torch

    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    out = torch.zeros(2, dtype=torch.int64, device=b.device)
    for off in range(0, b.numel(), _DIGEST_CHUNK):
        x = b[off:off + _DIGEST_CHUNK].to(torch.int64)
        w = torch.arange(off, off + x.numel(), dtype=torch.int64, device=b.device).remainder_(65521).add_(1)
        out[0] += x.sum()
        out[1] += (x * w).sum()
    return out


class _Sink:
    """What the receiver does with the rebuilt (name, tensor) pairs: nothing (timed runs), or collect
    (name, dtype, shape, digest) and optionally CPU copies (the check)."""

    def __init__(self, check: bool = False, keep: bool = False):
        self.check, self.keep = check, keep
        self.meta, self.digests, self.tensors = [], [], {}

    def __call__(self, pairs) -> None:
        if not self.check:
            return
        for name, t in pairs:
            self.meta.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
            self.digests.append(tensor_digest(t))
            if self.keep:
                self.tensors[name] = t.detach().to("cpu", copy=True)

    def result(self) -> dict:
        import torch

        d = torch.stack(self.digests).cpu().tolist() if self.digests else []
        return {"meta": self.meta, "digests": [tuple(x) for x in d], "tensors": self.tensors if self.keep else None}


def _tap(weights, sink: _Sink):
    """Pass ``weights`` through, recording each in ``sink`` (the trainer's side of the check)."""
    for name, t in weights:
        sink([(name, t)])
        yield name, t


def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)  # the host's clock: comparable across processes


class _Ctrl:
    """A TCPStore between the ``world`` processes (hosted by rank 0, the trainer) for metadata,
    barriers, results."""

    def __init__(self, port: int, rank: int, timeout_s: float, world: int = 2):
        from datetime import timedelta

        import torch.distributed as dist

        self.rank, self.world = rank, world
        self.store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                                   timeout=timedelta(seconds=timeout_s))
        self._n = 0

    def put(self, key: str, value) -> None:
        self.store.set(key, pickle.dumps(value))

    def get(self, key: str):
        return pickle.loads(self.store.get(key))  # blocks until set

    def barrier(self) -> None:
        self._n += 1
        key = f"barrier/{self._n}"
        self.store.add(key, 1)
        while self.store.add(key, 0) < self.world:
            time.sleep(0.0002)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _drain(inflight, waiter, limit: int = 0) -> None:
    """Wait (``waiter.wait``) for the oldest ``(work, buffer)`` pairs of ``inflight`` until at most
    ``limit`` are left."""
    while len(inflight) > limit:
        work, _ = inflight.popleft()
        waiter.wait(work)


def _env(device) -> dict:
    import torch

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__, "host": platform.node(),
           "cpu_count": os.cpu_count()}
    try:
        from importlib.metadata import version

        env["megatron_core"] = version("megatron-core")
    except Exception:  # noqa: BLE001
        env["megatron_core"] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpus"] = torch.cuda.device_count()
        env["cuda"] = torch.version.cuda
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            pass
    return env


def _dtype(name: str):
    import torch

    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
             "fp32": torch.float32, "float32": torch.float32}
    if name not in table:
        raise ValueError(f"--dtype must be one of {sorted(table)}, got {name!r}")
    return table[name]


def _say(opts, msg: str) -> None:
    if not opts.get("quiet"):
        print(f"[bench sync] {msg}", flush=True)


def _payload_sizes(plan) -> list[int]:
    import torch

    from megatron_grpo.weight_sync.buckets import dtype_from_name

    return [sum(math.prod(s) * torch.empty((), dtype=dtype_from_name(d)).element_size()
                for d, s in zip(m["dtype_names"], m["shapes"])) for m in plan]


def _bucket_packed_sizes(plan) -> list[int]:
    from megatron_grpo.weight_sync.buckets import dtype_from_name, packed_layout

    return [packed_layout([dtype_from_name(d) for d in m["dtype_names"]], m["shapes"])[2] for m in plan]
