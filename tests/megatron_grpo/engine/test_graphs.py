"""CUDA graphs for the trainer's micro-batches (``engine/graphs.py``).

CPU: the fallback reasons, the bucket shapes, the per-micro-batch eager cases, the segment bound
of a bucket's graph (its padding segments, recapture when a longer segment comes), and the bucket
padding itself (decoder input padded to the bucket, offsets padded with padding and zero-length
segments, the one-segment host plan) giving the thinker's own hidden states, through the same code
with the capture replaced by the eager module. GPU: the trainer with graphs against the trainer with the
same bucketed micro-batches run eagerly, over 3 steps with the optimizer: the final hidden states
bit-equal, the gradients within eager's run-to-run spread.
"""
from __future__ import annotations

import logging
import weakref

import pytest
import torch

from megatron_grpo.engine.graphs import (MAX_SEGMENTS, GraphShape, MicroBatchGraphs, bucket_sizes,
                                         graph_fallback_reason, graph_shape, segment_bound)
from model_bridge.spawn import run_ranks


@pytest.mark.parametrize("kw,reason", [
    (dict(cuda=True), None),
    (dict(cuda=False), "no CUDA device (graphs are a GPU feature)"),
    (dict(cuda=True, pp=2), "pipeline parallelism (pp=2): megatron's 1F1B schedule exchanges activations between "
                            "stages"),
    (dict(cuda=True, ep=2), "expert parallelism (ep=2): the all-to-all token dispatcher reads its split sizes on "
                            "the host"),
    (dict(cuda=True, tp=2), "tensor parallelism (tp=2): not checked under graphs yet"),
    (dict(cuda=True, backend="local"), "layer-spec backend 'local': only the 'torch' backend's layers run without "
                                       "host syncs"),
    (dict(cuda=True, recompute="full"), "model.recompute='full': recomputation under graphs is not checked yet"),
    (dict(cuda=True, dtype=torch.float32), "attention would not run flash varlen (dtype torch.float32 (flash runs "
                                           "bfloat16/float16)): its SDPA path plans on the host"),
    (dict(cuda=True, head_dim=10), "attention would not run flash varlen (head size 10 is not a multiple of 8): its "
                                   "SDPA path plans on the host"),
])
def test_fallback_reasons(kw, reason):
    assert graph_fallback_reason(**kw) == reason


def test_bucket_sizes():
    assert bucket_sizes(4096) == [1024, 2048, 3072, 4096]
    assert bucket_sizes(4096, 3) == [1026, 2052, 3078, 4096]
    assert bucket_sizes(6) == [2, 4, 6]


def test_segment_bound_is_the_longest_sample_or_the_padding_over_the_free_slots():
    assert segment_bound([0, 300, 700, 1000], 4096) == 400  # 3,096 padding rows over 61 free slots: 51 each
    assert segment_bound([0, 300, 700, 1000], 4096, 8) == 620  # over 5 free slots
    assert segment_bound([0, 4096], 4096, 8) == 4096
    full = list(range(0, 63 * 10 + 1, 10))  # 63 samples of 10 tokens: one slot left for all of the padding
    assert segment_bound(full, 4096) == 4096 - 630
    with pytest.raises(ValueError, match=r"^64 segments leave no slot for the bucket padding \(at most 63\)$"):
        segment_bound(list(range(0, 64 * 10 + 1, 10)), 4096)


