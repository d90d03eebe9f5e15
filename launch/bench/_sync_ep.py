"""``mgrpo bench sync --ep N`` (:mod:`launch.bench.sync`): N trainer processes holding the thinker with
expert parallelism N, plus one receiver process; every process runs :func:`_ep_rank_main`, which goes
through the same sequence of phases on all N + 1 of them (separated by barriers of the control store).

Processes (``run_ranks``, N + 1 ranks): trainer rank r (0 <= r < N; ``cuda:r``) is rank r of a
megatron job of its own (world N, EP = N, TP = ETP = PP = 1, its own default group: NCCL on CUDA,
gloo on CPU); the receiver is rank N (``cuda:N``) and takes part in no megatron group. The data
plane is one stateless N + 1-rank process group (``weight_sync.direct.p2p_group``: NCCL or gloo)
carrying only point-to-point sends from trainers to the receiver.

Weights: every process fills its parameters from the same deterministic HF-space source (each HF
tensor ~N(0, 0.02) from a generator seeded by ``--seed`` and the tensor's name, loaded through the
model's mapping table), so an EP rank holds exactly its share of the weights a single-rank model
holds; the check compares against the single-rank ``export_hf`` of those weights.
"""
from __future__ import annotations

import hashlib
import math
import os
import time

from launch.bench._sync_common import GB, _checkpoint_layout, _Ctrl, _dtype, _env, _now, _Sink, _sync, _tap, sync_config
from launch.bench._sync_report import _compare, _summ


# ------------------------------------------------------------------------------------------------
# the weights
# ------------------------------------------------------------------------------------------------


def _key_seed(seed: int, key: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest(), "little") >> 1


class _SeededSource:
    """A ``model_bridge.mappings.Source`` of HF tensors that exist nowhere: ``read(key)`` draws the whole
    tensor (fp32 N(0, 0.02), generator seeded by the seed and ``key``, on ``device``) and slices it."""

    def __init__(self, shapes: dict, seed: int, device):
        self.shapes, self.seed, self.device = shapes, seed, device

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.shapes[key])

    def read(self, key, dim=0, start=None, stop=None, expect_shape=None):
        import torch

        shape = self.shape(key)
        if expect_shape is not None and tuple(expect_shape) != shape:
            raise ValueError(f"{key}: the layout says {shape}, the model expects {tuple(expect_shape)}")
        g = torch.Generator(device=self.device).manual_seed(_key_seed(self.seed, key))
        t = torch.empty(shape, dtype=torch.float32, device=self.device).normal_(0.0, 0.02, generator=g)
        if start is None and stop is None:
            return t
        return t.narrow(dim, start or 0, (t.shape[dim] if stop is None else stop) - (start or 0))


def _build_filled(spec, layout, opts: dict, ep: int, device):
    """The thinker (EP = ``ep`` under the current parallel state) built on the meta device, materialised
    on ``device`` and filled from :class:`_SeededSource`; (model, seconds)."""
    import torch

    from model_bridge.export import export_tasks

    t0 = time.perf_counter()
    model = _build_meta(spec, opts, ep)
    model.to_empty(device=device)
    src = _SeededSource(layout, opts["seed"], device)
    with torch.no_grad():
        for t in export_tasks(model, spec):
            t.param.data.copy_(t.mapping.load(src, t.hf, t.param.shape, t.shard).to(device, t.param.dtype))
    _sync(device)
    return model, time.perf_counter() - t0


def _build_meta(spec, opts: dict, ep: int):
    import torch

    from model_bridge.config import ParallelLayout
    from model_bridge.modeling import build_thinker

    with torch.device("meta"):
        return build_thinker(spec, ParallelLayout(ep=ep), _dtype(opts["dtype"]), backend=opts["backend"],
                             dummy_audio=False, perform_initialization=False, build_audio=opts["audio_layers"] > 0)


# ------------------------------------------------------------------------------------------------
# raw passes (no export, no pack): the transport's ceilings
# ------------------------------------------------------------------------------------------------


def _raw_send(group, dst: int, sizes: list[int], bufs: list, buffers: int) -> None:
    from megatron_grpo.weight_sync.direct import _finish

    inflight = []
    for k, n in enumerate(sizes):
        b = bufs[k % len(bufs)][:n]
        inflight.append((group.send([b], dst, k), b))
        while len(inflight) > max(0, buffers - 1):
            _finish(*inflight.pop(0))
    while inflight:
        _finish(*inflight.pop(0))


