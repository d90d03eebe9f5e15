"""Reporting of :mod:`launch.bench.layers`: ratios and targets, the EP merge, the plot, the table."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from launch.bench._cli import pyplot
from launch.bench._layers_geometry import TARGET_VS_CEILING, TARGET_VS_HF_BS1, ep_target


def _ratios(res: dict) -> dict:
    """Every ``ours*`` system against HF (tok/s and peak memory) and against the kernel ceiling;
    the targets for ``ours``, and which of our systems meet speed and memory against HF bs1 at once."""
    s = res["systems"]
    r = {}
    kc = res.get("kernel_ceiling", {})
    for name in [n for n in s if n.startswith("ours") and "_ep" not in n]:
        for ref in ("hf_bs1", "hf_bs4", "mcore_local"):
            if ref not in s:
                continue
            r[f"{name}_vs_{ref}_tok_s"] = s[name]["tok_per_s"] / s[ref]["tok_per_s"]
            if ref != "mcore_local" and s[name]["peak_mem_gib"] and s[ref]["peak_mem_gib"]:
                r[f"{name}_vs_{ref}_peak_mem"] = s[name]["peak_mem_gib"] / s[ref]["peak_mem_gib"]
        if "total_s" in kc:
            r[f"{name}_vs_kernel_ceiling"] = kc["total_s"] / s[name]["step_s_median"]
            if s[name].get("step_s_pipelined"):  # steps back to back: no host prologue in the time
                r[f"{name}_pipelined_vs_kernel_ceiling"] = kc["total_s"] / s[name]["step_s_pipelined"]
            for key, tag in (("step_s_gpu_bound_median", "gpu_bound"), ("step_s_after_idle_median", "after_idle")):
                if s[name].get(key):  # diagnostics (_layers_timing.step_diagnostics), not targets
                    r[f"{name}_{tag}_vs_kernel_ceiling"] = kc["total_s"] / s[name][key]
            if name == "ours" and "paired_step_s_median" in kc:  # the stricter ceiling, same rounds
                r["ours_vs_kernel_ceiling_back_to_back"] = kc["back_to_back_s_median"] / kc["paired_step_s_median"]
    mbc = res.get("kernel_ceiling_micro_batches", {})
    if "total_s" in mbc:  # the same kernels at the micro-batches' shapes
        for name in [n for n in s if n.startswith("ours_mb")]:
            r[f"{name}_vs_kernel_ceiling_at_micro_batches"] = mbc["total_s"] / s[name]["step_s_median"]
        if "total_s" in kc:  # the most a micro-batched step reaches of the whole batch's ceiling with these kernels
            r["kernel_ceiling_vs_at_micro_batches"] = kc["total_s"] / mbc["total_s"]
    if "ours_replay" in s and "ours" in s:  # routing replay side by side with the same step unreplayed
        r["ours_replay_vs_ours_step_s"] = s["ours_replay"]["step_s_median"] / s["ours"]["step_s_median"]
    r["targets"] = {
        "vs_hf_bs1>=1.8": r["ours_vs_hf_bs1_tok_s"] >= TARGET_VS_HF_BS1 if "ours_vs_hf_bs1_tok_s" in r else None,
        "vs_ceiling>=0.85": r["ours_vs_kernel_ceiling"] >= TARGET_VS_CEILING if "ours_vs_kernel_ceiling" in r else None,
        "peak_mem<=hf_bs1": r["ours_vs_hf_bs1_peak_mem"] <= 1.0 if "ours_vs_hf_bs1_peak_mem" in r else None,
        "peak_mem<=hf_bs4": r["ours_vs_hf_bs4_peak_mem"] <= 1.0 if "ours_vs_hf_bs4_peak_mem" in r else None,
        # our configurations that are >= 1.8x HF bs1's tok/s with no more memory than HF bs1
        "speed_and_memory_vs_hf_bs1": sorted(
            n for n in s if n.startswith("ours") and r.get(f"{n}_vs_hf_bs1_tok_s", 0) >= TARGET_VS_HF_BS1
            and r.get(f"{n}_vs_hf_bs1_peak_mem", 9.9) <= 1.0) if "hf_bs1" in s else None,
    }
    return r


def _plot(res: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    s = res["systems"]
    order = ("ours", "ours_graph", "ours_rc", "ours_sepqkn", "ours_mb", "ours_mb_graph", "ours_mb_rc", "ours_mb_sepqkn",
             "ours_full_rc", "ours_replay", "hf_bs1", "hf_bs4", "mcore_local")
    names = [n for n in order if n in s] + [n for n in s if n not in order]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    axes[0].bar(names, [s[n]["tok_per_s"] / 1e3 for n in names], color="tab:blue")
    axes[0].set_ylabel("useful k tok/s" + (" per GPU" if res.get("ep", 1) > 1 else ""))
    if res.get("ep", 1) > 1 and "ours_ep1" in s:
        t = ep_target(res["ep"]) * s["ours_ep1"]["tok_per_s"] / 1e3
        axes[0].axhline(t, color="k", ls="--", label=f"target {ep_target(res['ep'])}x EP1")
        axes[0].legend()
    axes[1].bar(names, [s[n]["useful_tflops"] for n in names], color="tab:green")
    kc = res.get("kernel_ceiling", {})
    if "useful_tflops" in kc:
        axes[1].axhline(kc["useful_tflops"], color="k", ls="--", label=f"kernel ceiling {kc['useful_tflops']:.0f}")
        axes[1].legend()
    axes[1].set_ylabel("useful TFLOP/s" + (" per GPU" if res.get("ep", 1) > 1 else ""))
    mem = [s[n]["peak_mem_gib"] or 0 for n in names]
    axes[2].bar(names, mem, color="tab:red")
    axes[2].set_ylabel("peak GiB")
    g = res["geometry"]
    per = " per GPU" if res.get("ep", 1) > 1 else ""
    fig.suptitle(f"{g['layers']} thinker layers, {len(res['lengths'])} samples / {res['tokens']} tokens{per}, "
                 f"fwd+bwd {res.get('dtype', 'bfloat16')}, EP {res.get('ep', 1)} ({res['env'].get('gpu', 'cpu')})")
    for ax in axes:
        ax.tick_params(axis="x", rotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _merge_ep(base: dict, values: list[dict], ep: int) -> dict:
    """The JSON of an ``--ep N`` run from the EP1 baseline's result and the N ranks' results."""
    b = base["systems"]["ours"]
    per_rank = []
    for r, v in enumerate(values):
        s = v["systems"]["ours"]
        mine, ref = v["losses"][0], base["losses"][r]
        per_rank.append({
            "rank": r, "tokens": v["tokens"], "local_experts": v["local_experts"], "tok_per_s": s["tok_per_s"],
            "useful_tflops": s["useful_tflops"], "step_s_median": s["step_s_median"],
            "peak_mem_gib": s["peak_mem_gib"], "tok_per_s_vs_ep1": s["tok_per_s"] / b["tok_per_s"],
            "loss": mine["loss"], "loss_ep1": ref["loss"],
            "loss_rel_diff": abs(mine["loss"] - ref["loss"]) / max(ref["loss_scale"], 1e-30),
            "sumsq_rel_diff": abs(mine["sumsq"] - ref["sumsq"]) / max(ref["sumsq"], 1e-30)})
    res = {k: v for k, v in values[0].items() if k not in ("systems", "losses", "ratios", "rank")}
    res["lengths_per_rank"] = [v["lengths"] for v in values]
    res["systems"] = {"ours_ep1": b, **{f"ours_ep{ep}_rank{r}": v["systems"]["ours"] for r, v in enumerate(values)}}
    res["ep1_baseline"] = {"lengths": base["lengths"], "tokens": base["tokens"], "losses": base["losses"],
                           "env": base["env"]}
    res["per_rank"] = per_rank
    tps = [p["tok_per_s"] for p in per_rank]
    peaks = [p["peak_mem_gib"] for p in per_rank]
    mean_ratio = statistics.mean(tps) / b["tok_per_s"]
    res["ratios"] = {
        f"ep{ep}_vs_ep1_per_gpu_tok_s": mean_ratio,
        f"ep{ep}_vs_ep1_per_gpu_tok_s_slowest_rank": min(tps) / b["tok_per_s"],
        f"ep{ep}_vs_ep1_peak_mem": (max(peaks) / b["peak_mem_gib"]) if b["peak_mem_gib"] and all(peaks) else None,
        "loss_rel_diff_max": max(p["loss_rel_diff"] for p in per_rank),
        "targets": {f"ep{ep}_per_gpu_tok_s>={ep_target(ep)}x_ep1": mean_ratio >= ep_target(ep)},
    }
    return res


def _print_table(res: dict) -> None:
    s = res["systems"]
    w = max([12] + [len(n) for n in s])
    print(f"\n{'system':<{w}} {'tok/s':>10} {'TFLOP/s':>9} {'step ms':>9} {'piped ms':>9} {'GPU-bound':>9} "
          f"{'idle 1st':>9} {'peak GiB':>9}")

    def ms(v, key):
        return f"{v[key] * 1e3:.1f}" if v.get(key) else "-"

    for n, v in s.items():
        pk = f"{v['peak_mem_gib']:.1f}" if v["peak_mem_gib"] is not None else "-"
        print(f"{n:<{w}} {v['tok_per_s']:>10.0f} {v['useful_tflops']:>9.1f} {v['step_s_median'] * 1e3:>9.1f} "
              f"{ms(v, 'step_s_pipelined'):>9} {ms(v, 'step_s_gpu_bound_median'):>9} "
              f"{ms(v, 'step_s_after_idle_median'):>9} {pk:>9}")
    for n, v in s.items():
        if "graph_output_equals_eager" in v:
            print(f"{n}: replay's output equals eager's bit for bit: {v['graph_output_equals_eager']}; gradients vs "
                  f"eager {v['graph_grad_rel_diff_vs_eager']:.2e} (eager vs eager {v['eager_grad_rel_diff_run_to_run']:.2e})")
    kc = res.get("kernel_ceiling", {})
    if "total_s" in kc:
        print(f"{'ceiling':<{w}} {kc['tok_per_s']:>10.0f} {kc['useful_tflops']:>9.1f} {kc['total_s'] * 1e3:>9.1f}")
        if "paired_step_s_median" in kc:
            print(f"ceiling step, its parts back to back: {kc['back_to_back_s_median'] * 1e3:.1f} ms; ours in the "
                  f"same rounds (taking turns): {kc['paired_step_s_median'] * 1e3:.1f} ms")
    for p in res.get("per_rank", []):
        print(f"rank {p['rank']}: {p['tokens']} tokens, {p['local_experts']} local experts, "
              f"{p['tok_per_s_vs_ep1']:.3f}x EP1 tok/s; probe loss {p['loss']:.6g} vs EP1 {p['loss_ep1']:.6g} "
              f"(rel diff {p['loss_rel_diff']:.2e}, sum sq rel diff {p['sumsq_rel_diff']:.2e})")
    print("ratios:", json.dumps(res["ratios"], indent=None, default=str))
