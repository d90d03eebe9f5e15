"""`mgrpo train`: the GRPO loop. One step = rollout -> rewards -> advantages -> pack -> train step ->
push -> log -> checkpoint, each a visible call in :func:`train`.

Rank 0 talks to vLLM (rollout, weight push); every rank trains its share of the packed step.
:func:`build_run` assembles what the loop uses into one :class:`Run` (model and optimizer from
engine/, the rollout backend and trajectory source from run/, the packer's limits, the metrics
logger); this file holds the setup, the loop and what each rank decides per step.
"""
from __future__ import annotations

import functools
import json
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from megatron_grpo.config import TrainConfig, train_dtype
from megatron_grpo.configtree import to_dict

if TYPE_CHECKING:  # the annotations of Run; build_run imports them when it runs (megatron-core is heavy)
    from megatron_grpo.data.reader import DataIterator
    from megatron_grpo.engine.checkpoint_async import Checkpoints
    from megatron_grpo.engine.setup import Engine
    from megatron_grpo.engine.step import StepConfig
    from megatron_grpo.metrics import MetricsLogger
    from megatron_grpo.packing import PackLimits
    from megatron_grpo.run.replay import ReplayBackend, ReplaySource
    from megatron_grpo.run.rollout_source import RolloutBackend, TrajectorySource
    from megatron_grpo.run.trajlog import TrajectoryLog


def _broadcast(obj, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def peak_memory_gib() -> float:
    """The highest peak of allocated CUDA memory on any rank so far, in GiB (a MAX all-reduce)."""
    t = torch.tensor([float(torch.cuda.max_memory_allocated())], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() / 2**30


def _step_metrics(step: int, trajs, train: dict, push_s: float, times: dict) -> dict:
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float64)
    m = {"reward/mean": rewards.mean().item(), "reward/std": rewards.std().item() if len(trajs) > 1 else 0.0,
         "samples": float(len(trajs)), "tokens/generated": float(sum(t.num_generated for t in trajs)),
         "turns/mean": sum(t.num_turns for t in trajs) / max(1, len(trajs)),
         # steps between the policy that sampled and the one trained (0 on-policy, 1 with overlap)
         "rollout/weight_lag": float(step - 1 - min((t.weight_version for t in trajs), default=step - 1))}
    groups = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t.reward)
    if groups:  # share of groups whose samples all scored the same: advantage 0, no signal (TRL's name)
        m["reward/frac_zero_std"] = sum(max(r) == min(r) for r in groups.values()) / len(groups)
    for name in (trajs[0].reward_terms if trajs else {}):
        vals = [t.reward_terms.get(name) for t in trajs if t.reward_terms.get(name) is not None]
        if vals:
            m[f"reward/{name}"] = sum(vals) / len(vals)
    m.update({k: v for k, v in train.items() if isinstance(v, (int, float))})
    m.update({f"time/{k}": v for k, v in times.items()})
    m["time/push"] = push_s
    total = sum(times.values()) + push_s
    m["time/step"] = total
    m["tokens_per_s"] = m.get("tokens_total", m["tokens/generated"]) / max(total, 1e-9)
    return m


def _warn_no_signal(step: int, m: dict, streak: bool, say=None) -> bool:
    """One line (through `say`, default print) when a streak of steps without any learning signal
    begins: every group's samples scored the same, so every advantage is 0. Returns whether this
    step continues such a streak."""
    now = m.get("reward/frac_zero_std") == 1.0
    if now and not streak:
        line = (f"[train] step {step}: no learning signal: every group's samples scored the same (mean reward "
                f"{m['reward/mean']:.3f}), so every advantage is 0 and only auxiliary losses update the model. "
                "Expected once every rollout earns the top reward; otherwise raise rollout.temperature or "
                "rollout.num_generations, or check the reward functions (reward/* in metrics.jsonl)")
        (say or functools.partial(print, flush=True))(line)
    return now


def _plan_of(dp_size: int, packing, keep_groups: bool) -> Callable:
    """A step's packing plan from its token counts and GRPO groups: with ``keep_groups``
    (``trainer.shared_clips``) a group's samples gather on few DP ranks (``packing.balance_samples``),
    so its recording runs through the audio tower on fewer ranks."""
    from megatron_grpo.packing import plan_step

    def plan_of(lengths, groups=None):
        return plan_step(lengths, dp_size, packing, groups=groups if keep_groups else None)

    return plan_of


