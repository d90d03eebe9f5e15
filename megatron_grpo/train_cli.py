"""`mgrpo train [--config FILE] [--nproc N] [--resume RUN_DIR] [dotted.key=value ...]`."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def add_train_parser(sub) -> None:
    s = sub.add_parser("train", help="run GRPO (no arguments: the embedded tiny CPU job)",
                       description="Run GRPO: rollout -> rewards -> advantages -> pack -> train -> push. "
                                   "Without --config the embedded default runs: a tiny Qwen3-Omni, synthetic "
                                   "audio-agent data, a local vLLM CPU server, 2 trainer ranks (TP2).")
    s.add_argument("--config", help="YAML config (docs/configuration.md lists every key)")
    s.add_argument("--nproc", type=int, default=None,
                   help="trainer ranks to spawn (default: parallel.nproc; ignored under torchrun/srun)")
    s.add_argument("--resume", metavar="RUN_DIR",
                   help="continue RUN_DIR from its last checkpoint with its saved config")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides, e.g. optimizer.lr=1e-6")
    s.set_defaults(func=run_train)


def _load(args):
    from megatron_grpo.config import TrainConfig, load_train_config
    from megatron_grpo.configtree import load_config

    overrides = list(args.overrides)
    if args.resume:
        saved = Path(args.resume) / "config.json"
        if not saved.is_file():
            raise SystemExit(f"mgrpo train: --resume {args.resume}: no config.json there (not a run dir)")
        base = json.loads(saved.read_text())
        base.setdefault("trainer", {})["run_dir"] = str(args.resume)
        return load_config(TrainConfig, None, overrides, base=base)
    return load_train_config(args.config, overrides)


def _check_model_fits(cfg, world_size: int) -> None:
    """Build the embedded inputs if needed, then check the layout against the checkpoint and read
    every data row (a bad row fails here, in one line, not after the vLLM server has started)."""
    from megatron_grpo.run.embedded import ensure_embedded_inputs
    from model_bridge.config import ParallelLayout, check_layout, read_omni_config

    ensure_embedded_inputs(cfg)
    p = cfg.parallel
    check_layout(read_omni_config(cfg.model.hf_dir), ParallelLayout(tp=p.tp, ep=p.ep, etp=p.etp, pp=p.pp),
                 world_size=world_size)
    if cfg.rollout.server == "replay":  # the recording fits this checkpoint (vocab, audio mel bins)
        from megatron_grpo.run.replay import check_compatible, read_manifest
        check_compatible(read_manifest(cfg.rollout.replay_dir), cfg.model.hf_dir, cfg.rollout.replay_dir)
    else:
        from megatron_grpo.data.reader import read_jsonl
        read_jsonl(cfg.data.train_jsonl, cfg.data)  # DataError (a ValueError) names file, line, fix


# megatron-core and torch warn about optional kernels we knowingly do without; keep the run's
# output to what the user needs (the progress bar and real problems)
_QUIET = (r".*(Apex|Transformer Engine|TE) (is|are) not installed.*", r".*full scope is deprecated.*",
          r".*torch.distributed.*deprecated.*", r".*GPTModel IS DEPRECATED.*")


def run_train(args: argparse.Namespace) -> int:
    import warnings

    for pattern in _QUIET:
        warnings.filterwarnings("ignore", message=pattern)
    from megatron_grpo.configtree import ConfigKeyError
    from megatron_grpo.run.ranks import launched_externally, slurm_to_torch_env, spawn_ranks

    try:
        cfg = _load(args)
    except (ConfigKeyError, ValueError) as e:
        print(f"mgrpo train: config error: {e}", file=sys.stderr)
        return 2
    slurm_to_torch_env()
    nproc = args.nproc or cfg.parallel.nproc
    if os.environ.get("RANK", "0") == "0":
        try:  # fail fast, in one line, before any rank starts
            _check_model_fits(cfg, int(os.environ.get("WORLD_SIZE", nproc)))
        except ValueError as e:
            print(f"mgrpo train: config error: {e}", file=sys.stderr)
            return 2
    if not launched_externally():
        if nproc > 1:
            argv = ["train"] + (["--config", args.config] if args.config else []) + \
                   (["--resume", args.resume] if args.resume else []) + list(args.overrides) + \
                   [f"parallel.nproc={nproc}"]
            return spawn_ranks(nproc, argv)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        from megatron_grpo.run.ranks import _free_port
        os.environ["MASTER_PORT"] = str(_free_port())
    from megatron_grpo.train import train

    return train(cfg, resume=bool(args.resume))
