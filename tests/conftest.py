"""Test-wide fixtures: cached tiny checkpoint, real vLLM CPU server, CUDA skipping.

Markers (pytest.ini): unmarked = CPU, fast; `slow` = CPU, minutes (still in CI); `gpu` = needs CUDA.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("MGRPO_TEST_CACHE", REPO / ".cache" / "tests"))


def pytest_collection_modifyitems(config, items):
    # the tests of the embedded default run last: its cold start builds in the background until then
    items.sort(key=lambda item: item.get_closest_marker("cold_start") is not None)  # stable
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


def session_server_spec(ckpt: Path):
    """The session server's spec: exactly the server `mgrpo train` starts for `ckpt` with the
    embedded default's settings (rollout.server local: fp32 on CPU, our worker extension, the gloo
    weight-transfer backend), so tests of that server and `mgrpo train ... rollout.server=remote`
    runs share it instead of starting their own. It returns routed experts (R3), as `mgrpo train`
    starts it for rollout.return_routed_experts."""
    from megatron_grpo.config import ModelConfig, ServeConfig, TrainConfig
    from megatron_grpo.rollout.config import RolloutConfig
    from megatron_grpo.run.rollout_source import local_server_spec

    # serve.max_model_len "auto" is sized from a run's data; 4096 holds every test's conversations
    return local_server_spec(TrainConfig(model=ModelConfig(hf_dir=str(ckpt)), serve=ServeConfig(max_model_len=4096),
                                         rollout=RolloutConfig(return_routed_experts=True)))


_SESSION_SERVER: dict = {}
"""The session vLLM server, started in a background thread once collection shows a test needs it
(`pytest_collection_finish`): its minute of start-up overlaps the tests that run before the first
one using it. Keys: thread, server, error."""


def _start_session_server(log: Path) -> None:
    from megatron_grpo.rollout.server import VLLMServer

    spec = session_server_spec(build_cached_tiny())  # built here: the tests' own build must not race it

    def run():
        try:
            _SESSION_SERVER["server"] = VLLMServer(spec, log)
            _SESSION_SERVER["server"].start(timeout=900, progress=False)
        except BaseException as e:  # noqa: BLE001 - re-raised by the fixture in the test's thread
            _SESSION_SERVER["error"] = e

    _SESSION_SERVER["thread"] = threading.Thread(target=run, name="vllm-session-server", daemon=True)
    _SESSION_SERVER["thread"].start()


_COLD_START: dict = {}
"""The embedded default's cold start (`mgrpo sft`, ~4 minutes on 2 cores), built by a background
process at the lowest CPU priority once collection shows a `cold_start` test: it takes the CPU the
other tests leave idle, and those tests run last (`pytest_collection_modifyitems`). A test that
needs it before it is done waits on the cache's build lock (megatron_grpo/run/embedded.py); if the
build failed, the test's own run builds it again and shows why. Keys: proc, watcher, log."""


def _start_cold_start_build(log: Path) -> None:
    from megatron_grpo.config import TrainConfig
    from megatron_grpo.run.embedded import cold_start_dir
    from model_bridge.lifeline import guard_group

    cache = CACHE / "embedded"
    # the tiny checkpoint and the expert trajectories (seconds) here, before any test can read
    # them: they are built without the lock; the background process builds the rest under it
    if (cold_start_dir(TrainConfig(), cache) / "hf" / "model.safetensors.index.json").exists():
        return
    code = ("import sys; from megatron_grpo.config import TrainConfig; "
            "from megatron_grpo.run.embedded import ensure_embedded_inputs; "
            "ensure_embedded_inputs(TrainConfig(), sys.argv[1])")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", code, str(cache)], cwd=REPO, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, MGRPO_CACHE=str(cache)), preexec_fn=lambda: os.nice(19))
    # its own group; the watcher ends it if this pytest process dies without pytest_sessionfinish
    _COLD_START.update(proc=proc, watcher=guard_group(proc.pid), log=log)


def _stop_cold_start_build() -> None:
    """End a build still running at the end of the session (a run whose cold_start tests were
    deselected or failed early): SIGINT first, so it removes its temporary dirs."""
    from model_bridge.lifeline import release

    proc = _COLD_START.pop("proc", None)
    if proc is None:
        return
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    release(_COLD_START.pop("watcher", None))


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    factory = getattr(session.config, "_tmp_path_factory", None)
    if any(item.get_closest_marker("cold_start") for item in session.items):
        logdir = factory.mktemp("cold_start") if factory is not None else Path(tempfile.mkdtemp(prefix="mgrpo-cs-"))
        _start_cold_start_build(logdir / "build.log")
    if any("vllm_server" in getattr(item, "fixturenames", ()) for item in session.items):
        logdir = factory.mktemp("vllm") if factory is not None else Path(tempfile.mkdtemp(prefix="mgrpo-vllm-"))
        _start_session_server(logdir / "server.log")