def _raw_recv(group, order: list[tuple[int, int, int]], bufs: dict, window: int) -> None:
    """``order``: (sender, bucket index, bytes) in the global order; ``bufs[sender]``: its slots."""
    from megatron_grpo.weight_sync.direct import _finish

    inflight = []
    for s, k, n in order:
        b = bufs[s][k % len(bufs[s])][:n]
        inflight.append((group.recv([b], s, k), b))
        while len(inflight) > window:
            _finish(*inflight.pop(0))
    while inflight:
        _finish(*inflight.pop(0))


# ------------------------------------------------------------------------------------------------
# the rank function
# ------------------------------------------------------------------------------------------------


def _pg_timeout_s(hang_timeout_s: float) -> float:
    """Process-group timeout: longer than the watchdog's, so the watchdog names the stuck phase first."""
    return hang_timeout_s + 120.0


class _Run:
    """One process's side: its rank, device, control store, watchdog phases and logging."""

    def __init__(self, opts: dict, ctrl: _Ctrl, wd):
        self.opts, self.ctrl, self.wd = opts, ctrl, wd
        self.rank, self.n = ctrl.rank, opts["ep"]
        self.rx = self.rank == self.n
        self.world = self.n + 1
        self._phase = 0

    def armed(self, what: str):
        import contextlib

        stack = contextlib.ExitStack()
        self._phase += 1
        stack.enter_context(self.wd.step(self._phase, what=what))
        stack.enter_context(self.wd.collective(what))
        return stack

    def say(self, msg: str, every_rank: bool = False) -> None:
        if self.opts.get("quiet") or not (every_rank or self.rank == 0):
            return
        who = "receiver" if self.rx else f"rank {self.rank}"
        print(f"[bench sync ep{self.n} {who}] {msg}", flush=True)

    def timed(self, key: str, fn) -> list[dict] | None:
        """Barrier, ``fn()`` (returns a dict), its (start, end) on every process; on rank 0 the list of all
        processes' results (rank order), else None."""
        self.ctrl.barrier()
        start = _now()
        r = fn() or {}
        r.update(start=start, end=_now())
        self.ctrl.put(f"{key}/{self.rank}", r)
        if self.rank:
            return None
        return [self.ctrl.get(f"{key}/{q}") for q in range(self.world)]


def _span(results: list[dict]) -> float:
    return max(r["end"] for r in results) - min(r["start"] for r in results)


def _ep_rank_main(opts: dict) -> dict:
    """One process of ``mgrpo bench sync --ep N`` (trainer ranks 0..N-1, receiver N); spawned by
    ``run_ranks``. Every phase is armed on a :class:`megatron_grpo.guard.Watchdog`: one that runs past
    ``--hang-timeout`` dumps this process's stacks (``hang-rank{R}-step{S}.txt`` under ``--out``) and
    ends it; ``run_ranks`` then stops the others."""
    from megatron_grpo.guard import Watchdog

    rank = int(os.environ["RANK"])
    ctrl = _Ctrl(int(os.environ["MASTER_PORT"]), rank, opts["timeout_s"], world=opts["ep"] + 1)
    wd = Watchdog(opts["hang_timeout_s"], opts["out"], rank=rank, first_step_timeout_s=opts["hang_timeout_s"])
    with wd:
        run = _Run(opts, ctrl, wd)
        out = _body(run)
        with run.armed("finish (rank 0 hosts the control store: it leaves last)"):
            if rank == 0:
                for q in range(1, run.world):
                    ctrl.get(f"done/{q}")
            else:
                ctrl.put(f"done/{rank}", True)
    return out


