"""A clip several samples share (a GRPO group's recording) goes through the audio tower once per pass
(``model_bridge/modeling/shared_audio.py``): the step's loss, logprobs and gradients equal those of
the same trajectories with a copy of the clip per sample, on real gloo ranks with the tiny
checkpoint in float32, and the tower sees the shared recording once per step when the first pass's
graph is kept for the backward, twice (the first pass and the recomputation) when it is not,
instead of once per sample; pooled (``keep_shared > 0``), every clip goes through the tower in one
call per batch of micro-batches."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from model_bridge.spawn import run_ranks

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
BUDGET = 160
GROUP = 4
KEEP_PREFETCH = 0.05
"""``keep_shared`` of the prefetch test: the first micro-batch's batches then hold only some of the clips."""


def _wave(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000.0
    return (0.3 * np.sin(2 * np.pi * 330.0 * t) + 0.05 * rng.standard_normal(t.shape[0])).astype(np.float32)


def _data(hf_dir: str, records_s=(1.6,)) -> list:
    """GROUP samples per prompt, one prompt per recording (``records_s``: their lengths): a prompt's
    samples share its recording object, each has its own crop in a tool turn; sample 0 also hears
    the recording a second time (two uses in one sample)."""
    from megatron_grpo.engine.batch import featurizer_from_extractor
    from megatron_grpo.trajectory import Trajectory
    from model_bridge.config import read_omni_config
    from model_bridge.modeling.audio import audio_output_lengths
    from transformers import WhisperFeatureExtractor

    spec = read_omni_config(hf_dir)
    featurize = featurizer_from_extractor(WhisperFeatureExtractor.from_pretrained(hf_dir))
    g = torch.Generator().manual_seed(3)
    text = lambda n: torch.randint(0, 400, (n,), generator=g).tolist()  # noqa: E731
    a, s, e = spec.audio_token_id, spec.audio_start_token_id, spec.audio_end_token_id

    def tokens(w) -> int:
        return int(audio_output_lengths(featurize([w])[1], spec.audio.n_window)[0])

    out = []
    for p, k in ((p, k) for p in range(len(records_s)) for k in range(GROUP)):
        record = _wave(records_s[p], seed=1 + p) if k == 0 else record
        crop = _wave(0.4 + 0.1 * k, seed=10 + k + 7 * p)
        clips = [record, crop] + ([record] if k == 0 else [])
        ids, mask = text(5), [0] * 5
        for j, w in enumerate(clips):
            part = [s] + [a] * tokens(w) + [e] + text(3)
            ids += part
            mask += [0] * len(part)
            gen = text(12 + 3 * k + j)
            ids += gen
            mask += [1] * len(gen)
        out.append(Trajectory(prompt_index=p, group_id=p, input_ids_T=ids, loss_mask_T=mask,
                              rollout_logprobs_T=[-0.5 * m for m in mask], audios=clips,
                              audio_token_counts=[tokens(w) for w in clips], advantage=float(k) - 1.5))
    return out


def _unshared(trajs: list) -> list:
    """The same samples with a copy of every clip per use (nothing shared)."""
    import dataclasses

    return [dataclasses.replace(t, audios=[np.array(w, copy=True) for w in t.audios]) for t in trajs]


def _run(hf_dir: str, trajs: list, tp: int, keeps=(1.0, 0.0)) -> dict:
    """The step of ``trajs`` with the clips shared (one run per ``keep_shared`` of ``keeps``) and
    with a copy per use (key ``None``)."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.engine.batch import build_train_microbatches, featurizer_from_extractor
    from megatron_grpo.engine.forward import compute_logprobs
    from megatron_grpo.engine.setup import OptimConfig, build_engine, unwrapped
    from megatron_grpo.engine.step import forward_backward
    from megatron_grpo.packing import PackLimits, plan_step
    from model_bridge.config import ParallelLayout
    from model_bridge.parallel import destroy_parallel, init_parallel
    from transformers import WhisperFeatureExtractor

    from megatron_grpo.algo.importance import ISConfig
    from megatron_grpo.algo.losses import LossConfig
    from megatron_grpo.engine.step import StepConfig

    from tests.megatron_grpo.engine.test_step import hf_tensors

    step_cfg = StepConfig(loss=LossConfig(variant="grpo", entropy_coef=0.01),
                          importance=ISConfig(mode="tis", level="token", tis_cap=2.0), logprob_chunk_size=64)

    torch.set_num_threads(1)
    init_parallel(tp=tp, seed=1234)
    engine = build_engine(hf_dir, ParallelLayout(tp=tp), OptimConfig(lr=1e-3), dtype=torch.float32,
                          moe_aux_loss_coeff=0.0)
    featurize = featurizer_from_extractor(WhisperFeatureExtractor.from_pretrained(hf_dir))
    tower = unwrapped(engine.model[0]).audio_tower
    frames = []
    tower.register_forward_pre_hook(lambda mod, args: frames.append(int(args[1].sum())))
    cfg = PackLimits(max_tokens_per_microbatch=BUDGET, pad_multiple=tp)
    plan = plan_step([t.num_tokens for t in trajs], ps.get_data_parallel_world_size(), cfg)
    out = {}
    for keep in (*keeps, None):
        data = trajs if keep is not None else _unshared(trajs)
        mbs = build_train_microbatches(data, plan, ps.get_data_parallel_rank(), cfg, featurize=featurize,
                                       n_window=engine.spec.audio.n_window, keep_shared=keep or 0.0)
        lps = compute_logprobs(engine.model, mbs, vocab_size=engine.spec.text.vocab_size, chunk_size=64)
        for m in engine.model:
            m.zero_grad_buffer()
        engine.optimizer.zero_grad()
        frames.clear()
        metrics = forward_backward(engine, mbs, step_cfg, force_all_reduce=True)
        shared = next((m.clip_use.shared for m in mbs if m.clip_use), None)
        out[keep] = dict(loss=metrics["loss"], clips=metrics["audio_clips"], frames=list(frames),
                          batches=shared.batches if shared else (), kept=shared.kept_batches if shared else 0,
                          lens=shared.lens if shared else [],
                          logprobs=[r["logprobs_T"] for r in lps], grads=hf_tensors(engine.model, engine.spec, "grad"),
                          uses=[None if m.clip_use is None else (m.clip_use.order, m.clip_use.last) for m in mbs],
                          own=[m.audio_feature_lens.tolist() if m.audio_feature_lens is not None else [] for m in mbs])
    destroy_parallel()
    return out


@pytest.fixture(scope="module")
def trajectories(tiny_ckpt):
    return _data(str(tiny_ckpt))


@pytest.mark.parametrize("tp", [1, 2])
def test_shared_recording_runs_the_tower_once_with_the_same_step(tiny_ckpt, trajectories, tp):
    res = run_ranks(_run, tp, str(tiny_ckpt), trajectories, tp, timeout=300, env=CPU_ONLY)[0]
    alone, pooled, recomputed = res[None], res[1.0], res[0.0]
    assert all(u is None for u in alone["uses"])
    for shared in (pooled, recomputed):
        # the packer spread the group over several micro-batches; each of them uses the recording
        assert len(shared["uses"]) >= 2 and all(u is not None for u in shared["uses"])
        assert shared["clips"] == alone["clips"] == 2 * GROUP + 1
    # keep_shared 0: only the recording (shared clip 0) is shared, recomputed in its last user
    assert all(-1 in u[0] for u in recomputed["uses"])
    assert [u[1] for u in recomputed["uses"]][-1] == (0,) and all(u[1] == () for u in recomputed["uses"][:-1])
    assert recomputed["kept"] == 0
    # keep_shared 1: every clip pooled (no own clips), one tower call per batch, every first pass kept
    assert all(min(u[0]) < 0 <= -1 - max(u[0]) for u in pooled["uses"])
    assert len(pooled["frames"]) == len(pooled["batches"]) == pooled["kept"] < len(alone["frames"])
    assert sorted(b for u in pooled["uses"] for b in u[1]) == list(range(len(pooled["batches"])))
    # the tower: the recording once (kept) or twice (first pass + recomputation) instead of GROUP + 1
    # times, each crop once
    for shared, tower_runs in ((pooled, 1), (recomputed, 2)):
        assert sum(alone["frames"]) - sum(shared["frames"]) == (GROUP + 1 - tower_runs) * _record_frames(res), \
            (tower_runs, shared["frames"], alone["frames"])
    _assert_same_step(pooled, alone, f"tp{tp} pooled")
    _assert_same_step(recomputed, alone, f"tp{tp} recomputed")


def _assert_same_step(shared, alone, name):
    assert abs(shared["loss"] - alone["loss"]) <= 1e-6, (shared["loss"], alone["loss"])
    for a, b in zip(shared["logprobs"], alone["logprobs"]):
        assert (a - b).abs().max().item() <= 1e-5, (a - b).abs().max().item()
    gmax = max(g.abs().max().item() for g in alone["grads"].values())
    worst = max(((shared["grads"][k] - g).abs().max().item(), k) for k, g in alone["grads"].items())
    print(f"\n[{name}] loss {shared['loss']:.8f} vs {alone['loss']:.8f}; max|dgrad| {worst[0]:.2e} at {worst[1]} "
          f"(max|grad| {gmax:.2e}); tower frames {sum(shared['frames'])} vs {sum(alone['frames'])}")
    assert worst[0] <= 1e-5 * gmax, worst
    tower = [k for k, g in alone["grads"].items() if k.startswith("thinker.audio_tower.") and g.abs().max() > 0]
    assert tower, "the audio tower got no gradient"


# the two recordings' 163 + 121 frames against keep_shared x the budget's 160 x 100 / 13 = 1,230 frames
KEEP_UNDER, KEEP_OVER = 0.2, 0.25  # keep_frames 246 (< 284: recomputed) and 307 (kept)


def test_two_recordings_go_through_the_tower_in_one_batch(tiny_ckpt):
    """Two groups' recordings fit one batch (the budget's frames): the tower gets both in one call in
    the first pass and, when the batch is more than ``keep_shared`` allows to keep, one in the
    recomputation, in the micro-batch that uses either last; the crops' batches are always kept; the
    step equals the unshared one."""
    trajs = _data(str(tiny_ckpt), records_s=(1.63, 1.21))  # 163 + 121 frames: no sum of crops (10s of frames)
    res = run_ranks(_run, 1, str(tiny_ckpt), trajs, 1, (KEEP_UNDER, KEEP_OVER), timeout=300, env=CPU_ONLY)[0]
    for keep, tower_runs in ((KEEP_UNDER, 2), (KEEP_OVER, 1)):
        shared = res[keep]
        records = [b for b, clips in enumerate(shared["batches"])
                   if sorted(shared["lens"][c] for c in clips) == [121, 163]]
        assert len(records) == 1, (shared["batches"], shared["lens"])
        rb = records[0]
        assert shared["frames"].count(163 + 121) == tower_runs, (keep, shared["frames"])
        assert shared["kept"] == len(shared["batches"]) + 1 - tower_runs
        users = [k for k, u in enumerate(shared["uses"]) if u and any(-1 - c in shared["batches"][rb] for c in u[0])]
        assert [k for k, u in enumerate(shared["uses"]) if u and rb in u[1]] == [max(users)]
        assert 163 not in shared["frames"] and 121 not in shared["frames"]  # never one recording alone
        _assert_same_step(shared, res[None], f"keep {keep}")


def _record_frames(res) -> int:
    """Frames of the shared recording: what the unshared run's tower saw beyond the shared run's
    own clips, per use (the two runs have the same crops)."""
    own = sum(sum(x) for x in res[0.0]["own"])
    alone = sum(sum(x) for x in res[None]["own"])
    return (alone - own) // (GROUP + 1)


def _run_prefetch(hf_dir: str, trajs: list, tp: int) -> dict:
    """The pooled step built three ways: plain; with the first micro-batch's tower batches run
    during the build (``audio_tower=``); the same, then a forward-only pass before the training
    pass (which must drop the prefetch). Per way: the loss, the grads, the tower calls' frames made
    during the build and during the passes."""
    import dataclasses

    from megatron.core import parallel_state as ps

    from megatron_grpo.algo.importance import ISConfig
    from megatron_grpo.engine.batch import build_train_microbatches, featurizer_from_extractor
    from megatron_grpo.engine.forward import compute_logprobs
    from megatron_grpo.engine.setup import OptimConfig, build_engine, unwrapped
    from megatron_grpo.engine.step import StepConfig, audio_prefetch_tower, forward_backward
    from megatron_grpo.packing import PackLimits, plan_step
    from model_bridge.config import ParallelLayout
    from model_bridge.parallel import destroy_parallel, init_parallel
    from transformers import WhisperFeatureExtractor

    from tests.megatron_grpo.engine.test_step import hf_tensors

    torch.set_num_threads(1)
    init_parallel(tp=tp, seed=1234)
    engine = build_engine(hf_dir, ParallelLayout(tp=tp), OptimConfig(lr=1e-3), dtype=torch.float32,
                          moe_aux_loss_coeff=0.0)
    step_cfg = StepConfig(importance=ISConfig(mode="tis", level="token", tis_cap=2.0), logprob_chunk_size=64)
    tower = unwrapped(engine.model[0]).audio_tower
    out = {"tower": audio_prefetch_tower(engine, step_cfg) is tower,
           "collective_free": not (tower.tensor_parallel and tp > 1),
           "refused": [audio_prefetch_tower(engine, dataclasses.replace(step_cfg, **kw)) is None
                       for kw in ({"importance": ISConfig(mode="mis")}, {"routing_replay": "r2"})]}
    frames, calls = [], []  # calls: "F<clips>" per featurizer call, "T" per tower call, in order

    def hook(mod, args) -> None:
        frames.append(int(args[1].sum()))
        calls.append("T")

    tower.register_forward_pre_hook(hook)
    extractor = featurizer_from_extractor(WhisperFeatureExtractor.from_pretrained(hf_dir))

    def no_frames(waves):  # a featurizer that cannot tell a clip's frame count before featurising it
        calls.append(f"F{len(waves)}")
        return extractor(waves)

    featurize = type("Logged", (), {"__call__": lambda self, waves: no_frames(waves),
                                    "frames": lambda self, w: extractor.frames(w)})()
    cfg = PackLimits(max_tokens_per_microbatch=BUDGET, pad_multiple=tp)
    plan = plan_step([t.num_tokens for t in trajs], ps.get_data_parallel_world_size(), cfg)
    for way in ("plain", "prefetch", "prefetch_then_logprobs", "prefetch_no_frames"):
        frames.clear()
        calls.clear()
        mbs = build_train_microbatches(trajs, plan, ps.get_data_parallel_rank(), cfg,
                                       featurize=no_frames if way == "prefetch_no_frames" else featurize,
                                       n_window=engine.spec.audio.n_window, keep_shared=KEEP_PREFETCH,
                                       audio_tower=None if way == "plain" else tower)
        built, build_calls = list(frames), list(calls)
        if way == "prefetch_then_logprobs":
            compute_logprobs(engine.model, mbs, vocab_size=engine.spec.text.vocab_size, chunk_size=64)
        for m in engine.model:
            m.zero_grad_buffer()
        engine.optimizer.zero_grad()
        metrics = forward_backward(engine, mbs, step_cfg, force_all_reduce=True)
        shared = mbs[0].clip_use.shared
        out[way] = dict(loss=metrics["loss"], grads=hf_tensors(engine.model, engine.spec, "grad"), built=built,
                        passes=frames[len(built):], kept=shared.kept_batches, batches=shared.batches,
                        first=sorted({shared.batch_of[-1 - c] for c in mbs[0].clip_use.order}), calls=build_calls)
    destroy_parallel()
    return out


def test_prefetched_tower_batches_make_the_same_step(tiny_ckpt, trajectories):
    """``build_train_microbatches(audio_tower=...)`` runs the first micro-batch's tower batches during
    the build (the device works while the host packs); the training pass then takes them instead of
    running them again, and the step's loss and gradients are bit-identical to the plain build's.
    A featurizer that gives a clip's frame count (``frames``) has the first batches' clips featurised
    first, the tower run on them, then the rest featurised; one that cannot featurises every clip
    before the tower runs. A forward-only pass in between drops the prefetch (its batches run again,
    same step)."""
    res = run_ranks(_run_prefetch, 1, str(tiny_ckpt), trajectories, 1, timeout=300, env=CPU_ONLY)[0]
    plain, pre, dropped, blind = (res[k] for k in ("plain", "prefetch", "prefetch_then_logprobs",
                                                   "prefetch_no_frames"))
    assert res["tower"] and res["collective_free"] and res["refused"] == [True, True]
    assert plain["built"] == [] and len(plain["batches"]) >= 2
    first = [plain["passes"][k] for k in range(len(plain["first"]))]
    assert pre["built"] == first and pre["passes"] == plain["passes"][len(first):]
    assert dropped["built"] == first and blind["built"] == first and blind["passes"] == pre["passes"]
    # the forward-only pass runs every batch once, then the training pass runs them all again
    assert dropped["passes"][len(plain["batches"]):] == plain["passes"]
    # planned from the clips' lengths: only the first batches' clips are featurised before they run
    clips = sum(len(b) for b in plain["batches"])
    ahead = sum(len(plain["batches"][b]) for b in plain["first"])
    assert ahead < clips and plain["calls"] == [f"F{clips}"] and blind["calls"] == [f"F{clips}"] + ["T"] * len(first)
    assert pre["calls"] == [f"F{ahead}"] + ["T"] * len(first) + [f"F{clips - ahead}"], pre["calls"]
    for other in (pre, dropped, blind):
        assert other["kept"] == plain["kept"] and other["loss"] == plain["loss"]
        for k, g in plain["grads"].items():
            assert torch.equal(other["grads"][k], g), k