PREEMPTED_MARKER = "PREEMPTED"
"""run_dir/PREEMPTED (JSON: step, signal, time): the run stopped on SIGUSR1/SIGTERM after saving the
checkpoint of `step`; the slurm job script then requeues itself (docs/slurm.md). Removed at start."""


def _write_preempted(run_dir: Path, step: int, signal_name) -> None:
    tmp = run_dir / f".{PREEMPTED_MARKER}.tmp"
    tmp.write_text(json.dumps({"step": step, "signal": signal_name, "time": time.time()}) + "\n")
    tmp.replace(run_dir / PREEMPTED_MARKER)


def _exit_on_sigterm() -> None:
    """SIGTERM -> SystemExit (main thread only), so `finally`/`except` blocks run and stop the local
    vLLM server, which lives in its own session and would outlive us; the preemption handler
    replaces this for the training loop and restores it after."""
    import signal
    import sys
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def _default_sigterm() -> None:
    """SIGTERM back to its default once the run is closed: a rank the spawner stops while it runs
    its exit handlers then ends quietly instead of raising SystemExit inside them."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@dataclass
class Run:
    """Everything the loop uses, built once by :func:`build_run` (on every rank)."""

    cfg: TrainConfig
    """The resolved config (the same on every rank)."""
    rank: int
    run_dir: Path
    engine: Engine
    """This rank's model chunks, optimizer and LR schedule."""
    backend: Optional[Union[RolloutBackend, ReplayBackend]]
    """Rank 0: the vLLM servers and rollout engine, or the recording; None elsewhere."""
    source: Union[TrajectorySource, ReplaySource]
    """Every rank's trajectories of a step."""
    to_ranks: Callable
    """Hands rank 0's trajectories of a step to every rank: all on rank 0, elsewhere the samples of
    that rank's own micro-batches (``run.to_ranks.deliver``)."""
    plan_of: Callable
    """``(lengths, groups=) -> PackPlan`` of a step, the one ``to_ranks`` delivered by."""
    kept: TrajectoryLog
    """The trainer's logprobs beside recordings, and ``logging.trajectories`` (``run.trajlog``)."""
    data: Optional[DataIterator]
    """The prompts' iterator; None when replaying a recording."""
    featurize: Callable
    """A clip's log-mel features (the checkpoint's Whisper extractor; on the GPU with
    ``trainer.device_features``)."""
    packing: PackLimits
    """The packer's limits."""
    step_cfg: StepConfig
    """What one training step computes."""
    logger: Optional[MetricsLogger]
    """Rank 0's metrics logger; None elsewhere."""
    bar: Any
    """Rank 0's tqdm progress bar, when ``logging.progress``; None otherwise."""
    start: int
    """The last step already done (0 for a new run, the checkpoint's step on resume)."""
    dp_rank: int
    dp_size: int
    on_stream: ExitStack
    """Keeps this rank's work on the CUDA-graph capture stream (``engine.graphs.trainer_stream``)."""
    checkpoints: Checkpoints
    """The run's checkpoints, at most one being written (``checkpoint.async_save``)."""

    def close(self) -> None:
        """Stop what the run started (rank 0's local vLLM server among it) and leave megatron's groups."""
        from model_bridge.parallel import destroy_parallel

        for part in (self.source, self.bar, self.logger, self.backend):
            if part is not None:
                part.close()
        self.on_stream.close()
        destroy_parallel()


