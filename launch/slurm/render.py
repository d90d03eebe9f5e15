"""Render the two sbatch scripts and the resolved config of a `mgrpo launch slurm` run.

Pure: a `TrainConfig` plus the command line's numbers in, ``{file name: text}`` out; nothing is
written or submitted here (launch/slurm/submit.py does that). The templates are the readable
``templates/*.sbatch.in`` files; their ``@{name}`` placeholders are filled by `render`, every
substituted shell value quoted with `shlex.quote`.
"""
from __future__ import annotations

import copy
import os
import re
import shlex
import string
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

__all__ = ["LaunchError", "SlurmPlan", "resolve_plan", "render", "TEMPLATES", "FIT_MARGIN_S",
           "ROLLOUT_REQUEUE_S"]

TEMPLATES = Path(__file__).with_name("templates")
ROLLOUT_REQUEUE_S = 60
"""The rollout job requeues itself this many seconds before its time limit (`B:USR1@60`)."""
FIT_MARGIN_S = 180
"""The trainer job lowers its time limit to end this many seconds before the rollout job's."""


class LaunchError(ValueError):
    """A launch request that cannot work; the message says what to change."""


class _Template(string.Template):
    """``@{name}`` placeholders only, so that the shell's own ``$VAR``, ``${VAR:-x}`` and ``"$@"``
    stay untouched."""

    delimiter = "@"
    pattern = r"@(?:(?P<escaped>@)|\{(?P<braced>[a-z_][a-z0-9_]*)\}|(?P<named>(?!))|(?P<invalid>(?!)))"


@dataclass(frozen=True)
class SlurmPlan:
    """The numbers and paths of one launch, resolved from the command line and ``launch.*``."""

    trainer_nodes: int
    rollout_nodes: int
    gpus_per_node: int
    nproc_per_node: int
    """torchrun workers per trainer node: gpus_per_node, or parallel.nproc / trainer_nodes on CPU."""
    serve_tp: int
    serve_dp: int
    out: Path
    run_dir: Path
    workdir: Path
    partition: Optional[str] = None
    account: Optional[str] = None
    time: Optional[str] = None

    @property
    def world_size(self) -> int:
        return self.trainer_nodes * self.nproc_per_node

    @property
    def log_dir(self) -> Path:
        return self.out / "logs"


def _sbatch_safe(value: str, what: str) -> str:
    """#SBATCH lines are read by sbatch, not bash: refuse what it would split or misread."""
    value = str(value)
    if not value or re.search(r"[\s'\"#\\$`]", value):
        raise LaunchError(f"{what} {value!r} cannot go into an #SBATCH line (no spaces, quotes, '#', '$' "
                          "or backslashes)")
    return value


def _embedded_paths(cfg, build: bool) -> None:
    """Fill model.hf_dir / data.train_jsonl of the embedded tiny job: the cold-started tiny model,
    as `mgrpo train` uses (built when `build`; a dry run names the directory the launch would build)."""
    if cfg.model.hf_dir is not None and cfg.data.train_jsonl is not None:
        return
    if build:
        from megatron_grpo.run.embedded import ensure_embedded_inputs

        ensure_embedded_inputs(cfg)
        return
    from megatron_grpo.config import default_cache_dir
    from megatron_grpo.run.embedded import cold_start_dir

    if cfg.model.hf_dir is None:
        cfg.model.hf_dir = str(cold_start_dir(cfg) / "hf")
    if cfg.data.train_jsonl is None:
        cfg.data.train_jsonl = str(default_cache_dir() / "audio-agent-data" / "train.jsonl")


