"""Rank 0's side of the loop: the vLLM server(s), the multi-turn rollout engine, the weight push."""
from __future__ import annotations

from pathlib import Path

from megatron_grpo.config import TrainConfig, serve_dtype, train_dtype


def local_server_spec(cfg: TrainConfig):
    """The `ServerSpec` of the vLLM server `mgrpo train` starts when rollout.server is "local":
    the ``serve`` section, served as "policy", in the trainer's dtype unless serve.dtype says
    otherwise (`megatron_grpo.config.serve_dtype`)."""
    from megatron_grpo.rollout.server import ServerSpec

    s = cfg.serve
    return ServerSpec(model=cfg.model.hf_dir, served_model_name="policy", dtype=serve_dtype(cfg),
                      max_model_len=s.max_model_len, max_num_seqs=s.max_num_seqs,
                      seed=cfg.trainer.seed, max_audio_per_prompt=s.max_audio_per_prompt,
                      cpu_kvcache_gib=s.cpu_kvcache_gib, extra_args=list(s.extra_args))


class RolloutSide:
    """Starts (rollout.server == "local") or connects to the vLLM servers; rolls out; pushes."""

    def __init__(self, cfg: TrainConfig, run_dir: Path):
        from transformers import AutoTokenizer

        from megatron_grpo.rollout.engine import RolloutEngine
        from megatron_grpo.rollout.server import VLLMServer
        from megatron_grpo.weight_sync import WeightReceiver

        self.cfg = cfg
        self.server = None
        rcfg = cfg.rollout
        if rcfg.server == "local":
            spec = local_server_spec(cfg)
            trainer = str(train_dtype(cfg)).removeprefix("torch.")
            if spec.dtype != trainer:
                print(f"[train] warning: serve.dtype={spec.dtype} differs from the trainer's dtype "
                      f"({trainer}): rollout and training logprobs come from different numerics "
                      "(see the mismatch_kl_* metrics)", flush=True)
            self.server = VLLMServer(spec, run_dir / "vllm-server.log")
            self.server.start(timeout=cfg.serve.startup_timeout_s)
            rcfg.server_urls = [self.server.url]
            rcfg.model = spec.served_model_name
        if rcfg.tokenizer is None:
            rcfg.tokenizer = cfg.model.hf_dir
        self.tokenizer = AutoTokenizer.from_pretrained(rcfg.tokenizer)
        self.engine = RolloutEngine(rcfg, self.tokenizer, data_config=cfg.data)
        self.receivers = [WeightReceiver(u, api_key=rcfg.api_key) for u in rcfg.server_urls]

    def rollout(self, rows, group_ids):
        """Complete trajectories for the rows (rewards filled in)."""
        from megatron_grpo.rollout.rewards import run_sync

        batch = self.engine.run(rows, group_ids=group_ids)
        run_sync(self.engine.score(batch.trajectories))
        return batch

    def push(self, weights, version: int):
        from megatron_grpo.weight_sync import push

        return push(weights, version, self.receivers)

    def close(self):
        for r in self.receivers:
            try:
                r.close()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        if self.server is not None:
            self.server.stop()
