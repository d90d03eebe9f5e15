"""``mgrpo bench to_ranks``: bytes each trainer rank receives per step, and its host memory, when
rank 0 broadcasts every trajectory vs when it sends each rank only its micro-batches' (CPU, gloo).

The step is synthetic (no vLLM): ``--prompts`` x ``--generations`` trajectories, each prompt with
its own ``--minutes``-long recording (float32 at 16 kHz, shared by the prompt's generations as one
array object, as the rollout engine hands it out) and each generation with one ``crop_audio`` clip
of ``--crop-seconds``; token counts follow the audio (12.5 audio tokens per second) plus
``--text-tokens``. Two methods, on ``--ranks`` real gloo ranks (TP1, so DP = ranks), one after the
other on the same step:

* **broadcast**: ``dist.broadcast_object_list`` of the whole list from rank 0 (what ``mgrpo train``
  did): every rank unpickles every trajectory and every clip (pickle writes an array shared by
  several trajectories once);
* **to_ranks**: :func:`megatron_grpo.run.to_ranks.deliver`: the token counts to everyone, then each
  rank its own DP rank's samples with each distinct clip once.

Measured per rank: the pickled bytes it received and its resident memory (RSS) just before and
after receiving, with what it received still held. The **model** then counts the same bytes from
the packing plan alone (no arrays) for ``--model-prompts`` at ``--model-ranks`` / ``--model-dp``
(default: 64 prompts and the 30B recipe's 32 ranks, DP 8): a rank receives its share's distinct
clips plus the per-token payload; it is checked against the measured run (``model_check``).

Output: ``--out``/bench_to_ranks.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import platform
import sys
from pathlib import Path

from launch.bench._cli import bench_main
from launch.cli_help import doc_description

SR = 16000
TOKENS_PER_S = 13.0  # 13 audio tokens per 100 mel frames (1 s)


def _lengths(prompts: int, generations: int, minutes: float, crop_s: float, text: int) -> list[int]:
    base = int(minutes * 60 * TOKENS_PER_S) + int(crop_s * TOKENS_PER_S) + text
    return [base + (g * 37 + k * 11) % 200 for g in range(prompts) for k in range(generations)]


def make_step(prompts: int, generations: int, minutes: float, crop_s: float, text: int, seed: int = 0):
    """The synthetic step: trajectories with a shared recording per prompt and a crop per sample."""
    import numpy as np

    from megatron_grpo.trajectory import Trajectory, token_arrays

    rng = np.random.default_rng(seed)
    n_rec, n_crop = int(minutes * 60 * SR), int(crop_s * SR)
    lengths = _lengths(prompts, generations, minutes, crop_s, text)
    out = []
    for g in range(prompts):
        rec = rng.standard_normal(n_rec, dtype=np.float32)
        for k in range(generations):
            lo = int(rng.integers(0, max(1, n_rec - n_crop)))
            L = lengths[g * generations + k]
            gen = L // 10
            ids, mask, lp = token_arrays([7] * L, [0] * (L - gen) + [1] * gen, [0.0] * (L - gen) + [-0.5] * gen)
            out.append(Trajectory(prompt_index=g, group_id=g, input_ids_T=ids, loss_mask_T=mask, rollout_logprobs_T=lp,
                                  audios=[rec, rec[lo:lo + n_crop].copy()], reward=float(k % 2)))
    return out


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _rank(rank: int, world: int, port: int, args: dict, queue) -> None:
    import gc

    import torch.distributed as dist

    from megatron_grpo.packing import PackLimits, plan_step
    from megatron_grpo.run.to_ranks import Elsewhere, deliver, dp_ranks_of_all

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    packing = PackLimits(max_tokens_per_microbatch=args["budget"], allow_oversized=True)
    trajs = make_step(args["prompts"], args["generations"], args["minutes"], args["crop_seconds"],
                      args["text_tokens"]) if rank == 0 else None

    def bcast(obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    res = {"rank": rank}
    dist.barrier()
    before = _rss()
    got = bcast(trajs)
    res["broadcast"] = {"rss_before": before, "rss_after": _rss(),
                        "bytes": len(pickle.dumps(got)) if rank != 0 else 0}
    del got
    gc.collect()
    dist.barrier()
    before = _rss()
    got = deliver(trajs, lambda lens, groups: plan_step(lens, world, packing, groups), dp_ranks_of_all(rank), bcast)
    mine = {i: t for i, t in enumerate(got) if not isinstance(t, Elsewhere)}
    res["to_ranks"] = {"rss_before": before, "rss_after": _rss(), "samples": len(mine)}
    if rank != 0:  # what arrived: its share, pickled as rank 0 sent it (+ the broadcast token counts)
        from megatron_grpo.run.to_ranks import pack_share
        res["to_ranks"]["bytes"] = len(pickle.dumps(pack_share(got, sorted(mine)))) + \
            len(pickle.dumps([t.num_tokens for t in got]))
    queue.put(res)
    dist.barrier()
    dist.destroy_process_group()


def model_bytes(prompts: int, generations: int, minutes: float, crop_s: float, text: int, ranks: int, dp: int,
                budget: int, bytes_per_token: float) -> dict:
    """Bytes per rank per step for both methods, from the packing plan alone: the broadcast sends
    everything (each recording once, every crop, every token) to every rank; to_ranks sends a rank
    the distinct clips and the tokens of its DP rank's samples."""
    from megatron_grpo.packing import PackLimits, plan_step

    lengths = _lengths(prompts, generations, minutes, crop_s, text)
    rec, crop = int(minutes * 60 * SR) * 4, int(crop_s * SR) * 4
    plan = plan_step(lengths, dp, PackLimits(max_tokens_per_microbatch=budget, allow_oversized=True))
    group = lambda i: i // generations  # noqa: E731
    total = prompts * rec + len(lengths) * crop + bytes_per_token * sum(lengths)
    per_dp = []
    for r in range(dp):
        ids = [i for mb in plan.microbatches[r] for i in mb]
        per_dp.append(len({group(i) for i in ids}) * rec + len(ids) * crop + bytes_per_token * sum(lengths[i] for i in ids))
    return {"prompts": prompts, "generations": generations, "ranks": ranks, "dp": dp,
            "broadcast_bytes_per_rank": total, "to_ranks_bytes_per_rank_max": max(per_dp),
            "to_ranks_bytes_per_rank_mean": sum(per_dp) / dp,
            "recordings_per_rank_max": max(len({group(i) for mb in plan.microbatches[r] for i in mb})
                                           for r in range(dp))}