def test_graph_shape_takes_the_slots_and_bound_of_fewest_blocks_and_only_grows():
    assert graph_shape([0, 300, 700, 1000], 4096) == GraphShape(4096, 1024, 8)  # 620 over 5 slots; 4096/8
    assert graph_shape([0, 300, 700, 1000], 65536) == GraphShape(65536, 16384, 8)  # the padding sets it
    twenty = [0] + [3000 * (i + 1) for i in range(20)]  # 20 samples of 3,000 tokens
    assert graph_shape(twenty, 65536) == GraphShape(65536, 4096, 32)
    assert graph_shape(list(range(0, 400 * 63 + 1, 400)), 65536) == GraphShape(65536, 65536, 64)
    # 31 samples of 1,600 tokens: 32 slots would leave one for 15,936 padding rows (a bound of 16,384);
    # 64 slots launch a quarter of the blocks
    assert graph_shape(list(range(0, 1600 * 31 + 1, 1600)), 65536) == GraphShape(65536, 2048, 64)
    assert graph_shape([0, 10], 512) == GraphShape(512, 128, 8)  # flash's row block
    assert graph_shape([0, 3000], 3072) == GraphShape(3072, 3072, 8)  # never above the bucket
    big = GraphShape(4096, 2048, 16)
    assert graph_shape([0, 100, 200], 4096, big) == big  # a smaller micro-batch keeps the graph
    assert graph_shape([0, 3000, 3100], 4096, big) == GraphShape(4096, 4096, 16)


def test_graph_offsets_cut_the_padding_into_segments_within_the_bound():
    cu = GraphShape(4096, 512, 64).offsets([0, 300, 700, 1000])
    assert len(cu) == 65 and cu[:4] == [0, 300, 700, 1000] and cu[-1] == 4096
    lens = [b - a for a, b in zip(cu, cu[1:])]
    assert all(n >= 0 for n in lens) and max(lens) == 512 and sum(lens) == 4096
    assert lens[3:10] == [512] * 6 + [24] and set(lens[10:]) == {0}
    assert GraphShape(4096, 4096, 8).offsets([0, 4096]) == [0] + [4096] * 8
    with pytest.raises(ValueError, match=r"^a segment of 400 tokens exceeds the graph's bound 256$"):
        GraphShape(4096, 256, 64).offsets([0, 300, 700, 1000])
    with pytest.raises(ValueError, match=r"^a segment of 620 tokens exceeds the graph's bound 512$"):
        GraphShape(4096, 512, 8).offsets([0, 300, 700, 1000])  # the padding over 5 free slots


class _Graphed:
    """A stand-in graph that refers to itself, as ``make_graphed_callables``' module and function do."""

    def __init__(self, owner, shape):
        self.owner, self.shape, self.me = owner, shape, self

    def __call__(self, x, pos, cu, pad):
        self.owner.calls.append((self.shape, cu.tolist(), int(pad.sum())))
        return x


class _Recording(MicroBatchGraphs):
    """Captures nothing: each "graph" records the offsets it is replayed with."""

    def __init__(self, budget):
        super().__init__(thinker=None, budget=budget)
        self.calls = []

    def _capture(self, shape, like):
        return _Graphed(self, shape)


def test_a_micro_batch_that_does_not_fit_recaptures_its_buckets_graph(caplog):
    g = _Recording(4096)
    h = torch.zeros(1000, 1, 8)
    pos = torch.zeros(3, 1, 1000, dtype=torch.long)
    assert g.run(h, pos, [0, 100, 1000]).shape == h.shape  # 900 tokens: bound 1024
    assert g.run(h[:300], pos[..., :300], [0, 200, 300]) is not None  # same bucket, fits
    assert g.captures == 1 and g.shapes == {1024: GraphShape(1024, 1024, 8)} and g.replays == 2
    g = _Recording(4096)
    with caplog.at_level(logging.INFO, logger="megatron_grpo.engine.graphs"):
        g.run(h[:300], pos[..., :300], [0, 200, 300])  # bucket 1024: 8 slots of up to 256 tokens
        first = weakref.ref(g.graphed[1024])
        g.run(h[:900], pos[..., :900], [0, 600, 900])  # a 600-token sample: recaptured with 1024
        g.run(h[:300], pos[..., :300], [0, 200, 300])  # shapes only grow
        nine = list(range(0, 901, 100))
        g.run(h[:900], pos[..., :900], nine)  # 9 samples: 16 slots
    assert g.captures == 3 and g.shapes == {1024: GraphShape(1024, 1024, 16)}
    assert first() is None  # a replaced graph is freed before the recapture, its reference cycle too
    (s1, cu1, pad1), (s2, cu2, pad2), (s3, cu3, pad3), (s4, cu4, pad4) = g.calls
    assert (s1, pad1) == (GraphShape(1024, 256, 8), 724) and len(cu1) == 9 and cu1[:3] == [0, 200, 300]
    assert max(b - a for a, b in zip(cu1, cu1[1:])) == 256 and cu1[-1] == 1024
    assert (s2, pad2) == (GraphShape(1024, 1024, 8), 124) and cu2 == [0, 600, 900] + [1024] * 6
    assert (s3, pad3) == (s2, 724) and cu3 == [0, 200, 300] + [1024] * 6
    assert (s4, pad4) == (GraphShape(1024, 1024, 16), 124) and cu4 == nine + [1024] * 7
    assert ("trainer.cuda_graphs: a micro-batch of 2 segments (the longest 600 tokens, 124 tokens of bucket padding) "
            "does not fit the 1024-token bucket's graph of 8 segments of up to 256 tokens: recapturing it for 8 "
            "segments of up to 1024 tokens") in caplog.messages


