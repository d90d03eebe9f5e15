"""The audio tower on its own CUDA stream (``engine/audio_stream.py``, ``shared_audio``'s "Side stream").

CPU: the fallback reasons, no stream on CPU, and the plan's ``ClipUse.ahead`` (the batches each
micro-batch's forward launches for the next one). GPU: the trainer with the tower on its own
stream against the same micro-batches with it on the main stream, over 3 steps with the optimizer:
the same kept batches, the losses, and every gradient (the tower's included) within the
main-stream run's own run-to-run spread.
"""
from __future__ import annotations

import pytest
import torch

from megatron_grpo.engine.audio_stream import audio_tower_stream, side_stream_fallback_reason
from megatron_grpo.engine.step_audio import _shared_plan
from model_bridge.spawn import run_ranks

BUDGET = 512

OK = dict(enabled=True, cuda=True, pooled=True, overlap_grad_reduce=False, graphs=False, tower=True)


@pytest.mark.parametrize("kw,reason", [
    ({}, None),
    (dict(enabled=False), "trainer.audio_stream is false"),
    (dict(cuda=False), "no CUDA device"),
    (dict(tower=False), "this rank holds no audio tower"),
    (dict(tower_tp=2), "the audio tower is tensor-parallel (tp=2): its collectives would move between the decoder's"),
    (dict(pp=2), "pipeline parallelism (pp=2): 1F1B interleaves micro-batches' forwards and backwards, so a "
                 "micro-batch without audio could add its dummy pass's gradients beside the side stream's"),
    (dict(pooled=False), "the clips are not pooled (trainer.shared_clips false or shared_clips_keep 0)"),
    (dict(overlap_grad_reduce=True),
     "optim.overlap_grad_reduce is on (its bucket bookkeeping runs in DDP's hook on the main stream)"),
    (dict(graphs=True), "trainer.cuda_graphs captures the decoder on the main stream"),
])
def test_fallback_reasons(kw, reason):
    assert side_stream_fallback_reason(**{**OK, **kw}) == reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case")
def test_no_stream_on_cpu(caplog):
    class _Engine:
        model = [torch.nn.Module()]
        optim = type("O", (), {"overlap_grad_reduce": False})()
        layout = type("L", (), {"tp": 1, "pp": 1})()
        graphs = None

    _Engine.model[0].audio_tower = torch.nn.Linear(2, 2)
    with caplog.at_level("WARNING"):
        assert audio_tower_stream(_Engine()) is None
    assert not caplog.records  # nothing to say on CPU: the option is a GPU one


def test_each_micro_batch_launches_the_batches_the_next_one_uses_first():
    # clips 0-1 only in micro-batch 0, clip 2 in 0..2 (a group's recording), clip 3 only in 1,
    # clip 4 in 2..3, clip 5 only in 3
    span = {0: (0, 0), 1: (0, 0), 2: (0, 2), 3: (1, 1), 4: (2, 3), 5: (3, 3)}
    frames = [100] * 6
    orders = [(-1, -2, -3), (-3, -4), (-3, -5), (-5, -6)]
    shared, uses = _shared_plan(span, frames, orders, max_frames=1000, keep_shared=0.15, pool=True)
    first = {}
    for c, (f, _) in span.items():
        first[shared.batch_of[c]] = min(f, first.get(shared.batch_of[c], f))
    for k, use in enumerate(uses):
        assert set(use.ahead) == {b for b, f in first.items() if f == k + 1}, (k, use.ahead, shared.batches)
    assert uses[-1].ahead == ()
    assert all(u.shared.side is None for u in uses)  # no stream given: none used


def _trajectories(spec, n=8, seed=0):
    from launch.bench._train_data import TINY_RANGES, synth_trajectories

    return synth_trajectories(n, spec, max_tokens=BUDGET, seed=seed, ranges=TINY_RANGES, group_size=4)


def _side_vs_main_rank(hf_dir: str, steps: int = 3) -> dict:
    """Three bf16 engines from one checkpoint: the tower on its own stream, and twice on the main
    stream; ``steps`` train steps each on micro-batches of the same trajectories."""
    from transformers import AutoFeatureExtractor

    from megatron_grpo.data.device_features import trainer_featurizer
    from megatron_grpo.engine.batch import build_train_microbatches
    from megatron_grpo.engine.setup import build_engine, unwrapped
    from megatron_grpo.engine.step import StepConfig, forward_backward, optimizer_update
    from megatron_grpo.packing import PackLimits, plan_step
    from model_bridge.config import ParallelLayout
    from model_bridge.parallel import init_parallel

    init_parallel(seed=1234)
    engines = [build_engine(hf_dir, ParallelLayout(), dtype=torch.bfloat16) for _ in range(3)]
    sides = [audio_tower_stream(engines[0]), None, None]
    assert sides[0] is not None
    trajs = _trajectories(engines[0].spec)
    packing = PackLimits(max_tokens_per_microbatch=BUDGET)
    plan = plan_step([t.num_tokens for t in trajs], 1, packing)
    featurize = trainer_featurizer(AutoFeatureExtractor.from_pretrained(hf_dir))
    cfg = StepConfig()
    tower_names = {n for n, _ in unwrapped(engines[0].model[0]).audio_tower.named_parameters()}
    res = {"side_vs_main": [], "main_vs_main": [], "loss": [], "kept": [], "tower_grad_norm": [], "micro_batches": 0}

    def grads(e):
        return [p.main_grad.detach().float().clone() for p in e.model[0].parameters() if p.requires_grad]

    def rel(a, b):
        return max(float((x - y).norm() / y.norm().clamp_min(1e-30)) for x, y in zip(a, b))

    for step in range(1, steps + 1):
        gs, losses, kept = [], [], []
        for e, side in zip(engines, sides):
            mbs = build_train_microbatches(trajs, plan, 0, packing, featurize=featurize,
                                           n_window=e.spec.audio.n_window, tower_stream=side)
            res["micro_batches"] = len(mbs)
            for c in e.model:
                c.zero_grad_buffer()
            e.optimizer.zero_grad()
            losses.append(forward_backward(e, mbs, cfg)["loss"])
            gs.append(grads(e))
            shared = next(m.clip_use.shared for m in mbs if m.clip_use)
            kept.append((len(shared.batches), shared.kept_batches))
            optimizer_update(e, None, step)
        thinker = unwrapped(engines[0].model[0])
        res["tower_grad_norm"].append(float(sum(p.main_grad.float().norm() ** 2 for n, p in
                                                thinker.audio_tower.named_parameters() if n in tower_names)) ** 0.5)
        res["side_vs_main"].append(rel(gs[0], gs[1]))
        res["main_vs_main"].append(rel(gs[2], gs[1]))
        res["loss"].append(losses)
        res["kept"].append(kept)
    return res


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tower_on_its_own_stream_makes_the_same_steps(tiny_ckpt):
    res = run_ranks(_side_vs_main_rank, 1, str(tiny_ckpt), timeout=600)[0]
    assert res["micro_batches"] >= 2, res  # the run-ahead has a next micro-batch to launch for
    assert all(n > 0 for n in res["tower_grad_norm"]), res  # the side stream's gradients reach the buffers
    for kept in res["kept"]:
        assert kept[0] == kept[1] == kept[2], res
    for sv, mm in zip(res["side_vs_main"], res["main_vs_main"]):
        assert sv <= max(4 * mm, 1e-3), res
    for ls, lm, lm2 in res["loss"]:
        assert ls == pytest.approx(lm, rel=1e-3, abs=1e-6), res