def resolve_plan(cfg, *, trainer_nodes: Optional[int] = None, rollout_nodes: Optional[int] = None,
                 gpus_per_node: Optional[int] = None, partition: Optional[str] = None,
                 account: Optional[str] = None, time: Optional[str] = None, out: Optional[str] = None,
                 workdir: Optional[str] = None, build_embedded: bool = False):
    """Merge the command line into ``cfg.launch``, check everything, and return ``(cfg, plan)``:
    a copy of `cfg` as the trainer job will run it (rollout.server remote, parallel.nproc = the
    torchrun world, trainer.run_dir absolute) and the `SlurmPlan`. Raises `LaunchError`."""
    from megatron_grpo.config import TrainConfig, slurm_time_seconds
    from megatron_grpo.configtree import ConfigKeyError, from_dict, to_dict

    cfg = copy.deepcopy(cfg)
    la = cfg.launch
    n = trainer_nodes if trainer_nodes is not None else la.trainer_nodes
    m = rollout_nodes if rollout_nodes is not None else la.rollout_nodes
    g = gpus_per_node if gpus_per_node is not None else la.gpus_per_node
    for flag, key, v in (("--trainer-nodes", "trainer_nodes", n), ("--rollout-nodes", "rollout_nodes", m),
                         ("--gpus-per-node", "gpus_per_node", g)):
        if v is None:
            raise LaunchError(f"give {flag} (or launch.{key} in the config / recipe)")
    if n < 1:
        raise LaunchError(f"--trainer-nodes must be >= 1, got {n}")
    if m < 1:
        raise LaunchError(f"--rollout-nodes must be >= 1, got {m}")
    if g < 0:
        raise LaunchError(f"--gpus-per-node must be >= 0 (0: CPU nodes), got {g}")
    partition = partition if partition is not None else la.partition
    account = account if account is not None else la.account
    time = time if time is not None else la.time
    if time is not None:
        try:
            limit = slurm_time_seconds(time)
        except ValueError as e:
            raise LaunchError(f"--time: {e}") from None
        sig = la.signal_seconds()
        if sig is not None and sig >= limit:
            raise LaunchError(f"--time {time} ({limit} s) is not longer than launch.signal={la.signal!r}: "
                              "the trainer would be signalled before it starts")
    for what, v in (("--partition", partition), ("--account", account), ("--time", time)):
        if v is not None:
            _sbatch_safe(v, what)
    for arg in la.sbatch_args:
        if not str(arg).startswith("-"):
            raise LaunchError(f"launch.sbatch_args entry {arg!r} is not an sbatch option (e.g. '--qos=high')")

    if g > 0:
        nproc_per_node = g
    else:
        if cfg.parallel.nproc % n:
            raise LaunchError(f"CPU nodes (--gpus-per-node 0): parallel.nproc={cfg.parallel.nproc} ranks do not "
                              f"split evenly over {n} trainer nodes")
        nproc_per_node = cfg.parallel.nproc // n
    serve_tp = la.serve_tp or max(g, 1)
    if max(g, 1) % serve_tp:
        raise LaunchError(f"launch.serve_tp={serve_tp} does not divide the {max(g, 1)} GPU(s) of a rollout node")
    serve_dp = max(g, 1) // serve_tp

    cfg.rollout.server = "remote"
    cfg.rollout.api_key = None
    cfg.parallel.nproc = n * nproc_per_node
    la.trainer_nodes, la.rollout_nodes, la.gpus_per_node = n, m, g
    la.partition, la.account, la.time = partition, account, time
    cfg.trainer.run_dir = str(Path(cfg.trainer.run_dir).expanduser().resolve())
    _embedded_paths(cfg, build=build_embedded)
    try:  # the cross-section checks again, with the world the nodes give
        data = to_dict(cfg)
        data["rollout"]["api_key"] = None
        cfg = from_dict(TrainConfig, data)
        cfg.rollout.api_key = None
    except (ConfigKeyError, ValueError) as e:
        raise LaunchError(f"{n} trainer node(s) x {nproc_per_node} rank(s) = {n * nproc_per_node} ranks: {e}") from None
    out_dir = Path(out).expanduser().resolve() if out else Path(cfg.trainer.run_dir) / "slurm"
    _sbatch_safe(str(out_dir), "--out")
    wd = Path(workdir or os.getcwd()).resolve()
    _sbatch_safe(str(wd), "the working directory")
    plan = SlurmPlan(trainer_nodes=n, rollout_nodes=m, gpus_per_node=g, nproc_per_node=nproc_per_node,
                     serve_tp=serve_tp, serve_dp=serve_dp, out=out_dir, run_dir=Path(cfg.trainer.run_dir),
                     workdir=wd, partition=partition, account=account, time=time)
    return cfg, plan


