"""`mgrpo train [--config FILE] [--nproc N] [--resume RUN_DIR] [dotted.key=value ...]`."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from megatron_grpo.notices import quiet_known_notices


def add_train_parser(sub) -> None:
    s = sub.add_parser("train", help="run GRPO (no arguments: the embedded tiny CPU job)",
                       description="Run GRPO: rollout -> rewards -> advantages -> pack -> train -> push. "
                                   "Without --config the embedded default runs: a tiny Qwen3-Omni, synthetic "
                                   "audio-agent data, a local vLLM CPU server, 2 trainer ranks (TP2).")
    s.add_argument("--config", help="YAML config (docs/configuration.md lists every key)")
    s.add_argument("--nproc", type=_positive_int, default=None,
                   help="trainer ranks to spawn: the same as parallel.nproc=N (default: parallel.nproc, 2 for "
                        "the embedded job; under torchrun/srun the launcher's world size counts)")
    s.add_argument("--resume", metavar="RUN_DIR",
                   help="continue RUN_DIR from its last checkpoint with its saved config")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides, e.g. optimizer.lr=1e-6")
    s.set_defaults(func=run_train)


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return n


def _load(args, cmd: str = "train", run_dir_key: str = "trainer"):
    """The run's config: defaults <- --config <- overrides, or a run dir's saved config on --resume
    (its ``run_dir_key``.run_dir set to that dir)."""
    from megatron_grpo.config import TrainConfig, load_train_config
    from megatron_grpo.configtree import ConfigKeyError, load_config

    # --nproc is parallel.nproc: applied before the config's checks, which compare it with tp * pp
    overrides = list(args.overrides) + ([f"parallel.nproc={args.nproc}"] if args.nproc else [])
    if args.resume and args.config:
        raise ConfigKeyError(f"--config {args.config} with --resume {args.resume}: a resumed run keeps its "
                             f"saved config ({Path(args.resume) / 'config.json'}); pass changes as KEY=VALUE "
                             "overrides instead")
    if args.resume:
        saved = Path(args.resume) / "config.json"
        if not saved.is_file():
            what = "does not exist" if not Path(args.resume).exists() else "has no config.json (not a run dir)"
            raise ConfigKeyError(f"--resume {args.resume} {what}: pass the {run_dir_key}.run_dir of an earlier "
                                 f"`mgrpo {cmd}` (it holds config.json and checkpoints/), or start a new run "
                                 "with --config")
        try:
            base = json.loads(saved.read_text())
        except ValueError as e:
            raise ConfigKeyError(f"{saved} is not valid JSON ({e}); it is written by `mgrpo {cmd}` at the start "
                                 "of a run: restore it or start a new run") from None
        if not isinstance(base, dict):
            raise ConfigKeyError(f"{saved} does not hold a JSON object; it is written by `mgrpo {cmd}` at the "
                                 "start of a run: restore it or start a new run")
        base.setdefault(run_dir_key, {})["run_dir"] = str(args.resume)
        return load_config(TrainConfig, None, overrides, base=base)
    return load_train_config(args.config, overrides)


def _check_model_fits(cfg, world_size: int) -> list[str]:
    """Check the layout against the checkpoint, read every data row, build the embedded inputs if
    needed (the cold start takes minutes: after the user's inputs are checked) and size the local
    vLLM server from the rows (a bad row or one that cannot fit fails
    here, in one line each, not after the server has started). Returns the sizes as overrides."""
    from megatron_grpo.run.embedded import ensure_embedded_inputs, ensure_tiny
    from model_bridge.config import ParallelLayout, check_layout, read_omni_config

    if cfg.rollout.server != "replay":  # before the embedded cold start is built: it takes minutes
        from megatron_grpo.rollout.plugins import check_rollout_names
        check_rollout_names(cfg.rollout)  # PluginError (a ValueError): unknown reward, tool, policy, plugin file
    p = cfg.parallel
    # the embedded cold start has the tiny checkpoint's shapes: a layout that cannot fit fails before its build
    check_layout(read_omni_config(cfg.model.hf_dir or ensure_tiny()),
                 ParallelLayout(tp=p.tp, ep=p.ep, etp=p.etp, pp=p.pp), world_size=world_size)
    from megatron_grpo.data.reader import read_jsonl

    rows = None
    embedded_data = cfg.data.train_jsonl is None
    if cfg.rollout.server != "replay":  # the user's data and servers, checked before a cold start is built
        if cfg.rollout.server == "remote":
            _check_servers_answer(cfg.rollout.server_urls, cfg.rollout.connect_timeout_s)
        if cfg.data.train_jsonl is not None:
            # DataError (a ValueError) names file, line, fix; skipped rows are logged once, by the run
            rows = read_jsonl(cfg.data.train_jsonl, cfg.data, log_skips=False)
    ensure_embedded_inputs(cfg)
    if cfg.rollout.server == "replay":  # the recording fits this checkpoint (vocab, audio mel bins)
        from megatron_grpo.run.replay import check_compatible, read_manifest
        check_compatible(read_manifest(cfg.rollout.replay_dir), cfg.model.hf_dir, cfg.rollout.replay_dir)
    else:
        if rows is None:  # the embedded data
            rows = read_jsonl(cfg.data.train_jsonl, cfg.data, log_skips=False)
        # which prompts the run trains on: unset data.train_jsonl quietly means the embedded task's
        print(f"[train] data: {cfg.data.train_jsonl} ({len(rows)} rows"
              + ("; the embedded synthetic audio-agent data, as data.train_jsonl is unset)" if embedded_data else ")"),
              flush=True)
        if cfg.rollout.server == "local":  # RowsDoNotFit: one line per row that cannot fit
            return _size_local_server(cfg, rows)
    return []


def _size_local_server(cfg, rows) -> list[str]:
    """Size the local vLLM server from the data (megatron_grpo/run/sizing.py) into `cfg`; returns
    the overrides that carry the sizes to the ranks spawned next."""
    from megatron_grpo.run.sizing import size_server

    auto = cfg.serve.max_model_len == "auto"
    sized = size_server(cfg, rows)
    cfg.serve.max_model_len, cfg.serve.max_audio_seconds = sized.max_model_len, sized.max_audio_seconds
    if auto:
        print(f"[train] serve.max_model_len=auto: {sized.max_model_len} tokens (longest prompt "
              f"{sized.longest_prompt} + {cfg.rollout.max_turns} turns of {cfg.rollout.max_new_tokens}); "
              f"audio decode limit {sized.max_audio_seconds:g} s", flush=True)
    return [f"serve.max_model_len={sized.max_model_len}", f"serve.max_audio_seconds={sized.max_audio_seconds}"]


def _check_run_dir(run_dir: str, resume: bool, steps: int) -> None:
    """A new run never writes over an earlier run's checkpoints, and --resume needs one to resume
    and steps left to train (``steps``: trainer.steps)."""
    from megatron_grpo.engine.checkpoint import list_checkpoints

    done = list_checkpoints(run_dir)
    if done and not resume:
        raise ValueError(f"trainer.run_dir={run_dir} already holds a run with checkpoints (newest: "
                         f"{done[-1][1].name}): continue it with `mgrpo train --resume {run_dir}`, or start a "
                         "new run in another trainer.run_dir (or remove that directory)")
    if resume and not done:
        raise ValueError(f"--resume {run_dir}: no complete checkpoint under {Path(run_dir) / 'checkpoints'} "
                         "yet, so there is nothing to resume: start the run over without --resume (same "
                         "trainer.run_dir; its metrics.jsonl starts afresh)")
    if resume:
        check_steps_left(run_dir, steps, "trainer.steps")


def check_steps_left(run_dir: str, steps: int, key: str) -> None:
    """A resumed run must have steps left: ``steps`` (the config's ``key``) above the step of the
    checkpoint it resumes from (read from its small meta file: no model is built)."""
    from megatron_grpo.engine.checkpoint import find_latest_checkpoint, read_run_meta

    at = int(read_run_meta(find_latest_checkpoint(run_dir, warn=False))["step"])
    if steps <= at:
        raise ValueError(f"{run_dir} is at step {at} (its newest checkpoint); {key}={steps} leaves nothing to "
                         f"train: pass {key} greater than {at}")


def _check_resume_layout(cfg, world_size: int) -> None:
    """--resume at another layout: refuse one the checkpoint or the model cannot take (one line,
    both layouts, the fix); say the change (from -> to) in one line otherwise."""
    from megatron_grpo.engine.checkpoint import find_latest_checkpoint
    from megatron_grpo.engine.reshard import check_resumable, describe_layout, layout_changed
    from model_bridge.config import ParallelLayout, check_layout, read_omni_config
    from model_bridge.dist_ckpt.runs import read_run_meta

    ckpt = find_latest_checkpoint(cfg.trainer.run_dir, warn=False)
    meta = read_run_meta(ckpt) if ckpt is not None else None
    if meta is None or "layout" not in meta:
        return
    p = cfg.parallel
    now = {"tp": p.tp, "pp": p.pp, "ep": p.ep, "etp": p.tp if p.etp is None else p.etp,
           "dp": world_size // max(1, p.tp * p.pp), "world_size": world_size}
    saved = meta["layout"]
    try:
        check_layout(read_omni_config(cfg.model.hf_dir), ParallelLayout(tp=p.tp, ep=p.ep, etp=p.etp, pp=p.pp),
                     world_size=world_size)
    except ValueError as e:
        raise ValueError(f"cannot resume {ckpt} (saved at {describe_layout(saved)}) at {describe_layout(now)}: "
                         f"{e}; choose parallel.tp/pp/ep/etp and parallel.nproc that fit (the saved layout does)"
                         ) from None
    check_resumable(ckpt, meta, now)
    if layout_changed(saved, now):
        print(f"[train] resuming {ckpt} at another layout: {describe_layout(saved)} -> {describe_layout(now)}",
              flush=True)


def _check_servers_answer(urls, timeout_s: float) -> None:
    """Every remote server answers GET /health (no API key needed), so a wrong URL or a server that
    is down fails here in one line instead of after the ranks have built the model."""
    import requests

    for url in urls:
        try:
            requests.get(f"{url.rstrip('/')}/health", timeout=timeout_s)
        except requests.RequestException as e:
            raise ValueError(f"rollout server {url} is unreachable ({type(e).__name__}); is `mgrpo serve` "
                             "running there? (rollout.server_urls)") from None


def _error_kind(e: Exception) -> str:
    """How `mgrpo train` labels a refusal before any rank starts: a bad JSONL row or audio file is a
    data error, everything else (keys, values, layout, run dir) a config error."""
    from megatron_grpo.data.audio import AudioError
    from megatron_grpo.data.schema import DataError
    from megatron_grpo.run.sizing import RowsDoNotFit

    return "data error" if isinstance(e, (DataError, AudioError, RowsDoNotFit)) else "config error"


def _report_line(cfg, run_dir: Path) -> str:
    """How to read the run's trajectories (`mgrpo report`), or how to keep some for it."""
    if cfg.logging.trajectories.every > 0 or (cfg.rollout.record_dir and cfg.rollout.server != "replay"):
        return f"trajectories: `mgrpo report {run_dir}` writes them as web pages ({run_dir}/report/index.html)"
    return ("trajectories: none kept; add logging.trajectories.every=N to read every N-th step with "
            "`mgrpo report RUN_DIR`")


PREFLIGHT_DONE = "MGRPOPREFLIGHT_DONE"
"""Set in the environment of the ranks `mgrpo train` spawns itself: it has checked the run already."""


def run_train(args: argparse.Namespace) -> int:
    quiet_known_notices()
    from megatron_grpo.configtree import ConfigKeyError
    from megatron_grpo.run.ranks import launched_externally, slurm_to_torch_env

    try:
        cfg = _load(args)
    except (ConfigKeyError, ValueError) as e:
        print(f"mgrpo train: {_error_kind(e)}: {e}", file=sys.stderr)
        return 2
    slurm_to_torch_env()
    nproc = cfg.parallel.nproc
    if os.environ.get("RANK", "0") == "0" and not os.environ.get(PREFLIGHT_DONE):
        try:  # fail fast, in one line, before any rank starts (once: not again in the ranks spawned below)
            _check_run_dir(cfg.trainer.run_dir, bool(args.resume), cfg.trainer.steps)
            if args.resume:
                _check_resume_layout(cfg, int(os.environ.get("WORLD_SIZE", nproc)))
            sized = _check_model_fits(cfg, int(os.environ.get("WORLD_SIZE", nproc)))
        except ValueError as e:
            for line in str(e).splitlines():  # several rows that cannot fit: one line each
                print(f"mgrpo train: {_error_kind(e)}: {line}", file=sys.stderr)
            return 2
        args.overrides = list(args.overrides) + sized
    if not launched_externally():
        if nproc > 1:
            return _spawn_train_ranks(args, nproc)
        from model_bridge.spawn import free_port

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    from megatron_grpo.run.failures import RolloutFailed
    from megatron_grpo.train import PREEMPTED_MARKER, train

    try:
        code = train(cfg, resume=bool(args.resume))
    except RolloutFailed as e:  # every rank gets it; rank 0 says it, once (the trace is in the run dir)
        if os.environ.get("RANK", "0") == "0":
            print(f"mgrpo train: rollout error: {e}", file=sys.stderr, flush=True)
        return 1
    run_dir = Path(cfg.trainer.run_dir)
    if code == 0 and os.environ.get("RANK", "0") == "0" and not (run_dir / PREEMPTED_MARKER).exists():
        from megatron_grpo.metrics import run_summary

        steps = cfg.trainer.steps
        print("\n".join(["", f"mgrpo train: done ({steps} step{'s' if steps != 1 else ''})", *run_summary(run_dir),
                         _report_line(cfg, run_dir)]), flush=True)
    return code


_RANK_STOP_GRACE_S = 30.0
"""SIGTERM -> SIGKILL grace for a spawned trainer rank: time to stop its local vLLM server."""


def _spawn_train_ranks(args: argparse.Namespace, nproc: int) -> int:
    """Run `mgrpo train` as ``nproc`` ranks on this machine; the first non-zero exit code (a failing
    rank takes the others down), else 0 (Ctrl-C: the ranks are stopped and KeyboardInterrupt raised)."""
    return spawn_ranks(_train_rank, args, nproc)


def spawn_ranks(rank_fn, args: argparse.Namespace, nproc: int) -> int:
    """Run ``rank_fn(args)`` as ``nproc`` ranks on this machine (they skip the pre-flight checks
    already done here); the first non-zero exit code, else 0. On Ctrl-C the ranks get SIGTERM (a
    training rank checkpoints after its current step, ``engine/signals.py``) and KeyboardInterrupt
    goes on to the CLI."""
    from model_bridge.spawn import run_ranks

    rank_args = argparse.Namespace(**{**vars(args), "overrides": [*args.overrides, f"parallel.nproc={nproc}"]})
    # each rank gets an even share of the cores unless the user chose
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc))
    try:
        run_ranks(rank_fn, nproc, rank_args, timeout=None, stop_grace_s=_RANK_STOP_GRACE_S,
                  env={PREFLIGHT_DONE: "1", "OMP_NUM_THREADS": threads})
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    return 0


def _train_rank(args: argparse.Namespace) -> None:
    """One spawned rank: the run's own exit code, raised so that a failing rank stops the others."""
    code = run_train(args)
    if code:
        raise SystemExit(code)