class _FailsOnce(_Recording):
    def _capture(self, shape, like):
        if not getattr(self, "failed", False):
            self.failed = True
            raise torch.cuda.OutOfMemoryError("out of memory during the capture")
        return super()._capture(shape, like)


def test_a_failed_capture_leaves_no_shape_behind():
    g = _FailsOnce(4096)
    h, pos = torch.zeros(300, 1, 8), torch.zeros(3, 1, 300, dtype=torch.long)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        g.run(h, pos, [0, 200, 300])
    assert g.graphed == {} and g.shapes == {} and g.captures == 0
    assert g.run(h, pos, [0, 200, 300]) is not None  # the next micro-batch captures the bucket anew
    assert g.captures == 1 and g.shapes == {1024: GraphShape(1024, 256, 8)}


def test_micro_batches_that_run_eagerly_are_logged_once(caplog):
    g = MicroBatchGraphs(thinker=None, budget=4096)
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.engine.graphs"):
        assert g.bucket(1000, 3) == 1024 and g.bucket(1025, 3) == 2048 and g.bucket(4096, 1) == 4096
        assert g.bucket(5000, 1) is None and g.bucket(5001, 1) is None
        assert g.bucket(100, MAX_SEGMENTS) is None
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["trainer.cuda_graphs: a micro-batch runs eagerly: 5000 tokens exceed the token budget 4096 "
                     "(an oversized sample)",
                     f"trainer.cuda_graphs: a micro-batch runs eagerly: {MAX_SEGMENTS} samples in one micro-batch "
                     f"(graphs take up to {MAX_SEGMENTS - 1})"]


class EagerBuckets(MicroBatchGraphs):
    """The bucketed path with the capture replaced by the eager module (same padding, same offsets)."""

    def _capture(self, shape, like):
        from megatron_grpo.engine.graphs import _Stack

        return _Stack(self.thinker, shape)


def _trajectories(spec, budget, n=8, seed=0):
    from launch.bench._train_data import TINY_RANGES, synth_trajectories

    return synth_trajectories(n, spec, max_tokens=budget, seed=seed, ranges=TINY_RANGES, group_size=4)


def _microbatches(engine, hf_dir, budget):
    from transformers import AutoFeatureExtractor

    from megatron_grpo.data.device_features import trainer_featurizer
    from megatron_grpo.engine.batch import build_train_microbatches
    from megatron_grpo.packing import PackLimits, plan_step

    trajs = _trajectories(engine.spec, budget)
    packing = PackLimits(max_tokens_per_microbatch=budget)
    plan = plan_step([t.num_tokens for t in trajs], 1, packing)
    featurize = trainer_featurizer(AutoFeatureExtractor.from_pretrained(hf_dir))
    return build_train_microbatches(trajs, plan, 0, packing, featurize=featurize, n_window=engine.spec.audio.n_window)


