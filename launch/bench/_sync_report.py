"""Reporting of :mod:`launch.bench.sync`: summaries, targets, the check's comparison, the table, the plot."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from launch.bench._cli import pyplot
from launch.bench._sync_common import GB, TARGET_GB, TARGET_SECONDS, TARGET_VS_RAW


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
    plt = pyplot()
    if plt is None:
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
