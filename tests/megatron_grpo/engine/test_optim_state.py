"""The optimizer's fully_reshardable state built one bucket at a time (``engine/optim_state.py``).

Two gloo ranks train two steps and save, once with our builder and once with megatron's own
(``DistributedOptimizer.sharded_param_state_fully_reshardable``), from the same deterministic run:
the two checkpoints hold the same tensors bit for bit, and with ours both DP ranks write a share
of the optimizer state (megatron's builder has DP rank 0 write all of it).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_bridge.spawn import run_ranks

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def _save_both(hf_dir: str, root: str, layout: dict) -> None:
    import contextlib

    from test_checkpoint import _train_steps

    import megatron_grpo.engine.checkpoint as ck
    from model_bridge.parallel import destroy_parallel

    _train_steps(hf_dir, f"{root}/ours", 2, save_at=(2,), layout=layout)
    destroy_parallel(destroy_process_group=False)
    ck.light_fully_reshardable = lambda optimizer: contextlib.nullcontext()  # megatron's builder
    _train_steps(hf_dir, f"{root}/megatron", 2, save_at=(2,), layout=layout)
    destroy_parallel()


def _optimizer_bytes_per_rank(ckpt: Path) -> dict[int, int]:
    """Bytes of optimizer state each rank wrote (torch DCP metadata: the storage of every item;
    rank r's files are ``__<r>_<writer thread>.distcp``)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(ckpt)).read_metadata()
    out: dict[int, int] = {}
    for index, info in meta.storage_data.items():
        if index.fqn.startswith("optimizer.state."):
            rank = int(info.relative_path.split("_")[2])
            out[rank] = out.get(rank, 0) + info.length
    return out


@pytest.fixture(scope="module")
def hf_dir():
    from conftest import build_cached_tiny

    return str(build_cached_tiny())


@pytest.mark.parametrize("layout", [{}, {"ep": 2}], ids=["dp2", "ep2"])
def test_bucketwise_state_equals_megatrons_and_every_dp_rank_writes(hf_dir, tmp_path, layout):
    from test_checkpoint_layouts import _stored

    run_ranks(_save_both, 2, hf_dir, str(tmp_path), layout, timeout=300, env=CPU_ONLY)
    ours = tmp_path / "ours" / "checkpoints" / "step_00000002"
    theirs = tmp_path / "megatron" / "checkpoints" / "step_00000002"
    a, b = _stored(ours), _stored(theirs)
    opt = sorted(k for k in b if k.startswith("optimizer.state."))
    assert opt and {k.split(".")[2] for k in opt} == {"param", "exp_avg", "exp_avg_sq"}
    assert sorted(a) == sorted(b)
    bad = [k for k in b if not torch.equal(a[k], b[k])]
    assert not bad, f"{len(bad)} tensors differ from megatron's builder, e.g. {bad[:3]}"
    assert any(float(b[k].abs().max()) > 0 for k in opt if ".exp_avg." in k)  # a trained state
    shares = _optimizer_bytes_per_rank(ours)
    total = sum(shares.values())
    assert len(shares) == 2 and min(shares.values()) > 0.25 * total, shares
    if not layout:  # pure DP: megatron's builder has DP rank 0 write every optimizer tensor
        assert len(_optimizer_bytes_per_rank(theirs)) == 1