def run_bench(out_dir, prompts=4, generations=8, minutes=20.0, crop_seconds=220.0, text_tokens=600, ranks=4,
              budget=16384, model_prompts=64, model_ranks=32, model_dp=8) -> dict:
    import multiprocessing as mp
    import socket

    args = dict(prompts=prompts, generations=generations, minutes=minutes, crop_seconds=crop_seconds,
                text_tokens=text_tokens, budget=budget)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, ranks, port, args, q)) for r in range(ranks)]
    for p in procs:
        p.start()
    results = sorted((q.get(timeout=3600) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    # per-token payload (ids, mask, logprobs, pickled) from a measured rank's share
    r1 = results[1]["to_ranks"]
    lengths = _lengths(prompts, generations, minutes, crop_seconds, text_tokens)
    from megatron_grpo.packing import PackLimits, plan_step
    plan = plan_step(lengths, ranks, PackLimits(max_tokens_per_microbatch=budget, allow_oversized=True))
    ids1 = [i for mb in plan.microbatches[1] for i in mb]
    rec, crop = int(minutes * 60 * SR) * 4, int(crop_seconds * SR) * 4
    clip_bytes = len({i // generations for i in ids1}) * rec + len(ids1) * crop
    bpt = (r1["bytes"] - clip_bytes) / sum(lengths[i] for i in ids1)
    check = model_bytes(prompts, generations, minutes, crop_seconds, text_tokens, ranks, ranks, budget, bpt)
    res = {"bench": "to_ranks", "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": platform.python_version(),
           "config": dict(args, ranks=ranks), "per_rank": results, "bytes_per_token": bpt,
           "model_check": {"broadcast_model": check["broadcast_bytes_per_rank"],
                           "broadcast_measured": [r["broadcast"]["bytes"] for r in results[1:]],
                           "to_ranks_model_max": check["to_ranks_bytes_per_rank_max"],
                           "to_ranks_measured": [r["to_ranks"]["bytes"] for r in results[1:]]},
           "model": [model_bytes(model_prompts, generations, minutes, crop_seconds, text_tokens, n, d, budget, bpt)
                     for n, d in ((ranks, ranks), (model_ranks, model_dp))]}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_to_ranks.json").write_text(json.dumps(res, indent=1) + "\n")
    gib = lambda b: b / 2**30  # noqa: E731
    for r in results:
        b, t = r["broadcast"], r["to_ranks"]
        print(f"rank {r['rank']}: broadcast {gib(b['bytes']):.2f} GiB received, RSS +{gib(b['rss_after'] - b['rss_before']):.2f} GiB; "
              f"to_ranks {gib(t.get('bytes', 0)):.2f} GiB ({t['samples']} samples), "
              f"RSS +{gib(t['rss_after'] - t['rss_before']):.2f} GiB")
    for m in res["model"]:
        print(f"model {m['prompts']}x{m['generations']} on {m['ranks']} ranks (DP {m['dp']}): broadcast "
              f"{gib(m['broadcast_bytes_per_rank']):.1f} GiB/rank, to_ranks max {gib(m['to_ranks_bytes_per_rank_max']):.1f} "
              f"GiB/rank ({m['recordings_per_rank_max']} recordings)")
    return res


def _cmd(args: argparse.Namespace) -> int:
    run_bench(args.out, prompts=args.prompts, generations=args.generations, minutes=args.minutes,
              crop_seconds=args.crop_seconds, ranks=args.ranks, budget=args.budget,
              model_prompts=args.model_prompts)
    return 0


def add_parser(bsub) -> argparse.ArgumentParser:
    s = bsub.add_parser("to_ranks", help="bytes and host memory per rank: broadcast vs own micro-batches (CPU)",
                        description=doc_description(__doc__))
    s.add_argument("--out", default="bench_results/to_ranks", help="results directory (JSON)")
    s.add_argument("--prompts", type=int, default=4, help="prompts of the measured step (default 4)")
    s.add_argument("--generations", type=int, default=8, help="generations per prompt (default 8)")
    s.add_argument("--minutes", type=float, default=20.0, help="recording length in minutes (default 20)")
    s.add_argument("--crop-seconds", type=float, default=220.0, help="crop clip per sample (default 220: 13:45-17:25)")
    s.add_argument("--ranks", type=int, default=4, help="gloo ranks of the measured run (default 4)")
    s.add_argument("--budget", type=int, default=16384, help="micro-batch token budget (default 16384, the 30B recipe's)")
    s.add_argument("--model-prompts", type=int, default=64, help="prompts of the modelled step (default 64)")
    s.set_defaults(func=_cmd)
    return s


def main(argv=None) -> int:
    """``python -m launch.bench.to_ranks ARGS`` == ``mgrpo bench to_ranks ARGS``."""
    return bench_main("to_ranks", add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