def build_run(cfg: TrainConfig, resume: bool = False) -> Run:
    """Set up this rank for `cfg`: parallel groups, model and optimizer, rollout backend and source,
    data, packer, logger; on resume the checkpoint's state, and the server gets its weights."""
    from megatron.core import parallel_state as ps
    from transformers import AutoFeatureExtractor

    from megatron_grpo.data.device_features import trainer_featurizer
    from megatron_grpo.data.reader import DataIterator, read_jsonl
    from megatron_grpo.engine.budget import common_token_budget
    from megatron_grpo.engine.checkpoint import load_checkpoint
    from megatron_grpo.engine.checkpoint_async import Checkpoints, async_save_enabled
    from megatron_grpo.engine.graphs import enable_graphs, graph_fallback_reason, graphs_wanted, trainer_stream
    from megatron_grpo.engine.nonfinite import NonFiniteSkips
    from megatron_grpo.engine.setup import build_engine
    from megatron_grpo.engine.step import StepConfig
    from megatron_grpo.metrics import MetricsLogger
    from megatron_grpo.packing import PackLimits, round_up
    from megatron_grpo.run.embedded import ensure_embedded_inputs
    from megatron_grpo.run.rollout_source import open_backend, open_source
    from megatron_grpo.run.to_ranks import deliver, dp_ranks_of_all
    from megatron_grpo.run.trajlog import TrajectoryLog
    from model_bridge.config import ParallelLayout
    from model_bridge.parallel import init_parallel

    p = cfg.parallel
    init_parallel(tp=p.tp, ep=p.ep, etp=p.etp, pp=p.pp, seed=cfg.trainer.seed)
    on_stream = ExitStack()  # the rank's work on the graphs' capture stream, from the engine's build on
    graphs_on = graphs_wanted(cfg.trainer.cuda_graphs, cfg.packing.max_tokens_per_microbatch,
                              graph_fallback_reason(cuda=torch.cuda.is_available(), tp=p.tp, pp=p.pp, ep=p.ep,
                                                    backend=cfg.model.backend, recompute=cfg.model.recompute,
                                                    dtype=train_dtype(cfg)))
    on_stream.enter_context(trainer_stream(graphs_on))
    rank = dist.get_rank()
    run_dir = Path(cfg.trainer.run_dir)
    if rank == 0:
        ensure_embedded_inputs(cfg)
        run_dir.mkdir(parents=True, exist_ok=True)
        saved = to_dict(cfg)
        saved["rollout"]["api_key"] = None  # never on disk; a resumed run reads $VLLM_API_KEY again
        (run_dir / "config.json").write_text(json.dumps(saved, indent=2))
        (run_dir / PREEMPTED_MARKER).unlink(missing_ok=True)  # a stale marker of an earlier run
    cfg = _broadcast(cfg)  # every rank sees the resolved paths
    layout = ParallelLayout(tp=p.tp, ep=p.ep, etp=p.etp, pp=p.pp)
    dtype = train_dtype(cfg)  # the local vLLM server gets the same (config.serve_dtype)
    _exit_on_sigterm()  # before the loop a SIGTERM (the rank spawner stopping us) must still run the cleanup
    backend = open_backend(cfg, run_dir) if rank == 0 else None  # vLLM starts while ranks build the model
    try:  # until the run exists, an error must not leave the local server running
        engine = build_engine(cfg.model.hf_dir, layout, cfg.optimizer, dtype=dtype, backend=cfg.model.backend,
                              recompute=cfg.model.recompute)
        data = None  # rollout.server replay trains on the recording: the prompts are not read
        if cfg.rollout.server != "replay":
            # every rank reads the rows (the data order is computed everywhere); rank 0 logs the skipped ones
            data = DataIterator.from_config(read_jsonl(cfg.data.train_jsonl, cfg.data, log_skips=rank == 0),
                                            cfg.data, cfg.trainer.prompts_per_step)
        featurize = trainer_featurizer(AutoFeatureExtractor.from_pretrained(cfg.model.hf_dir),
                                       cfg.trainer.device_features)
        tp_sp = p.tp if p.tp > 1 else 1
        budget = common_token_budget(cfg.packing.max_tokens_per_microbatch, engine,
                                     chunk_tokens=cfg.trainer.logprob_chunk_size, multiple=tp_sp)
        packing = PackLimits(max_tokens_per_microbatch=round_up(budget, tp_sp),
                             pad_multiple=tp_sp, allow_oversized=cfg.packing.allow_oversized,
                             pad_token_id=int(backend.tokenizer.pad_token_id or 0) if rank == 0 else 0)
        packing = _broadcast(packing)
        enable_graphs(engine, graphs_on, packing.max_tokens_per_microbatch, backend=cfg.model.backend,
                      recompute=cfg.model.recompute, multiple=packing.pad_multiple,
                      requested=cfg.trainer.cuda_graphs is True)
        step_cfg = StepConfig(loss=cfg.loss, importance=cfg.importance,
                              max_consecutive_skips=cfg.trainer.max_consecutive_skips,
                              logprob_chunk_size=cfg.trainer.logprob_chunk_size,
                              fused_lm_head=cfg.trainer.fused_lm_head,
                              routing_replay=cfg.rollout.routing_replay or None)
        logger = None
        if rank == 0:
            logger = MetricsLogger(run_dir, tensorboard=cfg.logging.tensorboard, plot=cfg.logging.plot)
        source = open_source(cfg, backend, data, rank)  # rollout.server replay: a recording's steps, no server, no push
        if hasattr(source, "resolve_push_mode"):  # before step 1: a push that cannot work fails now
            source.resolve_push_mode(engine.model)
        kept = TrajectoryLog(cfg, run_dir, rank)  # trainer logprobs beside recordings, logging.trajectories
        dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        # the GRPO groups kept on few ranks where their shared recording saves tower work
        plan_of = _plan_of(dp_size, packing, cfg.trainer.shared_clips)
        to_ranks = functools.partial(deliver, plan_of=plan_of,
                                     dp_of_rank=dp_ranks_of_all(dp_rank), broadcast=_broadcast)

        start = 0
        if resume:
            start, extra = load_checkpoint(run_dir, engine.model, engine.optimizer, engine.scheduler)
            if extra and data is not None and extra.get("data"):
                data.load_state_dict(extra["data"])
            if extra and extra.get("nonfinite"):
                engine.nonfinite = NonFiniteSkips(cfg.trainer.max_consecutive_skips)
                engine.nonfinite.load_state_dict(extra["nonfinite"])
            if logger:
                logger.truncate_after(start)
        elif logger:  # a new run in a run dir without checkpoints: its metrics start afresh, unmixed
            logger.truncate_after(0)
        # the server must serve the checkpoint's weights, not the HF dir's; a remote server may
        # serve other weights than model.hf_dir's (another checkpoint, the tiny model before its cold start)
        if start > 0 or resume or cfg.rollout.server == "remote":
            from megatron_grpo.run.failures import RolloutFailed, rollout_failure
            from megatron_grpo.weight_sync.push import WeightPushError
            try:
                source.push(engine.model, start)
            except WeightPushError as e:  # a server that cannot take the weights: one line, as a failed rollout
                raise (rollout_failure(e, run_dir) if rank == 0 else RolloutFailed(str(e))) from None

        bar = None
        if rank == 0 and cfg.logging.progress:
            from tqdm import tqdm
            bar = tqdm(total=cfg.trainer.steps, initial=start, desc="grpo", unit="step", dynamic_ncols=True)
    except BaseException:
        on_stream.close()
        if backend:
            backend.close()
        raise
    return Run(cfg=cfg, rank=rank, run_dir=run_dir, engine=engine, backend=backend, source=source,
               to_ranks=to_ranks, plan_of=plan_of, kept=kept, data=data, featurize=featurize, packing=packing, step_cfg=step_cfg,
               logger=logger, bar=bar, start=start, dp_rank=dp_rank, dp_size=dp_size, on_stream=on_stream,
               checkpoints=Checkpoints(run_dir, keep_last=cfg.checkpoint.keep_last,
                                       async_save=async_save_enabled(cfg.checkpoint.async_save)))


