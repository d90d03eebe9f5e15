"""The trainer process of :mod:`launch.bench.sync`: the meta model's plan, the raw runs, the
materialised model and the export -> pack -> broadcast stream, the check."""
from __future__ import annotations

import math
import os
import time
from collections import deque

from launch.bench._sync_common import (GB, _bucket_packed_sizes, _checkpoint_layout, _Ctrl, _drain, _dtype, _env,
                                       _now, _say, _Sink, _sync, _tap, sync_config)
from launch.bench._sync_raw import _raw_pass, _timed
from launch.bench._sync_report import _compare, _summ, _summ_stream, _targets
from launch.bench._sync_transport import _GlooProductTrainer, _PgTransport


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
        _drain(inflight, tr, limit)
        if serial:
            _sync(device)
        phases["broadcast"] += _now() - t2
        if progress:
            progress.add(nbytes)
        k += 1
    t0 = _now()
    _drain(inflight, tr)
    _sync(device)
    phases["broadcast"] += _now() - t0
    if k != len(plan):
        raise RuntimeError(f"the export stream gave {k} buckets, the plan has {len(plan)}")
    return {"start": t_start, "end": _now(), "phases": phases, "buckets": k}


def _trainer(opts: dict, ctrl: _Ctrl) -> dict:
    import torch

    from model_bridge.spawn import free_port
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