def _body(run: _Run) -> dict:  # noqa: C901 - one linear sequence of phases, the same on every process
    import torch

    from model_bridge.spawn import free_port
    from megatron_grpo.weight_sync.direct import DirectPlan, local_buckets, p2p_group, recv_direct, send_direct, warm_up
    from model_bridge.config import parse_omni_config
    from model_bridge.parallel import destroy_parallel, init_parallel

    opts, ctrl, n, rank, rx = run.opts, run.ctrl, run.n, run.rank, run.rx
    t_all = time.perf_counter()
    cuda = opts["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    cfg = sync_config(opts["layers"], opts["audio_layers"], opts["tiny"], opts["experts"])
    spec = parse_omni_config(cfg, where="bench sync")
    layout = _checkpoint_layout(cfg, audio=opts["audio_layers"] > 0)
    bucket_bytes = int(opts["bucket_mb"] * 2**20)
    n_runs, warmup, buffers = opts["warmup"] + opts["iters"], opts["warmup"], opts["buffers"]
    hang = opts["hang_timeout_s"]
    res: dict = {}
    out: dict = {"rank": rank, "role": "receiver" if rx else "trainer", "device": str(device)}

    # 1. the trainers' megatron job (EP = N); the receiver is not part of it
    with run.armed(f"init megatron parallel state (world {n}, EP {n})" if not rx else "wait for the trainers"):
        if rank == 0:
            ctrl.put("trainer_port", free_port())
        if not rx:
            os.environ.update(WORLD_SIZE=str(n), RANK=str(rank), LOCAL_RANK=str(rank),
                              MASTER_PORT=str(ctrl.get("trainer_port")))
            init_parallel(ep=n, seed=opts["seed"], timeout_minutes=int(math.ceil(_pg_timeout_s(hang) / 60)))
        run.say(f"pid {os.getpid()} on {device}" + ("" if rx else f": megatron EP rank {rank} of {n}"), every_rank=True)

    # 2. the plan: every trainer's bucket list from its meta model's export plan (no collective)
    with run.armed("plan: export_plan of the meta model -> buckets"):
        if not rx:
            t0 = time.perf_counter()
            meta_model = _build_meta(spec, opts, n)
            ctrl.put(f"plan/{rank}", local_buckets(meta_model, bucket_bytes, spec=spec))
            del meta_model
            out["plan_s"] = time.perf_counter() - t0
        plan = DirectPlan({r: ctrl.get(f"plan/{r}") for r in range(n)}, receiver=n)
    order = plan.order()
    sizes = {(s, k): v for s, b in plan.senders.items() for k, v in enumerate(_packed_sizes(b))}
    payload = plan.payload_bytes()
    if rank == 0:
        got = {nm: tuple(sh) for b in plan.senders.values() for m in b for nm, sh in zip(m["names"], m["shapes"])}
        if got != layout or plan.tensors() != len(layout):
            missing, extra = sorted(set(layout) - set(got))[:5], sorted(set(got) - set(layout))[:5]
            raise RuntimeError(f"the EP ranks' export plans do not add up to the checkpoint layout: missing {missing}, "
                               f"extra {extra}")
        res.update(env=_env(device), config={k: v for k, v in opts.items() if k not in ("quiet",)},
                   geometry={k: cfg["thinker_config"]["text_config"][k] for k in (
                       "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                       "num_experts", "num_experts_per_tok", "moe_intermediate_size", "vocab_size")})
        res["geometry"]["audio_layers"] = opts["audio_layers"]
        res["ep"] = n
        res["devices"] = {"trainers": [f"cuda:{r}" if cuda else "cpu" for r in range(n)],
                          "receiver": f"cuda:{n}" if cuda else "cpu"}
        res["plan"] = {
            "tensors": plan.tensors(), "expert_tensors": sum(1 for nm in got if ".mlp.experts." in nm),
            "payload_bytes": payload, "bucket_bytes": bucket_bytes, "packed_bytes": plan.packed_bytes(),
            "direct_buckets": len(order),
            "senders": [_sender_summary(plan, s) for s in plan.senders]}
        run.say(f"plan: {plan.tensors():,} HF tensors, {payload / GB:.3f} GB {opts['dtype']}; direct: "
                + ", ".join(f"rank {s} {len(b)} buckets / {plan.payload_bytes(s) / GB:.3f} GB"
                            for s, b in plan.senders.items())
                + f" (buckets <= {opts['bucket_mb']:g} MiB; names and shapes match the checkpoint layout)")

    # 3. the data plane: one stateless group of N + 1 (trainers 0..N-1, receiver N)
    with run.armed(f"data-plane group ({n + 1} ranks) + warm-up messages"):
        group = p2p_group(ctrl.store, rank, run.world, device, _pg_timeout_s(hang), prefix="bench_sync_ep")
        warm_up(plan, group, rank, device)
        backend = "nccl" if cuda else "gloo"
    if rank == 0:
        res["transport"] = {"kind": "pg", "backend": backend, "buffers": buffers, "group_ranks": run.world}

    # 4. raw ceilings: every sender its direct bucket sizes at once; rank 0 alone all of them
    with run.armed("raw passes (no export, no pack)"):
        biggest = max(sizes.values())
        if rx:
            bufs = {s: [torch.empty(biggest, dtype=torch.uint8, device=device) for _ in range(max(1, buffers))]
                    for s in plan.senders}
            window = max(1, buffers) * len(plan.senders) - 1
            direct_fn = lambda: _raw_recv(group, [(s, k, sizes[s, k]) for s, k in order], bufs, window)  # noqa: E731
            single_fn = lambda: _raw_recv(group, [(0, i, sizes[sk]) for i, sk in enumerate(order)],  # noqa: E731
                                          {0: bufs[0]}, max(0, buffers - 1))
        else:
            bufs = [torch.full((biggest,), 7, dtype=torch.uint8, device=device) for _ in range(max(1, buffers))]
            mine = [sizes[rank, k] for k in range(len(plan.senders.get(rank, [])))]
            direct_fn = lambda: _raw_send(group, n, mine, bufs, buffers)  # noqa: E731
            single_fn = (lambda: _raw_send(group, n, [sizes[sk] for sk in order], bufs, buffers)) if rank == 0 \
                else (lambda: None)
        raw = {"raw_direct": [], "raw_single": []}
        for name, fn in (("raw_direct", direct_fn), ("raw_single", single_fn)):
            for i in range(n_runs):
                r = run.timed(f"{name}/{i}", lambda: (fn(), _sync(device))[1])
                if r is not None and i >= warmup:
                    raw[name].append(_span(r))
        del bufs
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        packed = plan.packed_bytes()
        res["raw_direct"], res["raw_single"] = _summ(raw["raw_direct"], packed), _summ(raw["raw_single"], packed)
        run.say(f"raw: {n} senders at once {packed / GB:.3f} GB in {res['raw_direct']['seconds']:.4f} s = "
                f"{res['raw_direct']['gb_per_s']:.2f} GB/s; rank 0 alone {res['raw_single']['seconds']:.4f} s = "
                f"{res['raw_single']['gb_per_s']:.2f} GB/s")

    # 5. the weights (trainers) and the gather mode's plan (rank 0's export_to_rank0 order, bucketed)
    with run.armed("materialise the model, fill it, plan the gather (export_order)"):
        model = None
        if not rx:
            from megatron_grpo.weight_sync.direct import bucket_plan
            from megatron_grpo.weight_sync.gather import export_order

            model, out["materialise_s"] = _build_filled(spec, layout, opts, n, device)
            g_order = export_order(model, bucket_bytes=bucket_bytes, spec=spec)
            if rank == 0:
                ctrl.put("gather_plan", bucket_plan(g_order, bucket_bytes))
            if cuda:
                out["model_memory_gib"] = torch.cuda.memory_allocated(device) / 2**30
        gplan = DirectPlan({0: ctrl.get("gather_plan")}, receiver=n)
    if rank == 0:
        res["plan"]["gather_buckets"] = len(gplan.senders[0])
        res["materialise_s"] = out["materialise_s"]
        run.say(f"model ready ({out['materialise_s']:.1f} s); gather mode: {len(gplan.senders[0])} buckets from rank 0")

    # 6. the streams
    def direct_pass(serial: bool, sink=None, rx_sinks=None) -> dict:
        from model_bridge.export import export_hf

        ph: dict = {}
        if rx:
            consume = (lambda s, k, pairs: rx_sinks[s](pairs)) if rx_sinks else (lambda s, k, pairs: None)
            recv_direct(plan, group, consume, device=device, buffers=buffers, serial=serial, phases=ph)
        else:
            w = export_hf(model, spec)
            send_direct(_tap(w, sink) if sink else w, plan.senders.get(rank, []), group, n, device=device,
                        buffers=buffers, serial=serial, phases=ph)
        _sync(device)
        return {"phases": ph}

    def gather_pass(serial: bool, sink=None, rx_sink=None) -> dict:
        from megatron_grpo.weight_sync.gather import export_to_rank0

        ph: dict = {}
        if rx:
            consume = (lambda s, k, pairs: rx_sink(pairs)) if rx_sink else (lambda s, k, pairs: None)
            recv_direct(gplan, group, consume, device=device, buffers=buffers, serial=serial, phases=ph)
            return {"phases": ph}
        st: dict = {}
        stream = export_to_rank0(model, bucket_bytes=bucket_bytes, stats=st, spec=spec)
        if rank == 0:
            send_direct(_tap(stream, sink) if sink else stream, gplan.senders[0], group, n, device=device,
                        buffers=buffers, serial=serial, phases=ph)
            ph["gather"] = ph.pop("export")  # waiting for export_to_rank0: own export + peers' buckets
        else:
            t0 = time.perf_counter()
            for _ in stream:
                pass
            ph["export_and_send_to_rank0"] = time.perf_counter() - t0
        _sync(device)
        return {"phases": ph, "gather_stats": st}

    for mode, fn in (("direct", direct_pass), ("gather", gather_pass)):
        with run.armed(f"{mode}: {warmup} warm-up + {opts['iters']} timed passes + 1 serial pass"):
            secs = []
            for i in range(n_runs):
                r = run.timed(f"{mode}/{i}", lambda: fn(False))
                if r is not None:
                    s = _span(r)
                    if i >= warmup:
                        secs.append(s)
                    run.say(f"{mode} {'warm-up' if i < warmup else 'run'} {i + 1}/{n_runs}: {payload / GB:.3f} GB in "
                            f"{s:.4f} s = {payload / s / GB:.2f} GB/s")
            r = run.timed(f"{mode}/serial", lambda: fn(True))
            if rank == 0:
                res[mode] = _summ(secs, payload)
                res[mode]["serial"] = {"seconds": _span(r), "phases_s": {
                    ("receiver" if q == n else f"rank {q}"): x["phases"] for q, x in enumerate(r)}}
                if mode == "gather":
                    res[mode]["gather_stats"] = {f"rank {q}": x.get("gather_stats") for q, x in enumerate(r[:n])}
    if cuda:
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30

    # 7. the check: one more pass of each mode with checksums on both sides, then the single-rank reference
    keep = opts["keep_tensors"]
    with run.armed("check passes (checksums of every tensor on both sides)"):
        if rx:
            sinks = {s: _Sink(check=True, keep=keep) for s in plan.senders}
            run.timed("check/direct", lambda: direct_pass(True, rx_sinks=sinks))
            gsink = _Sink(check=True, keep=keep)
            run.timed("check/gather", lambda: gather_pass(True, rx_sink=gsink))
            got_direct = {s: sk.result() for s, sk in sinks.items()}
            ctrl.put("check/rx", {"direct": {s: _no_tensors(v) for s, v in got_direct.items()},
                                  "gather": _no_tensors(gsink.result())})
            if keep:
                out["tensors"] = {"direct": {nm: t for s in plan.senders for nm, t in got_direct[s]["tensors"].items()},
                                  "gather": gsink.result()["tensors"]}
        else:
            sink = _Sink(check=True)
            run.timed("check/direct", lambda: direct_pass(True, sink=sink))
            ctrl.put(f"check/sent/{rank}", sink.result())
            gsink = _Sink(check=True) if rank == 0 else None
            run.timed("check/gather", lambda: gather_pass(True, sink=gsink))
            if rank == 0:
                ctrl.put("check/sent_gather", gsink.result())
    del model
    if not rx:
        with run.armed("destroy the trainers' process groups"):
            destroy_parallel()
    with run.armed("reference: single-rank export_hf of the same weights (receiver)"):
        if rx:
            from model_bridge.export import export_hf

            os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK=str(n if cuda else 0), MASTER_PORT=str(free_port()))
            init_parallel(seed=opts["seed"])
            ref_model, out["reference_build_s"] = _build_filled(spec, layout, opts, 1, device)
            ref = _Sink(check=True, keep=keep)
            for _ in _tap(export_hf(ref_model, spec), ref):
                pass
            del ref_model
            destroy_parallel()
            ctrl.put("check/reference", _no_tensors(ref.result()))
            if keep:
                out["tensors"]["reference"] = ref.result()["tensors"]
    if rank == 0:
        res["check"] = _checks(ctrl, n, plan)
        res["direct_speedup_vs_gather"] = res["gather"]["seconds"] / res["direct"]["seconds"]
        res["direct_vs_raw_direct"] = res["raw_direct"]["seconds"] / res["direct"]["seconds"]
        c = res["check"]
        transport_ok = c["direct"]["transport"]["ok"] and c["gather"]["transport"]["ok"]
        run.say(f"check: direct {c['direct']['vs_single_rank_export']['equal']}/{c['tensors']} tensors identical to the "
                f"single-rank export_hf, gather {c['gather']['vs_single_rank_export']['equal']}/{c['tensors']} (in its "
                f"order); transport checks {'ok' if transport_ok else 'FAILED'}" + ("" if c["ok"] else f"; MISMATCH: {c}"))
        out["result"] = res
    out["wall_s"] = time.perf_counter() - t_all
    return out


def _sender_summary(plan, s: int) -> dict:
    """What sender ``s`` sends: tensors, buckets, bytes, and which experts (global indices) and dense tensors."""
    import re

    names = [nm for m in plan.senders[s] for nm in m["names"]]
    experts = sorted({int(x.group(1)) for nm in names if (x := re.search(r"\.mlp\.experts\.(\d+)\.", nm))})
    return {"rank": s, "tensors": len(names), "buckets": len(plan.senders[s]), "payload_bytes": plan.payload_bytes(s),
            "experts": [experts[0], experts[-1]] if experts else None, "expert_count": len(experts),
            "dense_tensors": sum(1 for nm in names if ".mlp.experts." not in nm)}


def _packed_sizes(buckets: list[dict]) -> list[int]:
    from launch.bench._sync_common import _bucket_packed_sizes

    return _bucket_packed_sizes(buckets)


def _no_tensors(r: dict) -> dict:
    return {"meta": r["meta"], "digests": r["digests"]}


def _compare_named(ref: dict, got: dict) -> dict:
    """``got`` (any order) against ``ref``: the same names, each with the same dtype, shape and checksums."""
    r = {m[0]: (tuple(m), tuple(d)) for m, d in zip(ref["meta"], ref["digests"])}
    g = {m[0]: (tuple(m), tuple(d)) for m, d in zip(got["meta"], got["digests"])}
    missing, extra = sorted(set(r) - set(g)), sorted(set(g) - set(r))
    bad = [nm for nm in r if nm in g and r[nm] != g[nm]]
    equal = sum(1 for nm in r if nm in g and r[nm] == g[nm])
    dup = len(got["meta"]) - len(g)
    return {"ok": not (missing or extra or bad or dup), "tensors": len(r), "equal": equal, "missing": missing[:10],
            "extra": extra[:10], "mismatched": bad[:10], "duplicates": dup}


def _checks(ctrl: _Ctrl, n: int, plan) -> dict:
    rx = ctrl.get("check/rx")
    ref = ctrl.get("check/reference")
    per_sender = {s: _compare(ctrl.get(f"check/sent/{s}"), rx["direct"][s]) for s in plan.senders}
    direct_all = {"meta": [m for s in plan.senders for m in rx["direct"][s]["meta"]],
                  "digests": [d for s in plan.senders for d in rx["direct"][s]["digests"]]}
    direct = {"transport": {"ok": all(v["ok"] for v in per_sender.values()),
                            "per_sender": {f"rank {s}": v for s, v in per_sender.items()}},
              "vs_single_rank_export": _compare_named(ref, direct_all)}
    gather = {"transport": _compare(ctrl.get("check/sent_gather"), rx["gather"]),
              "vs_single_rank_export": _compare(ref, rx["gather"])}  # in the single-rank order, too
    ok = all(x["transport"]["ok"] and x["vs_single_rank_export"]["ok"] for x in (direct, gather))
    return {"ok": ok, "tensors": len(ref["meta"]), "direct": direct, "gather": gather}


def run_bench_ep(opts: dict, timeout_s: float) -> tuple[dict, list[dict]]:
    """Spawn the N + 1 processes; rank 0's result dict and every process's own return value."""
    from model_bridge.spawn import run_ranks

    env = {"CUDA_VISIBLE_DEVICES": ""} if opts["device"] == "cpu" else None
    values = run_ranks(_ep_rank_main, opts["ep"] + 1, opts, timeout=timeout_s, env=env)
    res = values[0].pop("result")
    return res, values
