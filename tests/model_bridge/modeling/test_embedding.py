"""model_bridge/modeling/embedding.py: the sorted-segment embedding backward (Triton's interpreter
on CPU tensors, and the GPU) against an fp64 scatter-add, and the switch of megatron's embedding."""
from __future__ import annotations

import pytest
import torch

from model_bridge.spawn import run_ranks
from megatron_grpo.testing.interpreted import run_interpreted

def _grad_cases(device: str) -> dict:
    """Per case: (max |ours - fp64 scatter-add| in units of the output dtype's rounding at the
    row's scale, bit-identical across two runs, rows no id hits all zero)."""
    from model_bridge.modeling.embedding import sorted_embedding

    g = torch.Generator().manual_seed(0)
    out = {}
    # many repeats of few ids (runs within and across windows of RUN_WINDOW sorted positions), one id
    # throughout, one dominant id among short runs (a micro-batch of audio placeholders), all ids
    # distinct, a width over one block, and no tokens
    for dtype in (torch.float32, torch.bfloat16):
        for T, V, H in ((200, 7, 24), (1000, 3, 24), (300, 1, 40), (700, -50, 24), (50, 400, 24), (33, 20, 1500),
                        (0, 9, 8)):
            if V < 0:  # id 0 for 80% of the tokens, the rest spread over -V ids
                V = -V
                ids = torch.where(torch.rand(1, T, generator=g) < 0.8, 0, torch.randint(1, V, (1, T), generator=g))
            elif V < T:
                ids = torch.randint(0, V, (1, T), generator=g)
            else:
                ids = torch.randperm(V, generator=g)[:T].view(1, T)
            w0 = torch.randn(V, H, generator=g).to(dtype)
            go = torch.randn(1, T, H, generator=g).to(dtype)
            grads = []
            for _ in range(2):
                w = w0.to(device).clone().requires_grad_()
                y = sorted_embedding(ids.to(device), w)
                assert torch.equal(y.cpu(), w0[ids])
                y.backward(go.to(device))
                grads.append(w.grad.cpu())
            ref = torch.zeros(V, H, dtype=torch.float64).index_add_(0, ids.view(-1), go.view(T, H).double())
            ulp = torch.finfo(dtype).eps * ref.abs().amax(1, keepdim=True).clamp_min(1.0)
            hit = torch.zeros(V, dtype=torch.bool)
            hit[ids.view(-1)] = True
            out[f"{str(dtype).split('.')[-1]}-{T}x{V}x{H}"] = (
                float(((grads[0].double() - ref).abs() / ulp).max()) if T else 0.0,
                torch.equal(grads[0], grads[1]), bool((grads[0][~hit] == 0).all()))
    return out


def _check(res: dict) -> None:
    for case, (ulps, same, zeros) in res.items():
        # fp32 sums of up to 1,000 rows, then one rounding to the output dtype
        assert ulps < 8 and same and zeros, (case, ulps, same, zeros)


def test_sorted_embedding_backward_interpreted():
    from model_bridge.modeling.embedding import _triton_embed_bwd_kernel

    res = run_interpreted(_triton_embed_bwd_kernel, _grad_cases, "cpu")
    print(f"\n[sorted embedding backward, interpreted] {res}")
    _check(res)


def test_sorted_embedding_falls_back_to_torch_on_cpu():
    """Without the kernel (plain CPU tensors) it is ``F.embedding``, gradient included."""
    from model_bridge.modeling.embedding import sorted_embedding

    w = torch.randn(11, 4, requires_grad=True)
    ids = torch.tensor([[3, 3, 0, 10]])
    y = sorted_embedding(ids, w)
    assert y.grad_fn.name() == "EmbeddingBackward0"
    y.sum().backward()
    assert torch.equal(w.grad[3], torch.full((4,), 2.0)) and torch.equal(w.grad[1], torch.zeros(4))


def _rank_switch() -> dict:
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
    from megatron.core.transformer.transformer_config import TransformerConfig

    from model_bridge.modeling import embedding as emb_mod
    from model_bridge.parallel import destroy_parallel, init_parallel

    init_parallel(seed=1)
    try:
        cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
        emb = VocabParallelEmbedding(16, 8, init_method=torch.nn.init.normal_, config=cfg)
        keys = list(emb.state_dict())
        calls = []
        orig = emb_mod.sorted_embedding
        emb_mod.sorted_embedding = lambda i, w: calls.append(1) or orig(i, w)
        try:
            same = emb_mod.use_sorted_embedding_backward(emb)
            ids = torch.tensor([[1, 5, 5]])
            res = {"same": same is emb, "isinstance": isinstance(emb, VocabParallelEmbedding),
                   "keys": list(emb.state_dict()) == keys, "lookup": torch.equal(emb(ids), emb.weight[ids]),
                   "calls": len(calls)}
            emb.reduce_scatter_embeddings = True  # a layout megatron handles itself: its own forward
            res["plain_with_reduce_scatter"] = emb_mod._plain_lookup(emb)
        finally:
            emb_mod.sorted_embedding = orig
        cls = type(emb)
        res["idempotent"] = type(emb_mod.use_sorted_embedding_backward(emb)) is cls
        try:
            emb_mod.use_sorted_embedding_backward(torch.nn.Embedding(4, 2))
            res["refused"] = None
        except TypeError as e:
            res["refused"] = str(e)
        return res
    finally:
        destroy_parallel()


def test_megatron_embedding_switch():
    """The switch keeps megatron's instance, parameters and state dict; at TP1 the forward is the
    sorted embedding, with a layout megatron handles itself its own; it refuses other modules."""
    res = run_ranks(_rank_switch, 1, timeout=300)[0]
    assert res == {"same": True, "isinstance": True, "keys": True, "lookup": True, "calls": 1,
                   "plain_with_reduce_scatter": False, "idempotent": True,
                   "refused": "use_sorted_embedding_backward: expected megatron's VocabParallelEmbedding, got Embedding"}


@pytest.mark.gpu
def test_sorted_embedding_backward_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    res = _grad_cases("cuda")
    print(f"\n[sorted embedding backward, GPU] {res}")
    for case, (ulps, same, zeros) in res.items():
        assert ulps < 8 and same and zeros, (case, ulps, same, zeros)


def test_the_thinker_calls_the_lookup_directly_only_when_megatron_would_add_nothing():
    """``_lookup_only``: every megatron feature that changes the embedding output keeps its module
    (the thinker-vs-HF parity tests check the direct call's numbers)."""
    from types import SimpleNamespace

    from model_bridge.modeling.thinker import _lookup_only

    def emb(**kw):
        cfg = SimpleNamespace(sequence_parallel=kw.pop("sp", False), fp32_residual_connection=kw.pop("fp32", False),
                              use_mup=kw.pop("mup", False), mup_embedding_mult=kw.pop("mult", 1.0))
        e = SimpleNamespace(config=cfg, embedding_dropout=torch.nn.Dropout(kw.pop("p", 0.0)), training=kw.pop("train", True),
                            add_position_embedding=kw.pop("pos", False), tokentype_embeddings=kw.pop("tt", None),
                            reduce_scatter_embeddings=kw.pop("rs", False))
        assert not kw
        return e

    assert _lookup_only(emb())
    assert _lookup_only(emb(p=0.1, train=False)) and _lookup_only(emb(mup=True, mult=1.0))
    for kw in ({"p": 0.1}, {"pos": True}, {"tt": object()}, {"rs": True}, {"sp": True}, {"fp32": True},
               {"mup": True, "mult": 2.0}):
        assert not _lookup_only(emb(**kw)), kw
