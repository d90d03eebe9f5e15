"""``mgrpo bench convert``: conversion throughput and peak RSS on a full-width Qwen3-Omni-layout checkpoint.

1. Generates (streaming, one tensor at a time, bf16, random) an HF checkpoint with Qwen3-Omni-30B-A3B's
   thinker at full width (hidden 2048, 32/4 heads of 128, 128 experts x 768 top-8, vocab 152064)
   but only ``--layers`` decoder layers, the audio tower at full width (d_model 1280, 20 heads,
   FFN 5120, 480-channel convs) with ``--audio-layers`` layers, and a few full-width vision blocks
   (pass-through). ``--layers 4`` gives ~6.6 GB.
2. Times the real CLI, each in its own process: ``mgrpo convert hf-to-mcore`` (one process) and
   ``mgrpo convert mcore-to-hf``; samples the RSS of the command's whole process tree (the CLI and
   the rank it spawns) every 50 ms in a thread.
3. Checks the round trip (every tensor of the output bit-equal to the source), writes
   ``bench_convert.json`` and ``bench_convert.png`` (RSS over time) under ``--out`` and removes the
   generated checkpoints unless ``--keep``.

Throughput is bytes of tensors converted (MB = 1e6 B) over the command's wall time, process start
included. Targets: >= 300 MB/s and peak RSS <= 3 GB in both directions.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from launch.bench._cli import bench_main, pyplot
from launch.cli_help import doc_description

__all__ = ["bench_config", "hf_tensor_specs", "write_checkpoint", "RssSampler", "run_bench", "add_parser"]

MB = 1e6
TARGET_MB_S = 300.0
TARGET_RSS_GB = 3.0
AUDIO_TOKEN_ID = 151675  # the release's ids
IDS = dict(audio_token_id=151675, audio_start_token_id=151669, audio_end_token_id=151670, image_token_id=151655,
           video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653, user_token_id=872)


def bench_config(layers: int, audio_layers: int, vision_blocks: int = 2) -> dict:
    """config.json of the benchmark checkpoint: the release's thinker geometry, fewer layers."""
    text = dict(
        model_type="qwen3_omni_moe_text", vocab_size=152064, hidden_size=2048, intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        hidden_act="silu", max_position_embeddings=65536, rms_norm_eps=1e-6, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [24, 20, 20],
                         "interleaved": True, "mrope_interleaved": True},
        decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, router_aux_loss_coef=0.001, tie_word_embeddings=False,
        dtype="bfloat16")
    audio = dict(
        model_type="qwen3_omni_moe_audio_encoder", num_mel_bins=128, encoder_layers=audio_layers,
        encoder_attention_heads=20, encoder_ffn_dim=5120, d_model=1280, activation_function="gelu",
        max_source_positions=1500, n_window=50, n_window_infer=800, conv_chunksize=500,
        downsample_hidden_size=480, output_dim=2048, scale_embedding=False)
    vision = dict(model_type="qwen3_omni_moe_vision_encoder", depth=vision_blocks, hidden_size=1152,
                  intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=2048, num_position_embeddings=2304,
                  deepstack_visual_indexes=[0])
    thinker = dict(model_type="qwen3_omni_moe_thinker", text_config=text, audio_config=audio,
                   vision_config=vision, **IDS, position_id_per_seconds=13, seconds_per_chunk=2,
                   tie_word_embeddings=False)
    return {"architectures": ["Qwen3OmniMoeForConditionalGeneration"], "model_type": "qwen3_omni_moe",
            "thinker_config": thinker, "enable_audio_output": False, "dtype": "bfloat16"}