def _cpu_buckets(hf_dir: str, budget: int, backend: str = "auto"):
    """``(engine, thinker, EagerBuckets)`` of the checkpoint on the CPU in fp32 (layer-spec ``backend``)."""
    from megatron_grpo.engine.setup import build_engine, unwrapped
    from model_bridge.config import ParallelLayout
    from model_bridge.parallel import init_parallel

    init_parallel(seed=1234)
    engine = build_engine(hf_dir, ParallelLayout(), dtype=torch.float32, backend=backend)
    thinker = unwrapped(engine.model[0])
    return engine, thinker, EagerBuckets(thinker, budget)


def _unpadded(thinker, m) -> torch.Tensor:
    """The thinker's own final hidden states of micro-batch ``m`` (``forward(return_hidden=True)``)."""
    return thinker(m.input_ids_T.unsqueeze(0), m.position_ids(), packed_seq_params=m.packed_seq_params(),
                   audio_features=m.audio_features, audio_feature_lens=m.audio_feature_lens, clip_use=m.clip_use,
                   return_hidden=True)


def _padded_hidden_rank(hf_dir: str, budget: int, graph_budget: int) -> list[float]:
    """Largest |difference| per micro-batch between the bucketed path's hidden states and the
    thinker's own, on the CPU in fp32 (micro-batches packed to ``budget``, buckets of ``graph_budget``)."""
    from megatron_grpo.engine.forward import _graphed_forward

    engine, thinker, graphs = _cpu_buckets(hf_dir, graph_budget)
    out = []
    with torch.no_grad():
        for m in _microbatches(engine, hf_dir, budget):
            ref = _unpadded(thinker, m)
            got = _graphed_forward(graphs, thinker, m, m)
            assert got.shape == ref.shape
            b = graphs.bucket(m.num_tokens, 1)
            out.append((m.num_tokens, b, graphs.shapes[b].seqlen, float((got - ref).abs().max())))
    return out


@pytest.mark.parametrize("graph_budget", [512, 4096])
def test_bucket_padding_gives_the_thinkers_hidden_states(tiny_ckpt, graph_budget):
    res = run_ranks(_padded_hidden_rank, 1, str(tiny_ckpt), 512, graph_budget, env={"CUDA_VISIBLE_DEVICES": ""},
                    timeout=600)[0]
    assert len(res) >= 2 and any(T < b for T, b, _, _ in res)  # some micro-batches were padded to their bucket
    if graph_budget > 512:  # buckets of 1,024 tokens: the padding takes several segments of the bound
        assert all(b - T > bound for T, b, bound, _ in res), res
    assert max(d for _, _, _, d in res) < 1e-5, res


def _aux_loss_padded_rank(hf_dir: str, budget: int, backend: str) -> list[tuple[int, int, list[float], list[float]]]:
    """Per micro-batch that the bucket pads: the MoE load-balancing loss of each layer through the
    bucketed path and through the thinker's own forward (CPU, fp32, training mode)."""
    from megatron.core.transformer.moe.moe_utils import (clear_aux_losses_tracker,
                                                         get_moe_layer_wise_logging_tracker)

    from megatron_grpo.engine.forward import _graphed_forward

    engine, thinker, graphs = _cpu_buckets(hf_dir, budget, backend)
    thinker.train()

    def losses() -> list[float]:
        values = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].tolist()
        clear_aux_losses_tracker()
        return values

    out = []
    clear_aux_losses_tracker()
    for m in _microbatches(engine, hf_dir, budget):
        b = graphs.bucket(m.num_tokens, 1)
        if b == m.num_tokens:
            continue
        _unpadded(thinker, m)
        ref = losses()
        _graphed_forward(graphs, thinker, m, m)
        out.append((m.num_tokens, b, losses(), ref))
    return out


