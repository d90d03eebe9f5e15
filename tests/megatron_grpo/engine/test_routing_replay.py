"""Routing replay against the real vLLM CPU server (R3): forced disagreement.

The server (tiny checkpoint, fp32) samples three text continuations and returns their routes and
logprobs. The trainer (torch backend, one gloo rank) scores the same tokens, packed THD into one
micro-batch with padding, three ways: with the checkpoint's router weights; with router weights
perturbed so that its own top-k differs from the server's on >= 10% of token-layer pairs; and
perturbed but replaying the server's routes (R3). Without replay the rollout/trainer mismatch KL
(k3, mean over the generated tokens) rises; with R3 the trainer's chosen experts equal the server's
on every pair that has a row, and the KL falls by >= 10x against no replay.
"""
from __future__ import annotations

import asyncio

import numpy as np
import torch

from model_bridge.spawn import run_ranks

MIN_DISAGREEMENT = 0.10
KL_DROP = 10.0


def _server_samples(url: str) -> list[dict]:
    from megatron_grpo.rollout.client import RolloutClient
    from megatron_grpo.rollout.config import RolloutConfig

    async def go():
        async with RolloutClient(RolloutConfig(server_urls=[url], max_retries=0)) as c:
            out = []
            for i, n in enumerate((20, 33, 27)):
                prompt = torch.randint(0, 400, (n,), generator=torch.Generator().manual_seed(40 + i)).tolist()
                r = await c.generate(prompt, [], max_tokens=12, temperature=1.0, seed=7 + i,
                                     extra_sampling_params={"ignore_eos": True}, routed_experts_prompt_start=0)
                out.append({"ids": list(r.prompt_token_ids) + list(r.token_ids), "prompt": len(r.prompt_token_ids),
                            "logprobs": list(r.logprobs), "routes": np.asarray(r.routed_experts)})
            return out
    return asyncio.run(go())


def _rank_scores(hf_dir: str, samples: list[dict]) -> dict:
    from megatron.core.packed_seq_params import PackedSeqParams

    from model_bridge.config import ParallelLayout, read_omni_config
    from model_bridge.load import load_hf
    from model_bridge.modeling.route_replay import RouteReplay, replay_scope
    from model_bridge.modeling.thinker import build_thinker, gather_logits, mrope_position_ids
    from model_bridge.parallel import destroy_parallel, init_parallel

    torch.set_num_threads(1)
    init_parallel(seed=1)
    try:
        spec = read_omni_config(hf_dir)
        model = build_thinker(spec, ParallelLayout(), torch.float32, backend="torch")
        load_hf(model, hf_dir)
        model.eval()
        pad = 3
        lens = [len(s["ids"]) for s in samples]
        cu = torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32)
        ids = torch.tensor([sum((s["ids"] for s in samples), []) + [0] * pad])
        T = ids.shape[1]
        pos = mrope_position_ids(ids, spec, cu_seqlens=cu).unsqueeze(1)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                              max_seqlen_kv=max(lens))
        L, k = samples[0]["routes"].shape[1:]
        routes = torch.full((T, L, k), -1, dtype=torch.int16)
        for s, c in zip(samples, cu.tolist()):
            routes[c:c + len(s["ids"]) - 1] = torch.from_numpy(s["routes"].astype(np.int16))
        has = (routes >= 0).all(-1)  # [T, L]
        # the positions whose next token the server sampled, and its logprobs there
        gen = torch.cat([torch.arange(c + s["prompt"] - 1, c + len(s["ids"]) - 1) for s, c in zip(samples, cu.tolist())])
        server_lp = torch.tensor(sum((s["logprobs"] for s in samples), []), dtype=torch.float64)
        chosen = {}
        for name, module in model.named_modules():
            if name.endswith("mlp.router"):
                layer = int(name.split("layers.")[1].split(".")[0])
                module.register_forward_hook(lambda _m, _i, out, layer=layer: chosen.__setitem__(layer, out[1].detach()))

        def score(replay: bool) -> dict:
            with torch.no_grad(), replay_scope(RouteReplay(routes) if replay else None) as rp:
                logits = gather_logits(model(ids, pos, psp, audio_features=None, audio_feature_lens=None),
                                       spec.text.vocab_size).double()
            lp = torch.log_softmax(logits[gen], -1).gather(1, ids[0, gen + 1].unsqueeze(1)).squeeze(1)
            delta = lp - server_lp  # log(trainer / server) per generated token
            own_TLK = torch.stack([chosen[l].nonzero()[:, 1].view(T, k) for l in range(L)], 1)
            same = (own_TLK.sort(-1).values == routes.long().sort(-1).values).all(-1)
            return {"kl_k3": float((torch.exp(delta) - delta - 1).mean()),  # k3 of KL(server || trainer)
                    "match": float(same[has].float().mean()), "counts": rp.counts() if rp else None}

        res = {"base": score(False), "pairs_with_rows": int(has.sum()), "pairs": T * L}
        routers = [m for n, m in model.named_modules() if n.endswith("mlp.router")]
        clean = [r.weight.detach().clone() for r in routers]
        g = torch.Generator().manual_seed(3)
        noise = [torch.randn(w.shape, generator=g) * w.std() for w in clean]
        for scale in (0.05, 0.1, 0.2, 0.4, 0.8):  # the smallest perturbation that flips >= 10%
            with torch.no_grad():
                for r, w, n in zip(routers, clean, noise):
                    r.weight.copy_(w + scale * n)
            res["perturbed"] = score(False)
            res["scale"] = scale
            if 1 - res["perturbed"]["match"] >= MIN_DISAGREEMENT:
                break
        res["perturbed_r3"] = score(True)
        return res
    finally:
        destroy_parallel()


def test_forced_disagreement_r3_restores_the_servers_routes(vllm_server, tiny_ckpt):
    samples = _server_samples(vllm_server.url)
    res = run_ranks(_rank_scores, 1, str(tiny_ckpt), samples, timeout=600)[0]
    base, pert, r3 = res["base"], res["perturbed"], res["perturbed_r3"]
    print(f"\n[forced disagreement] router noise x{res['scale']}: own top-k differs from the server's on "
          f"{1 - pert['match']:.1%} of pairs (unperturbed {1 - base['match']:.1%}); mismatch KL k3: unperturbed "
          f"{base['kl_k3']:.2e}, perturbed {pert['kl_k3']:.2e}, perturbed + R3 {r3['kl_k3']:.2e}; "
          f"R3 counts {r3['counts']} of {res['pairs']} pairs")
    assert 1 - pert["match"] >= MIN_DISAGREEMENT, pert
    assert pert["kl_k3"] > base["kl_k3"], (base, pert)
    assert r3["match"] == 1.0, r3  # every pair with a row routed to the server's experts
    assert r3["kl_k3"] * KL_DROP <= pert["kl_k3"], (pert, r3)
    assert r3["counts"]["rows"] == res["pairs_with_rows"] and r3["counts"]["pairs"] == res["pairs"]
    assert r3["counts"]["agree"] < r3["counts"]["rows"]  # the replay overrode choices the router disagreed on
