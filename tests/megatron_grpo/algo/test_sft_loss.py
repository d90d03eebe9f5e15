"""The SFT loss: token-mean NLL over the step's loss tokens, split exactly across micro-batches."""
import torch

from megatron_grpo.algo.sft import sft_loss


def test_shares_add_up_to_the_token_mean_nll_and_its_gradient():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(12, generator=g, dtype=torch.float64) * 3
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0, 0, 1, 0, 1], dtype=torch.bool)
    whole = lp.clone().requires_grad_()
    loss, m = sft_loss(whole, mask, global_num_tokens=int(mask.sum()))
    loss.backward()
    assert loss.item() == -(lp[mask].sum() / mask.sum()).item()
    torch.testing.assert_close(whole.grad, mask.to(torch.float64) * (-1.0 / 7), rtol=0, atol=1e-15)
    assert m["tokens"].item() == 7 and m["nll"].item() == loss.item()
    parts = [lp[:5].clone().requires_grad_(), lp[5:].clone().requires_grad_()]
    shares = [sft_loss(x, k, global_num_tokens=7)[0] for x, k in zip(parts, (mask[:5], mask[5:]))]
    torch.testing.assert_close(sum(shares), loss.detach(), rtol=0, atol=1e-15)
