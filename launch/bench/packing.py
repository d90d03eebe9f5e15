"""``mgrpo bench packing``: padding and data-parallel balance of our packer vs padded batches (CPU, seconds).

What is compared, on the same steps (the same sample lengths, in the same order, for every method):

* **ours**: :func:`megatron_grpo.packing.plan_step` exactly as ``mgrpo train`` calls it: samples go to
  the DP ranks by longest-processing-time on token counts, each rank packs its own samples
  first-fit-decreasing into THD micro-batches of at most ``--budget`` tokens (padding to a multiple of
  ``--pad-multiple``, the TP size, included), and every rank is padded with empty micro-batches to the
  largest count (design invariant 1);
* **padded_bsB** (``--batch-sizes``, default 1, 4, 8): what HF Trainer / DeepSpeed users run: a
  distributed sampler deals the step's samples to the DP ranks round-robin (sample i to rank i mod dp,
  in step order), each rank cuts its list into batches of B and right-pads each batch to its longest
  sample (gradient accumulation over the batches). B = 1 has no padding but the most micro-batches.

Lengths: each step has ``--samples`` trajectories (default 256 = the 30B recipe's 32 prompts x 8
generations) whose token counts are drawn uniformly, with replacement (seeded by ``--seed``), from
the 16 documented multi-turn audio-agent trajectories of ``mgrpo bench layers``
(:data:`launch.bench.layers.DEFAULT_LENGTHS`: 376-2,814 tokens, mean 1,425: a 30-200 s recording at
13 tokens/s, one to three ``crop_audio`` turns with 5-30 s clips, short assistant turns). ``--steps``
steps are planned for each ``--dp`` size.

Numbers (per method and DP size; "processed" tokens are what the GPUs compute, padding included):

* ``padding_fraction``: padded tokens / processed tokens over all steps (ours: rounding to
  ``--pad-multiple`` and the empty micro-batches, each ``--pad-multiple`` tokens);
* ``microbatches_per_rank``: forward/backward passes each rank runs per step (mean and max over steps;
  the same on every rank for every method);
* ``imbalance_tokens``: per step, max over ranks of processed tokens / mean over ranks; reported as the
  mean and the worst over steps (1.0 is perfect; a step takes as long as its slowest rank);
* ``imbalance_attn``: the same with attention cost instead of tokens: a rank's sum of L^2 over its
  attention segments (packed: each sample's own length, varlen attention; padded: B x L_max^2 per
  batch, since the padded positions are computed too);
* ``slowest_rank_tokens`` / ``slowest_rank_attn``: per step, the busiest rank's processed tokens /
  attention cost, averaged over steps: what the step's time follows (the table shows it relative to
  ours at the same DP size).

* ``host_build``: the packer's own host time per step on one rank (:func:`host_build`: ms per step and
  tokens/s, the median over the first steps), and of it the part the device waits for at a training
  step's start (``ms_to_first``: up to the first micro-batch; the rest runs under the device's work).

Outputs under ``--out``: ``bench_packing.json`` (every number, per step too) and ``bench_packing.png``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from launch.bench._cli import bench_main, positive_int, pyplot
from launch.bench.layers import DEFAULT_LENGTHS
from launch.cli_help import doc_description

__all__ = ["sample_steps", "plan_ours", "plan_padded", "imbalance", "evaluate", "host_build", "run_bench",
           "add_parser"]

DEFAULT_SAMPLES = 256
DEFAULT_BUDGET = 16384
DEFAULT_DP = (1, 2, 4, 8)
DEFAULT_BATCH_SIZES = (1, 4, 8)


def sample_steps(steps: int, samples: int, seed: int = 0, base=DEFAULT_LENGTHS) -> list[list[int]]:
    """``steps`` lists of ``samples`` lengths drawn uniformly with replacement from ``base``."""
    rng = random.Random(seed)
    return [[rng.choice(base) for _ in range(samples)] for _ in range(steps)]


# A rank's work in one step: its micro-batches, each a list of (attention segment length, count of
# copies, real tokens). The same shape for every method, so the metrics below are method-agnostic.
#   ours:    one segment per sample (+ one padding segment), count 1
#   padded:  one segment of L_max with count B (B rows padded to L_max)

def plan_ours(lengths: list[int], dp: int, budget: int, pad_multiple: int = 1):
    """(per rank: list of micro-batches, each {"samples": ids, "segments": [(len, copies)], "real": n}),
    from :func:`megatron_grpo.packing.plan_step`."""
    from megatron_grpo.packing import PackLimits, plan_step, round_up

    cfg = PackLimits(max_tokens_per_microbatch=round_up(budget, pad_multiple), pad_multiple=pad_multiple,
                        allow_oversized=True)
    plan = plan_step(lengths, dp, cfg)
    ranks = []
    for r in range(plan.dp_size):
        mbs = []
        for mb, T in zip(plan.microbatches[r], plan.microbatch_tokens(r)):
            real = sum(lengths[i] for i in mb)
            segs = [(lengths[i], 1) for i in mb] + ([(T - real, 1)] if T > real else [])
            mbs.append({"samples": list(mb), "segments": segs, "real": real})
        ranks.append(mbs)
    return ranks


def plan_padded(lengths: list[int], dp: int, batch_size: int):
    """Round-robin over ranks (sample i -> rank i % dp), batches of ``batch_size`` in order, each padded
    to its longest sample. A rank with fewer batches than another gets an empty one at the end (DDP
    needs the same count of backward passes everywhere; a real sampler pads or drops samples)."""
    ranks = []
    for r in range(dp):
        ids = list(range(r, len(lengths), dp))
        mbs = []
        for k in range(0, len(ids), batch_size):
            b = ids[k:k + batch_size]
            lmax = max(lengths[i] for i in b)
            mbs.append({"samples": b, "segments": [(lmax, len(b))], "real": sum(lengths[i] for i in b)})
        ranks.append(mbs)
    count = max(len(m) for m in ranks)
    for m in ranks:
        m.extend({"samples": [], "segments": [], "real": 0} for _ in range(count - len(m)))
    return ranks


def imbalance(per_rank: list[float]) -> float:
    """max / mean of the ranks' loads (1.0 when all equal or all zero)."""
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean > 0 else 1.0


