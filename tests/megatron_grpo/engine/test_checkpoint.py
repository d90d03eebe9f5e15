"""Checkpoints: exact resume, keep-last-K rotation, incomplete saves ignored, preemption by signal.

Resume determinism uses the engine's own pieces (``engine.setup.build_engine``: tiny thinker from
the HF checkpoint, megatron DDP, distributed Adam, cosine LR schedule; ``engine.step.train_step``)
on real gloo ranks. Each step's data is drawn from the global Python, NumPy and torch RNGs and a
data iterator with a position, so a resume that lost any RNG state or the data position would
train on different data and fail the bit-for-bit comparison.

Run as a script (``python test_checkpoint.py --preempt-loop RUN_DIR``) it is the tiny training loop
of the signal test.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from model_bridge.spawn import free_port, run_ranks

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
HERE = Path(__file__).resolve()
REPO = HERE.parents[3]


# ------------------------------------------------------------------------------------------------
# rank-side helpers
# ------------------------------------------------------------------------------------------------

class _Data:
    """A stand-in for the data iterator: a position, and samples drawn from the global RNGs."""

    def __init__(self, num_samples: int = 6):
        self.position = 0
        self.num_samples = num_samples

    def next_batch(self):
        import random

        import numpy as np

        from megatron_grpo.trajectory import Trajectory

        out = []
        for i in range(self.num_samples):
            n = random.randint(12, 40)  # python RNG
            ids = torch.randint(0, 400, (n,)).tolist()  # torch RNG
            mask = [0] * 5 + [1] * (n - 5)
            roll = [float(-1.0 - abs(x)) if m else 0.0 for x, m in zip(np.random.standard_normal(n), mask)]  # numpy
            out.append(Trajectory(prompt_index=self.position + i, group_id=(self.position + i) // 3,
                                  input_ids_T=ids, loss_mask_T=mask, rollout_logprobs_T=roll,
                                  advantage=float(np.random.standard_normal())))
        self.position += self.num_samples
        return out

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = int(state["position"])


def _engine(layout: dict):
    from megatron_grpo.engine.setup import OptimConfig, build_engine
    from model_bridge.parallel import init_parallel

    torch.set_num_threads(1)
    init_parallel(seed=1234, **layout)
    optim = OptimConfig(lr=1e-3, weight_decay=0.01, warmup_steps=1, lr_decay_style="cosine", decay_steps=8,
                        clip_grad=1.0, adam_eps=1e-6)
    return optim, build_engine


def _held_writer():
    """Hold every asynchronous checkpoint write until the returned event is set (a slow disk: the
    next step changes every parameter and Adam moment before the write starts)."""
    import threading

    from megatron_grpo.engine.checkpoint_async import PendingSave

    gate, write = threading.Event(), PendingSave._write

    def held(self, fn, args, kwargs):
        gate.wait(120)
        write(self, fn, args, kwargs)

    PendingSave._write = held
    return gate


def _train_steps(hf_dir: str, run_dir: str, last_step: int, *, save_at: tuple = (), resume: bool = False,
                 layout: dict | None = None, copy_to: str | None = None, async_save: bool = False) -> dict:
    """Build the engine at ``layout`` (ParallelLayout keywords), optionally resume (and save what
    was loaded again, at this layout, under ``copy_to``), train up to ``last_step`` (saving at
    ``save_at``; ``async_save``: in the background, the write held until the next step is done)."""
    import random

    import numpy as np
    from megatron.core import parallel_state as ps

    from megatron_grpo.algo.losses import LossConfig
    from megatron_grpo.engine.batch import build_train_microbatches
    from megatron_grpo.engine.checkpoint import find_latest_checkpoint, load_checkpoint, save_checkpoint
    from megatron_grpo.engine.checkpoint_async import start_checkpoint
    from megatron_grpo.engine.step import NonFiniteSkips, StepConfig, train_step
    from megatron_grpo.packing import PackLimits, plan_step
    from model_bridge.config import ParallelLayout

    layout = layout or {}
    optim, build_engine = _engine(layout)
    engine = build_engine(hf_dir, ParallelLayout(**layout), optim, dtype=torch.float32)
    # after the build: CPU weight init draws differently at different layouts, and the data of
    # every rank must be the same
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    data, skips = _Data(), NonFiniteSkips(3)
    cfg = StepConfig(loss=LossConfig(variant="grpo", entropy_coef=0.01), logprob_chunk_size=64)
    pack = PackLimits(max_tokens_per_microbatch=64, pad_multiple=2)  # one packing for every layout (SP at TP2)
    out = {"losses": {}, "lrs": {}, "grad_norms": {}, "resumed_at": None}
    start, pending, gate = 1, None, _held_writer() if async_save else None
    if resume:
        step, extra = load_checkpoint(run_dir, engine.model, engine.optimizer, engine.scheduler)
        data.load_state_dict(extra["data"])
        skips.load_state_dict(extra["skips"])
        out["resumed_at"], out["extra"], start = step, extra, step + 1
        out["params_loaded"] = {n: p.detach().clone() for n, p in engine.modules[0].named_parameters()}
        if copy_to:
            save_checkpoint(copy_to, step, engine.model, engine.optimizer, engine.scheduler, extra)
    for step in range(start, last_step + 1):
        trajs = data.next_batch()
        plan = plan_step([t.num_tokens for t in trajs], ps.get_data_parallel_world_size(), pack)
        mbs = build_train_microbatches(trajs, plan, ps.get_data_parallel_rank(), pack)
        m = train_step(engine, mbs, cfg, skips=skips, step=step)
        out["losses"][step], out["lrs"][step], out["grad_norms"][step] = m["loss"], m["lr"], m["grad_norm"]
        if pending is not None:  # the step after an asynchronous save: now let the write go
            out["latest_while_writing"] = find_latest_checkpoint(run_dir, warn=False)
            gate.set()
            out["written"] = str(pending.wait())
            pending = None
        if step in save_at:
            extra = {"data": data.state_dict(), "skips": skips.state_dict()}
            if async_save:
                pending = start_checkpoint(run_dir, step, engine.model, engine.optimizer, engine.scheduler, extra,
                                           keep_last=2)
            else:
                save_checkpoint(run_dir, step, engine.model, engine.optimizer, engine.scheduler, extra, keep_last=2)
            out["params_saved"] = {n: p.detach().clone() for n, p in engine.modules[0].named_parameters()}
    out["params"] = {n: p.detach().clone() for n, p in engine.modules[0].named_parameters()}
    out["data_position"] = data.position
    return out


def _uninterrupted_then_saved(hf_dir: str, run_dir: str, async_save: bool = False) -> dict:
    """Steps 1..3 without saving; then, from scratch in the same process, steps 1..3 saving at 2."""
    from model_bridge.parallel import destroy_parallel

    a = _train_steps(hf_dir, run_dir, 3)
    destroy_parallel(destroy_process_group=False)
    b = _train_steps(hf_dir, run_dir, 3, save_at=(2,), async_save=async_save)
    destroy_parallel()
    return {"uninterrupted": a, "saving": b}


def _resumed(hf_dir: str, run_dir: str) -> dict:
    import warnings

    from model_bridge.parallel import destroy_parallel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _train_steps(hf_dir, run_dir, 3, resume=True)
    out["warnings"] = [str(w.message) for w in caught if "checkpoint" in str(w.message)]
    destroy_parallel()
    return out


def _check_resume(world: int, hf_dir: str, run_dir: Path, async_save: bool = False) -> str:
    t0 = time.monotonic()
    first = run_ranks(_uninterrupted_then_saved, world, hf_dir, str(run_dir), async_save, timeout=240, env=CPU_ONLY)
    t1 = time.monotonic()
    second = run_ranks(_resumed, world, hf_dir, str(run_dir), timeout=240, env=CPU_ONLY)
    t2 = time.monotonic()
    ck = run_dir / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_00000002"
    meta = json.loads((ck / "step_00000002" / "mgrpo_checkpoint.json").read_text())
    assert meta["async_write"] is async_save
    if async_save:  # invisible to --resume until every rank's write is done, then complete
        for rank in range(world):
            assert first[rank]["saving"]["latest_while_writing"] is None
            assert first[rank]["saving"]["written"] == str(ck / "step_00000002")
    assert meta["step"] == 2 and meta["layout"]["world_size"] == world and meta["optimizer_sharding"] == "fully_reshardable"
    for rank in range(world):
        a, b, c = first[rank]["uninterrupted"], first[rank]["saving"], second[rank]
        assert c["resumed_at"] == 2 and c["extra"]["data"] == {"position": 12} and c["data_position"] == 18
        assert list(c["losses"]) == [3]
        # saving does not perturb the run, and the resumed step 3 is bit-identical
        for other in (b, c):
            assert other["losses"][3] == a["losses"][3], (rank, other["losses"], a["losses"])
            assert other["lrs"][3] == a["lrs"][3] and other["grad_norms"][3] == a["grad_norms"][3]
            bad = [n for n in a["params"] if not torch.equal(a["params"][n], other["params"][n])]
            assert not bad, f"rank {rank}: {len(bad)} parameters differ after step 3, e.g. {bad[:3]}"
        assert not c["warnings"], c["warnings"]
    a = first[0]["uninterrupted"]
    assert a["losses"][1] != a["losses"][2] != a["losses"][3] and a["lrs"][2] != a["lrs"][3]  # the data/LR move
    n = len(a["params"])
    text = (f"world {world}: step-3 loss {a['losses'][3]!r} == resumed {second[0]['losses'][3]!r}; lr "
            f"{a['lrs'][3]:.3e}; all {n} parameter tensors torch.equal on every rank "
            f"(train+save {t1 - t0:.1f}s, resume {t2 - t1:.1f}s)")
    if world > 1:  # the same checkpoint under one rank: DP reshards; RNG is not restored (warning)
        t3 = time.monotonic()
        (one,) = run_ranks(_resumed, 1, hf_dir, str(run_dir), timeout=240, env=CPU_ONLY)
        saved = first[0]["saving"]["params_saved"]
        bad = [n for n in saved if not torch.equal(saved[n], one["params_loaded"][n])]
        assert not bad, f"{len(bad)} parameters differ after loading a DP{world} checkpoint on one rank: {bad[:3]}"
        assert one["resumed_at"] == 2 and one["extra"]["data"] == {"position": 12}
        assert any("(2 ranks), this run has" in w and "(1 ranks)" in w for w in one["warnings"]), one["warnings"]
        text += f"; loaded on 1 rank: weights equal, layout-change RNG warning ({time.monotonic() - t3:.1f}s)"
    return text


# ------------------------------------------------------------------------------------------------
# resume determinism
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_dir():
    from conftest import build_cached_tiny

    return str(build_cached_tiny())


def test_resume_is_bit_identical_world1(hf_dir, tmp_path):
    print("\n" + _check_resume(1, hf_dir, tmp_path))


@pytest.mark.slow
def test_resume_is_bit_identical_world2_from_an_async_save(hf_dir, tmp_path):
    """The save at step 2 is asynchronous and its write is held until step 3 has changed every
    parameter and Adam moment: the checkpoint still holds step 2 exactly (the host snapshot)."""
    print("\n" + _check_resume(2, hf_dir, tmp_path, async_save=True))


# ------------------------------------------------------------------------------------------------
# rotation, incomplete checkpoints, a save that dies (model-free checkpoints: bookkeeping only)
# ------------------------------------------------------------------------------------------------

def _bookkeeping(run_dir: str) -> dict:
    import warnings

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_grpo.engine import checkpoint as ck
    from model_bridge.mcore_cpu import apply_cpu_patches

    torch.set_num_threads(1)
    apply_cpu_patches()  # megatron's dist_checkpointing on a CPU-only torch (init_parallel does it in runs)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = Path(run_dir) / "checkpoints"
    out = {}

    def names():
        return sorted(p.name for p in root.iterdir()) if rank == 0 else None

    def load():
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            step, extra = ck.load_checkpoint(run_dir, [], None, None)
        return step, extra, [str(x.message) for x in w]

    out["empty"] = load()
    for step in range(1, 5):
        ck.save_checkpoint(run_dir, step, [], None, None, {"step": step, "rank": rank}, keep_last=2)
    out["after_4"] = names()
    out["load_4"] = load()
    # keep_last=1: the new one replaces the old only once it is complete
    ck.save_checkpoint(run_dir, 5, [], None, None, {"step": 5, "rank": rank}, keep_last=1)
    out["after_5"] = names()
    # a save that dies inside megatron's writer: the only good checkpoint survives, latest unchanged
    real_save = dist_checkpointing.save

    def dying_save(sd, path, *a, **k):
        (Path(path) / "partial.distcp").write_bytes(b"junk")
        raise OSError("disk full (injected)")

    dist_checkpointing.save = dying_save
    try:
        ck.save_checkpoint(run_dir, 6, [], None, None, {"step": 6}, keep_last=1)
        out["died"] = None
    except Exception as e:  # noqa: BLE001
        out["died"] = f"{type(e).__name__}: {e}"
    finally:
        dist_checkpointing.save = real_save
    out["after_died"] = names()
    out["load_after_died"] = load()
    # latest names a directory that is gone: fall back to the newest complete one
    if rank == 0:
        (root / "latest").write_text("step_00000009\n")
    dist.barrier()
    out["load_bad_latest"] = load()
    # the next good save cleans the leftovers of the dead one
    ck.save_checkpoint(run_dir, 6, [], None, None, {"step": 6, "rank": rank}, keep_last=2)
    out["after_6"] = names()
    out["load_6"] = load()
    # damaged files in complete checkpoints: the newest intact one is used; none intact: one error
    ck.save_checkpoint(run_dir, 7, [], None, None, {"step": 7, "rank": rank}, keep_last=3)
    if rank == 0:
        part = next((root / "step_00000007").glob("*.distcp"))
        part.write_bytes(part.read_bytes()[:-5])
        (root / "step_00000006" / ".metadata").unlink()
    dist.barrier()
    out["load_damaged"] = load()
    if rank == 0:
        for p in (root / "step_00000005").glob("*.distcp"):
            p.unlink()
    dist.barrier()
    try:
        out["none_intact"] = load()
    except Exception as e:  # noqa: BLE001
        out["none_intact"] = f"{type(e).__name__}: {e}"
    dist.destroy_process_group()
    return out


def test_rotation_incomplete_and_crashed_saves(tmp_path):
    t0 = time.monotonic()
    r0, r1 = run_ranks(_bookkeeping, 2, str(tmp_path), timeout=240, env=CPU_ONLY)
    wall = time.monotonic() - t0
    assert r0["empty"][:2] == (0, None)
    assert r0["after_4"] == ["latest", "step_00000003", "step_00000004"]
    assert r0["load_4"][:2] == (4, {"step": 4, "rank": 0}) and r1["load_4"][:2] == (4, {"step": 4, "rank": 1})
    assert r0["after_5"] == ["latest", "step_00000005"]
    # the injected failure is raised on both ranks, the only good checkpoint is kept
    assert "disk full (injected)" in r0["died"] and "disk full (injected)" in r1["died"]
    assert r0["after_died"] == [".tmp-step_00000006", "latest", "step_00000005"]
    step, extra, warns = r0["load_after_died"]
    assert (step, extra) == (5, {"step": 5, "rank": 0})
    assert any("ignoring incomplete checkpoint" in w and ".tmp-step_00000006" in w for w in warns), warns
    step, extra, warns = r0["load_bad_latest"]
    assert step == 5 and any("not a complete checkpoint" in w and "step_00000005" in w for w in warns), warns
    assert r1["load_bad_latest"][:2] == (5, {"step": 5, "rank": 1})
    assert r0["after_6"] == ["latest", "step_00000005", "step_00000006"]
    assert r0["load_6"][:2] == (6, {"step": 6, "rank": 0})
    step, extra, warns = r0["load_damaged"]
    assert (step, extra) == (5, {"step": 5, "rank": 0}) and r1["load_damaged"][:2] == (5, {"step": 5, "rank": 1})
    damaged = [w for w in warns if "passing over damaged checkpoint" in w]
    assert len(damaged) == 2 and "step_00000007" in damaged[0] and "is truncated" in damaged[0], warns
    assert "step_00000006" in damaged[1] and ".metadata is missing" in damaged[1], warns
    for r in (r0, r1):  # one line, on every rank: the file and the fix
        msg = r["none_intact"]
        assert isinstance(msg, str) and "\n" not in msg and "no intact checkpoint under" in msg, msg
        assert "step_00000007" in msg and "is truncated" in msg and "start the run over" in msg, msg
    print(f"\nbookkeeping on 2 ranks: {wall:.1f}s; died save -> {r0['died']}")


# ------------------------------------------------------------------------------------------------
# preemption: SIGUSR1 to one rank mid-loop -> every rank checkpoints at the same step, exits 0
# ------------------------------------------------------------------------------------------------

def _preempt_loop(run_dir: str) -> None:
    """The signal test's training loop (one process per rank, torchrun-style environment)."""
    import torch.distributed as dist

    from megatron_grpo.engine.checkpoint import save_checkpoint
    from megatron_grpo.engine.signals import PREEMPT_EXIT_CODE, PreemptionHandler
    from model_bridge.mcore_cpu import apply_cpu_patches

    torch.set_num_threads(1)
    apply_cpu_patches()
    stop = PreemptionHandler().install()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.zeros(1)
    for step in range(1, 600):
        time.sleep(0.1)  # "the step"
        dist.all_reduce(t)
        print(f"rank {rank} finished step {step}", flush=True)
        if stop.agreed():
            path = save_checkpoint(run_dir, step, [], None, None, {"step": step, "rank": rank,
                                                                   "signal": stop.signal_name})
            print(f"rank {rank} preempted ({stop.signal_name}) after step {step}: saved {path}", flush=True)
            dist.destroy_process_group()
            sys.exit(PREEMPT_EXIT_CODE)
    sys.exit(3)  # not preempted


