"""Skipped steps name the parameters whose gradients are not finite (engine/nonfinite.py)."""
import logging

import pytest
import torch

from megatron_grpo.engine.nonfinite import (MAX_NAMED, NonFiniteGradError, NonFiniteSkips, log_nonfinite,
                                            nonfinite_grads)


class _Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight2 = torch.nn.Parameter(torch.zeros(10, 4, 3))


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = _Experts()
        self.proj = torch.nn.Linear(3, 2)


class _Wrapper(torch.nn.Module):
    """Named like megatron's DDP(Float16Module(model)): parameters under ``module.module.``."""

    def __init__(self, inner):
        super().__init__()
        self.module = inner


def _model():
    inner = torch.nn.Module()
    inner.layers = torch.nn.ModuleList([_Layer(), _Layer()])
    model = _Wrapper(_Wrapper(inner))
    for p in model.parameters():  # megatron's fp32 grad-buffer views; .grad stays None
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    return model


def test_names_parameters_and_runs_of_experts():
    model = _model()
    w2 = model.module.module.layers[1].experts.weight2
    w2.main_grad[2:5, 1, 0] = float("nan")
    w2.main_grad[7, 3, 2] = float("inf")
    model.module.module.layers[0].proj.bias.main_grad[1] = float("-inf")
    assert nonfinite_grads([model]) == ["layers.0.proj.bias", "layers.1.experts.weight2 (local experts 2-4, 7)"]
    for p in model.parameters():
        p.main_grad.zero_()
    assert nonfinite_grads([model]) == []


def test_plain_grads_when_there_is_no_main_grad():
    lin = torch.nn.Linear(2, 2)
    lin(torch.tensor([[float("nan"), 1.0]])).sum().backward()
    assert nonfinite_grads([lin]) == ["weight"]  # the bias's gradient is 1 per row: finite


def test_log_line_and_the_error_name_them(caplog):
    model = _model()
    for layer in model.module.module.layers:
        layer.experts.weight2.main_grad[0] = float("nan")
        layer.proj.weight.main_grad.fill_(float("nan"))
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.engine.nonfinite"):
        names = log_nonfinite([model], float("nan"), step=5, rank=1)
    assert names == ["layers.0.experts.weight2 (local experts 0)", "layers.0.proj.weight",
                     "layers.1.experts.weight2 (local experts 0)", "layers.1.proj.weight"]
    assert caplog.messages == [
        "step 5: update skipped (grad norm nan); non-finite gradients on rank 1 in "
        "layers.0.experts.weight2 (local experts 0); layers.0.proj.weight; "
        "layers.1.experts.weight2 (local experts 0); layers.1.proj.weight"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.engine.nonfinite"):
        assert log_nonfinite([_model()], float("inf")) == []
    assert caplog.messages == ["update skipped (grad norm inf); every gradient is finite (another rank's are not)"]

    skips = NonFiniteSkips(2)
    many = [f"p{i}" for i in range(MAX_NAMED + 3)]
    skips.record(True, float("nan"), 4, many)
    with pytest.raises(NonFiniteGradError) as e:
        skips.record(True, float("nan"), 5, many)
    assert (f"(at step 5). The last one's non-finite gradients on this rank: "
            f"{'; '.join(many[:MAX_NAMED])} and 3 more. Lower the LR") in str(e.value)
