"""``mgrpo bench train``: the training phase of ``mgrpo train`` on one device, where its time goes.

One process, one device (``init_parallel`` with TP = EP = PP = DP = 1), the trainer's own engine
(``build_engine``: megatron DDP, the distributed optimizer, bf16 with fp32 master weights on GPU)
on a generated checkpoint: Qwen3-Omni-30B-A3B's thinker at full width with ``--layers`` decoder
layers and ``--audio-layers`` full-width audio-tower layers, random weights (``bench convert``'s
generator); ``--tiny``: the tiny preset (a CPU run in seconds). Inputs: ``--samples`` synthetic
multi-turn audio-agent trajectories (``_train_data``: 10 s - 5 min recordings, 1-3 ``crop_audio``
turns with 5-30 s clips, real 16 kHz waveforms), packed with ``--mb-tokens`` (default ``auto``, the
trainer's default: the budget ``packing.max_tokens_per_microbatch: auto`` picks on this engine,
4,096 on CPU; or a number). Default ``StepConfig`` (fused LM-head logprob, GRPO loss, on-policy),
default ``OptimConfig`` (Adam, clip_grad 1.0), the trainer's featurizer (on the GPU:
``data/device_features.py``; ``--host-features`` for the host extractor), eager micro-batches as
``trainer.cuda_graphs``' default ``auto`` (graphs for a ``--mb-tokens`` of at most 4,096, else eager;
``--cuda-graphs`` / ``--no-cuda-graphs``: always / never the trainer's CUDA graphs for the
micro-batches' decoder stacks, ``engine/graphs.py``).
The side systems below run eagerly.

Systems (``_train_systems``), run in turns, round by round (``--warmup`` untimed rounds, then
``--iters`` timed ones; medians reported), all on the same engine and micro-batches:
``train`` (the phase as ``mgrpo train`` runs it: plan -> build micro-batches with features ->
schedule check -> ``train_step``), ``train_recompute`` (the same with every shared recording
recomputed in the backward instead of its first pass kept: ``trainer.shared_clips_keep: 0``;
``--shared-keep`` sets ``train``'s), ``train_serial`` (the same with no audio-tower batch started
while the host packs: ``ClipUse.prefetch`` off), ``train_split`` (the same with a sync between the parts),
``stack`` (layer stack alone: embedding, decoder, final norm), ``stack_lm`` (layer stack + fused
LM-head logprob), ``audio`` (the audio tower alone), ``h2d`` (the micro-batches' copy to the device).

Report (``bench_train.json``, ``bench_train.png``, a table): tokens/s (real tokens over the
phase's time) of ``train``, ``stack``, ``stack_lm``; ``train / stack_lm`` (target >= 0.8); the
phase's shares from ``train_split``: featurise, pack, H2D (measured apart; it happens inside the
forward/backward), forward/backward by part (audio tower = ``audio``, decoder layers = ``stack``,
LM head = ``stack_lm - stack``, rest = ``forward_backward - audio - stack_lm``: the loss, IS weights,
megatron's schedule and the host gaps between micro-batches), optimizer, other (zeroing, syncs);
the optimizer step against its memory-bandwidth bound (``_train_systems.optimizer_bound``);
``parts_bound_vs_stack_lm``: ``stack_lm / (stack_lm + audio + that bound)``, the ratio of a phase
that did nothing but those three back to back (no featurising, copies, loss, idle time): its gap
to ``train / stack_lm`` is what the rest of the phase costs;
featurise + pack + H2D against the 5% target; the budget ``packing.max_tokens_per_microbatch: auto``
would pick on this engine (``auto_budget``, next to the measured ``peak_mem_gib``).
``--profile SYSTEMS``: one more step of each named system under ``torch.profiler`` after the timed
rounds; its top device kernels and top host ops (``--profile-top`` rows each) into ``profile_NAME.txt`` and the JSON's
``profiles`` (a system whose host table adds up to more than its device table is launch-bound);
on CUDA its device timeline, with the idle time charged to the innermost ``mgrpo/...`` host range
(``megatron_grpo.host_ranges``: featurise, pack, forward, loss, schedule = megatron's backward
and glue, metrics, optimizer/...; ``launch.bench._idle``).
``--syncs SYSTEMS``: one more step of each named system with every host sync (a device read the
host waits for) counted by its call site in this repository and megatron-core (CUDA only;
``launch.bench._syncs``), in the JSON's ``host_syncs`` and the report.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from launch.bench._cli import bench_main, positive_int, pyplot
from launch.bench._idle import device_timeline
from launch.bench._syncs import count_syncs
from launch.cli_help import doc_description

__all__ = ["run_bench", "add_parser", "TARGET_VS_STACK_LM", "TARGET_HOST_SHARE"]

TARGET_VS_STACK_LM = 0.8
"""``train`` tokens/s over ``stack_lm`` tokens/s."""
TARGET_HOST_SHARE = 0.05
"""featurise + pack + H2D over the training phase."""
SYSTEMS = ("train", "train_recompute", "train_serial", "train_split", "stack", "stack_lm", "audio", "h2d")


def run_bench(out_dir, layers: int = 4, audio_layers: int = 4, samples: int = 16, mb_tokens: int | str = "auto",
              systems=SYSTEMS, warmup: int = 1, iters: int = 3, seed: int = 0, tiny: bool = False,
              device: str | None = None, work_dir=None, host_features: bool = False, hf_dir=None,
              cuda_graphs: bool | str = "auto", shared_clips: bool = True, keep_shared: float = 0.5, profile=(),
              syncs=(), profile_top: int = 60) -> dict:
    """Run the benchmark (module docstring); write ``bench_train.json`` / ``.png`` under ``out_dir``."""
    import torch

    from launch.bench._layers_timing import _env
    from launch.bench._train_data import TINY_RANGES, prepare_checkpoint, synth_trajectories
    from launch.bench._train_systems import TrainBench, optimizer_bound
    from megatron_grpo.data.device_features import trainer_featurizer
    from megatron_grpo.engine.setup import build_engine
    from megatron_grpo.engine.step import StepConfig
    from megatron_grpo.notices import quiet_known_notices
    from megatron_grpo.packing import PackLimits
    from model_bridge.config import ParallelLayout
    from model_bridge.parallel import destroy_parallel, init_parallel

    quiet_known_notices()  # as mgrpo train: the library notices we knowingly live with stay out of the output
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(work_dir) if work_dir else out
    if device == "cpu":
        import os

        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    dev = torch.device("cuda" if torch.cuda.is_available() and device != "cpu" else "cpu")
    t_start = time.time()
    say = lambda *a: print("[bench train]", *a, flush=True)  # noqa: E731
    say(f"checkpoint ({'tiny' if tiny else f'{layers} layers, {audio_layers} audio layers, full width'}) ...")
    ckpt = Path(hf_dir) if hf_dir else prepare_checkpoint(work, tiny=tiny, layers=layers, audio_layers=audio_layers,
                                                          seed=seed)
    init_parallel(seed=seed)
    from contextlib import ExitStack

    from megatron_grpo.engine.graphs import graph_fallback_reason, graphs_wanted, trainer_stream

    graphs_on = graphs_wanted(cuda_graphs, mb_tokens, graph_fallback_reason(cuda=dev.type == "cuda", backend="auto"))
    on_stream = ExitStack()
    on_stream.enter_context(trainer_stream(graphs_on))  # as mgrpo train: from the engine's build on
    try:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        say(f"engine on {dev} ({dtype}) ...")
        engine = build_engine(ckpt, ParallelLayout(), dtype=dtype)
        from transformers import AutoFeatureExtractor

        from megatron_grpo.engine.graphs import enable_graphs

        from megatron_grpo.engine.budget import resolve_token_budget

        auto_budget = resolve_token_budget("auto", engine, chunk_tokens=StepConfig().logprob_chunk_size)
        mb_tokens = auto_budget if mb_tokens == "auto" else int(mb_tokens)  # then the graphs, as mgrpo train
        graphs = enable_graphs(engine, graphs_on, mb_tokens, backend="auto", requested=cuda_graphs is True)
        featurize = trainer_featurizer(AutoFeatureExtractor.from_pretrained(ckpt), not host_features)
        trajs = synth_trajectories(samples, engine.spec, max_tokens=mb_tokens, seed=seed,
                                   ranges=TINY_RANGES if tiny else None, n_window=engine.spec.audio.n_window)
        bench = TrainBench(engine, trajs, PackLimits(max_tokens_per_microbatch=mb_tokens, allow_oversized=True),
                           StepConfig(max_consecutive_skips=10**6), featurize, dev,  # report, never stop
                           shared_clips=shared_clips, keep_shared=keep_shared)
        say(f"{samples} samples, {bench.real_tokens} tokens ({bench.total_tokens} with padding) in "
            f"{len(bench.host_mbs)} micro-batches, {bench.num_clips} clips; {warmup} + {iters} rounds of "
            f"{', '.join(systems)}")
        fns = bench.systems(list(systems))
        rows = {n: [] for n in fns}
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for r in range(warmup + iters):
            for n, fn in fns.items():
                retries = _alloc_retries(dev)
                res = fn()
                # the caching allocator's retries (free every cached block, then cudaMalloc again: a device
                # sync each): a budget that leaves too little memory shows here before it fails
                res["alloc_retries"] = _alloc_retries(dev) - retries
                if r >= warmup:
                    rows[n].append(res)
            say(f"round {r + 1}/{warmup + iters} done")
        profiles = {n: _profile(fn, out / f"profile_{n}.txt", profile_top)
                    for n, fn in bench.systems(list(profile)).items()}
        host_syncs = {n: count_syncs(fn) for n, fn in bench.systems(list(syncs)).items()}
        res = {"env": _env(dev), "device": str(dev), "checkpoint": str(ckpt), "layers": None if tiny else layers,
               "audio_layers": None if tiny else audio_layers, "tiny": tiny, "samples": samples,
               "mb_tokens": mb_tokens, "auto_budget": auto_budget, "host_features": host_features, "cuda_graphs_setting": cuda_graphs,
               "cuda_graphs": graphs is not None,
               "cuda_graphs_fallback": engine.graphs_fallback,
               "graph_buckets": sorted(graphs.graphed) if graphs else [],
               "graph_shapes": {b: {"max_seqlen": sh.seqlen, "segment_slots": sh.slots}
                                for b, sh in sorted(graphs.shapes.items())} if graphs else {},
               "graph_captures": graphs.captures if graphs else 0,
               "graph_replays": graphs.replays if graphs else 0, "graph_eager_micro_batches": graphs.eager if graphs else 0,
               "tokens_real": bench.real_tokens, "tokens_total": bench.total_tokens,
               "micro_batches": [m.num_tokens for m in bench.host_mbs], "audio_clips": bench.num_clips,
               "audio_seconds": sum(len(w) for t in trajs for w in t.audios) / 16000.0,
               "audio_seconds_distinct": sum(len(w) for w in {id(w): w for t in trajs for w in t.audios}.values()) / 16000.0,
               "shared_clips": shared_clips, "shared_clips_keep": keep_shared,
               "shared_batches_kept": bench.shared_kept,
               "systems": {n: _summary(v, bench.real_tokens) for n, v in rows.items()},
               "optimizer_bound": optimizer_bound(engine, dev),
               "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None,
               "last_train_metrics": getattr(bench, "last_metrics", None), "profiles": profiles,
               "host_syncs": host_syncs}
        res["featurizer"] = "device" if type(featurize).__name__ == "DeviceFeaturizer" else "host"
        res["report"] = report(res)
    finally:
        on_stream.close()
        destroy_parallel()
    res["wall_s"] = time.time() - t_start
    argv = sys.argv[3:] if sys.argv[1:3] == ["bench", "train"] else sys.argv[1:]
    res["command"] = " ".join(["mgrpo", "bench", "train", *argv])
    (out / "bench_train.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    _plot(res, out / "bench_train.png")
    _print_table(res)
    return res


def _alloc_retries(dev) -> int:
    import torch

    return int(torch.cuda.memory_stats(dev).get("num_alloc_retries", 0)) if dev.type == "cuda" else 0


def _annotation(event) -> bool:
    """A named range's mirror on the device's timeline (``record_function`` on CUDA), not device work."""
    return bool(getattr(event, "is_user_annotation", False))


def timeline_of(events) -> dict:
    """:func:`device_timeline` of a profile's events (``torch.profiler``'s ``FunctionEvent``s), over
    the train systems' ``mgrpo/phase`` range when there is one (else over every host event), with
    its idle time charged to the innermost ``mgrpo/...`` range open on the host (the main thread's:
    time in megatron's backward, which autograd runs on its own thread, goes to ``mgrpo/schedule``)."""
    from launch.bench._train_systems import PHASE
    from megatron_grpo.host_ranges import PREFIX

    evs = list(events)
    host = [(e.name, e.time_range.start, e.time_range.end) for e in evs if e.device_type.name != "CUDA"]
    dev = [(e.time_range.start, e.time_range.end) for e in evs if e.device_type.name == "CUDA" and not _annotation(e)]
    window = [r for r in host if r[0] == PREFIX + PHASE]
    t0, t1 = (window[0][1], window[0][2]) if window else (min(r[1] for r in host), max(r[2] for r in host))
    dev = [(a, b) for a, b in dev if b > t0 and a < t1]
    return device_timeline(dev, t0, t1, ranges=[r for r in host if r[0].startswith(PREFIX)],
                           host_ops=[r for r in host if not r[0].startswith(PREFIX)])


def _profile(fn, path: Path, top: int) -> dict:
    """One more (untimed) step of a system under ``torch.profiler``: its ``top`` device kernels (on
    CUDA) and its ``top`` host ops, each by total self time (name, calls, total ms, share of that side's
    profiled time), into ``path`` and returned as ``{"device": rows, "host": rows}``. The host table
    shows where a step that leaves the device idle spends its time (launches, copies, syncs); on
    CUDA, ``timeline`` says when the device was idle (:func:`device_timeline`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
    events = prof.key_averages()
    tables, text = {}, []
    for side, is_cuda, attr in (("device", True, "self_device_time_total"), ("host", False, "self_cpu_time_total")):
        if is_cuda and not cuda:
            continue
        mine = [e for e in events if (e.device_type.name == "CUDA") == is_cuda and not _annotation(e)]
        total = sum(getattr(e, attr) for e in mine) or 1.0
        rows = sorted(({"name": e.key[:160], "calls": e.count, "total_ms": getattr(e, attr) / 1e3,
                        "share": getattr(e, attr) / total} for e in mine), key=lambda r: -r["total_ms"])[:top]
        tables[side] = rows
        text.append(f"# {side} self time, {total / 1e3:.1f} ms in all\n" + "".join(
            f"{r['total_ms']:10.2f} ms {100 * r['share']:5.1f}% {r['calls']:7d}  {r['name']}\n" for r in rows))
    if cuda:
        tl = timeline_of(prof.events())
        tables["timeline"] = tl
        text.append("# device timeline (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in tl.items()
                                                            if isinstance(v, float))
                    + "\n# longest idle gaps (ms at ms): "
                    + ", ".join(f"{g['ms']:.2f} at {g['at_ms']:.1f}" for g in tl.get("longest_gaps", []))
                    + "".join(f"\n#   host during the {g['ms']:.2f} ms gap: "
                              + ", ".join(f"{o['name']} {o['overlap_ms']:.2f}/{o['ms']:.2f}" for o in g["host"])
                              for g in tl.get("longest_gaps", []) if "host" in g)
                    + "\n# idle by host range (ms): "
                    + ", ".join(f"{r['name']} {r['idle_ms']:.2f}" for r in tl["idle_by_range"]) + "\n")
    path.write_text("\n".join(text))
    return tables


def _summary(rows: list[dict], tokens: int) -> dict:
    keys = rows[0].keys() if rows else []
    s = {k: [r[k] for r in rows] for k in keys}
    out = {**s, **{f"{k}_median": statistics.median(v) for k, v in s.items()}}
    main = "phase_s_median" if "phase_s_median" in out else "step_s_median"
    if main in out and out[main] > 0:
        out["tok_per_s"] = tokens / out[main]
    return out


def report(res: dict) -> dict:
    """Ratios, the phase's shares and the targets from the systems' medians (module docstring)."""
    s = res["systems"]
    r: dict = {}
    med = lambda n, k="step_s_median": s[n][k] if n in s and k in s[n] else None  # noqa: E731
    train, split = med("train", "phase_s_median"), s.get("train_split", {})
    stack, stack_lm, audio, h2d = med("stack"), med("stack_lm"), med("audio"), med("h2d")
    if train and stack_lm:
        r["train_vs_stack_lm_tok_s"] = stack_lm / train
    if train and stack:
        r["train_vs_stack_tok_s"] = stack / train
    # what keeping the shared recordings' first pass and starting the tower during the packing save
    for other in ("train_recompute", "train_serial"):
        t = med(other, "phase_s_median")
        if train and t:
            r[f"train_vs_{other}_tok_s"] = t / train
    phase = split.get("phase_s_median")
    if phase:
        fb = split["forward_backward_s_median"]
        parts = {"featurise": split["featurise_s_median"], "pack": split["pack_s_median"], "h2d": h2d,
                 "fwd_bwd_audio_tower": audio, "fwd_bwd_decoder_layers": stack,
                 "fwd_bwd_lm_head": None if stack_lm is None or stack is None else stack_lm - stack,
                 "fwd_bwd_rest": None if None in (audio, stack_lm) else fb - audio - stack_lm,
                 "optimizer": split["optimizer_s_median"]}
        parts["other"] = phase - split["featurise_s_median"] - split["pack_s_median"] - fb - split["optimizer_s_median"]
        r["phase_s"] = phase
        r["parts_s"] = parts
        if "plan_s_median" in split:  # pack, part by part
            r["pack_parts_s"] = {k: split[f"{k}_s_median"] for k in ("plan", "build", "check")}
        r["shares"] = {k: None if v is None else v / phase for k, v in parts.items()}
        host = split["featurise_s_median"] + split["pack_s_median"] + (h2d or 0.0)
        r["featurise_pack_h2d_share"] = host / phase
    ob = res.get("optimizer_bound", {})
    if ob and split.get("optimizer_s_median"):
        r["optimizer_vs_bandwidth_bound"] = ob["bound_s"] / split["optimizer_s_median"]
    if ob and stack_lm and audio:
        # the phase as its three largest parts alone, back to back: the stack + LM head, the tower
        # (the ``audio`` system: its zeroing and loss proxy included) and the optimizer at its bound
        r["parts_bound_vs_stack_lm"] = stack_lm / (stack_lm + audio + ob["bound_s"])
    r["targets"] = {
        f"train_vs_stack_lm>={TARGET_VS_STACK_LM}": (r["train_vs_stack_lm_tok_s"] >= TARGET_VS_STACK_LM
                                                    if "train_vs_stack_lm_tok_s" in r else None),
        f"featurise+pack+h2d<={TARGET_HOST_SHARE}": (r["featurise_pack_h2d_share"] <= TARGET_HOST_SHARE
                                                     if "featurise_pack_h2d_share" in r else None)}
    return r


def _print_table(res: dict) -> None:
    s, r = res["systems"], res["report"]
    print(f"\n== bench train: {res['tokens_real']} tokens, {len(res['micro_batches'])} micro-batches, "
          f"{res['audio_clips']} clips ({res['audio_seconds']:.0f} s of audio), {res['device']}, "
          f"features on the {res['featurizer']}, cuda graphs "
          f"{res['graph_buckets'] if res['cuda_graphs'] else _graphs_off(res)}")
    width = max(map(len, s), default=0)
    for n, v in s.items():
        t = v.get("phase_s_median", v.get("step_s_median"))
        print(f"  {n:{width}s} {t * 1e3:10.1f} ms  {v.get('tok_per_s', 0):12.0f} tok/s")
    for k, v in r.get("parts_s", {}).items():
        if v is not None:
            print(f"  share {k:24s} {v * 1e3:9.1f} ms  {100 * v / r['phase_s']:5.1f}%")
    if "pack_parts_s" in r:
        print("  pack = " + " + ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r["pack_parts_s"].items()))
    for k in ("train_vs_stack_lm_tok_s", "parts_bound_vs_stack_lm", "train_vs_stack_tok_s",
              "train_vs_train_serial_tok_s", "featurise_pack_h2d_share", "optimizer_vs_bandwidth_bound"):
        if k in r:
            print(f"  {k:32s} {r[k]:.3f}")
    applies = not res["tiny"] and res["device"] != "cpu"
    print(f"  targets (#21: full-width layers on one GPU){'' if applies else ', not what this run measures'}: "
          f"{r['targets']}")
    for n, h in res.get("host_syncs", {}).items():
        print(f"  host syncs in one {n} step: " + (str(h["total"]) if "total" in h else h["note"]))
        for site in h.get("sites", [])[:8]:
            print(f"    {site['count']:5d}  {site['where']}")


def _plot(res: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    r = res["report"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [n for n in ("train", "stack_lm", "stack") if n in res["systems"]]
    a.bar(names, [res["systems"][n].get("tok_per_s", 0) for n in names], color=["C3", "C1", "C0"][:len(names)])
    a.set_ylabel("real tokens / s")
    a.set_title("training phase vs layer stack (+ LM head)")
    parts = {k: v for k, v in r.get("parts_s", {}).items() if v is not None and v > 0}
    left = 0.0
    for i, (k, v) in enumerate(parts.items()):
        b.barh([0], [v * 1e3], left=left, color=f"C{i}", label=f"{k} {100 * v / r['phase_s']:.1f}%")
        left += v * 1e3
    b.set_yticks([])
    b.set_xlabel("ms of one training phase (train_split)")
    b.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3)
    b.set_title("where the phase's time goes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cmd(args: argparse.Namespace) -> int:
    systems = [x for x in args.systems.split(",") if x]
    unknown = [x for x in systems + args.profile.split(",") + args.syncs.split(",") if x and x not in SYSTEMS]
    if unknown:
        print(f"mgrpo bench train: --systems/--profile/--syncs: unknown {', '.join(unknown)}; choose from {','.join(SYSTEMS)}",
              file=sys.stderr)
        return 2
    run_bench(args.out, layers=args.layers, audio_layers=args.audio_layers, samples=args.samples,
              mb_tokens=args.mb_tokens, systems=systems, warmup=args.warmup, iters=args.iters, seed=args.seed,
              tiny=args.tiny, device=args.device, work_dir=args.work_dir, host_features=args.host_features,
              hf_dir=args.hf_dir, cuda_graphs=args.cuda_graphs, shared_clips=not args.no_shared_clips,
              keep_shared=args.shared_keep,
              profile=[x for x in args.profile.split(",") if x], syncs=[x for x in args.syncs.split(",") if x],
              profile_top=args.profile_top)
    return 0


def _graphs_off(res: dict) -> str:
    if res["cuda_graphs_fallback"]:
        return f"off: {res['cuda_graphs_fallback']}"
    if res["device"] == "cpu":
        return "off (no CUDA device)"
    from megatron_grpo.engine.graphs import AUTO_MAX_BUDGET

    why = (f"trainer.cuda_graphs auto: on at budgets of at most {AUTO_MAX_BUDGET:,} tokens"
           if res["cuda_graphs_setting"] == "auto" else "--no-cuda-graphs")
    return f"off ({why}; --cuda-graphs turns them on)"


def _budget(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive number of tokens or auto, got {text!r}") from None


def add_parser(bsub) -> argparse.ArgumentParser:
    s = bsub.add_parser("train", help="the training phase of mgrpo train (features, packing, train_step) vs the "
                                      "layer stack (+ LM head), where its time goes",
                        description=doc_description(__doc__))
    s.add_argument("--layers", type=int, default=4, help="full-width decoder layers (default 4)")
    s.add_argument("--audio-layers", type=int, default=4, help="full-width audio-tower layers (default 4)")
    s.add_argument("--samples", type=int, default=16, help="trajectories per step (default 16)")
    s.add_argument("--mb-tokens", type=_budget, default="auto",
                   help="packing budget per micro-batch: auto (default, the trainer's default: what "
                        "packing.max_tokens_per_microbatch: auto picks on this engine, 4096 on CPU) or a number")
    s.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    s.add_argument("--warmup", type=int, default=1, help="untimed rounds (default 1)")
    s.add_argument("--iters", type=int, default=3, help="timed rounds, medians reported (default 3)")
    s.add_argument("--seed", type=int, default=0, help="seed of the weights and the trajectories")
    s.add_argument("--tiny", action="store_true", help="the tiny preset checkpoint and short clips: a CPU smoke run")
    s.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    s.add_argument("--host-features", action="store_true",
                   help="featurise on the host (the Whisper extractor) instead of on the device")
    s.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default="auto",
                   help="replay the micro-batches' decoder stacks from CUDA graphs (trainer.cuda_graphs=true) / "
                        "never; default: as mgrpo train's trainer.cuda_graphs: auto (on for a --mb-tokens of at "
                        "most 4,096)")
    s.add_argument("--no-shared-clips", action="store_true",
                   help="run a group's shared recording through the audio tower once per sample (trainer.shared_clips: false)")
    s.add_argument("--shared-keep", type=float, default=0.5,
                   help="trainer.shared_clips_keep of the train systems (default 0.5, the trainer's: keep the "
                        "recordings' first pass for the backward, up to half a micro-batch budget of audio; "
                        "0: recompute them)")
    s.add_argument("--profile", default="", help="comma-separated systems to run once more under torch.profiler "
                                                 "after the timed rounds: their top kernels into profile_NAME.txt and the JSON")
    s.add_argument("--profile-top", type=positive_int, default=60,
                   help="rows (the largest by total self time) each --profile table keeps, device and host "
                        "(default 60; 1000 keeps every kernel of a 4-layer step)")
    s.add_argument("--syncs", default="", help="comma-separated systems to run once more with every host sync "
                                               "counted by call site (CUDA; torch.cuda.set_sync_debug_mode): the "
                                               "JSON's host_syncs and the report")
    s.add_argument("--hf-dir", default=None, help="train this checkpoint instead of generating one (--tiny: its "
                                                 "clip lengths)")
    s.add_argument("--work-dir", default=None, help="where the generated checkpoint goes (default --out)")
    s.add_argument("--out", default="bench_results/train", help="results directory (JSON, PNG)")
    s.set_defaults(func=_cmd)
    return s


def main(argv=None) -> int:
    """``python -m launch.bench.train ARGS`` == ``mgrpo bench train ARGS``."""
    return bench_main("train", add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
