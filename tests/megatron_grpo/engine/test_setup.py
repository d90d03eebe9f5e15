"""``engine/setup.py``'s optimizer configuration: ``OptimConfig``'s checks and the LR schedule of
``build_scheduler`` (in-process, no model)."""
from __future__ import annotations

import math

import pytest


def test_lr_schedule_first_update_trains_and_skips_do_not_advance():
    from types import SimpleNamespace

    from megatron_grpo.engine.setup import OptimConfig, build_scheduler

    def lrs(cfg, n=8):
        opt = SimpleNamespace(param_groups=[{"params": []}])
        sched, out = build_scheduler(opt, cfg), []
        for _ in range(n):
            out.append(opt.param_groups[0]["lr"])
            sched.step(1)
        return out

    assert lrs(OptimConfig(lr=1e-3)) == [1e-3] * 8
    assert lrs(OptimConfig(lr=1e-3, warmup_steps=4))[:5] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    cos = lrs(OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=2, lr_decay_style="cosine", decay_steps=6))
    expected = [5e-4, 1e-3] + [1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * (s - 2) / 4)) for s in (3, 4, 5, 6)] \
        + [1e-4, 1e-4]
    assert cos == pytest.approx(expected)


@pytest.mark.parametrize("kw,match", [
    (dict(lr=0.0), "lr must be"), (dict(min_lr=2e-6), "min_lr"), (dict(lr_decay_style="cosine"), "decay_steps"),
    (dict(lr_decay_style="exp"), "lr_decay_style"), (dict(adam_beta2=1.0), "adam_beta2"),
    (dict(clip_grad=-1.0), "clip_grad"), (dict(warmup_steps=-1), "warmup_steps"),
    (dict(use_distributed_optimizer=False, overlap_param_gather=True), "overlap_param_gather")])
def test_optim_config_checks(kw, match):
    from megatron_grpo.engine.setup import OptimConfig

    with pytest.raises(ValueError, match=match):
        OptimConfig(**kw)
