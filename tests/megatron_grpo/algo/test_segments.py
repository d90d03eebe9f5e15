"""Per-sample segments of a packed micro-batch from its offsets, and the losses that use them."""
from __future__ import annotations

import torch

from megatron_grpo.algo.importance import ISConfig, importance_weights
from megatron_grpo.algo.losses import LossConfig, policy_loss
from megatron_grpo.algo.segments import packed_segment_ids, segment_ids, segment_sum
from megatron_grpo.packing import PackLimits, build_microbatch


def _packed():
    """A micro-batch of three samples (global ids 7, 2, 5) and a padding segment."""
    g = torch.Generator().manual_seed(0)
    lens = {7: 5, 2: 9, 5: 4}
    ids = {i: torch.randint(0, 100, (n,), generator=g) for i, n in lens.items()}
    masks = {i: torch.cat([torch.zeros(1, dtype=torch.long), (torch.rand(n - 1, generator=g) > 0.3).long()])
             for i, n in lens.items()}
    mb = build_microbatch([7, 2, 5], ids, masks, PackLimits(max_tokens_per_microbatch=24, pad_multiple=24))
    assert mb.num_padding_tokens > 0
    return mb, g


def test_packed_segments_group_the_tokens_as_the_sample_ids_do():
    mb, g = _packed()
    T = mb.num_tokens
    inv_T, G = packed_segment_ids(mb.cu_seqlens_S, T)
    ref_T, G_ref = segment_ids(mb.sample_index_T)
    assert G == G_ref == 4
    # the same partition of the tokens (segment order may differ from sorted ids)
    pairs = set(zip(inv_T.tolist(), ref_T.tolist()))
    assert len(pairs) == G and len({a for a, _ in pairs}) == G and len({b for _, b in pairs}) == G
    x_T = torch.randn(T, generator=g, dtype=torch.float64)
    assert sorted(segment_sum(x_T, inv_T, G).tolist()) == sorted(segment_sum(x_T, ref_T, G_ref).tolist())


def test_grpo_sequence_mean_and_sequence_is_with_packed_segments_match_the_sample_ids():
    """GRPO's per-sample mean and sequence-level IS through the offsets' segments give the loss,
    its gradient and the metrics of the ``torch.unique`` path (to float64 rounding)."""
    mb, g = _packed()
    T = mb.num_tokens
    mask_T = mb.loss_mask_T.bool()
    old_T = -torch.rand(T, generator=g, dtype=torch.float64)
    rollout_T = old_T + 0.05 * torch.randn(T, generator=g, dtype=torch.float64)
    adv_T = torch.randn(T, generator=g, dtype=torch.float64)
    seg = packed_segment_ids(mb.cu_seqlens_S, T)
    out = []
    for segments in (None, seg):
        lp_T = (old_T + 0.1 * torch.randn(T, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
                ).requires_grad_(True)
        isr = importance_weights(old_T, rollout_T, mask_T, mb.sample_index_T, config=ISConfig(mode="tis",
                                 level="sequence"), global_num_tokens=20.0, global_num_samples=3.0, segments=segments)
        loss, metrics = policy_loss(lp_T, old_T, adv_T, isr.keep_mask_T, mb.sample_index_T, config=LossConfig(),
                                    global_num_tokens=20.0, global_num_samples=3.0, is_weights_T=isr.weights_T,
                                    segments=segments)
        loss.backward()
        out.append((loss.detach(), lp_T.grad, isr.weights_T, {**metrics, **isr.metrics}))
    (l0, g0, w0, m0), (l1, g1, w1, m1) = out
    assert torch.allclose(l0, l1, rtol=1e-12, atol=0) and torch.allclose(g0, g1, rtol=1e-12, atol=1e-15)
    assert torch.equal(w0, w1)
    assert m0.keys() == m1.keys() and all(torch.allclose(m0[k], m1[k], rtol=1e-12) for k in m0)
