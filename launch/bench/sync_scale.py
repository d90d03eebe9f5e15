"""``mgrpo bench sync --senders N``: the multi-source push's data plane measured, and a model of the
30B recipe's push time at 1-8 trainer nodes, gather vs multisource.

Measured (CPU, this host): N sender processes and one receiver form one gloo group as a multi-source
push does (`weight_sync.gloo.send_to` / `recv_sources`, the product's own calls); ``--payload-mb``
of packed buckets (``--bucket-mb`` each) are split evenly over the senders, and one round per bucket
index receives every sender's bucket concurrently. Reported: seconds and GB/s for 1 sender and for N
(median of ``--iters``), and the bytes each sender sent (must be its share). On one host all
senders share the receiver's memory bandwidth and cores, so this checks the protocol's overhead and
gives the per-link number of this host's loopback; the cross-node numbers come from the model.

Model (`push_time_model`): the 30B recipe (launch/recipes: TP2 x EP8 x PP2 over 8 GPUs per trainer
node; 2 rollout nodes x 8 GPUs serving vLLM TP4 x DP2, so 4 replicas, each GPU receiving a quarter
of the weights), 61.07 GB of bf16 weights of which 57.98 GB are experts (spread over every trainer
rank) and 3.09 GB dense (owned by the TP x PP ranks of data-parallel replica 0), one NIC per GPU.
* gather: rank 0 receives the other nodes' shards through its one NIC and its own node's over
  NVLink, then sends every byte once into the broadcast to the servers (a pipelined NCCL broadcast
  moves each byte over each link once), one after the other (the streaming gather forwards each
  piece as it arrives, so the two do not overlap on rank 0's link);
* multisource: every rank sends its own shards to each of the 4 replicas through its own NIC, each
  inference GPU receives its quarter; time = the busiest link. Both plus a fixed control-plane cost.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

GB = 1e9

__all__ = ["Recipe30B", "push_time_model", "model_table", "run_senders"]


@dataclass
class Recipe30B:
    """Inputs of the push-time model (GB = 1e9 bytes, GB/s)."""

    expert_gb: float = 57.98
    """128 experts x 48 layers x 3 x 768 x 2048, bf16."""
    dense_gb: float = 3.09
    """Attention, norms, routers, embeddings, output layer (bf16): 61.07 GB in all, the thinker that
    `mgrpo bench sync` pushes (the audio tower adds 1.29 GB)."""
    gpus_per_node: int = 8
    dense_owner_ranks: int = 4
    """TP2 x PP2: the dense weights' owners (data-parallel replicas other than 0 send nothing)."""
    rollout_nodes: int = 2
    replicas: int = 4
    """vLLM servers holding a full copy: 2 rollout nodes x DP2."""
    inference_tp: int = 4
    """GPUs per replica; each receives 1/inference_tp of the weights."""
    nic_gbps: float = 50.0
    """Per-GPU NIC, GB/s (400 Gb/s InfiniBand; assumed, not measured here)."""
    nvlink_gbps: float = 302.0
    """Measured: 61.07 GB in 0.202 s between two H200 (docs/performance.md, mgrpo bench sync)."""
    control_s: float = 0.05
    """pause + start + finish + resume HTTP round trips (assumed; the tiny CPU pushes measure ~0.1 s
    of which most is vLLM's reload of the tiny model)."""

    @property
    def total_gb(self) -> float:
        return self.expert_gb + self.dense_gb


def push_time_model(trainer_nodes: int, mode: str, r: Recipe30B = Recipe30B()) -> dict:
    """Seconds of one push of the recipe's weights at `trainer_nodes`, with the bytes on the busiest
    link; mode "gather" or "multisource" (see the module doc)."""
    ranks = trainer_nodes * r.gpus_per_node
    if mode == "gather":
        off_node = r.expert_gb * (trainer_nodes - 1) / trainer_nodes  # node 0 also holds all dense owners
        on_node = r.total_gb - off_node - r.expert_gb / ranks - r.dense_gb / r.dense_owner_ranks
        into = off_node / r.nic_gbps + on_node / r.nvlink_gbps
        out = r.total_gb / r.nic_gbps
        return {"seconds": r.control_s + into + out, "rank0_in_gb": off_node, "rank0_out_gb": r.total_gb,
                "busiest_link_gb": off_node + r.total_gb}
    if mode == "multisource":
        owned = r.expert_gb / ranks + r.dense_gb / r.dense_owner_ranks  # the busiest rank's share
        send = r.replicas * owned
        recv = r.total_gb / r.inference_tp
        return {"seconds": r.control_s + max(send, recv) / r.nic_gbps, "busiest_sender_gb": send,
                "per_inference_gpu_gb": recv, "busiest_link_gb": max(send, recv)}
    raise ValueError(f"mode must be gather or multisource, got {mode!r}")


