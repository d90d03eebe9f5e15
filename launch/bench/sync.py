"""``mgrpo bench sync``: weight sync of the full Qwen3-Omni-30B-A3B thinker, trainer GPU -> receiver GPU.

What runs (two processes; on CUDA the trainer on ``cuda:0``, the receiver on ``cuda:1``):

* **trainer**: our thinker (megatron-core, ``--backend`` layer spec, default ``"torch"``: grouped
  experts as training runs it on the GPU machine) with the release's geometry and ``--layers``
  decoder layers (default 48: hidden 2048, 32/4 heads of 128, 128 experts x 768, vocab 152064) and
  ``--audio-layers`` audio-tower layers (default 32, full width), built on the meta device, then
  materialised with ``to_empty`` on the trainer's device and filled with random N(0, 0.02) values
  (``--dtype``, default bf16). It runs the real weight-sync stream:
  ``iter_buckets(export_hf(model), bucket_bytes)`` -> ``pack_bucket`` (one uint8 buffer per bucket,
  on the trainer's device) -> one broadcast per bucket;
* **receiver**: allocates each bucket's buffer from its metadata (``packed_layout``), receives the
  broadcast and rebuilds the HF-named tensors with ``unpack_bucket`` (views: the ``(name, tensor)``
  pairs vLLM's ``model.load_weights`` is handed). Nothing else is done with them in the timed runs.

Transports (``--transport``): ``pg`` (default on CUDA) is a two-rank torch process group of its own
(NCCL on CUDA, gloo on CPU) carrying the packed buckets, with up to ``--buffers`` buckets in flight
(the next bucket is exported and packed while the previous one is on the wire); ``gloo`` (default on
CPU) is the product's CPU transport itself: :class:`megatron_grpo.weight_sync.gloo.GlooTransport` on
the trainer and ``join_gloo_group`` + ``recv_bucket`` (what our vLLM-side engine calls) on the
receiver, one bucket at a time. In production the GPU path is vLLM's NCCL engine driven by
:class:`~megatron_grpo.weight_sync.nccl.NcclTransport`; vLLM is not installed on the GPU machine, so
``pg`` moves the same bytes with our bucket format over plain NCCL. The bucket metadata (names,
dtypes, shapes; HTTP in production, concurrent with the bytes) is sent to the receiver once, before
timing, from ``export_plan`` of the meta model; the trainer checks that every exported bucket matches it.

Measured in the same run, same process pair, same bytes (payload = the tensors' bytes, GB = 1e9 B):

* **raw**: one broadcast of the payload's byte count (the transport's bandwidth ceiling);
* **raw_bucketed**: broadcasts of the same bucket sizes back to back from a preallocated buffer
  (the per-collective overhead of bucketing, no export or packing);
* **pipelined** (the headline): the whole stream as described, timed from the trainer's first
  ``export_hf`` step to the receiver's last unpacked bucket (both processes start after a barrier;
  their monotonic clocks are the host's);
* **serial**: the same with a device synchronisation after every phase of every bucket, for the
  per-phase breakdown: trainer ``export`` (``export_hf`` + bucketing), ``pack``, ``broadcast``;
  receiver ``receive`` (allocate + broadcast) and ``unpack``. With the ``gloo`` transport
  ``recv_bucket`` does receive and unpack in one call (reported as ``receive``).

Each is run ``--warmup`` + ``--iters`` times (medians reported). A last, untimed pass checks the
result: every tensor the receiver rebuilt must have the name, shape and dtype ``export_hf`` yielded
and the same bytes (two integer checksums of the raw bytes per tensor, on the device).

Targets: the 30B thinker's ~61 GB in <= 0.5 s, and >= 75% of the raw broadcast bandwidth.

Outputs under ``--out``: ``bench_sync.json`` (every number, the environment, the tensor and bucket
counts) and ``bench_sync.png``. ``--tiny`` shrinks the widths (hidden 64, 8 experts, ...) so the
whole benchmark runs on a CPU in seconds (with ``--layers 48 --experts 128`` it keeps the release's
18,900 tensors: the per-tensor host overhead without the bytes).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pickle
import platform
import statistics
import sys
import time
from collections import deque
from pathlib import Path

__all__ = ["sync_config", "tensor_digest", "run_bench", "add_parser", "TARGET_SECONDS", "TARGET_VS_RAW"]

TARGET_SECONDS = 0.5
TARGET_GB = 61.0
TARGET_VS_RAW = 0.75
GB = 1e9


# ------------------------------------------------------------------------------------------------
# model geometry
# ------------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------------
# checks
# ------------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------------
# the two processes' plumbing: a control store, a barrier, the transports
# ------------------------------------------------------------------------------------------------

def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)  # the host's clock: comparable across processes


class _Ctrl:
    """A TCPStore between the two processes (hosted by the trainer) for metadata, barriers, results."""

    def __init__(self, port: int, rank: int, timeout_s: float):
        from datetime import timedelta

        import torch.distributed as dist

        self.rank = rank
        self.store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
        self._n = 0

    def put(self, key: str, value) -> None:
        self.store.set(key, pickle.dumps(value))

    def get(self, key: str):
        return pickle.loads(self.store.get(key))  # blocks until set

    def barrier(self) -> None:
        self._n += 1
        key = f"barrier/{self._n}"
        self.store.add(key, 1)
        while self.store.add(key, 0) < 2:
            time.sleep(0.0002)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


# ------------------------------------------------------------------------------------------------
# one pass of the stream, each side
# ------------------------------------------------------------------------------------------------

class _Progress:
    def __init__(self, total: int, label: str, enabled: bool, every: float = 0.25):
        self.total, self.label, self.enabled = total, label, enabled
        self.step, self.next = every * total, every * total
        self.done = 0

    def add(self, n: int) -> None:
        self.done += n
        if self.enabled and self.done >= self.next and self.done < self.total:
            print(f"[bench sync]   {self.label}: {self.done / GB:.1f} / {self.total / GB:.1f} GB", flush=True)
            while self.next <= self.done:
                self.next += self.step


def _trainer_pass(model, spec, plan, tr, device, bucket_bytes: int, serial: bool, buffers: int,
                  sink: _Sink | None, progress: _Progress | None) -> dict:
    from megatron_grpo.weight_sync.buckets import iter_buckets, pack_bucket
    from model_bridge.export import export_hf

    phases = {"export": 0.0, "pack": 0.0, "broadcast": 0.0}
    weights = export_hf(model, spec)
    if sink is not None:
        weights = _tap(weights, sink)
    buckets = iter_buckets(weights, bucket_bytes)
    inflight = deque()
    limit = 0 if serial else max(0, buffers - 1)
    k = 0
    t_start = _now()
    while True:
        t0 = _now()
        bucket = next(buckets, None)
        if serial:
            _sync(device)
        t1 = _now()
        phases["export"] += t1 - t0
        if bucket is None:
            break
        if bucket.names != plan[k]["names"]:
            raise RuntimeError(f"bucket {k} of the export stream does not match the plan sent to the receiver "
                               f"(first names {bucket.names[:2]} vs {plan[k]['names'][:2]})")
        buf = pack_bucket(bucket.tensors, device=device)
        nbytes = bucket.nbytes
        del bucket
        if serial:
            _sync(device)
        t2 = _now()
        phases["pack"] += t2 - t1
        inflight.append((tr.send(buf), buf))
        while len(inflight) > limit:
            work, _ = inflight.popleft()
            tr.wait(work)
        if serial:
            _sync(device)
        phases["broadcast"] += _now() - t2
        if progress:
            progress.add(nbytes)
        k += 1
    t0 = _now()
    while inflight:
        work, _ = inflight.popleft()
        tr.wait(work)
    _sync(device)
    phases["broadcast"] += _now() - t0
    if k != len(plan):
        raise RuntimeError(f"the export stream gave {k} buckets, the plan has {len(plan)}")
    return {"start": t_start, "end": _now(), "phases": phases, "buckets": k}


def _receiver_pass(plan, rx, device, serial: bool, buffers: int, sink: _Sink) -> dict:
    import torch

    from megatron_grpo.weight_sync.buckets import dtype_from_name, packed_layout, unpack_bucket

    phases = {"receive": 0.0, "unpack": 0.0}
    t_start = _now()
    if isinstance(rx, _GlooProductReceiver):
        for meta in plan:
            t0 = _now()
            pairs = rx.recv_bucket(meta)
            phases["receive"] += _now() - t0
            sink(pairs)
        phases["unpack"] = None
        return {"start": t_start, "end": _now(), "phases": phases}
    inflight = deque()
    limit = 0 if serial else max(0, buffers - 1)
    for meta in plan:
        t0 = _now()
        dtypes = [dtype_from_name(d) for d in meta["dtype_names"]]
        _, _, total = packed_layout(dtypes, meta["shapes"])
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        work = rx.recv(buf)
        if serial:
            rx.wait(work)
            _sync(device)
        t1 = _now()
        phases["receive"] += t1 - t0
        pairs = unpack_bucket(buf, meta["names"], dtypes, meta["shapes"])
        if serial:
            _sync(device)
        phases["unpack"] += _now() - t1
        sink(pairs)
        del pairs
        inflight.append((work, buf))
        while len(inflight) > limit:
            w, _ = inflight.popleft()
            rx.wait(w)
    t0 = _now()
    while inflight:
        w, _ = inflight.popleft()
        rx.wait(w)
    _sync(device)
    phases["receive"] += _now() - t0
    return {"start": t_start, "end": _now(), "phases": phases}


def _raw_pass(tr_or_rx, is_trainer: bool, device, sizes: list[int], buf, buffers: int) -> dict:
    """Broadcast ``sizes`` bytes back to back out of / into ``buf`` (one size: the raw ceiling)."""
    t0 = _now()
    if isinstance(tr_or_rx, (_GlooProductTrainer, _GlooProductReceiver)):
        for n in sizes:
            if is_trainer:
                tr_or_rx.send(buf[:n])
            else:
                rx = tr_or_rx
                rx.recv_bucket({"names": ["raw"], "dtype_names": ["uint8"], "shapes": [[n]]})
        return {"start": t0, "end": _now()}
    inflight = deque()
    for n in sizes:
        view = buf[:n]
        inflight.append(tr_or_rx.send(view) if is_trainer else tr_or_rx.recv(view))
        while len(inflight) > max(0, buffers - 1):
            tr_or_rx.wait(inflight.popleft())
    while inflight:
        tr_or_rx.wait(inflight.popleft())
    _sync(device)
    return {"start": t0, "end": _now()}


# ------------------------------------------------------------------------------------------------
# the ranks
# ------------------------------------------------------------------------------------------------

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


def _rank_main(opts: dict):
    rank = int(os.environ["RANK"])
    ctrl_port = int(os.environ["MASTER_PORT"])
    ctrl = _Ctrl(ctrl_port, rank, opts["timeout_s"])
    out = (_trainer if rank == 0 else _receiver)(opts, ctrl)
    # the trainer hosts the store: it leaves only once the receiver is done with it
    if rank == 0:
        ctrl.get("receiver_done")
    else:
        ctrl.put("receiver_done", True)
    return out


def _say(opts, msg: str) -> None:
    if not opts.get("quiet"):
        print(f"[bench sync] {msg}", flush=True)


def _trainer(opts: dict, ctrl: _Ctrl) -> dict:
    import torch

    from megatron_grpo.testing.dist import free_port
    from megatron_grpo.weight_sync.buckets import iter_buckets
    from model_bridge.config import ParallelLayout, parse_omni_config
    from model_bridge.export import export_plan
    from model_bridge.modeling import build_thinker
    from model_bridge.parallel import destroy_parallel, init_parallel

    say = lambda m: _say(opts, m)  # noqa: E731
    t_all = time.perf_counter()
    # the trainer is a one-rank megatron job of its own; the transport is a separate group
    os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_PORT=str(free_port()))
    device = torch.device(opts["device"], 0) if opts["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_parallel(seed=opts["seed"])
    dtype = _dtype(opts["dtype"])
    cfg = sync_config(opts["layers"], opts["audio_layers"], opts["tiny"], opts["experts"])
    spec = parse_omni_config(cfg, where="bench sync")
    res = {"env": _env(device), "config": {k: v for k, v in opts.items() if k != "quiet"},
           "geometry": {k: cfg["thinker_config"]["text_config"][k] for k in (
               "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "num_experts", "num_experts_per_tok", "moe_intermediate_size", "vocab_size")}}
    res["geometry"]["audio_layers"] = opts["audio_layers"]

    # 1. the model on the meta device and the exact tensor list it pushes
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = build_thinker(spec, ParallelLayout(), dtype, backend=opts["backend"], dummy_audio=False,
                              perform_initialization=False, build_audio=opts["audio_layers"] > 0)
    plan_t = export_plan(model, spec)
    layout = _checkpoint_layout(cfg, audio=opts["audio_layers"] > 0)
    got = {n: tuple(s) for n, s, _ in plan_t}
    if got != layout or len(got) != len(plan_t):
        missing, extra = sorted(set(layout) - set(got))[:5], sorted(set(got) - set(layout))[:5]
        wrong = [n for n in got if n in layout and got[n] != layout[n]][:5]
        raise RuntimeError(f"export_plan does not match the checkpoint layout: missing {missing}, extra {extra}, "
                           f"wrong shapes {wrong}")
    payload = sum(math.prod(s) * torch.empty((), dtype=dt).element_size() for _, s, dt in plan_t)
    bucket_bytes = int(opts["bucket_mb"] * 2**20)
    fake = ((n, torch.empty(s, dtype=dt, device="meta")) for n, s, dt in plan_t)
    plan = [b.metadata() for b in iter_buckets(fake, bucket_bytes)]
    sizes = _bucket_packed_sizes(plan)
    experts = sum(1 for n, _, _ in plan_t if ".mlp.experts." in n)
    res["plan"] = {"tensors": len(plan_t), "expert_tensors": experts, "payload_bytes": payload,
                   "buckets": len(plan), "bucket_bytes": bucket_bytes, "packed_bytes": sum(sizes),
                   "largest_tensor": max(((n, list(s)) for n, s, _ in plan_t),
                                         key=lambda x: math.prod(x[1]))}
    say(f"plan: {len(plan_t):,} HF tensors ({experts:,} per-expert), {payload / GB:.3f} GB {opts['dtype']} in "
        f"{len(plan)} buckets of <= {opts['bucket_mb']:g} MiB (export_plan of the meta model, "
        f"{time.perf_counter() - t0:.1f} s; names and shapes match the checkpoint layout)")
    ctrl.put("plan", plan)

    # 2. transport
    if opts["transport"] == "gloo":
        tr = _GlooProductTrainer(ctrl, opts["timeout_s"])
    else:
        tr = _PgTransport(ctrl, 0, device, opts["timeout_s"])
    res["transport"] = {"kind": tr.name, "backend": tr.backend, "buffers": opts["buffers"]}
    say(f"transport: {tr.name} ({tr.backend}), trainer {device} -> receiver "
        f"{'cuda:1' if device.type == 'cuda' else 'cpu'}")

    # 3. raw bandwidth (before the model takes the memory)
    n_runs = opts["warmup"] + opts["iters"]
    big = torch.empty(payload, dtype=torch.uint8, device=device)
    big.fill_(7)
    raw = _timed(ctrl, n_runs, opts["warmup"], _raw_pass, tr, True, device, [payload], big, opts["buffers"])
    del big
    biggest = max(sizes)
    buf = torch.empty(biggest, dtype=torch.uint8, device=device)
    rawb = _timed(ctrl, n_runs, opts["warmup"], _raw_pass, tr, True, device, sizes, buf, opts["buffers"])
    del buf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    res["raw"] = _summ(raw, payload)
    res["raw_bucketed"] = _summ(rawb, sum(sizes))
    say(f"raw broadcast of {payload / GB:.2f} GB: {res['raw']['seconds']:.3f} s = {res['raw']['gb_per_s']:.1f} GB/s; "
        f"same bytes in {len(sizes)} bucket broadcasts: {res['raw_bucketed']['seconds']:.3f} s = "
        f"{res['raw_bucketed']['gb_per_s']:.1f} GB/s")

    # 4. materialise the model: real storage, random values
    t0 = time.perf_counter()
    say(f"materialising the model on {device} ({payload / GB:.1f} GB) ...")
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(opts["seed"])
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.zero_()
    _sync(device)
    res["materialise_s"] = time.perf_counter() - t0
    if device.type == "cuda":
        res["trainer_memory_gib"] = {"model": torch.cuda.memory_allocated(device) / 2**30}
    say(f"model ready in {res['materialise_s']:.1f} s")

    # 5. the stream: pipelined (headline), serial (phase breakdown)
    for mode in ("pipelined", "serial"):
        runs = []
        for i in range(n_runs):
            label = f"{mode} {'warmup' if i < opts['warmup'] else 'run'} {i + 1}/{n_runs}"
            prog = _Progress(payload, label, enabled=not opts.get("quiet"))
            ctrl.barrier()
            _sync(device)
            r = _trainer_pass(model, spec, plan, tr, device, bucket_bytes, mode == "serial", opts["buffers"],
                              None, prog)
            rx = ctrl.get(f"rx/{mode}/{i}")
            r["seconds"] = max(r["end"], rx["end"]) - r["start"]
            r["receiver_phases"] = rx["phases"]
            runs.append(r)
            say(f"{label}: {payload / GB:.2f} GB in {r['seconds']:.3f} s = {payload / r['seconds'] / GB:.1f} GB/s "
                f"(trainer: " + ", ".join(f"{k} {v:.3f} s" for k, v in r["phases"].items()) + "; receiver: "
                + ", ".join(f"{k} {v:.3f} s" for k, v in rx["phases"].items() if v is not None) + ")")
        res[mode] = _summ_stream(runs[opts["warmup"]:], payload)
    if device.type == "cuda":
        res.setdefault("trainer_memory_gib", {})["peak"] = torch.cuda.max_memory_allocated(device) / 2**30
    res["vs_raw"] = res["raw"]["seconds"] / res["pipelined"]["seconds"]
    res["targets"] = _targets(res, payload)

    # 6. the check: what the receiver rebuilt is what export_hf yielded
    say("checking: one more pass with checksums of every tensor on both sides ...")
    sink = _Sink(check=True, keep=opts["keep_tensors"])
    ctrl.barrier()
    _trainer_pass(model, spec, plan, tr, device, bucket_bytes, True, opts["buffers"], sink, None)
    mine = sink.result()
    theirs = ctrl.get("rx/check")
    res["check"] = _compare(mine, theirs)
    say(f"check: {res['check']['equal']} of {res['check']['tensors']} tensors identical (name, dtype, shape, bytes)"
        + ("" if res["check"]["ok"] else f"; MISMATCH: {res['check']['mismatched'][:5]}"))
    if opts["keep_tensors"]:
        res["tensors"] = {"sent": mine["tensors"], "received": theirs["tensors"]}
    tr.close()
    res["wall_s"] = time.perf_counter() - t_all
    destroy_parallel()
    return res


def _receiver(opts: dict, ctrl: _Ctrl) -> dict:
    import torch

    device = torch.device("cuda", 1) if opts["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    plan = ctrl.get("plan")
    rx = _GlooProductReceiver(ctrl) if opts["transport"] == "gloo" else _PgTransport(ctrl, 1, device, opts["timeout_s"])
    sizes = _bucket_packed_sizes(plan)
    payload = sum(_payload_sizes(plan))
    n_runs = opts["warmup"] + opts["iters"]
    big = torch.empty(payload, dtype=torch.uint8, device=device)
    _timed(ctrl, n_runs, opts["warmup"], _raw_pass, rx, False, device, [payload], big, opts["buffers"])
    del big
    buf = torch.empty(max(sizes), dtype=torch.uint8, device=device)
    _timed(ctrl, n_runs, opts["warmup"], _raw_pass, rx, False, device, sizes, buf, opts["buffers"])
    del buf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for mode in ("pipelined", "serial"):
        for i in range(n_runs):
            ctrl.barrier()
            _sync(device)
            r = _receiver_pass(plan, rx, device, mode == "serial", opts["buffers"], _Sink())
            ctrl.put(f"rx/{mode}/{i}", r)
    sink = _Sink(check=True, keep=opts["keep_tensors"])
    ctrl.barrier()
    _receiver_pass(plan, rx, device, True, opts["buffers"], sink)
    ctrl.put("rx/check", sink.result())
    out = {"peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}
    rx.close()
    return out


def _payload_sizes(plan) -> list[int]:
    import torch

    from megatron_grpo.weight_sync.buckets import dtype_from_name

    return [sum(math.prod(s) * torch.empty((), dtype=dtype_from_name(d)).element_size()
                for d, s in zip(m["dtype_names"], m["shapes"])) for m in plan]


def _bucket_packed_sizes(plan) -> list[int]:
    from megatron_grpo.weight_sync.buckets import dtype_from_name, packed_layout

    return [packed_layout([dtype_from_name(d) for d in m["dtype_names"]], m["shapes"])[2] for m in plan]


def _timed(ctrl: _Ctrl, n: int, warmup: int, fn, *args) -> list[float]:
    """``n`` runs of ``fn(*args)`` after a barrier each; both sides' (start, end) pairs are exchanged so
    the trainer times from its start to the later end (seconds of the runs after ``warmup``)."""
    out = []
    for i in range(n):
        ctrl.barrier()
        r = fn(*args)
        key = f"timed/{ctrl._n}"
        if ctrl.rank == 1:
            ctrl.put(key, r)
        else:
            other = ctrl.get(key)
            if i >= warmup:
                out.append(max(r["end"], other["end"]) - r["start"])
    return out


def _summ(seconds: list[float], nbytes: int) -> dict:
    if not seconds:  # the receiver's side
        return {}
    med = statistics.median(seconds)
    return {"seconds": med, "runs_s": seconds, "bytes": nbytes, "gb_per_s": nbytes / med / GB}


def _summ_stream(runs: list[dict], payload: int) -> dict:
    secs = [r["seconds"] for r in runs]
    med = statistics.median(secs)
    best = min(range(len(runs)), key=lambda i: abs(runs[i]["seconds"] - med))
    return {"seconds": med, "runs_s": secs, "bytes": payload, "gb_per_s": payload / med / GB,
            "trainer_phases_s": runs[best]["phases"], "receiver_phases_s": runs[best]["receiver_phases"],
            "buckets": runs[best]["buckets"]}


def _targets(res: dict, payload: int) -> dict:
    s = res["pipelined"]["seconds"]
    scaled = TARGET_SECONDS * payload / (TARGET_GB * GB)
    return {"seconds<=0.5_for_61GB": s <= scaled, "target_seconds_for_these_bytes": scaled,
            "vs_raw>=0.75": res["vs_raw"] >= TARGET_VS_RAW, "vs_raw": res["vs_raw"]}


def _compare(mine: dict, theirs: dict) -> dict:
    a, b = mine["meta"], theirs["meta"]
    bad = []
    if len(a) != len(b):
        bad.append(f"{len(a)} tensors sent, {len(b)} received")
    equal = 0
    for (ma, da), (mb, db) in zip(zip(a, mine["digests"]), zip(b, theirs["digests"])):
        if ma == mb and da == db:
            equal += 1
        else:
            bad.append(f"{ma} -> {mb}")
    return {"ok": not bad and equal == len(a), "tensors": len(a), "equal": equal, "mismatched": bad[:20]}


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------

def run_bench(out_dir, layers: int = 48, audio_layers: int = 32, bucket_mb: int | None = None, dtype: str = "bf16",
              iters: int = 3, warmup: int = 1, device: str | None = None, transport: str | None = None,
              buffers: int = 2, tiny: bool = False, experts: int | None = None, backend: str = "torch",
              seed: int = 0, keep_tensors: bool = False, quiet: bool = False, timeout_s: float = 1800,
              plot: bool = True) -> dict:
    """Run the benchmark (module docstring); returns the trainer's results and writes them under out_dir.
    ``keep_tensors`` (tests, tiny sizes) also returns every sent and received tensor on the CPU."""
    import torch

    from megatron_grpo.testing.dist import run_ranks
    from megatron_grpo.weight_sync.buckets import CPU_BUCKET_BYTES, GPU_BUCKET_BYTES

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(f"bench sync on CUDA needs 2 GPUs (trainer cuda:0, receiver cuda:1); this machine has "
                         f"{torch.cuda.device_count()}. Use --device cpu for the gloo path.")
    transport = transport or ("pg" if device == "cuda" else "gloo")
    if transport == "gloo" and device == "cuda":
        raise SystemExit("--transport gloo is the product's CPU transport: use it with --device cpu")
    if bucket_mb is None:
        bucket_mb = (GPU_BUCKET_BYTES if device == "cuda" else CPU_BUCKET_BYTES) // 2**20
    opts = dict(layers=layers, audio_layers=audio_layers, bucket_mb=float(bucket_mb), dtype=dtype, iters=iters,
                warmup=warmup, device=device, transport=transport, buffers=buffers, tiny=tiny, experts=experts,
                backend=backend, seed=seed, keep_tensors=keep_tensors, quiet=quiet, timeout_s=timeout_s)
    env = {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else None
    t0 = time.time()
    values = run_ranks(_rank_main, 2, opts, timeout=timeout_s, env=env)
    res, rx = values
    res["receiver"] = rx
    res["wall_s"] = time.time() - t0
    argv = sys.argv[3:] if sys.argv[1:3] == ["bench", "sync"] else sys.argv[1:]
    res["command"] = " ".join(["mgrpo", "bench", "sync", *argv])
    tensors = res.pop("tensors", None)
    (out / "bench_sync.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    if plot:
        _plot(res, out / "bench_sync.png")
    if not quiet:
        _print_summary(res)
    if tensors is not None:
        res["tensors"] = tensors
    return res


def _print_summary(res: dict) -> None:
    p = res["plan"]
    print(f"\n{p['tensors']:,} tensors, {p['payload_bytes'] / GB:.3f} GB, {p['buckets']} buckets "
          f"({res['transport']['kind']}/{res['transport']['backend']})")
    print(f"{'':<14} {'seconds':>9} {'GB/s':>8}")
    for k in ("raw", "raw_bucketed", "pipelined", "serial"):
        print(f"{k:<14} {res[k]['seconds']:>9.3f} {res[k]['gb_per_s']:>8.1f}")
    ph = res["serial"]
    print("serial phases: trainer " + ", ".join(f"{k} {v:.3f}" for k, v in ph["trainer_phases_s"].items())
          + "; receiver " + ", ".join(f"{k} {v:.3f}" for k, v in ph["receiver_phases_s"].items() if v is not None))
    print(f"pipelined vs raw: {res['vs_raw']:.2f}; targets: {json.dumps(res['targets'])}; "
          f"check: {'ok' if res['check']['ok'] else 'FAILED'} ({res['check']['equal']}/{res['check']['tensors']})")


def _plot(res: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - no matplotlib: JSON only
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    names = ["raw", "raw_bucketed", "pipelined", "serial"]
    axes[0].bar(names, [res[n]["gb_per_s"] for n in names], color=["0.5", "0.7", "tab:blue", "tab:cyan"])
    payload = res["plan"]["payload_bytes"]
    axes[0].axhline(TARGET_GB * GB / TARGET_SECONDS / GB, color="tab:red", ls="--", label="61 GB in 0.5 s")
    axes[0].axhline(TARGET_VS_RAW * res["raw"]["gb_per_s"], color="k", ls=":", label="75% of raw")
    axes[0].set_ylabel("GB/s (payload)")
    axes[0].legend(fontsize=8)
    tp, rp = res["serial"]["trainer_phases_s"], res["serial"]["receiver_phases_s"]
    bottom = 0.0
    for k, v in tp.items():
        axes[1].bar(["serial (trainer)"], [v], bottom=bottom, label=f"trainer {k}")
        bottom += v
    bottom = 0.0
    for k, v in rp.items():
        if v is not None:
            axes[1].bar(["serial (receiver)"], [v], bottom=bottom, label=f"receiver {k}")
            bottom += v
    axes[1].bar(["pipelined"], [res["pipelined"]["seconds"]], color="tab:blue")
    axes[1].bar(["raw"], [res["raw"]["seconds"]], color="0.5")
    axes[1].set_ylabel("seconds")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"weight sync: {res['plan']['tensors']:,} tensors, {payload / GB:.1f} GB, {res['plan']['buckets']} "
                 f"buckets, {res['transport']['kind']}/{res['transport']['backend']} "
                 f"({res['env'].get('gpu', 'cpu')})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cmd(args: argparse.Namespace) -> int:
    res = run_bench(args.out, layers=args.layers, audio_layers=args.audio_layers, bucket_mb=args.bucket_mb,
                    dtype=args.dtype, iters=args.iters, warmup=args.warmup, device=args.device,
                    transport=args.transport, buffers=args.buffers, tiny=args.tiny, experts=args.experts,
                    backend=args.backend, seed=args.seed, timeout_s=args.timeout)
    return 0 if res["check"]["ok"] else 1


def add_parser(bsub) -> argparse.ArgumentParser:
    s = bsub.add_parser("sync", help="weight sync (export_hf -> buckets -> broadcast -> unpack) of the 30B "
                                     "thinker between two GPUs, against raw NCCL bandwidth",
                        description=__doc__.split("\n\n")[0])
    s.add_argument("--layers", type=int, default=48, help="decoder layers (default 48, the release's)")
    s.add_argument("--audio-layers", type=int, default=32,
                   help="audio-tower layers (default 32, the release's; 0: no audio tower)")
    s.add_argument("--out", default="bench_results/sync", help="results directory (JSON, PNG)")
    s.add_argument("--bucket-mb", type=float, default=None,
                   help="bucket size in MiB (default: the product's, 512 on GPU, 64 on CPU)")
    s.add_argument("--dtype", default="bf16", help="model (and pushed) dtype: bf16, fp16 or fp32")
    s.add_argument("--iters", type=int, default=3, help="timed runs of each kind (median reported)")
    s.add_argument("--warmup", type=int, default=1, help="untimed runs before them")
    s.add_argument("--device", default=None, choices=["cuda", "cpu"],
                   help="cuda (default when available: needs 2 GPUs) or cpu (gloo between two processes)")
    s.add_argument("--transport", default=None, choices=["pg", "gloo"],
                   help="pg: a two-rank torch process group, NCCL on CUDA (default there); gloo: the product's "
                        "CPU transport, GlooTransport + recv_bucket (default on CPU)")
    s.add_argument("--buffers", type=int, default=2, help="buckets in flight at once with --transport pg")
    s.add_argument("--tiny", action="store_true", help="tiny widths (a CPU run of the whole benchmark in seconds)")
    s.add_argument("--experts", type=int, default=None, help="experts per layer (default: the geometry's)")
    s.add_argument("--backend", default="torch",
                   help="layer-spec backend of the model (default torch: grouped experts)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--timeout", type=float, default=1800, help="seconds before the two processes are killed")
    s.set_defaults(func=_cmd)
    return s


def main(argv=None) -> int:
    """``python -m launch.bench.sync ARGS`` == ``mgrpo bench sync ARGS``."""
    p = argparse.ArgumentParser(prog="mgrpo bench")
    add_parser(p.add_subparsers(dest="kind", required=True))
    args = p.parse_args(["sync", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
