"""Data to ranks (megatron_grpo/run/to_ranks.py): each rank receives only its own DP group's
micro-batches' trajectories, every clip once, and the step's loss and gradients are bit for bit
those of broadcasting everything to every rank (real gloo ranks, the tiny checkpoint, fp32)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from model_bridge.spawn import run_ranks

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
BUDGET = 160
GROUPS, GENERATIONS = 3, 4


def make_step(hf_dir: str) -> list:
    """GROUPS prompts x GENERATIONS samples: a group's samples share one recording (one array
    object, as the rollout engine hands it out) and each has its own crop clip after a tool turn."""
    from transformers import WhisperFeatureExtractor

    from megatron_grpo.algo.advantages import compute_advantages
    from megatron_grpo.engine.batch import featurizer_from_extractor
    from megatron_grpo.trajectory import Trajectory, check_alignment
    from model_bridge.config import read_omni_config
    from model_bridge.modeling.audio import audio_output_lengths

    spec = read_omni_config(hf_dir)
    featurize = featurizer_from_extractor(WhisperFeatureExtractor.from_pretrained(hf_dir))
    tokens = lambda clip: int(audio_output_lengths(featurize([clip])[1], spec.audio.n_window)[0])  # noqa: E731
    rng = np.random.default_rng(3)
    g = torch.Generator().manual_seed(5)
    text = lambda n: torch.randint(0, 400, (n,), generator=g).tolist()  # noqa: E731
    a, s, e = spec.audio_token_id, spec.audio_start_token_id, spec.audio_end_token_id
    trajs = []
    for grp in range(GROUPS):
        rec = (0.2 * rng.standard_normal(int(16000 * (1.5 + grp)))).astype(np.float32)
        n_rec = tokens(rec)
        for k in range(GENERATIONS):
            lo = int(rng.integers(0, rec.shape[0] // 2))
            crop = rec[lo:lo + 16000 * (k + 1) // 2].copy()
            n_crop = tokens(crop)
            prompt = text(5) + [s] + [a] * n_rec + [e] + text(2)
            gen1, tool, gen2 = text(6 + k), text(2) + [s] + [a] * n_crop + [e] + text(2), text(5 + 2 * k)
            ids = prompt + gen1 + tool + gen2
            mask = [0] * len(prompt) + [1] * len(gen1) + [0] * len(tool) + [1] * len(gen2)
            lp = [-float(x) for x in torch.rand(len(ids), generator=g)]
            trajs.append(Trajectory(prompt_index=grp, group_id=grp, input_ids_T=ids, loss_mask_T=mask,
                                    rollout_logprobs_T=[x if m else 0.0 for x, m in zip(lp, mask)],
                                    audios=[rec, crop], audio_token_counts=[n_rec, n_crop],
                                    reward=float(torch.rand(1, generator=g))))
    adv = compute_advantages(torch.tensor([t.reward for t in trajs], dtype=torch.float64),
                             torch.tensor([t.group_id for t in trajs]), "grpo").values_N
    out = []
    for t, v in zip(trajs, adv.tolist()):
        t.advantage = float(v)
        check_alignment(t, spec.audio_token_id)
        out.append(t)
    return out


def _grads(engine) -> list[torch.Tensor]:
    out = []
    for m in engine.model:
        for p in m.parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            out.append(torch.zeros_like(p) if g is None else g.detach().clone())
    return out


def _run(hf_dir: str, tp: int, ep: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from transformers import WhisperFeatureExtractor

    from megatron_grpo.algo.importance import ISConfig
    from megatron_grpo.algo.losses import LossConfig
    from megatron_grpo.engine.batch import build_train_microbatches, featurizer_from_extractor
    from megatron_grpo.engine.setup import OptimConfig, build_engine
    from megatron_grpo.engine.step import StepConfig, forward_backward
    from megatron_grpo.packing import PackLimits, plan_step
    from megatron_grpo.run.to_ranks import Elsewhere, deliver, dp_ranks_of_all, rank_sample_ids
    from megatron_grpo.train import _broadcast
    from model_bridge.config import ParallelLayout
    from model_bridge.parallel import destroy_parallel, init_parallel

    torch.set_num_threads(1)
    init_parallel(tp=tp, ep=ep, seed=1234)
    engine = build_engine(hf_dir, ParallelLayout(tp=tp, ep=ep), OptimConfig(lr=1e-3), dtype=torch.float32,
                          moe_aux_loss_coeff=0.0)
    rank, dp_rank, dp_size = dist.get_rank(), ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    packing = PackLimits(max_tokens_per_microbatch=BUDGET, pad_multiple=tp)
    step_cfg = StepConfig(loss=LossConfig(variant="grpo", kl_coef=0.0, entropy_coef=0.01),
                          importance=ISConfig(mode="tis", level="token", tis_cap=2.0), logprob_chunk_size=64)
    featurize = featurizer_from_extractor(WhisperFeatureExtractor.from_pretrained(hf_dir))
    mine = make_step(hf_dir) if rank == 0 else None  # only rank 0 holds the rollout

    def step(trajs):
        plan = plan_step([t.num_tokens for t in trajs], dp_size, packing, [t.group_id for t in trajs])
        mbs = build_train_microbatches(trajs, plan, dp_rank, packing, featurize=featurize,
                                       n_window=engine.spec.audio.n_window)
        for m in engine.model:
            m.zero_grad_buffer()
        engine.optimizer.zero_grad()
        metrics = forward_backward(engine, mbs, step_cfg, force_all_reduce=True)
        return plan, metrics, _grads(engine)

    plan_a, metrics_a, grads_a = step(_broadcast(mine))  # every trajectory, every clip, to every rank
    got = deliver(mine, lambda lens, groups: plan_step(lens, dp_size, packing, groups), dp_ranks_of_all(dp_rank), _broadcast)
    plan_b, metrics_b, grads_b = step(got)
    received = [i for i, t in enumerate(got) if not isinstance(t, Elsewhere)]
    clips = {id(a) for i in received for a in got[i].audios}
    destroy_parallel()
    return {"rank": rank, "dp_rank": dp_rank, "received": received, "own": rank_sample_ids(plan_a, dp_rank),
            "clip_objects": len(clips), "groups": len({got[i].group_id for i in received}),
            "same_plan": plan_a == plan_b, "metrics": (metrics_a, metrics_b),
            "grads_equal": all(torch.equal(x, y) for x, y in zip(grads_a, grads_b)),
            "grads_nonzero": sum(int(x.abs().sum() > 0) for x in grads_b), "num_grads": len(grads_b)}


def _check(results, world):
    n = GROUPS * GENERATIONS
    assert [r["rank"] for r in results] == list(range(world))
    for r in results:
        assert r["same_plan"] and r["grads_equal"], r["rank"]
        assert r["metrics"][0] == r["metrics"][1], r["metrics"]
        assert r["grads_nonzero"] > r["num_grads"] // 2
        if r["rank"] == 0:
            assert r["received"] == list(range(n))  # it rolled them out
        else:  # exactly its DP group's micro-batches' samples arrived, and every clip once
            assert r["received"] == sorted(r["own"]) and 0 < len(r["received"]) < n, r
            assert r["clip_objects"] == len(r["received"]) + r["groups"]  # a crop each, a recording per group
    own = sorted(i for r in results if r["rank"] != 0 for i in r["own"])
    assert set(own) | {i for r in results if r["dp_rank"] == 0 for i in r["own"]} == set(range(n))


def test_dp2_each_rank_gets_its_own_microbatches_and_the_same_grads_as_a_broadcast(tiny_ckpt):
    _check(run_ranks(_run, 2, str(tiny_ckpt), 1, 1, timeout=600, env=CPU_ONLY), 2)


@pytest.mark.slow
def test_tp2_dp2_each_rank_gets_its_own_microbatches_and_the_same_grads_as_a_broadcast(tiny_ckpt):
    _check(run_ranks(_run, 4, str(tiny_ckpt), 2, 2, timeout=900, env=CPU_ONLY), 4)


def test_pack_and_unpack_send_each_clip_once():
    import pickle

    from megatron_grpo.run.to_ranks import Elsewhere, pack_share, unpack_share
    from megatron_grpo.trajectory import Trajectory

    rec = np.arange(10, dtype=np.float32)
    trajs = [Trajectory(prompt_index=0, group_id=0, input_ids_T=[1] * (3 + k), loss_mask_T=[0] * (3 + k),
                        rollout_logprobs_T=[0.0] * (3 + k), audios=[rec, rec[:k + 1].copy()]) for k in range(4)]
    share = pack_share(trajs, [1, 3])
    assert sorted(share["samples"]) == [1, 3] and len(share["clips"]) == 3  # the recording once, two crops
    got = unpack_share(pickle.loads(pickle.dumps(share)), [t.num_tokens for t in trajs], [0, 0, 1, 1])
    assert got[0] == Elsewhere(3, 0) and got[2] == Elsewhere(5, 1)
    assert got[1].audios[0] is got[3].audios[0]  # one object: its features are computed once
    for i in (1, 3):
        assert all(np.array_equal(x, y) for x, y in zip(got[i].audios, trajs[i].audios))
        assert got[i].input_ids_T == trajs[i].input_ids_T