def hf_tensor_specs(cfg: dict):
    """(name, shape) of every tensor, layer by layer, in on-disk (per-expert) naming."""
    th = cfg["thinker_config"]
    t, a, v = th["text_config"], th["audio_config"], th["vision_config"]
    H, E, I, D = t["hidden_size"], t["num_experts"], t["moe_intermediate_size"], t["head_dim"]
    q, kv, V = t["num_attention_heads"] * D, t["num_key_value_heads"] * D, t["vocab_size"]
    yield "thinker.model.embed_tokens.weight", (V, H)
    for L in range(t["num_hidden_layers"]):
        p = f"thinker.model.layers.{L}."
        yield p + "input_layernorm.weight", (H,)
        yield p + "post_attention_layernorm.weight", (H,)
        yield p + "self_attn.q_proj.weight", (q, H)
        yield p + "self_attn.k_proj.weight", (kv, H)
        yield p + "self_attn.v_proj.weight", (kv, H)
        yield p + "self_attn.o_proj.weight", (H, q)
        yield p + "self_attn.q_norm.weight", (D,)
        yield p + "self_attn.k_norm.weight", (D,)
        yield p + "mlp.gate.weight", (E, H)
        for e in range(E):
            yield p + f"mlp.experts.{e}.gate_proj.weight", (I, H)
            yield p + f"mlp.experts.{e}.up_proj.weight", (I, H)
            yield p + f"mlp.experts.{e}.down_proj.weight", (H, I)
    yield "thinker.model.norm.weight", (H,)
    yield "thinker.lm_head.weight", (V, H)
    d, c, f = a["d_model"], a["downsample_hidden_size"], a["encoder_ffn_dim"]
    A = "thinker.audio_tower."
    yield A + "conv2d1.weight", (c, 1, 3, 3)
    yield A + "conv2d1.bias", (c,)
    for n in (2, 3):
        yield A + f"conv2d{n}.weight", (c, c, 3, 3)
        yield A + f"conv2d{n}.bias", (c,)
    freq = (((a["num_mel_bins"] + 1) // 2 + 1) // 2 + 1) // 2
    yield A + "conv_out.weight", (d, c * freq)
    for i in range(a["encoder_layers"]):
        p = f"{A}layers.{i}."
        for m in ("q_proj", "k_proj", "v_proj", "out_proj"):
            yield p + f"self_attn.{m}.weight", (d, d)
            yield p + f"self_attn.{m}.bias", (d,)
        for m in ("self_attn_layer_norm", "final_layer_norm"):
            yield p + f"{m}.weight", (d,)
            yield p + f"{m}.bias", (d,)
        yield p + "fc1.weight", (f, d)
        yield p + "fc1.bias", (f,)
        yield p + "fc2.weight", (d, f)
        yield p + "fc2.bias", (d,)
    yield A + "ln_post.weight", (d,)
    yield A + "ln_post.bias", (d,)
    yield A + "proj1.weight", (d, d)
    yield A + "proj1.bias", (d,)
    yield A + "proj2.weight", (a["output_dim"], d)
    yield A + "proj2.bias", (a["output_dim"],)
    vh, vi = v["hidden_size"], v["intermediate_size"]
    P = "thinker.visual."
    yield P + "patch_embed.proj.weight", (vh, 3, 2, 16, 16)
    yield P + "patch_embed.proj.bias", (vh,)
    yield P + "pos_embed.weight", (v["num_position_embeddings"], vh)
    for b in range(v["depth"]):
        p = f"{P}blocks.{b}."
        yield p + "attn.qkv.weight", (3 * vh, vh)
        yield p + "attn.qkv.bias", (3 * vh,)
        yield p + "attn.proj.weight", (vh, vh)
        yield p + "attn.proj.bias", (vh,)
        yield p + "mlp.linear_fc1.weight", (vi, vh)
        yield p + "mlp.linear_fc1.bias", (vi,)
        yield p + "mlp.linear_fc2.weight", (vh, vi)
        yield p + "mlp.linear_fc2.bias", (vh,)
        for n in ("norm1", "norm2"):
            yield p + f"{n}.weight", (vh,)
            yield p + f"{n}.bias", (vh,)


def write_checkpoint(out_dir, layers: int = 4, audio_layers: int = 8, seed: int = 0,
                     max_shard_bytes: int = 2**30, progress: bool = True) -> dict:
    """Generate the benchmark HF checkpoint in ``out_dir``, one tensor at a time (bf16 N(0, 0.02))."""
    import torch
    from tqdm import tqdm

    from model_bridge.io import ShardedWriter

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = bench_config(layers, audio_layers)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    specs = list(hf_tensor_specs(cfg))
    total = sum(2 * _numel(s) for _, s in specs)
    g = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    bar = tqdm(total=total, desc="generate", unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
               mininterval=1.0)
    with ShardedWriter(out, max_shard_bytes=max_shard_bytes) as w:
        for name, shape in specs:
            t = torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=g).to(torch.bfloat16)
            w.add(name, t)
            bar.update(2 * t.numel())
            del t
    bar.close()
    return {"bytes": total, "tensors": len(specs), "seconds": time.perf_counter() - t0, "config": cfg}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class RssSampler(threading.Thread):
    """Samples the summed RSS of a process and all its descendants every ``interval`` seconds."""

    def __init__(self, pid: int, interval: float = 0.05):
        super().__init__(daemon=True)
        import psutil

        self.proc = psutil.Process(pid)
        self.interval = interval
        self.samples: list[tuple[float, int, int]] = []  # (t, summed rss, largest single rss)
        self.peak = 0
        self.peak_single = 0
        self._halt = threading.Event()
        self.t0 = time.perf_counter()

    def run(self) -> None:
        import psutil

        while not self._halt.is_set():
            try:
                procs = [self.proc] + self.proc.children(recursive=True)
            except psutil.Error:
                break
            rss = []
            for p in procs:
                try:
                    rss.append(p.memory_info().rss)
                except psutil.Error:
                    pass
            if rss:
                s, m = sum(rss), max(rss)
                self.samples.append((time.perf_counter() - self.t0, s, m))
                self.peak, self.peak_single = max(self.peak, s), max(self.peak_single, m)
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def _run_cli(argv: list[str], stats_json: Path, log: Path) -> dict:
    """Run ``python -m launch.cli ARGV --stats-json F`` and measure it."""
    cmd = [sys.executable, "-m", "launch.cli", *argv, "--stats-json", str(stats_json)]
    env = dict(os.environ, PYTHONWARNINGS="ignore", TQDM_MININTERVAL="2")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        sampler = RssSampler(proc.pid)
        sampler.start()
        rc = proc.wait()
        sampler.stop()
    wall = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed with exit code {rc}; see {log}:\n{log.read_text()[-3000:]}")
    stats = json.loads(stats_json.read_text())
    return {"command": "mgrpo " + " ".join(argv), "wall_s": wall, "peak_rss_bytes": sampler.peak,
            "peak_rss_single_process_bytes": sampler.peak_single, "rss_samples": sampler.samples, "stats": stats}


def _compare(src: Path, out: Path, sample_every: int = 1) -> dict:
    """Every tensor of ``out`` vs ``src``: same names, bit-equal (compared as raw bytes)."""
    import torch

    from model_bridge.io import SafetensorsReader

    a, b = SafetensorsReader(src), SafetensorsReader(out)
    if set(a.keys()) != set(b.keys()):
        missing, extra = sorted(set(a.keys()) - set(b.keys())), sorted(set(b.keys()) - set(a.keys()))
        return {"equal": False, "missing": missing[:10], "extra": extra[:10]}
    bad, n, done = [], 0, 0
    for i, k in enumerate(a.keys()):
        if i % sample_every:
            continue
        x, y = a.read(k), b.read(k)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.int16) if x.dtype == torch.bfloat16
                                                                      else x, y.view(torch.int16)
                                                                      if y.dtype == torch.bfloat16 else y):
            bad.append(k)
        n += 1
        done += x.numel() * x.element_size()
        if done > 512 * 2**20:
            a.close()
            b.close()
            done = 0
    return {"equal": not bad, "compared": n, "mismatched": bad[:10]}