def check_model(cfg, plan: SlurmPlan) -> Optional[str]:
    """None when model.hf_dir is a checkpoint the layout fits and the training data exists; else the
    problem, in one line."""
    hf = Path(cfg.model.hf_dir)
    from megatron_grpo.run.embedded import ensure_tiny, is_cold_start_dir

    if is_cold_start_dir(hf.parent) and not (hf / "config.json").is_file():
        hf = ensure_tiny()  # a dry run's embedded cold start, not built yet: the tiny checkpoint's shapes
    if not (hf / "config.json").is_file():
        return (f"model.hf_dir {str(hf)!r} is not an HF checkpoint directory (no config.json) on this machine; "
                "the rollout nodes serve it and the trainer nodes load it, so it must be on a shared file system")
    data = cfg.data.train_jsonl
    if cfg.rollout.server != "replay" and data is not None and not Path(data).is_file():
        return (f"data.train_jsonl {str(data)!r} does not exist on this machine; the trainer nodes read it (and "
                "the audio files it names), so it must be on a shared file system: set data.train_jsonl=PATH")
    from model_bridge.config import ConfigError, ParallelLayout, check_layout, read_omni_config

    p = cfg.parallel
    from launch.serve_cli import check_serving_layout

    try:
        check_layout(read_omni_config(hf), ParallelLayout(tp=p.tp, ep=p.ep, etp=p.etp, pp=p.pp),
                     world_size=plan.world_size)
        check_serving_layout(str(hf), plan.serve_tp, plan.serve_dp, "launch.serve_tp=")  # the rollout nodes' vLLM
    except (ConfigError, ValueError) as e:
        return str(e)
    return None


def _serve_dtype(cfg, plan: SlurmPlan) -> str:
    """The servers' dtype: serve.dtype, else model.dtype, else bf16 on GPU nodes / fp32 on CPU ones
    (decided for the nodes, not for the machine running `mgrpo launch`)."""
    if cfg.serve.dtype != "auto":
        return cfg.serve.dtype
    if cfg.model.dtype != "auto":
        return cfg.model.dtype
    return "bfloat16" if plan.gpus_per_node > 0 else "float32"


def _setup_lines(cfg) -> str:
    if cfg.launch.setup is not None:
        lines = [str(s) for s in cfg.launch.setup]
        return "\n".join(lines) if lines else "# (launch.setup is empty: the nodes' default environment)"
    activate = Path(sys.prefix) / "bin" / "activate"
    if activate.is_file():
        return ("# launch.setup unset: the Python environment that ran `mgrpo launch` (on a shared file system)\n"
                f"source {shlex.quote(str(activate))}")
    return ("# launch.setup unset: the Python that ran `mgrpo launch` (on a shared file system)\n"
            f"export PATH={shlex.quote(str(Path(sys.prefix) / 'bin'))}:\"$PATH\"")


def _export_lines(cfg) -> str:
    la = cfg.launch
    lines = []
    if la.socket_ifname:
        q = shlex.quote(la.socket_ifname)
        lines += [f"export NCCL_SOCKET_IFNAME={q}  # launch.socket_ifname", f"export GLOO_SOCKET_IFNAME={q}"]
    else:
        lines.append("# launch.socket_ifname unset: NCCL and gloo choose the interface themselves")
    if not la.nccl_ib:
        lines.append("export NCCL_IB_DISABLE=1  # launch.nccl_ib: false (TCP sockets only)")
    else:
        lines.append("# launch.nccl_ib: true (NCCL uses InfiniBand/RoCE when it finds it)")
    for k, v in la.env.items():
        lines.append(f"export {k}={shlex.quote(str(v))}  # launch.env")
    return "\n".join(lines)