def model_table(nodes=(1, 2, 4, 8), r: Recipe30B = Recipe30B()) -> str:
    """The markdown table of docs/performance.md ("Weight sync at scale")."""
    rows = ["| trainer nodes (GPUs) | gather: rank 0's NIC in / out | gather push | multisource: "
            "busiest link | multisource push |", "|---|---|---|---|---|"]
    for n in nodes:
        g, m = push_time_model(n, "gather", r), push_time_model(n, "multisource", r)
        rows.append(f"| {n} ({n * r.gpus_per_node}) | {g['rank0_in_gb']:.1f} GB / {g['rank0_out_gb']:.1f} GB | "
                    f"{g['seconds']:.2f} s | {m['busiest_link_gb']:.1f} GB | {m['seconds']:.2f} s |")
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------------ measured
def _sender_rank(opts: dict):
    import torch
    from datetime import timedelta
    from torch.distributed import TCPStore

    from megatron_grpo.weight_sync import gloo as G

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    senders = world - 1
    timeout = timedelta(seconds=opts["timeout_s"])
    store = TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]) + 1, world, is_master=rank == 0,
                     timeout=timeout, wait_for_workers=False)
    pg = G._gloo_group(store, rank, world, "127.0.0.1", timeout)
    bucket = int(opts["bucket_mb"] * 2**20)
    n_buckets = max(1, int(opts["payload_mb"] * 2**20) // bucket)
    mine = [k for k in range(n_buckets) if k % senders == rank] if rank < senders else []
    times, sent = [], 0
    for it in range(opts["warmup"] + opts["iters"]):
        bufs = [torch.full((bucket,), k % 251, dtype=torch.uint8) for k in (mine or [0])]
        pg.barrier().wait()
        t0 = time.perf_counter()
        if rank < senders:
            for buf in bufs:
                G.send_to(pg, buf, [senders])
                sent += buf.numel() if it == opts["warmup"] else 0
        else:
            rounds = -(-n_buckets // senders)
            for k in range(rounds):
                runs = [(s, ["b"], ["uint8"], [[bucket]]) for s in range(senders) if k * senders + s < n_buckets]
                for s, pairs in G.recv_sources(pg, runs, lambda s: f"sender {s}"):
                    assert int(pairs[0][1][0]) == (k * senders + s) % 251, "bucket bytes differ"
        pg.barrier().wait()
        if it >= opts["warmup"]:
            times.append(time.perf_counter() - t0)
    return {"rank": rank, "seconds": statistics.median(times), "sent_bytes": sent,
            "share_bytes": len(mine) * bucket, "payload_bytes": n_buckets * bucket}


def run_senders(senders: int, payload_mb: float = 256, bucket_mb: float = 16, iters: int = 3, warmup: int = 1,
                timeout_s: float = 600, baseline: bool = True) -> dict:
    """`senders` (and with `baseline` 1) sender processes into one receiver over the product's gloo p2p
    (module doc); {senders: {seconds, gb_per_s, payload_bytes, sent_bytes per sender}}."""
    from model_bridge.spawn import run_ranks

    out = {}
    for n in sorted({1, senders} if baseline else {senders}):
        opts = dict(payload_mb=payload_mb, bucket_mb=bucket_mb, iters=iters, warmup=warmup, timeout_s=timeout_s)
        vals = run_ranks(_sender_rank, n + 1, opts, timeout=timeout_s, env={"CUDA_VISIBLE_DEVICES": ""})
        rx = vals[-1]
        for v in vals[:-1]:
            if v["sent_bytes"] != v["share_bytes"]:
                raise RuntimeError(f"sender {v['rank']} sent {v['sent_bytes']} B, its share is {v['share_bytes']} B")
        out[n] = {"seconds": rx["seconds"], "gb_per_s": rx["payload_bytes"] / rx["seconds"] / GB,
                  "payload_bytes": rx["payload_bytes"], "sent_bytes": [v["sent_bytes"] for v in vals[:-1]]}
    return out


def bench_senders(out_dir, senders: int, payload_mb: float, bucket_mb: float, iters: int, warmup: int,
                  timeout_s: float) -> dict:
    """`mgrpo bench sync --senders N`: measurement + model; writes bench_sync_senders.json."""
    import platform

    import torch

    measured = run_senders(senders, payload_mb, bucket_mb, iters, warmup, timeout_s)
    r = Recipe30B()
    res = {"measured": measured, "model_inputs": asdict(r),
           "model": {n: {m: push_time_model(n, m, r) for m in ("gather", "multisource")} for n in (1, 2, 4, 8)},
           "model_table": model_table(r=r), "target": "multisource push of the 30B recipe <= 1.0 s at 4 trainer nodes",
           "target_met_by_model": push_time_model(4, "multisource", r)["seconds"] <= 1.0,
           "env": {"torch": torch.__version__, "host": platform.node(), "cpus": os.cpu_count(),
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_sync_senders.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    for n, m in measured.items():
        print(f"[bench sync --senders] {n} sender(s): {m['payload_bytes'] / 1e6:.0f} MB in {m['seconds']:.3f} s "
              f"({m['gb_per_s']:.2f} GB/s); bytes per sender {m['sent_bytes']}")
    print(res["model_table"])
    return res