@pytest.mark.parametrize("backend", ["local", "torch"])  # torch: our routers, as the GPU's graphs run them
def test_bucket_padding_stays_out_of_the_load_balancing_loss(tiny_ckpt, backend):
    res = run_ranks(_aux_loss_padded_rank, 1, str(tiny_ckpt), 512, backend, env={"CUDA_VISIBLE_DEVICES": ""},
                    timeout=600)[0]
    assert res, "no micro-batch was padded to its bucket"
    for T, b, got, ref in res:
        assert any(v > 0 for v in ref), (T, b, ref)  # the loss is on (the tiny checkpoint's coefficient)
        assert got == pytest.approx(ref, rel=1e-5, abs=1e-7), (T, b, got, ref)


def _graph_vs_eager_rank(hf_dir: str, budget: int, steps: int = 3) -> dict:
    """Three engines from one checkpoint (bf16, GPU): graphs, and twice the same bucketed path
    eagerly; ``steps`` train steps each on the same micro-batches. Per step: hidden states of the
    first micro-batch before the update (graph vs eager, bit-equal), gradient differences. All on
    the trainer's stream (``trainer_stream``), as ``mgrpo train`` runs."""
    from model_bridge.parallel import init_parallel

    from megatron_grpo.engine.graphs import trainer_stream

    init_parallel(seed=1234)
    with trainer_stream():
        return _graph_vs_eager(hf_dir, budget, steps)


def _graph_vs_eager(hf_dir: str, budget: int, steps: int) -> dict:
    from megatron_grpo.engine.forward import _graphed_forward
    from megatron_grpo.engine.graphs import enable_graphs
    from megatron_grpo.engine.setup import build_engine, unwrapped
    from megatron_grpo.engine.step import StepConfig, forward_backward, optimizer_update
    from model_bridge.config import ParallelLayout

    engines = [build_engine(hf_dir, ParallelLayout(), dtype=torch.bfloat16) for _ in range(3)]
    g = enable_graphs(engines[0], True, budget, backend="torch")
    assert g is not None, engines[0].graphs_fallback
    for e in engines[1:]:
        e.graphs = EagerBuckets(unwrapped(e.model[0]), budget)
    mbs = _microbatches(engines[0], hf_dir, budget)
    cfg = StepConfig()
    res = {"equal_hidden": [], "graph_vs_eager": [], "eager_vs_eager": [], "loss": []}

    def grads(e):
        return [p.main_grad.detach().float().clone() for p in e.model[0].parameters() if p.requires_grad]

    def rel(a, b):
        return max(float((x - y).norm() / y.norm().clamp_min(1e-30)) for x, y in zip(a, b))

    for step in range(1, steps + 1):
        if step > 1:  # the graphs exist from step 1's forward_backward on
            m = mbs[0].to("cuda")
            with torch.no_grad():
                hs = [_graphed_forward(e.graphs, unwrapped(e.model[0]), mbs[0], m) for e in engines[:2]]
            res["equal_hidden"].append(bool(torch.equal(hs[0], hs[1])))
        gs, losses = [], []
        for e in engines:
            for c in e.model:
                c.zero_grad_buffer()
            e.optimizer.zero_grad()
            losses.append(forward_backward(e, mbs, cfg)["loss"])
            gs.append(grads(e))
            optimizer_update(e, None, step)
        res["graph_vs_eager"].append(rel(gs[0], gs[1]))
        res["eager_vs_eager"].append(rel(gs[2], gs[1]))
        res["loss"].append(losses)
    res["replays"], res["buckets"] = g.replays, sorted(g.graphed)
    return res


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphs_match_eager_over_three_steps(tiny_ckpt):
    res = run_ranks(_graph_vs_eager_rank, 1, str(tiny_ckpt), 512, timeout=600)[0]
    assert res["replays"] >= 6 and res["buckets"], res
    assert all(res["equal_hidden"]), res
    for gv, ee in zip(res["graph_vs_eager"], res["eager_vs_eager"]):
        assert gv <= max(4 * ee, 1e-3), res
    for lg, le, le2 in res["loss"]:
        assert lg == pytest.approx(le, rel=1e-3, abs=1e-6), res