def train(cfg: TrainConfig, resume: bool = False) -> int:
    """Run (or resume) the job described by `cfg` on this process's rank; returns an exit code."""
    from megatron_grpo.engine.batch import build_train_microbatches
    from megatron_grpo.engine.signals import PreemptionHandler
    from megatron_grpo.engine.step import audio_prefetch_tower, train_step
    from megatron_grpo.hang import StepSchedule, Watchdog, check_schedule

    run = build_run(cfg, resume)
    cfg, src, engine = run.cfg, run.source, run.engine
    tower = audio_prefetch_tower(engine, run.step_cfg)  # runs on the first micro-batch's clips while packing
    preempt = PreemptionHandler().install()
    no_signal = False
    try:
        g = cfg.guard
        with Watchdog(g.step_timeout_s, run.run_dir, first_step_timeout_s=g.first_step_timeout_s) as wd:
            for step in range(run.start + 1, cfg.trainer.steps + 1):
                with wd.step(step):
                    t0 = time.monotonic()
                    batch = src.rollout_and_score(step)       # 1-2. rollout and rewards (rank 0)
                    trajs, extra = src.advantages(step, batch, run.to_ranks)  # 3. advantages, this rank's share
                    times = {"rollout": time.monotonic() - t0}
                    if step < cfg.trainer.steps:
                        src.prefetch(step + 1)  # rollout.overlap: step+1 rolls out while this step trains
                    t0 = time.monotonic()
                    plan = run.plan_of([t.num_tokens for t in trajs], groups=[t.group_id for t in trajs])  # 4. pack
                    mbs = build_train_microbatches(trajs, plan, run.dp_rank, run.packing, featurize=run.featurize,
                                                   n_window=engine.spec.audio.n_window,
                                                   routes=cfg.rollout.routing_replay == "r3",
                                                   share_clips=cfg.trainer.shared_clips,
                                                   keep_shared=cfg.trainer.shared_clips_keep, audio_tower=tower)
                    check_schedule(StepSchedule.from_microbatches(step, mbs))
                    lps = {} if run.kept.wants(step) else None
                    with wd.collective("train_step"):                       # 5. train step
                        train_metrics = train_step(engine, mbs, run.step_cfg, step=step, logprobs_out=lps)
                    del mbs  # before the next step's build, which then reuses its host memory
                    if lps is not None:
                        with wd.collective("keep_trajectories"):
                            run.kept.keep(step, trajs, lps)
                    train_metrics["padding_fraction"] = plan.padding_fraction
                    if torch.cuda.is_available():
                        train_metrics["memory/peak_gib"] = peak_memory_gib()  # max over ranks
                    times["train"] = time.monotonic() - t0
                    t0 = time.monotonic()
                    src.settle()                                             # 6. push to vLLM
                    with wd.collective("weight_push"):
                        src.push(engine.model, step)
                    push_s = time.monotonic() - t0
                    if run.rank == 0:                                        # 7. log
                        no_signal = _log_step(run, step, trajs, train_metrics, push_s, times, extra, no_signal)
                    stop = preempt.agreed()                                  # 8. checkpoint
                    with wd.collective("save_checkpoint"):
                        run.checkpoints.poll()  # finishes an asynchronous save once written everywhere
                        if stop or _checkpoint_due(cfg, step):
                            _save(run, step, wait=stop)
                    if stop:
                        if run.rank == 0:
                            _write_preempted(run.run_dir, step, preempt.signal_name)
                            print(f"[train] preempted: checkpoint of step {step} saved; resume with "
                                  f"`mgrpo train --resume {run.run_dir}`", flush=True)
                        break
            with wd.collective("save_checkpoint"):
                run.checkpoints.wait()  # an asynchronous save still being written is complete before the end
    finally:
        src.close()  # waits for a background rollout, with the preemption handler still in place
        preempt.restore()
        try:
            run.close()
        finally:
            _default_sigterm()
    return 0


