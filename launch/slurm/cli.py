"""`mgrpo launch slurm`: render the sbatch scripts of a run, write them next to it, submit them.

    mgrpo launch slurm (--config FILE | --recipe NAME) [--trainer-nodes N] [--rollout-nodes M]
        [--gpus-per-node G] [--partition P] [--account A] [--time T] [--out DIR] [--dry-run]
        [dotted.key=value ...]

Two jobs: the rollout job (M nodes, one `mgrpo serve` each) and the trainer job (N nodes, torchrun,
`mgrpo train`), submitted with --dependency=after:<rollout job>. docs/slurm.md walks through it.
"""
from __future__ import annotations

import argparse
import shlex
import sys

import yaml

from launch.cli_help import doc_description

__all__ = ["add_launch_parser", "run_launch_slurm"]


def add_launch_parser(sub) -> argparse.ArgumentParser:
    """Register ``launch`` (with its ``slurm`` target) on an argparse subparsers object."""
    p = sub.add_parser("launch", help="launch a run on a cluster (slurm: render + submit sbatch scripts)",
                       description="Launch a run on a cluster.")
    lsub = p.add_subparsers(dest="launch_target", metavar="{slurm}")
    lsub.required = True
    s = lsub.add_parser("slurm", help="render the rollout and trainer sbatch scripts, write them next to "
                                      "the run, submit them (docs/slurm.md)",
                        description=doc_description(__doc__, paragraphs=(0, 2)))
    src = s.add_mutually_exclusive_group()
    src.add_argument("--config", help="YAML config of the run (docs/configuration.md)")
    src.add_argument("--recipe", help="a recipe from launch/recipes instead of --config, e.g. tiny_cpu, "
                                      "qwen3_omni_30b_a3b_audio_agent_4x8_h200")
    s.add_argument("--trainer-nodes", type=int, default=None, help="trainer nodes N (default launch.trainer_nodes)")
    s.add_argument("--rollout-nodes", type=int, default=None, help="rollout nodes M (default launch.rollout_nodes)")
    s.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per node G, both jobs; 0: CPU nodes (default launch.gpus_per_node)")
    s.add_argument("--partition", default=None, help="slurm partition (default launch.partition)")
    s.add_argument("--account", default=None, help="slurm account (default launch.account)")
    s.add_argument("--time", default=None, help="time limit of both jobs, e.g. 24:00:00 (default launch.time)")
    s.add_argument("--out", default=None, help="where the scripts, key, URL files and logs go "
                                               "(default <trainer.run_dir>/slurm)")
    s.add_argument("--dry-run", action="store_true", help="write everything but do not submit")
    s.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted config overrides, e.g. launch.socket_ifname=ib0 trainer.steps=100")
    s.set_defaults(func=run_launch_slurm)
    return p


def _load_config(args):
    """The run's config, its layout checked on the rank count the launch gives: on GPU nodes that is
    trainer nodes x GPUs per node, so an explicit parallel.nproc override that differs is refused
    (the launch would replace it)."""
    from megatron_grpo.config import TrainConfig, load_train_config
    from megatron_grpo.configtree import ConfigKeyError, load_config

    from launch.slurm.render import LaunchError

    if bool(args.config) == bool(args.recipe):
        raise LaunchError("give exactly one of --config FILE and --recipe NAME")
    overrides = list(args.overrides)
    if args.config:
        def load(extra):
            return load_train_config(args.config, overrides + extra)
    else:
        from launch.recipes import get_recipe

        try:
            base = get_recipe(args.recipe)
        except KeyError as e:
            raise LaunchError(e.args[0]) from None

        def load(extra):
            return load_config(TrainConfig, None, overrides + extra, base=base)
    # launch.* first, under a layout any rank count fits: the real one is checked below on the real count
    la = load(["parallel.nproc=1", "parallel.tp=1", "parallel.pp=1", "parallel.ep=1", "parallel.etp=null"]).launch
    n = args.trainer_nodes if args.trainer_nodes is not None else la.trainer_nodes
    g = args.gpus_per_node if args.gpus_per_node is not None else la.gpus_per_node
    if n is None or g is None or n < 1 or g < 1:
        return load([])  # CPU nodes run parallel.nproc ranks; resolve_plan names missing or bad counts
    given = [o.split("=", 1)[1].strip() for o in overrides if o.split("=", 1)[0].strip() == "parallel.nproc"]
    if given and yaml.safe_load(given[-1]) != n * g:
        raise LaunchError(f"parallel.nproc={given[-1]}: under mgrpo launch slurm the rank count is trainer nodes x "
                          f"GPUs per node = {n} x {g} = {n * g}; drop the override (or change --trainer-nodes / "
                          "--gpus-per-node)")
    try:
        return load([f"parallel.nproc={n * g}"])
    except ConfigKeyError as e:  # only the layout differs from the load above
        raise LaunchError(f"{n} trainer node(s) x {g} rank(s) = {n * g} ranks: {e}") from None


