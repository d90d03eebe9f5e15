"""The embedded default's inputs: the tiny checkpoint, synthetic audio-agent data and the tiny
model's agentic cold start (a short `mgrpo sft` on the synthetic expert trajectories), built into
the cache dir ($MGRPO_CACHE, default ~/.cache/megatron-grpo) the first time a run needs them."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_grpo.config import TrainConfig, default_cache_dir

TINY_SEED = 0
DATA_ROWS = 64


def ensure_embedded_inputs(cfg: TrainConfig, cache: Path | None = None) -> TrainConfig:
    """Fill model.hf_dir / data.train_jsonl when unset, building what is missing (rank 0 only).
    One process at a time per cache builds (`_build_lock`); another waits and then finds it built."""
    cache = Path(cache or default_cache_dir())
    if cfg.model.hf_dir is not None and (cfg.data.train_jsonl is not None or cfg.rollout.server == "replay"):
        return cfg
    with _build_lock(cache):
        if cfg.model.hf_dir is None:
            cfg.model.hf_dir = str(ensure_cold_start(cfg, cache))
        if cfg.data.train_jsonl is None and cfg.rollout.server != "replay":  # a replay reads no data
            out = cache / "audio-agent-data"
            if not (out / "train.jsonl").exists():
                from megatron_grpo.data.synth import make_data
                print(f"[train] building the embedded synthetic data in {out}", flush=True)
                make_data(out, n=DATA_ROWS, n_dev=4, seed=0, progress=False)
            cfg.data.train_jsonl = str(out / "train.jsonl")
    return cfg


@contextlib.contextmanager
def _build_lock(cache: Path):
    """An exclusive lock on ``cache/.build.lock`` while the embedded inputs are checked and built:
    two runs sharing a cache (or a test session's background build and a test's run) would
    otherwise both build the cold start, and the second to finish removes the first's. The lock
    goes with the process that holds it, however it ends. The cold start's own `mgrpo sft` takes
    no lock: the inputs it reads are built before it starts."""
    import fcntl

    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".build.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[train] waiting for another process to finish building the embedded inputs in {cache}",
                  flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_sft_inputs(cfg: TrainConfig, cache: Path | None = None) -> TrainConfig:
    """Fill model.hf_dir / sft.data when unset: the embedded tiny checkpoint and the synthetic
    expert trajectories (`mgrpo make-data --sft`: the embedded GRPO data's recordings and
    questions), built once (rank 0 only)."""
    cache = Path(cache or default_cache_dir())
    _ensure_tiny(cfg, cache)
    if cfg.sft.data is None:
        # keyed by the generator's source: a changed expert text is built afresh, never read stale
        out = cache / f"audio-agent-sft-{_source_hash(_SFT_DATA_SOURCES)}"
        if not (out / "sft.jsonl").exists():
            from megatron_grpo.data.synth import make_data
            print(f"[sft] building the embedded expert trajectories in {out}", flush=True)
            for old in cache.glob("audio-agent-sft*"):
                shutil.rmtree(old, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=".audio-agent-sft-", dir=cache))
            try:
                make_data(tmp, n=DATA_ROWS, n_dev=4, seed=0, progress=False, sft=True)
                tmp.chmod(0o755)
                tmp.rename(out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        cfg.sft.data = str(out / "sft.jsonl")
    return cfg


_SFT_DATA_SOURCES = ("megatron_grpo/data/synth.py", "megatron_grpo/data/synth_sft.py",
                     "megatron_grpo/data/audio_events.py")
"""What the embedded expert trajectories are made by."""


_COLD_START_SOURCES = ("megatron_grpo/sft", "megatron_grpo/algo/sft.py", "megatron_grpo/data/synth.py",
                       "megatron_grpo/data/synth_sft.py", "megatron_grpo/data/audio_events.py", "model_bridge/tiny")
"""What the cold start is made by: a change to any of them builds it again."""


def cold_start_key(cfg: TrainConfig, sft_jsonl: Path) -> str:
    """The cold start's cache key: the sft section's steps, batch, lr and seed, the trajectories'
    bytes and the source of the SFT, the synthetic data and the tiny model."""
    h = hashlib.sha256(json.dumps([cfg.sft.steps, cfg.sft.samples_per_step, cfg.sft.lr, cfg.data.seed,
                                   TINY_SEED, DATA_ROWS]).encode())
    h.update(sft_jsonl.read_bytes())
    h.update(_source_hash(_COLD_START_SOURCES).encode())
    return h.hexdigest()[:12]


def _source_hash(rels) -> str:
    """A hash of the named files' and folders' Python source (paths and bytes)."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for rel in rels:
        p = root / rel
        for f in sorted(p.rglob("*.py")) if p.is_dir() else [p]:
            h.update(f.relative_to(root).as_posix().encode() + f.read_bytes())
    return h.hexdigest()[:12]