def test_sigusr1_to_one_rank_checkpoints_every_rank_and_exits_cleanly(tmp_path):
    port = free_port()
    procs = []
    try:
        for rank in range(2):
            env = {**os.environ, **CPU_ONLY, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
            procs.append(subprocess.Popen([sys.executable, str(HERE), "--preempt-loop", str(tmp_path)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        # wait until rank 1 has trained a few steps, then signal rank 1 only
        lines1 = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = procs[1].stdout.readline()
            if not line:
                break
            lines1.append(line)
            if "finished step 3" in line:
                break
        assert any("finished step 3" in x for x in lines1), "".join(lines1)[-3000:]
        procs[1].send_signal(signal.SIGUSR1)
        outs = []
        for p in procs:
            rest, _ = p.communicate(timeout=60)
            outs.append(rest)
        outs[1] = "".join(lines1) + outs[1]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    codes = [p.returncode for p in procs]
    assert codes == [0, 0], (codes, outs[0][-2000:], outs[1][-2000:])
    assert "received SIGUSR1" in outs[1] and "received SIGUSR1" not in outs[0]
    steps = []
    for rank, text in enumerate(outs):
        line = [x for x in text.splitlines() if "preempted" in x]
        assert len(line) == 1, text[-2000:]
        steps.append(int(line[0].split("after step ")[1].split(":")[0]))
    assert steps[0] == steps[1] >= 3, steps
    ck = tmp_path / "checkpoints"
    assert (ck / "latest").read_text().strip() == f"step_{steps[0]:08d}"
    assert json.loads((ck / f"step_{steps[0]:08d}" / "mgrpo_checkpoint.json").read_text())["step"] == steps[0]
    print(f"\nSIGUSR1 to rank 1 after step 3 -> both ranks checkpointed step {steps[0]} and exited 0")


def test_preemption_handler_in_process():
    from megatron_grpo.engine.signals import PreemptionHandler

    prev = signal.getsignal(signal.SIGTERM)
    with PreemptionHandler() as stop:
        assert not stop.agreed()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.requested and stop.signal_name == "SIGTERM" and stop.agreed()
    assert signal.getsignal(signal.SIGTERM) is prev


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--preempt-loop":
        _preempt_loop(sys.argv[2])