def _sbatch_lines(cfg, plan: SlurmPlan) -> str:
    la = cfg.launch
    lines = []
    if plan.gpus_per_node > 0:
        lines.append(f"#SBATCH --gpus-per-node={plan.gpus_per_node}")
    else:
        lines.append("# (CPU nodes: no --gpus-per-node)")
    if la.cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={la.cpus_per_task}")
    if la.exclusive:
        lines.append("#SBATCH --exclusive")
    for opt, v in (("partition", plan.partition), ("account", plan.account), ("time", plan.time)):
        if v is not None:
            lines.append(f"#SBATCH --{opt}={v}")
    for arg in la.sbatch_args:
        lines.append(f"#SBATCH {arg}")
    return "\n".join(lines)


def _srun_resources(cfg, plan: SlurmPlan) -> str:
    parts = []
    if plan.gpus_per_node > 0:
        parts.append(f"--gpus-per-node={plan.gpus_per_node}")
    # since slurm 22.05 srun no longer inherits sbatch's --cpus-per-task: give the one task per node
    # the job's CPUs on that node explicitly
    if cfg.launch.cpus_per_task:
        parts.append(f"--cpus-per-task={cfg.launch.cpus_per_task}")
    else:
        parts.append('--cpus-per-task="$SLURM_CPUS_ON_NODE"')
    return " ".join(parts)


def _serve_max_model_len(cfg) -> int:
    """The rollout nodes' context length: serve.max_model_len, or with auto the model's positions
    (the data-sized auto is for the server `mgrpo train` starts itself), 4096 where the checkpoint
    cannot be read from here."""
    if cfg.serve.max_model_len != "auto":
        return int(cfg.serve.max_model_len)
    from megatron_grpo.run.sizing import model_positions

    try:
        return model_positions(cfg.model.hf_dir)
    except (OSError, KeyError, ValueError, TypeError):
        return 4096


def _serve_args(cfg, plan: SlurmPlan) -> list[str]:
    s = cfg.serve
    return ["--model", str(cfg.model.hf_dir), "--port", str(cfg.launch.serve_port),
            "--tp", str(plan.serve_tp), "--dp", str(plan.serve_dp), "--served-model-name", "policy",
            "--dtype", _serve_dtype(cfg, plan), "--max-model-len", str(_serve_max_model_len(cfg)),
            "--max-num-seqs", str(s.max_num_seqs), "--max-audio-per-prompt", str(s.max_audio_per_prompt),
            # every recording the data accepts must decode on the rollout nodes (sized there from no data)
            "--max-audio-seconds", f"{s.max_audio_seconds or cfg.data.max_audio_seconds:g}",
            "--startup-timeout", f"{s.startup_timeout_s:g}", *map(str, s.extra_args), *map(str, cfg.launch.serve_args)]


def _layout_args(cfg) -> str:
    """The trainer layout as overrides for `mgrpo train --resume`: a run launched again with other
    nodes or another layout resumes at this one, not at the checkpoint's saved config."""
    p = cfg.parallel
    etp = p.tp if p.etp is None else p.etp
    return f"parallel.nproc={p.nproc} parallel.tp={p.tp} parallel.pp={p.pp} parallel.ep={p.ep} parallel.etp={etp}"


def _config_yaml(cfg) -> str:
    from megatron_grpo.configtree import to_dict

    data = to_dict(cfg)
    data["rollout"]["api_key"] = None
    head = ("# The resolved config of this slurm run (`mgrpo launch slurm`). train.sbatch runs\n"
            "# `mgrpo train --config <this file> rollout.server=remote rollout.server_urls=[<the servers>]`;\n"
            "# the API key comes from the api_key file through VLLM_API_KEY, never from here.\n")
    return head + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def _wrap_args(args: list[str], indent: str = "    ") -> str:
    """Shell-quoted arguments, one option (with its values) per continued line."""
    groups: list[list[str]] = []
    for a in args:
        if a.startswith("-") or not groups:
            groups.append([a])
        else:
            groups[-1].append(a)
    return (" \\\n" + indent).join(shlex.join(g) for g in groups)


