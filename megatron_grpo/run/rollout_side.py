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


class RolloutFeed:
    """Where each step's trajectories come from, the same on every rank.

    Default: step k's prompts are rolled out (rank 0), then trained. With ``rollout.overlap``:
    step k+1's prompts are taken and their rollout starts on rank 0 in a thread right after step k's
    trajectories are handed out, so it runs while step k trains; `settle()` waits for it before
    the weight push (a push pauses the servers and would abort it). A checkpoint saves the data
    position from before the prefetch, so a resume rolls that batch out again with its weights.
    """

    def __init__(self, side, data, overlap: bool, rank: int):
        self.side, self.data, self.overlap, self.rank = side, data, overlap, rank
        self.pool = None
        if overlap and rank == 0:
            from concurrent.futures import ThreadPoolExecutor
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="rollout")
        self.future = None
        self.prefetched_rows = None
        self.state_before_prefetch = None

    @staticmethod
    def group_ids(step: int, n: int) -> list[int]:
        return [step * 10_000 + i for i in range(n)]

    def take(self, step: int, broadcast):
        """(trajectories, rollout stats or None off rank 0) of `step`."""
        if self.prefetched_rows is not None:
            rows, self.prefetched_rows, self.state_before_prefetch = self.prefetched_rows, None, None
            batch = self.future.result() if self.rank == 0 else None
            self.future = None
        else:
            rows = self.data.next_batch()
            batch = self.side.rollout(rows, self.group_ids(step, len(rows))) if self.rank == 0 else None
        trajs = broadcast(batch.trajectories if batch is not None else None)
        return trajs, (batch.stats if batch is not None else None)

    def prefetch(self, next_step: int) -> None:
        """With overlap: start rolling out `next_step`'s prompts now (rank 0), in the background."""
        if not self.overlap:
            return
        self.state_before_prefetch = self.data.state_dict()
        self.prefetched_rows = self.data.next_batch()
        if self.rank == 0:
            self.future = self.pool.submit(self.side.rollout, self.prefetched_rows,
                                           self.group_ids(next_step, len(self.prefetched_rows)))

    def settle(self) -> None:
        """Wait for a background rollout (rank 0) so that nothing is in flight during a push."""
        if self.future is not None:
            self.future.result()

    def data_state(self) -> dict:
        """The data position to checkpoint: before any prefetched batch."""
        return self.state_before_prefetch if self.state_before_prefetch is not None else self.data.state_dict()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
