"""Asynchronous checkpoints' pieces: the host snapshot of the write buckets and the setting.

The whole path (save in the background, the write held until the next step changed every
parameter, a bit-identical resume) is ``test_resume_is_bit_identical_world2_from_an_async_save`` in
test_checkpoint.py; ``mgrpo train`` with it is ``test_embedded_default_learns_checkpoints_and_resumes``.
"""
from __future__ import annotations

import io

import pytest
import torch

from megatron_grpo.config import CheckpointSection
from megatron_grpo.engine.checkpoint_async import snapshot_write_buckets


def _buckets(device: str):
    a = torch.arange(12, dtype=torch.float32, device=device).reshape(3, 4)
    b = torch.randn(5, dtype=torch.bfloat16, device=device)
    blob = io.BytesIO(b"pickled object")
    return [("/x/__0_0.distcp", "__0_0.distcp", ([("obj", blob)], [("a", a), ("b", b)]))], (a, b, blob)


def test_cpu_tensors_become_copies_of_that_moment():
    buckets, (a, b, blob) = _buckets("cpu")
    want_a, want_b = a.clone(), b.clone()
    ((path, name, (bytes_data, tensor_data)),) = snapshot_write_buckets(buckets)
    a.add_(1.0)  # the next step changes the live tensors in place (at DP 1: the optimizer's own)
    b.mul_(2.0)
    assert (path, name) == ("/x/__0_0.distcp", "__0_0.distcp")
    assert bytes_data[0][1] is blob
    assert [item for item, _ in tensor_data] == ["a", "b"]
    (_, ca), (_, cb) = tensor_data
    assert torch.equal(ca, want_a) and torch.equal(cb, want_b) and cb.dtype == torch.bfloat16


@pytest.mark.gpu
def test_device_tensors_become_pinned_host_copies_of_that_moment():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (run on the GPU machine)")
    buckets, (a, b, _) = _buckets("cuda")
    want_a, want_b = a.cpu(), b.cpu()
    ((_, _, (_, tensor_data)),) = snapshot_write_buckets(buckets)
    a.add_(1.0)  # the next step changes the live tensors in place
    b.mul_(2.0)
    (_, ca), (_, cb) = tensor_data
    assert ca.device.type == "cpu" and ca.is_pinned() and cb.is_pinned()
    assert torch.equal(ca, want_a) and torch.equal(cb, want_b) and cb.dtype == torch.bfloat16


def test_async_save_setting():
    assert CheckpointSection().async_save == "auto"
    with pytest.raises(ValueError, match=r"^checkpoint.async_save must be true, false or auto, got 'yes'$"):
        CheckpointSection(async_save="yes")