def render(cfg, plan: SlurmPlan) -> dict[str, str]:
    """``{"rollout.sbatch": ..., "train.sbatch": ..., "config.yaml": ...}`` for a resolved
    (`resolve_plan`) config and plan."""
    la = cfg.launch
    q = shlex.quote
    common = dict(setup=_setup_lines(cfg), exports=_export_lines(cfg), out=q(str(plan.out)),
                  workdir=str(plan.workdir), log_dir=str(plan.log_dir), sbatch_lines=_sbatch_lines(cfg, plan),
                  srun_resources=_srun_resources(cfg, plan))
    requeue = "#SBATCH --requeue" if la.requeue else "# launch.requeue: false (no --requeue)"

    if plan.gpus_per_node == 0:  # vLLM's CPU KV cache (the local server gets it from serve.cpu_kvcache_gib too)
        common["exports"] += f"\nexport VLLM_CPU_KVCACHE_SPACE={cfg.serve.cpu_kvcache_gib}  # serve.cpu_kvcache_gib"
    if la.requeue:
        rollout_requeue = f"{requeue}\n#SBATCH --signal=B:USR1@{ROLLOUT_REQUEUE_S}"
        time_block = (
            "# B:USR1 goes to this shell only (the servers keep serving); the trainer job lowered its own\n"
            f"# time limit to end {FIT_MARGIN_S} s before this job, so it has checkpointed and requeued by now\n"
            "requeue_before_time_limit() {\n"
            f"    echo \"[rollout] time limit in {ROLLOUT_REQUEUE_S} s: requeueing; "
            "the trainer job waits for the new servers\"\n"
            "    scontrol requeue \"$SLURM_JOB_ID\"\n"
            "}\n"
            "trap requeue_before_time_limit USR1")
    else:
        rollout_requeue = requeue
        time_block = "# launch.requeue: false -- the servers stop at the time limit"
    rollout = _Template((TEMPLATES / "rollout.sbatch.in").read_text()).substitute(
        common, job_name=_sbatch_safe(f"{la.job_name}-rollout", "launch.job_name"), nodes=plan.rollout_nodes,
        requeue_lines=rollout_requeue, time_limit_block=time_block,
        ifname_arg=f"--ifname {q(la.socket_ifname)} " if la.socket_ifname else "",
        serve_args=_wrap_args(_serve_args(cfg, plan)))

    if la.requeue:
        requeue_cmd = "scontrol requeue \"$SLURM_JOB_ID\"  # launch.requeue: back in the queue, resumes from $RUN_DIR"
    else:
        requeue_cmd = ("echo \"[train] launch.requeue is false: resume with \\`sbatch $OUT/train.sbatch\\` "
                       "(export MGRPO_ROLLOUT_JOB_ID)\"")
    train = _Template((TEMPLATES / "train.sbatch.in").read_text()).substitute(
        common, job_name=_sbatch_safe(f"{la.job_name}-train", "launch.job_name"), nodes=plan.trainer_nodes,
        signal_line=(f"#SBATCH --signal={la.signal}" if la.signal else "# launch.signal: none (no --signal)"),
        requeue_lines=requeue, run_dir=q(str(plan.run_dir)), rollout_nodes=plan.rollout_nodes,
        health_timeout=f"{la.health_timeout_s:g}", fit_margin=FIT_MARGIN_S, master_port=la.master_port,
        nproc_per_node=plan.nproc_per_node, requeue_command=requeue_cmd, layout_args=_layout_args(cfg))
    return {"rollout.sbatch": rollout, "train.sbatch": train, "config.yaml": _config_yaml(cfg)}
