"""``mgrpo bench report``: how long `mgrpo report` takes for one large step (CPU, seconds).

A recording of one step with ``--samples`` trajectories (default 512: 64 prompts x 8 generations) is
written by the production recorder (``megatron_grpo.run.replay.Recorder``, trainer logprobs by
``megatron_grpo.run.trajlog.TrajectoryLog``) into ``--out``: each prompt a ``--recording-s`` second
recording, each sample a ``crop_audio`` tool call, a 5 s crop in its tool result and an answer of
``--gen-tokens`` generated tokens (text drawn from a word list, tokenised by the tiny checkpoint's
tokenizer; logprobs seeded random, the trainer's a little off). Then the step page is built
(``launch.report.render.build_report``, timed in-process: wall and CPU seconds, the clips written
by its two threads included) and loaded in headless Chromium (``chromium --dump-dom``, timed as a
whole, browser start included: wall and the CPU seconds of its processes). The machine's load
average is recorded beside them: on a shared machine the CPU seconds are the comparable numbers.

Outputs under ``--out``: ``bench_report.json`` (build seconds, Chromium load seconds, page bytes,
tokens, clips written) and the report itself under ``report/``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from launch.bench._cli import bench_main
from launch.cli_help import doc_description

WORDS = ("the dog barks near the door then a car passes and someone speaks about the weather while "
         "music plays softly in the background at around one minute").split()


def _trajectories(tok, audio_id: int, samples: int, group_size: int, gen_tokens: int, recording_s: float, seed: int):
    import numpy as np

    from megatron_grpo.data.features import audio_token_counts
    from megatron_grpo.trajectory import Trajectory

    rng = np.random.default_rng(seed)

    def enc(text):
        return tok.encode(text, add_special_tokens=False).ids

    out, rate = [], 16000
    for i in range(samples):
        g = i // group_size
        rec = (0.2 * np.sin(2 * np.pi * (200 + g) * np.arange(int(recording_s * rate)) / rate)).astype(np.float32)
        s0 = int(rng.integers(0, max(1, int(recording_s) - 5)))
        crop = rec[s0 * rate:(s0 + 5) * rate].copy()
        counts = audio_token_counts([rec, crop])
        answer = enc(" ".join(rng.choice(WORDS, size=gen_tokens)))[:gen_tokens - 1] + enc("<|im_end|>")
        parts = [(enc("<|im_start|>user\n<|audio_start|>") + [audio_id] * counts[0] +
                  enc("<|audio_end|>When does the dog bark?<|im_end|>\n<|im_start|>assistant\n"), 0),
                 (enc('<tool_call>\n{"name": "crop_audio", "arguments": {"start_sec": %d, "end_sec": %d}}\n'
                      '</tool_call><|im_end|>' % (s0, s0 + 5)), 1),
                 (enc("\n<|im_start|>user\n<tool_response>\n<|audio_start|>") + [audio_id] * counts[1] +
                  enc("<|audio_end|>\n</tool_response><|im_end|>\n<|im_start|>assistant\n"), 0),
                 (answer, 1)]
        ids = [t for p, _ in parts for t in p]
        mask = [m for p, m in parts for _ in p]
        lp = [float(-rng.exponential(0.7)) if m else 0.0 for m in mask]
        out.append(Trajectory(prompt_index=g, group_id=g, input_ids_T=ids, loss_mask_T=mask, rollout_logprobs_T=lp,
                              audios=[rec, crop], audio_token_counts=counts, num_turns=2, finish_reason="answer",
                              reward=float(rng.random()), reward_terms={"format": 1.0, "iou": float(rng.random())},
                              advantage=float(rng.standard_normal())))
    return out


def run_bench(args) -> dict:
    import numpy as np
    import torch

    from launch.report.render import build_report
    from launch.report.tokens import load_tokenizer
    from megatron_grpo.config import load_train_config
    from megatron_grpo.configtree import to_dict
    from megatron_grpo.metrics import MetricsLogger
    from megatron_grpo.run.embedded import ensure_embedded_inputs
    from megatron_grpo.run.replay import Recorder
    from megatron_grpo.run.trajlog import TrajectoryLog

    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    run, rec = out / "run", out / "rec"
    run.mkdir(parents=True)
    cfg = load_train_config(None, [f"rollout.record_dir={rec}", f"trainer.run_dir={run}", "data.train_jsonl=unused"]
                            + ([f"model.hf_dir={args.hf_dir}"] if args.hf_dir else []))
    ensure_embedded_inputs(cfg)
    (run / "config.json").write_text(json.dumps(to_dict(cfg)))
    tok = load_tokenizer(cfg.model.hf_dir)
    trajs = _trajectories(tok, tok.token_to_id("<|audio_pad|>"), args.samples, args.group_size, args.gen_tokens,
                          args.recording_s, args.seed)
    Recorder(cfg).record(1, trajs, {})
    rng = np.random.default_rng(args.seed + 1)
    lps = {i: torch.tensor(t.rollout_logprobs_T, dtype=torch.float32) +
           torch.tensor(t.loss_mask_T) * torch.from_numpy(rng.standard_normal(len(t.loss_mask_T)) * 0.05).float()
           for i, t in enumerate(trajs)}
    TrajectoryLog(cfg, run, rank=0).keep(1, trajs, lps)
    log = MetricsLogger(run, tensorboard=False, plot=False)
    log.log(1, {"reward/mean": float(np.mean([t.reward for t in trajs])), "time/step": 1.0})
    log.close()

    report = out / "report"
    load_before = os.getloadavg()[0]
    cpu0 = time.process_time()
    r = build_report(run, out=report)
    build_cpu = time.process_time() - cpu0
    page = report / "step_000001.html"
    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    chrome = subprocess.run([args.chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                             "--disable-background-networking", "--disable-component-update", "--disable-sync",
                             f"--user-data-dir={out / 'chromium-profile'}", "--dump-dom", page.resolve().as_uri()],
                            capture_output=True, text=True, timeout=600)
    load_s = time.perf_counter() - t0
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    chrome_cpu = (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime)
    result = {"samples": len(trajs), "groups": len({t.group_id for t in trajs}),
              "tokens": sum(t.num_tokens for t in trajs), "generated_tokens": sum(t.num_generated for t in trajs),
              "build_s": round(r["seconds"], 3), "build_cpu_s": round(build_cpu, 3),
              "chromium_dump_dom_s": round(load_s, 3), "chromium_cpu_s": round(chrome_cpu, 3),
              "loadavg_1min_before": round(load_before, 2), "cpus": os.cpu_count(),
              "chromium_ok": chrome.returncode == 0 and "data-sample" in chrome.stdout,
              "page_bytes": page.stat().st_size, "clips_written": r["clips_written"],
              "time": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv}
    (out / "bench_report.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _cmd(args) -> int:
    r = run_bench(args)
    print(f"bench report: {r['samples']} samples ({r['tokens']} tokens, {r['generated_tokens']} generated): page "
          f"built in {r['build_s']:.2f} s ({r['build_cpu_s']:.2f} s CPU; {r['page_bytes'] / 2**20:.1f} MiB, "
          f"{r['clips_written']} clips), loaded by chromium --dump-dom in {r['chromium_dump_dom_s']:.2f} s "
          f"({r['chromium_cpu_s']:.2f} s CPU, browser start included; load average {r['loadavg_1min_before']:.1f} on "
          f"{r['cpus']} CPUs) -> {Path(args.out) / 'bench_report.json'}")
    return 0 if r["chromium_ok"] else 1


def add_parser(bsub) -> argparse.ArgumentParser:
    s = bsub.add_parser("report", help="time `mgrpo report` on one large recorded step (CPU)",
                        description=doc_description(__doc__))
    s.add_argument("--out", default="bench_results/report", help="results directory (replaced)")
    s.add_argument("--samples", type=int, default=512, help="trajectories in the step (default 512)")
    s.add_argument("--group-size", type=int, default=8, help="samples per prompt (default 8)")
    s.add_argument("--gen-tokens", type=int, default=400, help="tokens of each sample's answer turn (default 400)")
    s.add_argument("--recording-s", type=float, default=30.0, help="seconds of each prompt's recording (default 30)")
    s.add_argument("--hf-dir", help="checkpoint whose tokenizer to use (default: the embedded tiny)")
    s.add_argument("--chromium", default="chromium", help="the browser to load the page in (default chromium)")
    s.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    s.set_defaults(func=_cmd)
    return s


def main(argv=None) -> int:
    """``python -m launch.bench.report ARGS`` == ``mgrpo bench report ARGS``."""
    return bench_main("report", add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
