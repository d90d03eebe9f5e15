"""Test-wide fixtures: cached tiny checkpoint, real vLLM CPU server, CUDA skipping.

Markers (pytest.ini): unmarked = CPU, fast; `slow` = CPU, minutes (still in CI); `gpu` = needs CUDA.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("MGRPO_TEST_CACHE", REPO / ".cache" / "tests"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _source_hash(*dirs: Path) -> str:
    h = hashlib.sha256()
    for d in dirs:
        for f in sorted(d.rglob("*.py")):
            h.update(f.relative_to(REPO).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def build_cached_tiny(preset: str = "tiny", seed: int = 0, with_talker: bool = False) -> Path:
    """Build (once per source version) a tiny checkpoint under the test cache and return its dir."""
    from model_bridge.tiny import make_tiny

    key = f"{preset}-s{seed}{'-talker' if with_talker else ''}-{_source_hash(REPO / 'model_bridge' / 'tiny')}"
    out = CACHE / "tiny" / key
    done = out / ".complete"
    if not done.exists():
        make_tiny(out, preset=preset, seed=seed, with_talker=with_talker)
        done.write_text("ok\n")
    return out


@pytest.fixture(scope="session")
def tiny_ckpt() -> Path:
    """The default tiny Qwen3-Omni checkpoint (seed 0), built once and cached across runs."""
    return build_cached_tiny()


@pytest.fixture(scope="session")
def vllm_server(tiny_ckpt, tmp_path_factory):
    """A real vLLM CPU server on a free loopback port serving the tiny checkpoint in fp32.

    It loads our worker extension and the weight-transfer backend (gloo on CPU), so the weight-sync
    tests push into this same server; they push the checkpoint's weights back when done. It returns
    routed experts (R3) when asked (``routed_experts_prompt_start``), as `mgrpo train` starts it
    for rollout.return_routed_experts.
    Start-up takes about a minute on 2 cores; the server is stopped (by process group) at the end.
    """
    from megatron_grpo.rollout.server import DEFAULT_WORKER_EXTENSION, ServerSpec, VLLMServer

    log = tmp_path_factory.mktemp("vllm") / "server.log"
    spec = ServerSpec(model=str(tiny_ckpt), served_model_name="tiny", dtype="float32",
                      max_model_len=4096, max_num_seqs=8,
                      worker_extension=DEFAULT_WORKER_EXTENSION, weight_transfer_backend="auto",
                      return_routed_experts=True)
    server = VLLMServer(spec, log).start(timeout=900)
    yield server
    server.stop()
