"""The plan cache of export_to_rank0 (weight_sync/gather.py) on 2 real gloo ranks, tiny model at EP2.

* a second push of the same model reuses the first push's plan (``local_meta`` and
  ``build_schedule`` run once on every rank) and rank 0's stream stays bit-identical;
* another bucket size or export dtype plans again;
* a rank that lost its plan makes every rank plan again (no rank skips the plan's collective
  alone), and the stream is unchanged;
* the plan's signature changes when a parameter's shape or dtype does.
"""
from __future__ import annotations

import torch

from model_bridge.spawn import run_ranks

BUCKET = 3000  # bytes: several pieces from the tiny model's 1-16 KiB tensors


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def _pushes(hf_dir):
    """Rank body: ({push label: (rank 0's stream, local_meta calls so far, build_schedule calls so
    far)}, {signature check: whether the signature changed})."""
    from model_bridge.config import ParallelLayout, read_omni_config
    from model_bridge.load import load_hf, model_chunks
    from model_bridge.modeling import build_thinker
    from model_bridge.parallel import init_parallel

    import megatron_grpo.weight_sync.gather as gather

    calls = {"local_meta": 0, "build_schedule": 0}

    def counted(name):
        fn = getattr(gather, name)

        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    # export_to_rank0 looks both up in the module at call time
    gather.local_meta, gather.build_schedule = counted("local_meta"), counted("build_schedule")

    init_parallel(tp=1, ep=2)
    spec = read_omni_config(hf_dir)
    model = build_thinker(spec, ParallelLayout(tp=1, ep=2))
    load_hf(model, hf_dir)

    def push(label, bucket=BUCKET, **export_kw):
        stream = [(n, t.dtype, _bytes(t)) for n, t in
                  gather.export_to_rank0(model, bucket_bytes=bucket, **export_kw)]
        pushes[label] = (stream, calls["local_meta"], calls["build_schedule"])

    pushes: dict = {}
    push("first")
    push("second")
    push("other_bucket", bucket=2 * BUCKET)
    push("bf16", dtype=torch.bfloat16)
    push("back")  # the cache keeps one plan per model: the bf16 one replaced it
    push("again")
    if torch.distributed.get_rank() == 1:
        gather._PLAN_CACHE.clear()
    push("rank1_lost_it")

    chunks = model_chunks(model)
    p = next(p for p in chunks[0].parameters())
    before = gather._plan_signature(chunks, BUCKET)
    changed = {}
    p.data = p.data.to(torch.bfloat16)
    changed["dtype"] = gather._plan_signature(chunks, BUCKET) != before
    p.data = p.data.float()[..., :-1].contiguous()
    changed["shape"] = gather._plan_signature(chunks, BUCKET) != before
    return pushes, changed


def test_second_push_reuses_the_plan_and_is_bit_identical(tiny_ckpt):
    per_rank = run_ranks(_pushes, 2, str(tiny_ckpt), timeout=300)
    for rank, (pushes, changed) in enumerate(per_rank):
        # (local_meta calls, build_schedule calls) after each push
        plans = {label: (n_meta, n_sched) for label, (_, n_meta, n_sched) in pushes.items()}
        assert plans == {"first": (1, 1), "second": (1, 1), "other_bucket": (2, 2), "bf16": (3, 3),
                         "back": (4, 4), "again": (4, 4), "rank1_lost_it": (5, 5)}, f"rank {rank}: {plans}"
        assert changed == {"dtype": True, "shape": True}, f"rank {rank}: {changed}"
    streams = {label: stream for label, (stream, _, _) in per_rank[0][0].items()}
    assert streams["first"], "rank 0 yielded nothing"
    assert not any(stream for stream, _, _ in per_rank[1][0].values())
    for label in ("second", "other_bucket", "back", "again", "rank1_lost_it"):
        assert streams[label] == streams["first"], f"{label}: the stream differs from the first push"
    assert [n for n, _, _ in streams["bf16"]] == [n for n, _, _ in streams["first"]]
    assert torch.bfloat16 in {dt for _, dt, _ in streams["bf16"]}