def cold_start_dir(cfg: TrainConfig, cache: Path | None = None) -> Path:
    """Where the embedded cold start of `cfg` lies (or will lie once built): ``cache/tiny-omni-sft-KEY``.
    Builds only what the key is made of (the tiny checkpoint and the expert trajectories, ~20 s once)."""
    cache = Path(cache or default_cache_dir())
    sft_cfg = ensure_sft_inputs(TrainConfig(), cache)
    return cache / f"tiny-omni-sft-{cold_start_key(cfg, Path(sft_cfg.sft.data))}"


def is_cold_start_dir(path: Path) -> bool:
    """Whether `path` is where the embedded cold start lies (built or not), in the default cache."""
    return Path(path).parent == Path(default_cache_dir()) and Path(path).name.startswith("tiny-omni-sft-")


def ensure_cold_start(cfg: TrainConfig, cache: Path) -> Path:
    """The tiny model after `sft.steps` steps of `mgrpo sft` on the embedded expert trajectories
    (one rank, TP1): ``cache/tiny-omni-sft-KEY/hf``, built on first use (about 200 s on 2 cores)
    and reused while `cold_start_key` is unchanged; older builds and an interrupted build's folder
    are removed. The caller holds the build lock (:func:`_build_lock`)."""
    out = cold_start_dir(cfg, cache)
    if (out / "hf" / "model.safetensors.index.json").exists():
        return out / "hf"
    for stale in cache.glob(".tiny-omni-sft-*"):  # an interrupted build's (the caller holds the build lock)
        shutil.rmtree(stale, ignore_errors=True)
    print(f"[train] building the embedded cold start (mgrpo sft, {cfg.sft.steps} steps) in {out}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-omni-sft-", dir=cache))
    cmd = [sys.executable, "-m", "launch.cli", "sft", "--nproc", "1", "parallel.tp=1", "parallel.ep=1",
           "parallel.pp=1", f"sft.run_dir={tmp}", f"sft.steps={cfg.sft.steps}",
           f"sft.samples_per_step={cfg.sft.samples_per_step}", f"sft.lr={cfg.sft.lr}", f"data.seed={cfg.data.seed}",
           "checkpoint.every=0", "checkpoint.keep_last=1", "logging.tensorboard=false", "logging.plot=false"]
    env = dict(os.environ, MGRPO_CACHE=str(cache))
    env.pop("RANK", None), env.pop("WORLD_SIZE", None), env.pop("LOCAL_RANK", None)
    try:
        code = subprocess.run(cmd, env=env, cwd=Path(__file__).resolve().parents[2]).returncode
        if code != 0:
            raise RuntimeError(f"the embedded cold start (`{' '.join(cmd[2:])}`) exited with {code}; its output is "
                               "above. Give model.hf_dir to train another checkpoint")
        shutil.rmtree(tmp / "checkpoints", ignore_errors=True)  # the HF export is what the runs read
        for old in cache.glob("tiny-omni-sft-*"):
            shutil.rmtree(old, ignore_errors=True)
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide it from other users of a shared cache
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[train] the embedded cold start is ready: {out / 'hf'} (the `mgrpo sft` lines above name the folder "
          f"it was built in, {tmp.name}, now renamed to {out.name})", flush=True)
    return out / "hf"


def ensure_tiny(cache: Path | None = None) -> Path:
    """The embedded tiny checkpoint (random weights; the cold start's shapes), built on first use."""
    out = Path(cache or default_cache_dir()) / "tiny-omni"
    if not (out / "model.safetensors.index.json").exists():
        from model_bridge.tiny import make_tiny
        print(f"[train] building the embedded tiny checkpoint in {out}", flush=True)
        make_tiny(out, preset="tiny", seed=TINY_SEED)
    return out


def _ensure_tiny(cfg: TrainConfig, cache: Path) -> None:
    if cfg.model.hf_dir is None:
        cfg.model.hf_dir = str(ensure_tiny(cache))
