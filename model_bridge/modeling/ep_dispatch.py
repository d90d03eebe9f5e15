"""Expert-parallel token exchange that sends each token once per destination rank (torch backend).

Shape legend: ``T`` tokens on this rank, ``h`` hidden size, ``E`` experts, ``P`` expert-parallel
ranks, ``El = E / P`` experts per rank (rank q holds experts ``[q * El, (q + 1) * El)``, megatron's
layout), ``k`` the router's top-k, ``kl = min(k, El)`` the most rows one token can have on one
rank, ``Ns`` / ``Nr`` tokens this rank sends / receives (summed over ranks), ``R`` the routed
rows (token, local expert) this rank's experts compute.

megatron's all-to-all dispatcher sends one row per (token, expert) pair: with top-8 routing over
2 ranks that is ~4 copies of a token to each rank, ~16 MB per 1,000 tokens and layer on the wire
each way. Here each token goes once to each rank that holds any of its experts, with the slice of
its routing it needs there (the idea of DeepEP's dispatch):

1. ``dispatch_preprocess``: the destinations of every token (``[T, P]``), the count of tokens
   and of rows per local expert for each destination, one small all-to-all of those counts and
   **one** host read of them (megatron's dispatcher reads its splits too); then the tokens in
   destination-major order and their ``[probs | mask]`` slice for that rank ``[Ns, 2 El]``;
2. ``token_dispatch``: two all-to-alls (the tokens, and probabilities with the mask);
3. ``dispatch_postprocess``: the received tokens expanded into rows sorted by local expert (then
   by arrival, megatron's order), with their probabilities and the per-expert counts;
4. ``combine_preprocess``: each received token's rows summed (fp32) into one row, so
5. ``token_combine`` sends one row per token and destination back, and
6. ``combine_postprocess`` sums each token's returned rows over the ranks (fp32).

Gathers and sums are the autograd pairs of one another (a gather's backward is a gather-sum and
back), with no atomics; the all-to-alls are megatron's differentiable ``all_to_all``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .permute import _CombineRows, _GatherRows, gather_rows

__all__ = ["DedupExchange"]


def _slot_table(rows_n: torch.Tensor, slot_n: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """int64 ``[n * k]``: at ``t * k + slot`` the row that holds token ``t``'s ``slot``, else -1."""
    inv = torch.full((n * k,), -1, dtype=torch.int64, device=rows_n.device)
    inv[rows_n * k + slot_n] = torch.arange(rows_n.numel(), device=rows_n.device)
    return inv


class DedupExchange:
    """One MoE layer call's exchange state (build one per forward in ``dispatch_preprocess``)."""

    def __init__(self, group, num_local_experts: int, topk: int):
        self.group = group
        self.P = dist.get_world_size(group)
        self.El = num_local_experts
        self.kl = min(topk, num_local_experts)

    # 1. ------------------------------------------------------------------------------------------
    def preprocess(self, x_Th: torch.Tensor, routing_map_TE: torch.Tensor, probs_TE: torch.Tensor):
        from megatron.core.tensor_parallel.mappings import all_to_all

        T, P, El = x_Th.shape[0], self.P, self.El
        mask_TPl = routing_map_TE.view(T, P, El)
        dest_TP = mask_TPl.any(-1)
        counts_send_PC = torch.cat([dest_TP.sum(0).unsqueeze(1), mask_TPl.sum(0)], 1)  # [P, 1 + El]
        counts_recv_PC = all_to_all(self.group, counts_send_PC.contiguous())
        host = torch.stack([counts_send_PC, counts_recv_PC]).cpu()  # the one host sync of the layer
        self.send_splits = host[0, :, 0].tolist()
        self.recv_splits = host[1, :, 0].tolist()
        self.tokens_per_expert = host[1, :, 1:].sum(0)  # [El] on the host, as megatron hands it over
        self.R = int(self.tokens_per_expert.sum())
        Ns = sum(self.send_splits)

        pairs_N2 = torch.nonzero_static(dest_TP.t(), size=Ns)  # (q, t), destination-major
        self.send_t = pairs_N2[:, 1].contiguous()
        send_q = pairs_N2[:, 0]
        self.inv_src = _slot_table(self.send_t, send_q, T, P)  # token t's copy for rank q
        x_send = _GatherRows.apply(x_Th, self.send_t, self.inv_src, P, True)
        probs_NL = probs_TE.view(T, P, El)[self.send_t, send_q]  # [Ns, El]
        mask_NL = mask_TPl[self.send_t, send_q].to(probs_NL.dtype)
        return x_send, torch.cat([probs_NL, mask_NL], 1)

    # 2. / 5. -------------------------------------------------------------------------------------
    def send(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import all_to_all

        return all_to_all(self.group, x, self.recv_splits, self.send_splits)

    def send_back(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import all_to_all

        return all_to_all(self.group, x, self.send_splits, self.recv_splits)

    # 3. ------------------------------------------------------------------------------------------
    def expand(self, x_recv: torch.Tensor, pm_recv: torch.Tensor):
        """Received tokens ``[Nr, h]`` and ``[probs | mask]`` ``[Nr, 2 El]`` -> rows sorted by local
        expert ``[R, h]``, their probabilities ``[R]`` and the host counts per local expert."""
        El, kl = self.El, self.kl
        probs_NL, mask_NL = pm_recv[:, :El], pm_recv[:, El:] > 0.5
        Nr = x_recv.shape[0]
        pairs_R2 = torch.nonzero_static(mask_NL.t(), size=self.R)  # (expert, token): megatron's order
        expert_R, self.rows_n = pairs_R2[:, 0], pairs_R2[:, 1].contiguous()
        slot_R = (mask_NL.to(torch.int32).cumsum(1) - 1)[self.rows_n, expert_R]  # < kl
        self.inv_rows = _slot_table(self.rows_n, slot_R.to(torch.int64), Nr, kl)
        rows = gather_rows(x_recv, self.rows_n, self.inv_rows, kl, True)
        return rows, self.tokens_per_expert, probs_NL[self.rows_n, expert_R]

    # 4. ------------------------------------------------------------------------------------------
    def reduce_rows(self, y_rows: torch.Tensor) -> torch.Tensor:
        """Expert outputs ``[R, h]`` -> one row per received token ``[Nr, h]``."""
        return _CombineRows.apply(y_rows, self.inv_rows, self.rows_n, self.kl, True)

    # 6. ------------------------------------------------------------------------------------------
    def reduce_ranks(self, y_back: torch.Tensor) -> torch.Tensor:
        """Returned partial outputs ``[Ns, h]`` -> ``[T, h]`` (sum over the ranks)."""
        return _CombineRows.apply(y_back, self.inv_src, self.send_t, self.P, True)