def _pool_blocks_nothing_holds_rank(hf_dir: str, budget: int) -> dict:
    """On a fresh trainer stream (no GEMM has run on it yet, in this thread or in autograd's), one
    step with graphs; then the live blocks of the graphs' private pool that no Python-reachable
    tensor's storage covers: memory something outside the graphs (a library's cached workspace)
    took during a capture and keeps using."""
    import gc

    from megatron_grpo.engine.graphs import enable_graphs, trainer_stream
    from megatron_grpo.engine.setup import build_engine
    from megatron_grpo.engine.step import StepConfig, forward_backward
    from model_bridge.config import ParallelLayout
    from model_bridge.parallel import init_parallel

    init_parallel(seed=1234)
    with trainer_stream():
        engine = build_engine(hf_dir, ParallelLayout(), dtype=torch.bfloat16)
        g = enable_graphs(engine, True, budget, backend="torch")
        loss = forward_backward(engine, _microbatches(engine, hf_dir, budget), StepConfig())["loss"]
        torch.cuda.synchronize()
    held = set()
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.is_cuda:
            st = o.untyped_storage()
            held.add((st.data_ptr(), st.nbytes()))
    orphans, live = [], 0
    for seg in torch.cuda.memory._snapshot()["segments"]:
        if tuple(seg.get("segment_pool_id", ())) != tuple(g.pool):
            continue
        for b in seg["blocks"]:
            if b["state"] != "active_allocated":
                continue
            live += 1
            # a block is rounded up (512 B at least): held when a storage overlaps it
            if not any(p < b["address"] + b["size"] and b["address"] < p + n for p, n in held):
                orphans.append((hex(b["address"]), b["size"]))
    return {"orphans": orphans, "live": live, "replays": g.replays, "loss": loss}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_capture_leaves_no_library_workspace_in_the_graph_pool(tiny_ckpt):
    res = run_ranks(_pool_blocks_nothing_holds_rank, 1, str(tiny_ckpt), 512, timeout=600)[0]
    assert res["replays"] >= 2 and res["live"] > 0, res  # the graphs' static outputs are live
    assert res["orphans"] == [], res


def test_enable_graphs_logs_the_fallback_reason(caplog):
    from types import SimpleNamespace

    from megatron_grpo.engine.graphs import enable_graphs
    from model_bridge.config import ParallelLayout

    engine = SimpleNamespace(layout=ParallelLayout(), spec=SimpleNamespace(text=SimpleNamespace(head_dim=128)),
                             dtype=torch.bfloat16, graphs=object(), graphs_fallback=None)
    assert enable_graphs(engine, False, 4096) is None and engine.graphs is None
    with caplog.at_level(logging.INFO, logger="megatron_grpo.engine.graphs"):
        assert enable_graphs(engine, True, 4096, backend="local") is None
    assert engine.graphs_fallback == ("no CUDA device (graphs are a GPU feature)" if not
                                                    torch.cuda.is_available() else
                                                    "layer-spec backend 'local': only the 'torch' backend's layers "
                                                    "run without host syncs")
    assert caplog.messages == [f"trainer.cuda_graphs: micro-batches run eagerly: {engine.graphs_fallback}"]