def _machine() -> dict:
    import psutil
    import torch

    out = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
           "ram_gb": round(psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version(),
           "torch": torch.__version__, "platform": platform.platform()}
    try:
        from importlib.metadata import version

        out["megatron_core"] = version("megatron-core")
        out["safetensors"] = version("safetensors")
    except Exception:  # noqa: BLE001
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    out["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return out


def _plot(results: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    for name in ("hf_to_mcore", "mcore_to_hf"):
        r = results[name]
        ts = [s[0] for s in r["rss_samples"]]
        ax.plot(ts, [s[1] / 2**30 for s in r["rss_samples"]],
                label=f"{name} ({r['throughput_mb_s']:.0f} MB/s, peak {r['peak_rss_bytes'] / 2**30:.2f} GiB)")
    ax.axhline(TARGET_RSS_GB * 1e9 / 2**30, color="gray", ls="--", lw=1, label="3 GB target")
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS of the process tree (GiB)")
    ax.set_title(f"convert: {results['checkpoint']['bytes'] / 1e9:.2f} GB bf16 checkpoint, "
                 f"{results['checkpoint']['layers']} layers")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_bench(out_dir, layers: int = 4, audio_layers: int = 8, keep: bool = False, work_dir=None,
              verify: bool = True, progress: bool = True) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(work_dir) if work_dir else out / "work"
    if work.exists() and any(work.iterdir()):
        raise SystemExit(f"work directory {work} is not empty; remove it or pass another --work-dir")
    work.mkdir(parents=True, exist_ok=True)
    cfg = bench_config(layers, audio_layers)
    size = sum(2 * _numel(s) for _, s in hf_tensor_specs(cfg))
    free = shutil.disk_usage(work).free
    need = 3 * size + 2 * 2**30
    print(f"benchmark checkpoint: {layers} decoder layers, {audio_layers} audio layers, {size / 1e9:.2f} GB bf16; "
          f"needs ~{need / 1e9:.1f} GB on {work} ({free / 1e9:.1f} GB free)", flush=True)
    if free < need:
        raise SystemExit(f"not enough disk space on {work}: {free / 1e9:.1f} GB free, ~{need / 1e9:.1f} GB needed "
                         "(fewer --layers, or --work-dir elsewhere)")
    src, mc, back = work / "hf", work / "mcore", work / "hf_back"
    results: dict = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": _machine()}
    try:
        gen = write_checkpoint(src, layers, audio_layers, progress=progress)
        results["checkpoint"] = {"bytes": gen["bytes"], "tensors": gen["tensors"], "layers": layers,
                                 "audio_layers": audio_layers, "generate_s": gen["seconds"], "dtype": "bfloat16"}
        print(f"generated {gen['bytes'] / 1e9:.2f} GB in {gen['seconds']:.0f} s", flush=True)
        model_bytes = None
        for name, argv in (
                ("hf_to_mcore", ["convert", "hf-to-mcore", "--hf", str(src), "--out", str(mc)]),
                ("mcore_to_hf", ["convert", "mcore-to-hf", "--mcore", str(mc), "--hf-source", str(src),
                                 "--out", str(back)])):
            if not progress:
                argv.append("--no-progress")
            disk = disk_baseline(work)
            for d in ((src,) if name == "hf_to_mcore" else (src, mc)):
                _drop_page_cache_hint(d)
            r = _run_cli(argv, out / f"{name}_stats.json", out / f"{name}.log")
            r["disk_baseline_before"] = disk
            nbytes = r["stats"]["bytes"]
            if name == "hf_to_mcore":
                model_bytes = nbytes
            r["bytes"] = nbytes
            r["throughput_mb_s"] = nbytes / MB / r["wall_s"]
            r["peak_rss_gb"] = r["peak_rss_bytes"] / 1e9
            r["meets_targets"] = {"throughput": r["throughput_mb_s"] >= TARGET_MB_S,
                                  "peak_rss": r["peak_rss_gb"] <= TARGET_RSS_GB}
            results[name] = r
            print(f"{name}: {nbytes / 1e9:.2f} GB in {r['wall_s']:.1f} s = {r['throughput_mb_s']:.0f} MB/s, "
                  f"peak RSS {r['peak_rss_gb']:.2f} GB (targets >= {TARGET_MB_S:.0f} MB/s, <= {TARGET_RSS_GB} GB); "
                  f"disk just before: write {disk['write_mb_s']:.0f} MB/s, read {disk['read_mb_s']:.0f} MB/s",
                  flush=True)
        results["mcore_checkpoint_bytes"] = sum(f.stat().st_size for f in mc.iterdir() if f.is_file())
        results["model_tensor_bytes"] = model_bytes
        if verify:
            t0 = time.perf_counter()
            results["round_trip"] = _compare(src, back)
            results["round_trip"]["seconds"] = time.perf_counter() - t0
            print(f"round trip bit-exact: {results['round_trip']['equal']} "
                  f"({results['round_trip'].get('compared')} tensors)", flush=True)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    slim = json.loads(json.dumps(results))
    for name in ("hf_to_mcore", "mcore_to_hf"):
        if name in slim:
            samples = slim[name].pop("rss_samples")
            step = max(1, len(samples) // 400)
            slim[name]["rss_samples_gib"] = [[round(s[0], 2), round(s[1] / 2**30, 3)] for s in samples[::step]]
    (out / "bench_convert.json").write_text(json.dumps(slim, indent=2) + "\n")
    if "mcore_to_hf" in results:
        _plot(results, out / "bench_convert.png")
    print(f"results: {out / 'bench_convert.json'}", flush=True)
    return slim


def disk_baseline(work: Path, nbytes: int = 2**30) -> dict:
    """Plain sequential write (with fsync) and cold read of ``nbytes`` in ``work``: the disk's
    speed at this moment, the ceiling for a conversion that reads and writes every byte."""
    import numpy as np

    path = work / ".disk_baseline"
    block = np.random.RandomState(0).bytes(16 * 2**20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    _drop_page_cache_hint(path)
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(16 * 2**20):
            pass
    read_s = time.perf_counter() - t0
    path.unlink()
    n = max(1, nbytes // len(block)) * len(block)
    return {"bytes": n, "write_mb_s": n / MB / write_s, "read_mb_s": n / MB / read_s}


def _drop_page_cache_hint(path: Path) -> None:
    """Ask the kernel to drop cached pages of the source files (POSIX_FADV_DONTNEED), so a run
    does not read a checkpoint that the previous step left in the page cache (best effort)."""
    if not hasattr(os, "posix_fadvise"):
        return
    files = [Path(path)] if Path(path).is_file() else list(Path(path).glob("*"))
    for f in files:
        if f.is_file():
            try:
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            except OSError:
                pass


def _cmd(args: argparse.Namespace) -> int:
    r = run_bench(args.out, layers=args.layers, audio_layers=args.audio_layers, keep=args.keep,
                  work_dir=args.work_dir, verify=not args.no_verify, progress=not args.no_progress)
    ok = all(r[n]["meets_targets"]["throughput"] and r[n]["meets_targets"]["peak_rss"]
             for n in ("hf_to_mcore", "mcore_to_hf"))
    print("targets met" if ok else "a target was missed (see bench_convert.json)")
    return 0


def add_parser(bsub) -> argparse.ArgumentParser:
    s = bsub.add_parser("convert", help="HF <-> Megatron dist checkpoint conversion: throughput and peak RSS",
                        description=doc_description(__doc__))
    s.add_argument("--out", default="bench_results/convert", help="results directory (JSON, PNG, logs)")
    s.add_argument("--layers", type=int, default=4, help="decoder layers (each ~1.25 GB bf16; default 4 -> ~6.6 GB)")
    s.add_argument("--audio-layers", type=int, default=8, help="audio encoder layers (full width; default 8)")
    s.add_argument("--work-dir", default=None, help="where the checkpoints go (default OUT/work)")
    s.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    s.add_argument("--no-verify", action="store_true", help="skip the bit-exact round-trip comparison")
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    s.set_defaults(func=_cmd)
    return s


def main(argv=None) -> int:
    """``python -m launch.bench.convert ARGS`` == ``mgrpo bench convert ARGS``."""
    return bench_main("convert", add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