def _rank_loads(ranks) -> tuple[list[int], list[int], list[int]]:
    """(processed tokens, real tokens, attention cost sum L^2) per rank."""
    proc = [sum(n * c for mb in mbs for n, c in mb["segments"]) for mbs in ranks]
    real = [sum(mb["real"] for mb in mbs) for mbs in ranks]
    attn = [sum(n * n * c for mb in mbs for n, c in mb["segments"]) for mbs in ranks]
    return proc, real, attn


def evaluate(step_plans: list) -> dict:
    """Metrics (module docstring) over the steps' plans of one method at one DP size."""
    proc_t = real_t = 0
    mb_counts, imb_tok, imb_attn, per_step = [], [], [], []
    for ranks in step_plans:
        proc, real, attn = _rank_loads(ranks)
        proc_t += sum(proc)
        real_t += sum(real)
        counts = {len(m) for m in ranks}
        assert len(counts) == 1, f"ranks run different micro-batch counts {counts}"
        mb_counts.append(counts.pop())
        imb_tok.append(imbalance(proc))
        imb_attn.append(imbalance(attn))
        per_step.append({"microbatches": mb_counts[-1], "rank_tokens": proc, "rank_attn": attn,
                         "imbalance_tokens": imb_tok[-1], "imbalance_attn": imb_attn[-1]})
    return {"padding_fraction": 1.0 - real_t / proc_t if proc_t else 0.0,
            "processed_tokens": proc_t, "real_tokens": real_t,
            "microbatches_per_rank": {"mean": statistics.mean(mb_counts), "max": max(mb_counts)},
            "imbalance_tokens": {"mean": statistics.mean(imb_tok), "worst": max(imb_tok)},
            "imbalance_attn": {"mean": statistics.mean(imb_attn), "worst": max(imb_attn)},
            "slowest_rank_tokens": statistics.mean(max(s["rank_tokens"]) for s in per_step),
            "slowest_rank_attn": statistics.mean(max(s["rank_attn"]) for s in per_step),
            "steps": per_step}


