"""Where each step's trajectories come from: rank 0's backend (the vLLM server(s), the multi-turn
rollout engine, the weight push) and every rank's trajectory source.

`open_backend` / `open_source` pick the live pair (RolloutBackend, TrajectorySource) or, with
``rollout.server: replay``, the recording's (megatron_grpo/run/replay.py) behind the same interface.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from megatron_grpo.config import TrainConfig, serve_dtype, train_dtype
from megatron_grpo.run.failures import RolloutFailed, rollout_failure


def local_server_spec(cfg: TrainConfig):
    """The `ServerSpec` of the vLLM server `mgrpo train` starts when rollout.server is "local":
    the ``serve`` section, served as "policy", in the trainer's dtype unless serve.dtype says
    otherwise (`megatron_grpo.config.serve_dtype`)."""
    from megatron_grpo.rollout.server import ServerSpec

    s = cfg.serve
    if s.max_model_len == "auto":  # the pre-flight sizes it (megatron_grpo/run/sizing.py)
        raise ValueError("serve.max_model_len is auto but was not sized from the data: run through "
                         "`mgrpo train`, or give it a number of tokens")
    return ServerSpec(model=cfg.model.hf_dir, served_model_name="policy", dtype=serve_dtype(cfg),
                      max_model_len=s.max_model_len, max_num_seqs=s.max_num_seqs,
                      seed=cfg.trainer.seed, max_audio_per_prompt=s.max_audio_per_prompt,
                      cpu_kvcache_gib=s.cpu_kvcache_gib, max_audio_seconds=s.max_audio_seconds,
                      return_routed_experts=cfg.rollout.return_routed_experts,
                      weight_transfer_backend=cfg.rollout.weight_transfer, extra_args=list(s.extra_args))


def open_backend(cfg: TrainConfig, run_dir: Path):
    """Rank 0's backend: a ReplayBackend for ``rollout.server: replay``, else a RolloutBackend."""
    if cfg.rollout.server == "replay":
        from megatron_grpo.run.replay import ReplayBackend
        return ReplayBackend(cfg, run_dir)
    return RolloutBackend(cfg, run_dir)


def open_source(cfg: TrainConfig, backend, data, rank: int):
    """Every rank's source of trajectories (with advantages): replayed or rolled out."""
    if cfg.rollout.server == "replay":
        from megatron_grpo.run.replay import ReplaySource
        return ReplaySource(backend, data, rank)
    recorder = None
    if cfg.rollout.record_dir and rank == 0:
        from megatron_grpo.run.replay import Recorder
        recorder = Recorder(cfg)
    return TrajectorySource(backend, data, cfg.rollout.overlap, rank, variant=cfg.loss.variant, recorder=recorder,
                            run_dir=cfg.trainer.run_dir, sync_mode=cfg.weight_sync.mode)


def torch_dist_ready() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def with_advantages(trajs, variant: str):
    """The trajectories the trainer consumes: advantages filled in, filtered samples dropped."""
    import torch

    from megatron_grpo.algo.advantages import compute_advantages

    rewards_N = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    groups_N = torch.tensor([t.group_id for t in trajs])
    adv = compute_advantages(rewards_N, groups_N, variant)
    return [replace(trajs[i], advantage=float(adv.values_N[i])) for i in range(len(trajs)) if bool(adv.keep_N[i])]


class RolloutBackend:
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
            self.server.start(timeout=cfg.serve.startup_timeout_s)  # stops the server if interrupted
            rcfg.server_urls = [self.server.url]
            rcfg.model = spec.served_model_name
        try:
            if rcfg.tokenizer is None:
                rcfg.tokenizer = cfg.model.hf_dir
            self.tokenizer = AutoTokenizer.from_pretrained(rcfg.tokenizer)
            self.engine = RolloutEngine(rcfg, self.tokenizer, data_config=cfg.data)
            backend = None if rcfg.weight_transfer == "auto" else rcfg.weight_transfer
            self.receivers = [WeightReceiver(u, api_key=rcfg.api_key, backend=backend) for u in rcfg.server_urls]
        except BaseException:  # the caller never gets `self` to close: stop our server here
            if self.server is not None:
                self.server.stop()
            raise

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


