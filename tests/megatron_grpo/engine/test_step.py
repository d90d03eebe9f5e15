"""The packed multi-rank training step == a single-rank unpacked reference (CPU, gloo, fp32).

Data: 12 trajectories of the tiny checkpoint: one multi-turn sample with two audio clips (220
tokens, two generated turns around a tool turn with the second clip) and eleven text samples of
21 tokens (10x shorter), with GRPO advantages, rollout logprobs (TIS correction active) and
reference logprobs (k3 KL term), plus an entropy bonus. Packed with a 224-token budget, at DP2 the
audio sample lands alone on DP rank 0 (one micro-batch + one empty padding micro-batch, which
runs the dummy audio clip) and all text on DP rank 1 (two micro-batches, no audio at all).

Reference (one rank, no packing, no DDP): every sample alone through ``build_thinker``, full
logits gathered, ``torch.log_softmax``, the loss of ``algo.losses.policy_loss`` on the
concatenation of all samples, ``backward``. Gradients are compared in HF naming (TP/EP shards
gathered with the bridge's mappings), so every layout is checked against the same numbers. The
MoE aux loss is off for parity (it depends on which tokens share a micro-batch); a separate test
shows that, when on, it reaches the router gradients with megatron's scaling. The SFT objective
(`mgrpo sft`) is checked the same way against the reference's token-mean NLL of the same samples.
"""
from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from model_bridge.spawn import run_ranks

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
BUDGET = 224
LR, EPS, CLIP = 1e-3, 1e-4, 1.0
GRAD_TOL = 1e-5
LOSS_TOL = 1e-5


# ------------------------------------------------------------------------------------------------
# data (built in the test process, pickled to the ranks)
# ------------------------------------------------------------------------------------------------