def test_enable_graphs_logs_the_bucket_shapes_where_they_apply(caplog, monkeypatch):
    from types import SimpleNamespace

    from megatron_grpo.engine import graphs, setup

    thinker = object()
    monkeypatch.setattr(graphs, "graph_fallback_reason", lambda **kw: None)  # a configuration graphs apply to
    monkeypatch.setattr(setup, "unwrapped", lambda m: m)
    engine = SimpleNamespace(layout=SimpleNamespace(tp=1, pp=1, ep=1), dtype=torch.bfloat16, model=[thinker],
                             spec=SimpleNamespace(text=SimpleNamespace(head_dim=128)), graphs=None,
                             graphs_fallback="stale")
    with caplog.at_level(logging.INFO, logger="megatron_grpo.engine.graphs"):
        g = graphs.enable_graphs(engine, True, 4096)
    assert engine.graphs is g and g.thinker is thinker and g.buckets == [1024, 2048, 3072, 4096]
    assert engine.graphs_fallback is None
    assert caplog.messages == ["trainer.cuda_graphs: on, bucket shapes [1024, 2048, 3072, 4096] tokens"]


@pytest.mark.parametrize("setting,budget,on", [
    ("auto", 4096, True), ("auto", 2048, True), ("auto", 4097, False), ("auto", 65536, False),
    ("auto", "auto", False), (True, "auto", True), (True, 65536, True), (False, 1024, False),
])
def test_auto_turns_graphs_on_at_small_budgets_only(setting, budget, on, caplog, monkeypatch):
    from megatron_grpo.config import load_train_config
    from megatron_grpo.engine import graphs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the log line is for GPU runs
    cfg = load_train_config(None, [f"trainer.cuda_graphs={str(setting).lower()}",
                                     f"packing.max_tokens_per_microbatch={budget}"])
    assert cfg.trainer.cuda_graphs == setting and cfg.packing.max_tokens_per_microbatch == budget
    with caplog.at_level(logging.INFO, logger="megatron_grpo.engine.graphs"):
        assert graphs.graphs_wanted(cfg.trainer.cuda_graphs, cfg.packing.max_tokens_per_microbatch) is on
    assert caplog.messages == ([] if on or setting is False else
                               [f"trainer.cuda_graphs: auto: off at a token budget of {budget} (graphs pay at budgets "
                                f"of at most {graphs.AUTO_MAX_BUDGET} tokens, where eager micro-batches are "
                                "host-bound; trainer.cuda_graphs=true turns them on)"])


def test_auto_stays_off_where_graphs_cannot_apply(caplog, monkeypatch):
    from megatron_grpo.engine import graphs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    why = graphs.graph_fallback_reason(cuda=True, ep=2)
    with caplog.at_level(logging.INFO, logger="megatron_grpo.engine.graphs"):
        assert graphs.graphs_wanted("auto", 4096, why) is False
        assert graphs.graphs_wanted(True, 4096, why) is True  # asked for: enable_graphs warns with the reason
    assert caplog.messages == [f"trainer.cuda_graphs: auto: off: {why}"]


def test_an_auto_choice_that_cannot_apply_is_not_a_warning(caplog, monkeypatch):
    from types import SimpleNamespace

    from megatron_grpo.engine import graphs
    from model_bridge.config import ParallelLayout

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    engine = SimpleNamespace(layout=ParallelLayout(), spec=SimpleNamespace(text=SimpleNamespace(head_dim=10)),
                             dtype=torch.bfloat16, graphs=None, graphs_fallback=None)
    with caplog.at_level(logging.INFO, logger="megatron_grpo.engine.graphs"):
        graphs.enable_graphs(engine, True, 4096, backend="torch", requested=False)
        graphs.enable_graphs(engine, True, 4096, backend="torch")
    assert [r.levelname for r in caplog.records] == ["INFO", "WARNING"]
    assert caplog.messages[0] == f"trainer.cuda_graphs: micro-batches run eagerly: {engine.graphs_fallback}"
    assert "head size 10" in engine.graphs_fallback


def test_cuda_graphs_setting_names_its_choices():
    from megatron_grpo.config import TrainConfig, load_train_config
    from megatron_grpo.configtree import ConfigKeyError

    assert TrainConfig().trainer.cuda_graphs == "auto"
    with pytest.raises(ConfigKeyError, match=r"trainer\.cuda_graphs: 'sometimes' fits none of"):
        load_train_config(None, ["trainer.cuda_graphs=sometimes"])