class TrajectorySource:
    """Where each step's trajectories come from, the same on every rank.

    Default: step k's prompts are rolled out (rank 0), then trained. With ``rollout.overlap``:
    step k+1's prompts are taken and their rollout starts on rank 0 in a thread right after step k's
    trajectories are handed out, so it runs while step k trains; `settle()` waits for it before
    the weight push (a push pauses the servers and would abort it). A checkpoint saves the data
    position from before the prefetch, so a resume rolls that batch out again with its weights.
    """

    def __init__(self, backend, data, overlap: bool, rank: int, variant: str = "grpo", recorder=None,
                 run_dir: str | Path = ".", sync_mode: str = "auto"):
        self.backend, self.data, self.overlap, self.rank = backend, data, overlap, rank
        self.sync_mode = sync_mode
        self.resolved_mode: str | None = None
        self.run_dir = run_dir
        self.variant, self.recorder = variant, recorder
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

    def rollout_and_score(self, step: int):
        """Rank 0: `step`'s rolled-out batch with its rewards (the prefetched one with overlap), or
        the `RolloutFailed` naming what went wrong (run/failures.py); None on the other ranks."""
        future = self.future
        if self.prefetched_rows is not None:
            rows, self.prefetched_rows, self.state_before_prefetch = self.prefetched_rows, None, None
            self.future = None
        else:
            rows = self.data.next_batch()
        if self.rank != 0:
            return None
        try:
            if future is not None:
                return future.result()
            return self.backend.rollout(rows, self.group_ids(step, len(rows)))
        except Exception as e:  # noqa: BLE001 - every rank stops with one line (run/failures.py)
            return rollout_failure(e, self.run_dir)

    def advantages(self, step: int, batch, to_ranks):
        """(this rank's trajectories with advantages, extra metrics for rank 0's log) of `step`: rank 0
        fills in the advantages (filtered samples dropped) and ``to_ranks`` hands every rank its share
        (all of it on rank 0, a rank's own micro-batches' samples elsewhere: run/to_ranks.py); a
        rollout failure is raised on every rank. With a recorder, rank 0 saves exactly those
        trajectories (rollout.record_dir)."""
        failed = batch if isinstance(batch, RolloutFailed) else None
        payload = with_advantages(batch.trajectories, self.variant) if self.rank == 0 and failed is None else failed
        trajs = to_ranks(payload)
        if isinstance(trajs, RolloutFailed):
            raise trajs
        if self.recorder is not None:
            self.recorder.record(step, trajs, batch.stats)
        return trajs, {}

    def prefetch(self, next_step: int) -> None:
        """With overlap: start rolling out `next_step`'s prompts now (rank 0), in the background."""
        if not self.overlap:
            return
        self.state_before_prefetch = self.data.state_dict()
        self.prefetched_rows = self.data.next_batch()
        if self.rank == 0:
            self.future = self.pool.submit(self.backend.rollout, self.prefetched_rows,
                                           self.group_ids(next_step, len(self.prefetched_rows)))

    def settle(self) -> None:
        """Wait for a background rollout (rank 0) so that nothing is in flight during a push."""
        if self.future is not None:
            self.future.result()

    def resolve_push_mode(self, model) -> str:
        """How this run pushes (`multisource.resolve_mode`), decided once, before the first step: from
        the servers' data plane (rank 0's receivers, broadcast) and, on nccl_m2n servers, whether the
        job fits vLLM's m2n contract (raises if not). A collective: every rank calls it."""
        if self.resolved_mode is not None:
            return self.resolved_mode
        from megatron_grpo.weight_sync.multisource import resolve_mode

        backend = self.backend.receivers[0].backend if self.rank == 0 else None
        if torch_dist_ready():
            import torch.distributed as dist
            box = [backend]
            dist.broadcast_object_list(box, src=0)
            backend = box[0]

        def m2n_unfit():
            from megatron_grpo.weight_sync.m2n import unfit_reason
            return unfit_reason(model)

        self.resolved_mode = resolve_mode(self.sync_mode, backend, m2n_unfit=m2n_unfit)
        return self.resolved_mode

    def push(self, model, version: int) -> None:
        """Push the weights to vLLM (a collective: every rank calls it): from every shard owner
        (weight_sync.mode multisource: our gloo engine, or vLLM's nccl_m2n) or gathered to rank 0."""
        from megatron_grpo.weight_sync.gather import export_to_rank0
        from megatron_grpo.weight_sync.multisource import push_multisource

        receivers = self.backend.receivers if self.rank == 0 else None
        self.resolve_push_mode(model)
        if self.resolved_mode == "multisource":
            push_multisource(model, version, receivers)
            return
        if self.resolved_mode == "m2n":
            from megatron_grpo.weight_sync.m2n import push_m2n
            push_m2n(model, version, receivers)
            return
        weights = export_to_rank0(model)
        self.backend.push(weights, version) if self.rank == 0 else sum(1 for _ in weights)

    def data_state(self) -> dict:
        """The data position to checkpoint: before any prefetched batch."""
        return self.state_before_prefetch if self.state_before_prefetch is not None else self.data.state_dict()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
