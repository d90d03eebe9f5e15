"""`mgrpo sft [--config FILE] [--nproc N] [--resume RUN_DIR] [dotted.key=value ...]`."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from launch.train_cli import PREFLIGHT_DONE, _load, _positive_int, check_steps_left, spawn_ranks
from megatron_grpo.notices import quiet_known_notices


def add_sft_parser(sub) -> None:
    s = sub.add_parser("sft", help="supervised fine-tuning on conversations with tool calls (no arguments: "
                                   "the embedded tiny cold start)",
                       description="Full-parameter SFT on the GRPO engine: the loss covers the assistant turns "
                                   "(think blocks and tool calls) only; the result is exported as an HF "
                                   "checkpoint to SFT.RUN_DIR/hf, a model.hf_dir for `mgrpo train`. Without "
                                   "--config: the tiny Qwen3-Omni on synthetic expert crop_audio trajectories "
                                   "(docs/sft.md).")
    s.add_argument("--config", help="YAML config (the `mgrpo train` tree; docs/configuration.md, section sft)")
    s.add_argument("--nproc", type=_positive_int, default=None,
                   help="trainer ranks to spawn: the same as parallel.nproc=N")
    s.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR (an sft.run_dir) from its last checkpoint")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides, e.g. sft.steps=50")
    s.set_defaults(func=run_sft)


def _preflight(cfg, resume: bool) -> list[str]:
    """Build the embedded inputs if needed, check the run dir, the layout and every data row (one
    line each on failure, before any rank starts); the resolved paths as overrides for the ranks."""
    from megatron_grpo.engine.checkpoint import list_checkpoints
    from megatron_grpo.run.embedded import ensure_sft_inputs
    from megatron_grpo.sft.rows import read_sft_jsonl
    from model_bridge.config import ParallelLayout, check_layout, read_omni_config

    run_dir = cfg.sft.run_dir
    done = list_checkpoints(run_dir)
    if done and not resume:
        raise ValueError(f"sft.run_dir={run_dir} already holds a run with checkpoints (newest: {done[-1][1].name}): "
                         f"continue it with `mgrpo sft --resume {run_dir}`, or choose another sft.run_dir")
    if resume and not done:
        raise ValueError(f"--resume {run_dir}: no complete checkpoint under {Path(run_dir) / 'checkpoints'} yet: "
                         "start the run over without --resume")
    if resume:
        check_steps_left(run_dir, cfg.sft.steps, "sft.steps")
    ensure_sft_inputs(cfg)
    p = cfg.parallel
    check_layout(read_omni_config(cfg.model.hf_dir), ParallelLayout(tp=p.tp, ep=p.ep, etp=p.etp, pp=p.pp),
                 world_size=int(os.environ.get("WORLD_SIZE", p.nproc)))
    read_sft_jsonl(cfg.sft.data, cfg.data)
    return [f"model.hf_dir={cfg.model.hf_dir}", f"sft.data={cfg.sft.data}"]


def _kind(e: Exception) -> str:
    from megatron_grpo.data.audio import AudioError
    from megatron_grpo.data.schema import DataError

    return "data error" if isinstance(e, (DataError, AudioError)) else "config error"


def run_sft(args: argparse.Namespace) -> int:
    quiet_known_notices()
    from megatron_grpo.configtree import ConfigKeyError
    from megatron_grpo.run.ranks import launched_externally, slurm_to_torch_env

    try:
        cfg = _load(args, "sft", "sft")
    except (ConfigKeyError, ValueError) as e:
        print(f"mgrpo sft: config error: {e}", file=sys.stderr)
        return 2
    slurm_to_torch_env()
    leader = os.environ.get("RANK", "0") == "0" and not os.environ.get(PREFLIGHT_DONE)
    if leader:  # the process that checks first and exports last (not a rank this command spawned)
        try:
            args.overrides = list(args.overrides) + _preflight(cfg, bool(args.resume))
        except ValueError as e:
            print(f"mgrpo sft: {_kind(e)}: {e}", file=sys.stderr)
            return 2
    if not launched_externally() and cfg.parallel.nproc > 1:
        code = _spawn_sft_ranks(args, cfg.parallel.nproc)
    else:
        if not launched_externally():
            from model_bridge.spawn import free_port

            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(free_port()))
        from megatron_grpo.sft.loop import sft

        code = sft(cfg, resume=bool(args.resume))
    if code == 0 and leader:
        _finish(cfg)
    return code


def _finish(cfg) -> None:
    """The export (``sft.export``) and the closing lines."""
    from megatron_grpo.metrics import read_metrics
    from megatron_grpo.sft.loop import export_hf_dir

    run_dir = Path(cfg.sft.run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    lines = ["", f"mgrpo sft: done ({cfg.sft.steps} steps)"]
    if rows:
        lines.append(f"loss: step {rows[0]['step']} {rows[0]['loss']:.4f} -> step {rows[-1]['step']} "
                     f"{rows[-1]['loss']:.4f}")
    if cfg.sft.export:
        out = export_hf_dir(cfg)
        lines.append(f"model: {out} (HF format): continue with `mgrpo train model.hf_dir={out} "
                     "data.train_jsonl=PROMPTS.jsonl` (your GRPO prompts, docs/data.md; without "
                     "data.train_jsonl it trains on the embedded synthetic data)")
    lines.append(f"run dir: {run_dir}/ (metrics.jsonl, curves.png, checkpoints/)")
    print("\n".join(lines), flush=True)


def _spawn_sft_ranks(args: argparse.Namespace, nproc: int) -> int:
    return spawn_ranks(_sft_rank, args, nproc)


def _sft_rank(args: argparse.Namespace) -> None:
    code = run_sft(args)
    if code:
        raise SystemExit(code)