def _waves(seconds: list[float], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for s in seconds:
        t = np.arange(int(16000 * s)) / 16000.0
        w = 0.3 * np.sin(2 * np.pi * 440.0 * t) + 0.05 * rng.standard_normal(t.shape[0])
        out.append(w.astype(np.float32))
    return out


def make_data(hf_dir: str) -> dict:
    """Trajectories (audio token counts from the checkpoint's feature extractor). Their rollout
    logprobs are placeholders: :func:`reference_run` replaces them (and makes the reference
    logprobs) from the model's own logprobs plus noise, so that IS ratios and KL are O(1)."""
    from transformers import WhisperFeatureExtractor

    from megatron_grpo.algo.advantages import compute_advantages
    from megatron_grpo.engine.batch import featurizer_from_extractor
    from megatron_grpo.trajectory import Trajectory, check_alignment
    from model_bridge.config import read_omni_config
    from model_bridge.modeling.audio import audio_output_lengths

    spec = read_omni_config(hf_dir)
    featurize = featurizer_from_extractor(WhisperFeatureExtractor.from_pretrained(hf_dir))
    g = torch.Generator().manual_seed(7)
    text = lambda n: torch.randint(0, 400, (n,), generator=g).tolist()  # noqa: E731

    trajs = []
    # sample 0: prompt (text + clip 1) -> generated turn -> tool turn (clip 2) -> generated turn
    waves = _waves([2.3, 0.7], seed=1)
    _, lens = featurize(waves)
    n1, n2 = (int(x) for x in audio_output_lengths(lens, spec.audio.n_window))
    a, s, e = spec.audio_token_id, spec.audio_start_token_id, spec.audio_end_token_id
    prompt = text(6) + [s] + [a] * n1 + [e] + text(3)
    gen1 = text(40)
    tool = text(2) + [s] + [a] * n2 + [e] + text(4)
    gen2 = text(220 - len(prompt) - len(gen1) - len(tool))
    ids = prompt + gen1 + tool + gen2
    mask = [0] * len(prompt) + [1] * len(gen1) + [0] * len(tool) + [1] * len(gen2)
    trajs.append(dict(ids=ids, mask=mask, audios=waves, counts=[n1, n2]))
    for _ in range(11):  # text samples, 10x shorter
        ids = text(21)
        trajs.append(dict(ids=ids, mask=[0] * 8 + [1] * 13, audios=[], counts=[]))
    rewards = torch.rand(len(trajs), generator=g, dtype=torch.float64)
    groups = torch.tensor([i // 4 for i in range(len(trajs))])
    adv = compute_advantages(rewards, groups, "grpo").values_N.float()
    out = []
    for i, d in enumerate(trajs):
        t = Trajectory(prompt_index=i, group_id=int(groups[i]), input_ids_T=d["ids"], loss_mask_T=d["mask"],
                       rollout_logprobs_T=[0.0] * len(d["ids"]), audios=d["audios"], audio_token_counts=d["counts"],
                       advantage=float(adv[i]))
        check_alignment(t, spec.audio_token_id)
        out.append(t)
    return {"trajectories": out}


def step_config(mode: str = "tis"):
    from megatron_grpo.algo.importance import ISConfig
    from megatron_grpo.algo.losses import LossConfig
    from megatron_grpo.engine.step import StepConfig

    return StepConfig(loss=LossConfig(variant="grpo", kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01),
                      importance=ISConfig(mode=mode, level="token", tis_cap=2.0), logprob_chunk_size=64,
                      max_consecutive_skips=2)


# ------------------------------------------------------------------------------------------------
# helpers that run inside the rank processes
# ------------------------------------------------------------------------------------------------

def hf_tensors(model, spec, what: str) -> dict:
    """{HF name: full tensor} of this rank's exported grads (``main_grad`` / ``grad``) or params."""
    from model_bridge.export import export_tasks
    from model_bridge.mappings import gather_shards

    out = {}
    for t in export_tasks(model, spec):
        if t.shard.replica_rank != 0:
            continue
        p = t.param
        if what == "grad":
            x = getattr(p, "main_grad", None)
            x = p.grad if x is None else x
            x = torch.zeros_like(p) if x is None else x
        else:
            x = p
        shards = gather_shards(x.detach().float().clone(), t.shard)
        if shards is None:
            continue
        full = t.mapping.merge(shards)
        for role in t.mapping.roles:
            out[t.hf[role]] = full[role].clone()
    return out


def _featurizer(hf_dir):
    from transformers import WhisperFeatureExtractor

    from megatron_grpo.engine.batch import featurizer_from_extractor

    return featurizer_from_extractor(WhisperFeatureExtractor.from_pretrained(hf_dir))


def reference_run(hf_dir: str, data: dict) -> dict:
    """One rank: each sample alone (no packing, no DDP), plain log_softmax, policy_loss on the
    concatenation, backward; grads and params in HF naming."""
    from megatron_grpo.algo.importance import importance_weights
    from megatron_grpo.algo.losses import policy_loss
    from model_bridge.config import ParallelLayout, read_omni_config
    from model_bridge.load import load_hf
    from model_bridge.modeling.thinker import build_thinker, gather_logits, mrope_position_ids
    from model_bridge.parallel import destroy_parallel, init_parallel

    torch.set_num_threads(1)
    init_parallel(seed=1234)
    spec = read_omni_config(hf_dir)
    cfg = step_config()
    model = build_thinker(spec, ParallelLayout(), torch.float32, moe_aux_loss_coeff=0.0)
    load_hf(model, hf_dir)
    featurize = _featurizer(hf_dir)
    V = spec.text.vocab_size
    lps, ents, per_sample = [], [], []
    trajs = data["trajectories"]
    for traj in trajs:
        ids = torch.tensor([traj.input_ids_T])
        kw = {}
        if traj.audios:
            f, ln = featurize(traj.audios)
            kw = dict(audio_features=f, audio_feature_lens=ln)
        logits = gather_logits(model(ids, mrope_position_ids(ids, spec).unsqueeze(1), **kw), V)  # [L, V]
        logsm = torch.log_softmax(logits.float(), dim=-1)
        lp = torch.cat([torch.zeros(1), logsm[:-1].gather(1, ids[0, 1:, None])[:, 0]])  # token-aligned
        ent = torch.cat([torch.zeros(1), -(logsm[:-1].exp() * logsm[:-1]).sum(-1)])
        lps.append(lp)
        ents.append(ent)
        per_sample.append(lp.detach().clone())
    # rollout (TIS truncates where rollout < old - log 2) and reference logprobs near the model's own
    g = torch.Generator().manual_seed(11)
    refs = []
    for traj, lp in zip(trajs, per_sample):
        m = torch.tensor(traj.loss_mask_T, dtype=torch.bool)
        roll = (lp + 0.5 * torch.randn(lp.shape, generator=g)).clamp(max=0.0)
        traj.rollout_logprobs_T = torch.where(m, roll, torch.zeros_like(roll)).tolist()
        refs.append(torch.where(m, lp + 0.3 * torch.randn(lp.shape, generator=g), torch.zeros_like(lp)))
    data = {"trajectories": trajs, "ref_logprobs": refs}
    lp_T, ent_T = torch.cat(lps), torch.cat(ents)
    mask_T = torch.cat([torch.tensor(t.loss_mask_T, dtype=torch.bool) for t in trajs])
    sid_T = torch.cat([torch.full((t.num_tokens,), i) for i, t in enumerate(trajs)])
    adv_T = torch.cat([torch.full((t.num_tokens,), float(t.advantage)) for t in trajs])
    roll_T = torch.cat([torch.tensor(t.rollout_logprobs_T) for t in trajs])
    ref_T = torch.cat(data["ref_logprobs"]).float()
    n_tok = float(mask_T.sum())
    n_samp = float(sum(1 for t in trajs if sum(t.loss_mask_T)))
    isr = importance_weights(lp_T.detach(), roll_T, mask_T, sid_T, config=cfg.importance,
                             global_num_tokens=n_tok, global_num_samples=n_samp)
    loss, metrics = policy_loss(lp_T, lp_T.detach(), adv_T, isr.keep_mask_T, sid_T, config=cfg.loss,
                                global_num_tokens=n_tok, global_num_samples=n_samp, ref_logprobs_T=ref_T,
                                is_weights_T=isr.weights_T, entropy_T=ent_T)
    loss.backward(retain_graph=True)
    grads = hf_tensors(model, spec, "grad")
    # the SFT objective on the same samples: token-mean NLL of the loss tokens, its own backward
    model.zero_grad(set_to_none=True)
    sft_loss = -lp_T[mask_T].sum() / n_tok
    sft_loss.backward()
    sft = {"loss": sft_loss.item(), "grads": hf_tensors(model, spec, "grad")}
    out = {"data": data, "loss": loss.item(), "grads": grads, "params": hf_tensors(model, spec, "param"),
           "grad_norm": math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values())),
           "logprobs": per_sample, "masks": [torch.tensor(t.loss_mask_T, dtype=torch.bool) for t in trajs],
           "is_truncated_frac": float(isr.metrics["is_truncated_frac"]),
           "metrics": {k: float(v) for k, v in metrics.items()}, "sft": sft}
    destroy_parallel()
    return out


def _setup_rank(hf_dir, tp=1, ep=1, pp=1, **overrides):
    from megatron_grpo.engine.setup import OptimConfig, build_engine
    from model_bridge.config import ParallelLayout
    from model_bridge.parallel import init_parallel

    torch.set_num_threads(1)
    init_parallel(tp=tp, ep=ep, pp=pp, seed=1234)
    layout = ParallelLayout(tp=tp, ep=ep, pp=pp)
    optim = OptimConfig(lr=LR, adam_eps=EPS, clip_grad=CLIP)
    return build_engine(hf_dir, layout, optim, dtype=torch.float32, **overrides)


def _rank_microbatches(engine, hf_dir, data):
    from megatron.core import parallel_state as ps

    from megatron_grpo.engine.batch import build_train_microbatches
    from megatron_grpo.packing import PackLimits, plan_step

    trajs = data["trajectories"]
    cfg = PackLimits(max_tokens_per_microbatch=BUDGET, pad_multiple=2)
    plan = plan_step([t.num_tokens for t in trajs], ps.get_data_parallel_world_size(), cfg)
    mbs = build_train_microbatches(trajs, plan, ps.get_data_parallel_rank(), cfg, featurize=_featurizer(hf_dir),
                                   n_window=engine.spec.audio.n_window, ref_logprobs_by_sample=data["ref_logprobs"])
    return plan, mbs


def layout_run(hf_dir: str, data: dict, tp: int, ep: int, pp: int, adam: bool) -> dict:
    """One rank of a layout: old-policy logprobs (forward only), the step's grads, optionally one update."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.engine.forward import compute_logprobs
    from megatron_grpo.engine.step import forward_backward, optimizer_update
    from model_bridge.parallel import destroy_parallel

    t0 = time.time()
    engine = _setup_rank(hf_dir, tp=tp, ep=ep, pp=pp, moe_aux_loss_coeff=0.0)
    spec = engine.spec
    plan, mbs = _rank_microbatches(engine, hf_dir, data)
    out = {"rank": torch.distributed.get_rank(), "dp_rank": ps.get_data_parallel_rank(),
           "microbatches": [(m.sample_ids, m.num_tokens, m.num_clips) for m in mbs]}
    lps = compute_logprobs(engine.model, mbs, vocab_size=spec.text.vocab_size, chunk_size=64)
    if lps[0] is not None:
        per = {}
        for m, r in zip(mbs, lps):
            cu = m.cu_seqlens_S.tolist()
            for k, i in enumerate(m.sample_ids):
                per[i] = r["logprobs_T"][cu[k]:cu[k + 1]]
        out["logprobs"] = per
    t1 = time.time()
    for m in engine.model:
        m.zero_grad_buffer()
    engine.optimizer.zero_grad()
    kept = {}  # the trainer logprobs `mgrpo report` shades against vLLM's, gathered to rank 0
    out["metrics"] = forward_backward(engine, mbs, step_config(), force_all_reduce=True, logprobs_out=kept)
    out["grads"] = hf_tensors(engine.model, spec, "grad")
    from megatron_grpo.run.trajlog import gather_sample_logprobs

    gathered = gather_sample_logprobs(kept, len(data["trajectories"]))
    if gathered is not None:
        out["gathered_logprobs"] = gathered
    out["seconds_fb"] = time.time() - t1
    if pp > 1:  # MIS: the last stage asks for the old-logprob pass, every stage runs it (no hang)
        for m in engine.model:
            m.zero_grad_buffer()
        out["mis_tokens"] = forward_backward(engine, mbs, step_config("mis"))["global_num_tokens"]
    out["optimizers"] = [type(o).__name__ for o in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])]
    if adam:
        before = hf_tensors(engine.model, spec, "param")
        out["update"] = optimizer_update(engine)
        after = hf_tensors(engine.model, spec, "param")
        out["delta"] = {k: after[k] - before[k] for k in after}
        # a rank with one micro-batch fewer: every rank raises instead of hanging in the schedule
        from megatron_grpo.engine.step import StepError

        try:
            forward_backward(engine, mbs[:-1] if out["rank"] == 0 else mbs, step_config())
            out["mismatch"] = None
        except StepError as e:
            out["mismatch"] = str(e)
    out["seconds"] = time.time() - t0
    destroy_parallel()
    return out


def sft_run(hf_dir: str, data: dict, tp: int, ep: int) -> dict:
    """One rank of a layout: the packed step's SFT loss and grads (``StepConfig(objective="sft")``)."""
    from megatron_grpo.algo.importance import ISConfig
    from megatron_grpo.engine.step import StepConfig, forward_backward
    from model_bridge.parallel import destroy_parallel

    engine = _setup_rank(hf_dir, tp=tp, ep=ep, moe_aux_loss_coeff=0.0)
    _, mbs = _rank_microbatches(engine, hf_dir, data)
    for m in engine.model:
        m.zero_grad_buffer()
    cfg = StepConfig(objective="sft", importance=ISConfig(mode="off"), logprob_chunk_size=64)
    metrics = forward_backward(engine, mbs, cfg, force_all_reduce=True)
    out = {"loss": metrics["loss"], "grads": hf_tensors(engine.model, engine.spec, "grad")}
    destroy_parallel()
    return out


def aux_and_skips_run(hf_dir: str, data: dict) -> dict:
    """World 1: the MoE aux loss reaches the gradient (linear in its coefficient, only upstream of
    the router); the schedule assembles each micro-batch as it reads it; compute_logprobs + MIS give
    ratio 1 exactly; a non-finite update is skipped, too many raise."""
    import dataclasses

    from megatron_grpo.engine.forward import fill_old_logprobs
    from megatron_grpo.engine.step import NonFiniteGradError, forward_backward, optimizer_update, train_step
    from model_bridge.parallel import destroy_parallel

    engine = _setup_rank(hf_dir, moe_aux_loss_coeff=0.0)
    spec = engine.spec
    _, mbs = _rank_microbatches(engine, hf_dir, data)
    cfg = step_config()
    routers = [c for c in engine.modules[0].modules() if type(c).__name__ == "TopKRouter"]
    out = {"router_config_is_shared": all(r.config is engine.config for r in routers), "aux": {}}
    for coeff in (0.0, 0.1, 0.2):
        engine.config.moe_aux_loss_coeff = coeff
        for m in engine.model:
            m.zero_grad_buffer()
        metrics = forward_backward(engine, mbs, cfg)
        out["aux"][coeff] = {"grads": hf_tensors(engine.model, spec, "grad"), "metrics": metrics}
    engine.config.moe_aux_loss_coeff = 0.0

    # a fresh step's micro-batches are assembled one at a time as the schedule reads them (the k-th
    # forward finds k assembled), and the step is the same as over the assembled list
    _, fresh = _rank_microbatches(engine, hf_dir, data)
    seen = [fresh.assembled]
    hook = engine.model[0].register_forward_pre_hook(lambda module, args: seen.append(fresh.assembled))
    for m in engine.model:
        m.zero_grad_buffer()
    lazy = forward_backward(engine, fresh, cfg)
    hook.remove()
    lazy_grads = hf_tensors(engine.model, spec, "grad")
    for m in engine.model:
        m.zero_grad_buffer()
    plain = forward_backward(engine, list(fresh), cfg)
    plain_grads = hf_tensors(engine.model, spec, "grad")
    for m in engine.model:
        m.zero_grad_buffer()
    read_once = forward_backward(engine, (m for m in fresh), cfg)  # an iterator works as well
    out["lazy"] = {"seen": seen, "count": len(fresh), "loss": (lazy["loss"], plain["loss"], read_once["loss"]),
                   "grads_differ": sorted(k for k in plain_grads if not torch.equal(plain_grads[k], lazy_grads[k]))}

    # old logprobs from the no-grad pass == the training forward's: MIS keeps everything, ratio == 1
    filled = fill_old_logprobs(engine.model, mbs, vocab_size=spec.text.vocab_size, chunk_size=64)
    for m in engine.model:
        m.zero_grad_buffer()
    mis = forward_backward(engine, filled, step_config("mis"))
    out["mis"] = {k: mis[k] for k in ("ratio_max", "ratio_min", "clip_frac", "global_num_tokens", "loss_tokens")}

    # non-finite: NaN advantages -> skipped update, params unchanged; the 2nd in a row raises
    bad = [dataclasses.replace(m, advantages_T=torch.full_like(m.advantages_T, float("nan"))) for m in mbs]
    before = hf_tensors(engine.model, spec, "param")
    first = train_step(engine, bad, cfg)
    after = hf_tensors(engine.model, spec, "param")
    out["skip"] = {"metrics": first, "changed": max((after[k] - before[k]).abs().max().item() for k in before)}
    try:
        train_step(engine, bad, cfg)
        out["raised"] = None
    except NonFiniteGradError as e:
        out["raised"] = str(e)
    good = train_step(engine, mbs, cfg)
    out["good"] = {"skipped": good["skipped"], "consecutive_skips": good["consecutive_skips"],
                   "grad_norm": good["grad_norm"], "lr": good["lr"]}

    # bf16 (the GPU recipe): Float16Module, bf16 logits into the chunked logprobs, fp32 master weights
    from megatron_grpo.engine.setup import OptimConfig, build_engine, has_float16_wrapper
    from model_bridge.config import ParallelLayout

    bf = build_engine(hf_dir, ParallelLayout(), OptimConfig(lr=LR), dtype=torch.bfloat16, moe_aux_loss_coeff=0.0)
    for m in bf.model:
        m.zero_grad_buffer()
    out["bf16"] = {"wrapper": has_float16_wrapper(bf.model[0]),
                   "param_dtype": str(next(bf.modules[0].parameters()).dtype),
                   "optimizers": [type(o).__name__ for o in bf.optimizer.chained_optimizers],
                   "loss": forward_backward(bf, mbs, cfg)["loss"]}
    destroy_parallel()
    return out


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    return run_ranks(reference_run, 1, str(tiny_ckpt), make_data(str(tiny_ckpt)), timeout=300, env=CPU_ONLY)[0]


@pytest.fixture(scope="module")
def data(reference):
    """The trajectories with the rollout and reference logprobs the reference run made."""
    return reference["data"]


def _compare(results, reference, name):
    losses = [r["metrics"]["loss"] for r in results]
    grads = {}
    for r in results:
        for k, v in r["grads"].items():
            if k in grads:
                assert torch.equal(grads[k], v), f"{name}: two ranks exported different grads for {k}"
            grads[k] = v
    missing = sorted(set(reference["grads"]) - set(grads))
    assert not missing, f"{name}: no rank exported grads for {missing[:5]}"
    diffs = {k: (grads[k] - g).abs().max().item() for k, g in reference["grads"].items()}
    worst = max(diffs, key=diffs.get)
    gmax = max(g.abs().max().item() for g in reference["grads"].values())
    dloss = max(abs(x - reference["loss"]) for x in losses)
    lp_diff = 0.0
    for r in results:
        for i, lp in r.get("logprobs", {}).items():
            m = reference["masks"][i]
            lp_diff = max(lp_diff, (lp - reference["logprobs"][i])[m].abs().max().item())
    print(f"\n[{name}] loss {losses[0]:.8f} (ref {reference['loss']:.8f}, |dloss| {dloss:.2e}); "
          f"max|dgrad| {diffs[worst]:.2e} at {worst} (max|grad| {gmax:.2e}); old-logprob max|diff| {lp_diff:.2e}; "
          f"micro-batches per rank {[r['microbatches'] for r in results]}; rank seconds "
          f"{[round(r['seconds'], 1) for r in results]}")
    gathered = [r["gathered_logprobs"] for r in results if "gathered_logprobs" in r]
    assert len(gathered) == 1 and results[0].get("gathered_logprobs") is gathered[0], name  # rank 0 alone
    for i, lp in enumerate(gathered[0]):  # every sample's, from whichever DP rank / last stage trained it
        m = reference["masks"][i]
        assert lp is not None and not lp[~m].any(), (name, i)
        assert (lp - reference["logprobs"][i])[m].abs().max().item() <= 1e-5, (name, i)
    assert dloss <= LOSS_TOL, (name, losses, reference["loss"])
    assert diffs[worst] <= GRAD_TOL, (name, worst, diffs[worst])
    assert lp_diff <= 1e-5, (name, lp_diff)
    return grads


def test_reference_is_sane(reference):
    assert math.isfinite(reference["loss"])
    assert reference["grad_norm"] > 0
    assert 0.0 < reference["is_truncated_frac"] < 1.0, "TIS should truncate some tokens and not others"
    assert any(k.startswith("thinker.audio_tower.") and g.abs().max() > 0 for k, g in reference["grads"].items())


def test_dp2_audio_on_one_rank_only_and_adam_step(tiny_ckpt, data, reference):
    """DP2: rank 0 has the audio sample (+ an empty micro-batch), rank 1 only text, 10x shorter
    samples; grads match the reference and one Adam step is the closed-form first step."""
    res = run_ranks(layout_run, 2, str(tiny_ckpt), data, 1, 1, 1, True, timeout=300, env=CPU_ONLY)
    by_dp = {r["dp_rank"]: r["microbatches"] for r in res}
    assert by_dp[0] == [((0,), 220, 2), ((), 2, 0)], by_dp  # audio sample alone + an empty padding micro-batch
    assert all(clips == 0 for _, _, clips in by_dp[1]) and len(by_dp[1]) == 2, by_dp
    _compare(res, reference, "dp2")
    m = res[0]["metrics"]
    assert m["empty_microbatches"] == 1 and m["audio_clips"] == 2 and m["samples"] == 12
    assert 0.0 < m["padding_fraction"] < 0.05
    _check_adam(res, reference, "dp2")
    for r in res:
        assert r["mismatch"] and "disagree on the number of micro-batches" in r["mismatch"], r["mismatch"]
        assert "{0: 1, 1: 2}" in r["mismatch"], r["mismatch"]


def _mis_kept(reference, data) -> int:
    """MIS keeps the loss tokens whose old/rollout ratio lies in [0.5, 2]: they alone normalise the loss."""
    kept = 0
    for lp, t in zip(reference["logprobs"], data["trajectories"]):
        d = lp - torch.tensor(t.rollout_logprobs_T)
        kept += int(((d >= math.log(0.5)) & (d <= math.log(2.0)) & torch.tensor(t.loss_mask_T, dtype=torch.bool)).sum())
    return kept


def _check_adam(res, reference, name):
    """Adam's first step: p -= lr * g / (|g| + eps), g clipped to CLIP by the global norm."""
    upd = res[0]["update"]
    assert all(r["update"] == upd for r in res), [r["update"] for r in res]
    assert upd["skipped"] == 0.0 and upd["lr"] == LR
    assert abs(upd["grad_norm"] - reference["grad_norm"]) <= 1e-5 * reference["grad_norm"], upd
    scale = min(1.0, CLIP / (reference["grad_norm"] + 1e-6))
    delta = {}
    for r in res:
        delta.update(r["delta"])
    worst = 0.0
    for k, g in reference["grads"].items():
        g = g * scale
        expected = -LR * g / (g.abs() + EPS)
        worst = max(worst, (delta[k] - expected).abs().max().item())
    print(f"[{name} adam] grad norm {upd['grad_norm']:.6f} (ref {reference['grad_norm']:.6f}), "
          f"max|dparam - closed form| {worst:.2e}; optimizers {res[0]['optimizers']}")
    assert worst <= 1e-6, worst


@pytest.mark.parametrize("tp,ep,pp,adam", [pytest.param(2, 1, 1, False, id="tp2sp"),
                                           pytest.param(1, 2, 1, True, id="ep2-adam"),
                                           pytest.param(1, 1, 2, False, id="pp2")])
def test_layout_matches_unpacked_reference(tiny_ckpt, data, reference, tp, ep, pp, adam):
    res = run_ranks(layout_run, 2, str(tiny_ckpt), data, tp, ep, pp, adam, timeout=300, env=CPU_ONLY)
    _compare(res, reference, f"tp{tp} ep{ep} pp{pp}")
    if pp > 1:
        assert all(r["mis_tokens"] == _mis_kept(reference, data) for r in res), [r["mis_tokens"] for r in res]
    if adam:  # dense and expert parameters in two distributed optimizers, clipped by one global norm
        assert len(res[0]["optimizers"]) == 2, res[0]["optimizers"]
        _check_adam(res, reference, f"tp{tp} ep{ep} pp{pp}")


@pytest.mark.slow  # two worlds of 2 on 2 cores: ~20 s
@pytest.mark.parametrize("tp,ep", [pytest.param(2, 1, id="tp2sp"), pytest.param(1, 2, id="ep2")])
def test_sft_step_matches_unpacked_reference(tiny_ckpt, data, reference, tp, ep):
    """`mgrpo sft`'s step: the packed multi-rank SFT loss and grads equal the unpacked NLL's."""
    res = run_ranks(sft_run, 2, str(tiny_ckpt), data, tp, ep, timeout=300, env=CPU_ONLY)
    ref = reference["sft"]
    grads = {}
    for r in res:
        assert abs(r["loss"] - ref["loss"]) <= 1e-6 * ref["loss"], (r["loss"], ref["loss"])  # fp32: relative
        grads.update(r["grads"])
    assert set(grads) == set(ref["grads"])
    gmax = max(g.abs().max().item() for g in ref["grads"].values())
    worst = max((grads[k] - g).abs().max().item() for k, g in ref["grads"].items())
    assert worst <= 1e-5 * gmax, (worst, gmax)


@pytest.mark.slow  # world 4 on 2 cores: ~30 s
def test_tp2_ep2_four_ranks(tiny_ckpt, data, reference):
    res = run_ranks(layout_run, 4, str(tiny_ckpt), data, 2, 2, 1, False, timeout=600, env=CPU_ONLY)
    _compare(res, reference, "tp2 ep2 (world 4)")


@pytest.mark.slow  # worlds 4 and 8 on 2 cores: ~1-2 min each
@pytest.mark.parametrize("world,tp,ep,pp", [pytest.param(4, 1, 2, 2, id="ep2xpp2"),
                                            pytest.param(8, 2, 2, 2, id="tp2sp-ep2-pp2")])
def test_pipeline_mixes_of_the_four_and_eight_gpu_machines(tiny_ckpt, data, reference, world, tp, ep, pp):
    """The scale-run issue's PP layouts (EP2 x PP2 on four GPUs, TP2 x EP2 x PP2 on eight) on gloo:
    the step's gradients and the old-policy logprobs against the unpacked one-rank reference."""
    res = run_ranks(layout_run, world, str(tiny_ckpt), data, tp, ep, pp, False, timeout=900, env=CPU_ONLY)
    _compare(res, reference, f"tp{tp} ep{ep} pp{pp} (world {world})")
    assert all(r["mis_tokens"] == _mis_kept(reference, data) for r in res), [r["mis_tokens"] for r in res]


def test_moe_aux_loss_reaches_router_grads_and_nonfinite_skips(tiny_ckpt, data, reference):
    out = run_ranks(aux_and_skips_run, 1, str(tiny_ckpt), data, timeout=300, env=CPU_ONLY)[0]
    assert out["router_config_is_shared"]
    g0, g1, g2 = (out["aux"][c]["grads"] for c in (0.0, 0.1, 0.2))
    routers = [k for k in g0 if k.endswith("mlp.gate.weight")]
    assert routers
    d1 = {k: (g1[k] - g0[k]) for k in g0}
    d2 = {k: (g2[k] - g0[k]) for k in g0}
    router_change = max(d1[k].abs().max().item() for k in routers)
    linear_err = max((d2[k] - 2 * d1[k]).abs().max().item() for k in g0)
    # the aux loss acts on the router logits: nothing downstream of the last router moves
    last = max(int(k.split(".layers.")[1].split(".")[0]) for k in routers)
    downstream = [k for k in g0 if k in ("thinker.lm_head.weight", "thinker.model.norm.weight")
                  or (f".layers.{last}.mlp.experts." in k)]
    downstream_change = max(d1[k].abs().max().item() for k in downstream)
    print(f"\n[aux] router grad change at coeff 0.1: {router_change:.3e}; linearity error {linear_err:.2e}; "
          f"downstream change {downstream_change:.1e}; "
          f"lb loss {out['aux'][0.1]['metrics'].get('moe_load_balancing_loss')}")
    assert router_change > 1e-4
    assert linear_err <= 1e-6 * max(1.0, router_change * 1e3)
    assert downstream_change == 0.0
    assert out["aux"][0.1]["metrics"]["moe_load_balancing_loss"] > 0
    assert "moe_load_balancing_loss" not in out["aux"][0.0]["metrics"]

    lazy = out["lazy"]
    assert lazy["count"] >= 2 and lazy["seen"] == list(range(lazy["count"] + 1)), lazy
    assert lazy["loss"][0] == lazy["loss"][1] == lazy["loss"][2] and not lazy["grads_differ"], lazy

    mis = out["mis"]
    assert abs(mis["ratio_max"] - 1.0) < 1e-6 and abs(mis["ratio_min"] - 1.0) < 1e-6, mis
    kept = _mis_kept(reference, data)
    print(f"[mis] kept {mis['global_num_tokens']:.0f} of {mis['loss_tokens']:.0f} loss tokens (expected {kept})")
    assert mis["global_num_tokens"] == kept and 0 < kept < mis["loss_tokens"]

    skip = out["skip"]
    assert skip["metrics"]["skipped"] == 1.0 and not math.isfinite(skip["metrics"]["grad_norm"])
    assert skip["changed"] == 0.0
    assert out["raised"] and "2 consecutive training steps had non-finite gradients" in out["raised"]
    # NaN advantages reach every gradient: the error names the first parameters, counts the rest
    first = "The last one's non-finite gradients on this rank: language_model.embedding.word_embeddings.weight; "
    assert first in out["raised"], out["raised"]
    assert " more. Lower the LR" in out["raised"], out["raised"]
    assert out["good"]["skipped"] == 0.0 and out["good"]["consecutive_skips"] == 0.0
    assert math.isfinite(out["good"]["grad_norm"]) and out["good"]["lr"] == LR

    bf = out["bf16"]
    print(f"[bf16] loss {bf['loss']:.5f} vs fp32 reference {reference['loss']:.5f}; {bf}")
    assert bf["wrapper"] and bf["param_dtype"] == "torch.bfloat16" and bf["optimizers"] == ["DistributedOptimizer"]
    assert abs(bf["loss"] - reference["loss"]) < 0.05 * abs(reference["loss"]) + 1e-3
