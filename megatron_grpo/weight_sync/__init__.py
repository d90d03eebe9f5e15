"""Weight sync: trainer weights (HF names, full tensors) -> buckets -> a transport -> vLLM servers.

`push(weights, version, servers)` drives vLLM's native RL weight-transfer API on each
`WeightReceiver` (one per server); `buckets` groups the stream; `gloo` (CPU) and `nccl` (GPU) are
the transports, one per file; the vLLM side lives in `megatron_grpo.rollout.vllm_ext`. A multi-rank
trainer brings its stream to rank 0 with `gather.export_to_rank0`, or pushes from every rank that owns
a shard with `multisource.push_multisource` (gloo servers) or `m2n.push_m2n` (vLLM's nccl_m2n engine on
GPU servers); `weight_sync.mode` picks.
Protocol and failure semantics: docs/rollout.md.
"""
from megatron_grpo.weight_sync.buckets import Bucket, default_bucket_bytes, iter_buckets
from megatron_grpo.weight_sync.push import (
    PushStats,
    ServerRequestError,
    WeightPushError,
    WeightReceiver,
    default_backend,
    push,
)

__all__ = ["push", "PushStats", "WeightReceiver", "WeightPushError", "ServerRequestError",
           "default_backend", "Bucket", "iter_buckets", "default_bucket_bytes"]