def run_launch_slurm(args: argparse.Namespace) -> int:
    from megatron_grpo.configtree import ConfigKeyError

    from launch.slurm.render import LaunchError, check_model, render, resolve_plan
    from launch.slurm.submit import SubmitError, check_sbatch, sbatch_commands, submit, write_files

    err = sys.stderr
    try:
        if args.config and args.recipe:
            raise LaunchError("give exactly one of --config FILE and --recipe NAME")
        cfg = _load_config(args)
        if not args.dry_run:
            check_sbatch()
        cfg, plan = resolve_plan(cfg, trainer_nodes=args.trainer_nodes, rollout_nodes=args.rollout_nodes,
                                 gpus_per_node=args.gpus_per_node, partition=args.partition,
                                 account=args.account, time=args.time, out=args.out,
                                 build_embedded=not args.dry_run)
        problem = check_model(cfg, plan)
        if problem and not args.dry_run:
            raise LaunchError(problem)
        files = render(cfg, plan)
        written = write_files(plan, files)
    except (LaunchError, ConfigKeyError, ValueError) as e:
        print(f"mgrpo launch slurm: error: {e}", file=err)
        return 2
    g = f"{plan.gpus_per_node} GPUs per node" if plan.gpus_per_node else "CPU"
    print(f"[launch] trainer: {plan.trainer_nodes} node(s) x {plan.nproc_per_node} rank(s) ({g}); rollout: "
          f"{plan.rollout_nodes} node(s), vLLM TP{plan.serve_tp} x DP{plan.serve_dp} each")
    print(f"[launch] wrote {', '.join(p.name for p in written)} (mode 0600) to {plan.out}")
    if args.dry_run:
        if problem:
            print(f"[launch] warning: {problem} (without --dry-run the launch would stop here, before "
                  "submitting; the dry run wrote the files anyway)", file=err)
        print("[launch] dry run: not submitted. To submit by hand:")
        first, second = sbatch_commands(plan, "${ROLLOUT}")
        print(f"  ROLLOUT=$({shlex.join(first)})")
        print("  " + " ".join(a if "${ROLLOUT}" in a else shlex.quote(a) for a in second))
        return 0
    try:
        jobs = submit(plan)
    except (SubmitError, LaunchError) as e:
        print(f"mgrpo launch slurm: error: {e}", file=err)
        return 1
    print(f"[launch] submitted rollout job {jobs['rollout']} and trainer job {jobs['train']} "
          f"(after:{jobs['rollout']}); ids in {plan.out / 'jobs.json'}")
    print(f"[launch] watch: squeue -j {jobs['rollout']},{jobs['train']}")
    print(f"[launch] logs:  {jobs['logs']['rollout']}  {jobs['logs']['train']}")
    print(f"[launch] stop:  scancel {jobs['rollout']} {jobs['train']}   "
          f"(done when {plan.run_dir / 'DONE'} appears)")
    return 0