HOST_BUILD_STEPS = 5
"""Steps whose micro-batches :func:`host_build` builds (the first of the bench's steps)."""


def host_build(step_lengths: list[list[int]], budget: int, pad_multiple: int, seed: int = 0) -> dict:
    """The packer's host time on one rank (DP 1) per step: ``engine.batch.build_train_microbatches``
    as ``mgrpo train`` calls it, on text-only trajectories whose token ids, loss mask and rollout
    logprobs are Python lists, as the rollout hands them (the audio's featurising is not part of
    this). Returns the median ms per step to build and assemble every micro-batch
    (``ms_per_step``), and of it the part before the schedule can start (``ms_to_first``: the
    build, which converts and checks every sample, and the first micro-batch's assembly; the
    others are assembled as the schedule reads them, while the device runs the one before), and
    tokens/s."""
    from megatron_grpo.engine.batch import build_train_microbatches
    from megatron_grpo.packing import PackLimits, plan_step, round_up
    from megatron_grpo.trajectory import Trajectory, token_arrays

    rng = random.Random(seed)
    cfg = PackLimits(max_tokens_per_microbatch=round_up(budget, pad_multiple), pad_multiple=pad_multiple,
                     allow_oversized=True)
    times, firsts, tokens, counts = [], [], [], []
    for lengths in step_lengths[:HOST_BUILD_STEPS]:
        trajs = []
        for i, n in enumerate(lengths):  # the per-token arrays the rollout hands (trajectory.token_arrays)
            ids, mask, lp = token_arrays([rng.randrange(150_000) for _ in range(n)], [int(k > n // 2) for k in range(n)],
                                         [-rng.random() for _ in range(n)])
            trajs.append(Trajectory(prompt_index=i, group_id=i, input_ids_T=ids, loss_mask_T=mask, rollout_logprobs_T=lp))
        plan = plan_step(lengths, 1, cfg)
        t = time.perf_counter()
        mbs = build_train_microbatches(trajs, plan, 0, cfg)
        mbs[0]
        firsts.append(time.perf_counter() - t)
        mbs[:]
        times.append(time.perf_counter() - t)
        tokens.append(sum(lengths))
        counts.append(len(mbs))
        del mbs, trajs  # as mgrpo train drops a step's micro-batches before the next step's build
    ms = 1e3 * statistics.median(times)
    return {"steps": len(times), "ms_per_step": ms, "ms_to_first": 1e3 * statistics.median(firsts),
            "microbatches": statistics.mean(counts),
            "tokens_per_step": statistics.mean(tokens), "tokens_per_s": statistics.mean(tokens) / (ms / 1e3)}


def _check_cover(ranks, n: int, method: str) -> None:
    seen = sorted(i for mbs in ranks for mb in mbs for i in mb["samples"])
    if seen != list(range(n)):
        raise AssertionError(f"{method}: the plan does not hold every sample exactly once")


def run_bench(out_dir, samples: int = DEFAULT_SAMPLES, steps: int = 20, dp_sizes=DEFAULT_DP,
              budget: int = DEFAULT_BUDGET, batch_sizes=DEFAULT_BATCH_SIZES, pad_multiple: int = 2,
              seed: int = 0, plot: bool = True, quiet: bool = False) -> dict:
    """Run the benchmark (module docstring); returns the results and writes them under ``out_dir``."""
    log = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    step_lengths = sample_steps(steps, samples, seed)
    methods = ["ours"] + [f"padded_bs{b}" for b in batch_sizes]
    log(f"[bench packing] {steps} steps x {samples} samples (lengths drawn from the layers bench's "
        f"{len(DEFAULT_LENGTHS)} trajectories, seed {seed}), budget {budget} tokens, pad multiple "
        f"{pad_multiple}, dp {list(dp_sizes)}")
    res = {"config": {"samples": samples, "steps": steps, "dp": list(dp_sizes), "budget": budget,
                      "batch_sizes": list(batch_sizes), "pad_multiple": pad_multiple, "seed": seed,
                      "length_source": "launch.bench.layers.DEFAULT_LENGTHS", "base_lengths": list(DEFAULT_LENGTHS)},
           "lengths": {"mean": statistics.mean(x for s in step_lengths for x in s),
                       "min": min(min(s) for s in step_lengths), "max": max(max(s) for s in step_lengths),
                       "tokens_per_step_mean": statistics.mean(sum(s) for s in step_lengths)},
           "env": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "python": platform.python_version(), "host": platform.node(),
                   "machine": platform.machine()},
           "methods": {m: {} for m in methods}}
    for dp in dp_sizes:
        plans = {m: [] for m in methods}
        for lengths in step_lengths:
            p = plan_ours(lengths, dp, budget, pad_multiple)
            _check_cover(p, len(lengths), "ours")
            plans["ours"].append(p)
            for b in batch_sizes:
                p = plan_padded(lengths, dp, b)
                _check_cover(p, len(lengths), f"padded_bs{b}")
                plans[f"padded_bs{b}"].append(p)
        for m in methods:
            r = evaluate(plans[m])
            res["methods"][m][str(dp)] = r
            log(f"[bench packing] dp={dp} {m:<12} padding {r['padding_fraction'] * 100:7.3g}%  "
                f"micro-batches/rank {r['microbatches_per_rank']['mean']:6.1f}  "
                f"imbalance tokens {r['imbalance_tokens']['mean']:.3f} (worst {r['imbalance_tokens']['worst']:.3f})  "
                f"attn {r['imbalance_attn']['mean']:.3f} (worst {r['imbalance_attn']['worst']:.3f})")
    res["host_build"] = host_build(step_lengths, budget, pad_multiple, seed)
    hb = res["host_build"]
    log(f"[bench packing] host build (dp=1): {hb['ms_per_step']:.1f} ms per step of {hb['tokens_per_step']:.0f} "
        f"tokens in {hb['microbatches']:.1f} micro-batches ({hb['tokens_per_s'] / 1e6:.1f}M tokens/s), "
        f"{hb['ms_to_first']:.1f} ms of it before the first micro-batch can run; median of {hb['steps']} steps")
    res["wall_s"] = time.perf_counter() - t0
    argv = sys.argv[3:] if sys.argv[1:3] == ["bench", "packing"] else sys.argv[1:]
    res["command"] = " ".join(["mgrpo", "bench", "packing", *argv])
    (out / "bench_packing.json").write_text(json.dumps(res, indent=1) + "\n")
    if plot:
        _plot(res, out / "bench_packing.png")
    if not quiet:
        print_table(res)
    return res


def print_table(res: dict) -> None:
    """A markdown table of the summary numbers (what docs/performance.md shows)."""
    print("\n| method | dp | padding | micro-batches / rank (mean, max) | token imbalance mean / worst "
          "| attention imbalance mean / worst | slowest rank vs ours: tokens, attention |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    ours = res["methods"].get("ours", {})
    for m, by_dp in res["methods"].items():
        for dp, r in by_dp.items():
            mb, it, ia = r["microbatches_per_rank"], r["imbalance_tokens"], r["imbalance_attn"]
            rel = (f"{r['slowest_rank_tokens'] / ours[dp]['slowest_rank_tokens']:.2f}x, "
                   f"{r['slowest_rank_attn'] / ours[dp]['slowest_rank_attn']:.2f}x") if dp in ours else "-"
            print(f"| {m} | {dp} | {r['padding_fraction'] * 100:.3g}% | {mb['mean']:.1f}, {mb['max']} "
                  f"| {it['mean']:.3f} / {it['worst']:.3f} | {ia['mean']:.3f} / {ia['worst']:.3f} | {rel} |")


def _plot(res: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    methods = list(res["methods"])
    dps = [str(d) for d in res["config"]["dp"]]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    width = 0.8 / len(methods)
    panels = [("padding fraction (%)", lambda r: 100 * r["padding_fraction"], False),
              ("micro-batches per rank per step", lambda r: r["microbatches_per_rank"]["mean"], True),
              ("token imbalance max/mean (bar: mean, tick: worst)", lambda r: r["imbalance_tokens"], False),
              ("attention (sum L^2) imbalance max/mean", lambda r: r["imbalance_attn"], False)]
    for ax, (title, get, logy) in zip(axes, panels):
        for k, m in enumerate(methods):
            xs = [i + (k - (len(methods) - 1) / 2) * width for i in range(len(dps))]
            vals = [get(res["methods"][m][d]) for d in dps]
            if isinstance(vals[0], dict):
                ax.bar(xs, [v["mean"] - 1 for v in vals], width, bottom=1, label=m)
                ax.scatter(xs, [v["worst"] for v in vals], marker="_", color="k", s=80, zorder=3)
            else:
                ax.bar(xs, vals, width, label=m)
        ax.set_xticks(range(len(dps)), [f"dp={d}" for d in dps])
        ax.set_title(title, fontsize=10)
        if logy:
            ax.set_yscale("log")
    axes[1].legend(fontsize=8)
    c = res["config"]
    fig.suptitle(f"packing: {c['steps']} steps x {c['samples']} samples (layers-bench lengths), budget {c['budget']} "
                 f"tokens, pad multiple {c['pad_multiple']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _cmd(args: argparse.Namespace) -> int:
    run_bench(args.out, samples=args.samples, steps=args.steps, dp_sizes=args.dp, budget=args.budget,
              batch_sizes=args.batch_sizes, pad_multiple=args.pad_multiple, seed=args.seed)
    return 0


def add_parser(bsub) -> argparse.ArgumentParser:
    s = bsub.add_parser("packing", help="padding fraction and DP balance: our packer vs padded batches (CPU)",
                        description=doc_description(__doc__))
    s.add_argument("--out", default="bench_results/packing", help="results directory (JSON, PNG)")
    s.add_argument("--samples", type=positive_int, default=DEFAULT_SAMPLES,
                   help=f"trajectories per step (default {DEFAULT_SAMPLES}: 32 prompts x 8 generations)")
    s.add_argument("--steps", type=positive_int, default=20, help="steps planned per DP size (default 20)")
    s.add_argument("--dp", type=_ints, default=",".join(map(str, DEFAULT_DP)), help="comma-separated DP sizes")
    s.add_argument("--budget", type=positive_int, default=DEFAULT_BUDGET,
                   help=f"our micro-batch token budget (default {DEFAULT_BUDGET}, the 30B recipe's)")
    s.add_argument("--batch-sizes", type=_ints, default=",".join(map(str, DEFAULT_BATCH_SIZES)),
                   help="padded batch sizes to compare (default 1,4,8)")
    s.add_argument("--pad-multiple", type=positive_int, default=2,
                   help="our micro-batches' T rounds up to this (the TP size; default 2, the 30B recipe's TP)")
    s.add_argument("--seed", type=int, default=0, help="seed of the sampled lengths (default 0)")
    s.set_defaults(func=_cmd)
    return s


def main(argv=None) -> int:
    """``python -m launch.bench.packing ARGS`` == ``mgrpo bench packing ARGS``."""
    return bench_main("packing", add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