def _log_step(run: Run, step: int, trajs, train_metrics: dict, push_s: float, times: dict, extra: dict,
              no_signal: bool) -> bool:
    """Rank 0: the step's metrics to metrics.jsonl (and TensorBoard, the plot, the bar); whether a
    streak of steps without learning signal goes on."""
    m = {**_step_metrics(step, trajs, train_metrics, push_s, times), **extra}
    run.logger.log(step, m)
    no_signal = _warn_no_signal(step, m, no_signal, say=run.bar.write if run.bar else None)
    if run.bar:
        run.bar.set_postfix(reward=f"{m['reward/mean']:.3f}",  # turns > 1: the agent called a tool
                            turns=f"{m['turns/mean']:.2f}",
                            rollout_kl=f"{m.get('mismatch_kl_k3', 0.0):.1e}",  # vLLM vs trainer
                            tok_s=f"{m['tokens_per_s']:.0f}", step_s=f"{m['time/step']:.1f}")
        run.bar.update(1)
    return no_signal


def _checkpoint_due(cfg: TrainConfig, step: int) -> bool:
    ck = cfg.checkpoint
    return bool((ck.every and step % ck.every == 0) or (ck.at_end and step == cfg.trainer.steps))


def _save(run: Run, step: int, wait: bool = False) -> None:
    """The checkpoint of `step` (collective): model, optimizer, LR schedule, the data position and
    the skipped-update counters; written in the background with ``checkpoint.async_save`` unless
    ``wait`` (a preemption: the job ends next)."""
    e = run.engine
    extra = {"data": run.source.data_state(), "nonfinite": e.nonfinite.state_dict() if e.nonfinite else None}
    run.checkpoints.save(step, e.model, e.optimizer, e.scheduler, extra, wait=wait)