def pytest_sessionfinish(session):
    _stop_cold_start_build()
    thread = _SESSION_SERVER.get("thread")
    if thread is None:
        return
    # stop it even while it is still starting: an interrupted run must not wait for the start-up
    while thread.is_alive() and getattr(_SESSION_SERVER.get("server"), "proc", None) is None:
        thread.join(0.1)
    if _SESSION_SERVER.get("server") is not None:
        _SESSION_SERVER["server"].stop()
    thread.join()


@pytest.fixture(scope="session")
def vllm_server(tiny_ckpt):
    """A real vLLM CPU server on a free loopback port serving the tiny checkpoint in fp32: the
    server `mgrpo train` starts for it (`session_server_spec`), one for the whole test run.

    It loads our worker extension and the weight-transfer backend (gloo on CPU), so the weight-sync
    tests and `mgrpo train rollout.server=remote` runs push into this same server; they push the
    checkpoint's weights back when done (`restore_checkpoint_weights`). Start-up takes about a
    minute on 2 cores and begins in the background when collection ends; the server is stopped
    (by process group) when the test run ends.
    It returns routed experts (R3: rollout.return_routed_experts, vLLM's flag; on CPU our worker
    extension captures them), which runs that do not ask for them ignore.
    """
    if "thread" not in _SESSION_SERVER:  # collected in a way our hook did not see
        _start_session_server(Path(tempfile.mkdtemp(prefix="mgrpo-vllm-")) / "server.log")
    _SESSION_SERVER["thread"].join()
    if "error" in _SESSION_SERVER:
        raise _SESSION_SERVER["error"]
    server = _SESSION_SERVER["server"]
    assert Path(server.spec.model) == tiny_ckpt
    return server


def checkpoint_weights(ckpt: Path):
    """(on-disk name, tensor) of what `mgrpo train` pushes: the thinker without its vision tower."""
    from safetensors import safe_open

    for f in sorted(Path(ckpt).glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                if k.startswith("thinker.") and not k.startswith("thinker.visual."):
                    yield k, st.get_tensor(k)


def restore_checkpoint_weights(server) -> None:
    """Push the served checkpoint's own weights back into `server` as version "default"."""
    from megatron_grpo.weight_sync import WeightReceiver, push

    rx = WeightReceiver(server.url, backend="gloo", transfer_timeout_s=120)
    try:
        push(checkpoint_weights(Path(server.spec.model)), "default", [rx])
        assert rx.weight_version() == "default" and not rx.is_paused()
    finally:
        rx.close()


class PreflightPassed(AssertionError):
    """Raised in place of spawning ranks or training when `mgrpo` runs in-process (`mgrpo_inproc`)."""


@pytest.fixture
def mgrpo_inproc(monkeypatch):
    """Run `mgrpo ARGS...` in this process through the CLI's own entry (`launch.cli.main`), for
    commands that must stop at a pre-flight check: returns a `subprocess.CompletedProcess` (exit
    code, stdout, stderr) as `python -m launch.cli` would. Getting past the checks (spawning ranks
    or training) raises `PreflightPassed` instead. The entry point itself (`python -m launch.cli`
    printing the same) is tested by tests/megatron_grpo/test_train.py."""
    import contextlib
    import io
    import subprocess

    import launch.train_cli
    import megatron_grpo.train

    def passed(*a, **k):
        raise PreflightPassed("mgrpo train got past its pre-flight checks (it would start ranks now)")

    monkeypatch.setattr(launch.train_cli, "_spawn_train_ranks", passed)
    monkeypatch.setattr(megatron_grpo.train, "train", passed)
    monkeypatch.setenv("MGRPO_CACHE", str(CACHE / "embedded"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def run(*args: str) -> subprocess.CompletedProcess:
        from launch.cli import main

        out, err, env = io.StringIO(), io.StringIO(), dict(os.environ)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(list(args))
        except SystemExit as e:  # argparse errors
            code = e.code if isinstance(e.code, int) else 1
        finally:
            os.environ.clear()  # the single-rank path sets RANK, WORLD_SIZE, ... before training
            os.environ.update(env)
        return subprocess.CompletedProcess(["mgrpo", *args], code, out.getvalue(), err.getvalue())

    return run


@pytest.fixture
def remote_server(vllm_server):
    """The session server for one `mgrpo train rollout.server=remote` run, which pushes its weights
    into it: the checkpoint's weights are pushed back afterwards for the tests that follow."""
    yield vllm_server
    restore_checkpoint_weights(vllm_server)
