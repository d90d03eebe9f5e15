"""`mgrpo sft`: the SFT loop on the GRPO engine. One step = next conversations -> samples (ids,
assistant-only mask, clips) -> pack -> train step (``StepConfig(objective="sft")``) -> log ->
checkpoint; every rank builds the step's samples (same data order everywhere) and trains its
packed share. The HF export of the result happens after the ranks end (``export_hf_dir``).
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch.distributed as dist

from megatron_grpo.config import TrainConfig, train_dtype
from megatron_grpo.configtree import to_dict

__all__ = ["sft", "export_hf_dir", "HF_SUBDIR"]

HF_SUBDIR = "hf"
"""``sft.run_dir/hf``: the exported HF checkpoint (a ``model.hf_dir`` for `mgrpo train`)."""


def _broadcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _progress_line(step: int, steps: int, m: dict, t_step: float) -> str:
    return (f"[sft] step {step}/{steps} loss {m['loss']:.4f} tokens {int(m['global_num_tokens'])} "
            f"grad_norm {m['grad_norm']:.3f} lr {m['lr']:.2e} {t_step:.1f} s")


def sft(cfg: TrainConfig, resume: bool = False) -> int:
    """Run (or resume) the SFT run of ``cfg`` (``sft.*``) on this process's rank; returns 0."""
    from megatron.core import parallel_state as ps
    from transformers import AutoFeatureExtractor, AutoTokenizer

    from megatron_grpo.algo.importance import ISConfig
    from megatron_grpo.data.device_features import trainer_featurizer
    from megatron_grpo.data.reader import DataIterator
    from megatron_grpo.engine.batch import build_train_microbatches
    from megatron_grpo.engine.budget import common_token_budget
    from megatron_grpo.engine.checkpoint import load_checkpoint
    from megatron_grpo.engine.checkpoint_async import Checkpoints, async_save_enabled
    from megatron_grpo.engine.setup import build_engine
    from megatron_grpo.engine.step import StepConfig, audio_prefetch_tower, train_step
    from megatron_grpo.hang import StepSchedule, Watchdog, check_schedule
    from megatron_grpo.metrics import MetricsLogger
    from megatron_grpo.packing import PackLimits, plan_step, round_up
    from megatron_grpo.run.embedded import ensure_sft_inputs
    from megatron_grpo.sft.rows import read_sft_jsonl
    from megatron_grpo.sft.tokens import sft_sample
    from model_bridge.config import ParallelLayout
    from model_bridge.parallel import destroy_parallel, init_parallel

    p, s = cfg.parallel, cfg.sft
    init_parallel(tp=p.tp, ep=p.ep, etp=p.etp, pp=p.pp, seed=cfg.trainer.seed)
    rank = dist.get_rank()
    run_dir = Path(s.run_dir)
    if rank == 0:
        ensure_sft_inputs(cfg)
        run_dir.mkdir(parents=True, exist_ok=True)
        saved = to_dict(cfg)
        saved["rollout"]["api_key"] = None
        (run_dir / "config.json").write_text(json.dumps(saved, indent=2))
    cfg = _broadcast(cfg)
    s = cfg.sft
    optim = cfg.optimizer if s.lr is None else dataclasses.replace(cfg.optimizer, lr=s.lr)
    engine = build_engine(cfg.model.hf_dir, ParallelLayout(tp=p.tp, ep=p.ep, etp=p.etp, pp=p.pp), optim,
                          dtype=train_dtype(cfg), backend=cfg.model.backend, recompute=cfg.model.recompute)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_dir)
    featurize = trainer_featurizer(AutoFeatureExtractor.from_pretrained(cfg.model.hf_dir), cfg.trainer.device_features)
    data = DataIterator(read_sft_jsonl(s.data, cfg.data), s.samples_per_step, shuffle=cfg.data.shuffle,
                        seed=cfg.data.seed)
    tp_sp = p.tp if p.tp > 1 else 1
    # the same train_step as GRPO's (no reference logprobs): the same activation memory per token
    budget = common_token_budget(cfg.packing.max_tokens_per_microbatch, engine,
                                 chunk_tokens=cfg.trainer.logprob_chunk_size, multiple=tp_sp)
    packing = PackLimits(max_tokens_per_microbatch=round_up(budget, tp_sp), pad_multiple=tp_sp,
                         allow_oversized=cfg.packing.allow_oversized, pad_token_id=int(tokenizer.pad_token_id or 0))
    step_cfg = StepConfig(objective="sft", importance=ISConfig(mode="off"), compute_entropy=False,
                          max_consecutive_skips=cfg.trainer.max_consecutive_skips,
                          logprob_chunk_size=cfg.trainer.logprob_chunk_size, fused_lm_head=cfg.trainer.fused_lm_head)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    tower = audio_prefetch_tower(engine, step_cfg)  # runs on the first micro-batch's clips while packing
    audio_id, n_window = engine.spec.audio_token_id, engine.spec.audio.n_window
    logger = MetricsLogger(run_dir, tensorboard=cfg.logging.tensorboard, plot=cfg.logging.plot,
                           plotted=(("loss", "SFT loss (token-mean NLL)"), ("grad_norm", "grad norm"))) \
        if rank == 0 else None
    start = 0
    ckpts = Checkpoints(run_dir, keep_last=cfg.checkpoint.keep_last,
                        async_save=async_save_enabled(cfg.checkpoint.async_save))
    try:
        if resume:
            start, extra = load_checkpoint(run_dir, engine.model, engine.optimizer, engine.scheduler)
            if extra and extra.get("data"):
                data.load_state_dict(extra["data"])
        if logger:
            logger.truncate_after(start)
        with Watchdog(cfg.guard.step_timeout_s, run_dir, first_step_timeout_s=cfg.guard.first_step_timeout_s) as wd:
            for step in range(start + 1, s.steps + 1):
                with wd.step(step):
                    t0 = time.monotonic()
                    rows = data.next_batch()
                    samples = [sft_sample(r, tokenizer, r.load_audios(cfg.data), audio_token_id=audio_id,
                                          chat_template_kwargs=cfg.rollout.chat_template_kwargs, n_window=n_window)
                               for r in rows]
                    plan = plan_step([x.num_tokens for x in samples], dp_size, packing)
                    mbs = build_train_microbatches(samples, plan, dp_rank, packing, featurize=featurize,
                                                   n_window=n_window, audio_tower=tower)
                    check_schedule(StepSchedule.from_microbatches(step, mbs))
                    with wd.collective("train_step"):
                        m = train_step(engine, mbs, step_cfg, step=step)
                    del mbs  # before the next step's build, which then reuses its host memory
                    m["padding_fraction"] = plan.padding_fraction
                    m["time/step"] = time.monotonic() - t0
                    if logger:
                        logger.log(step, m)
                        if cfg.logging.progress:
                            print(_progress_line(step, s.steps, m, m["time/step"]), flush=True)
                    with wd.collective("save_checkpoint"):
                        ckpts.poll()  # finishes an asynchronous save once written everywhere
                        if step == s.steps or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                            # the last one always, and written before the end: the export reads it
                            ckpts.save(step, engine.model, engine.optimizer, engine.scheduler,
                                       {"data": data.state_dict()}, wait=step == s.steps)
    finally:
        if logger:
            logger.close()
        destroy_parallel()
    return 0


def export_hf_dir(cfg: TrainConfig) -> Path:
    """``sft.run_dir/hf`` from the run's newest checkpoint (the bridge's ``mcore_to_hf``, in this
    process); an earlier export there is replaced."""
    import shutil

    from model_bridge.convert import mcore_to_hf

    run_dir = Path(cfg.sft.run_dir)
    out = run_dir / HF_SUBDIR
    if out.exists():
        shutil.rmtree(out)
    mcore_to_hf(run_dir, cfg.model.hf_dir, out, progress=False, in_process=True)
    return out
