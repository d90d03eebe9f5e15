"""Push new weights into running vLLM servers through vLLM's native RL weight-transfer API.

One push, for every server (one bucket at a time fanned out to all of them, so the weight stream
- usually `model_bridge.export.export_hf(model)`, a collective - is iterated once):

    POST /pause?mode=abort            stop generating, drop in-flight requests and the prefix,
                                      multimodal and encoder caches (computed with old weights)
    POST /start_weight_update
    POST /update_weights  x buckets   names/dtypes/shapes over HTTP, bytes through the transport
    POST /finish_weight_update        {"weight_version": str(version)}
    POST /resume

`/init_weight_transfer_engine` (the data-plane rendezvous) runs once per server, at its first push
and again after a failed one. Always pause first: an update under live traffic killed the engine
on the next audio request ("Encoder cache miss") in the probe.

Failure: `push` raises `WeightPushError` naming the server, the version and the stage, after
recovering every server it touched: a server whose update did not complete gets
`mgrpo_abort_weight_update` (worker extension, see `rollout.vllm_ext`) and is resumed when it is
still on its previous weights - always the case with the gloo engine, which stages the buckets
until `/finish_weight_update`. A server whose model already holds part of the new weights (vLLM's
nccl engine loads each bucket as it arrives) is left PAUSED, and the error says so: serving a mix
of two versions under the old version tag would poison the rollouts silently; the next successful
push (or a restart) repairs it. The failed server's data-plane group is closed and rebuilt on the
next push.

Runs in the one trainer process that holds the connection (the sender); a multi-rank trainer
iterates its export collective on every rank and gives the sender's stream to `push`.
"""
from __future__ import annotations

import ipaddress
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator
from urllib.parse import urlparse

import requests
import torch

from megatron_grpo.weight_sync.buckets import Bucket, iter_buckets

__all__ = ["WeightReceiver", "push", "PushStats", "PushSteps", "WeightPushError", "ServerRequestError",
           "default_backend"]

PAUSE_MODES = ("abort", "wait")


def default_backend() -> str:
    """The data plane a server started by `rollout.server` uses: nccl with CUDA, gloo without."""
    return "nccl" if torch.cuda.is_available() else "gloo"


class ServerRequestError(RuntimeError):
    """A control-plane HTTP call failed; the message carries the server's answer."""


class WeightPushError(RuntimeError):
    """A weight push failed. Attributes: `server` (URL), `version`, `stage`, `states`
    ({url: 'previous version, resumed' | 'new version, resumed' | 'PAUSED, ...' | ...}), `rank`
    (the trainer rank that failed in a multi-source push, when known; else None)."""

    def __init__(self, message: str, *, server: str | None, version: str, stage: str,
                 states: dict[str, str], rank: int | None = None):
        super().__init__(message)
        self.server, self.version, self.stage, self.states = server, version, stage, states
        self.rank = rank


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _trainer_address_for(host: str) -> str:
    """The address of this machine that the server at `host` can reach us on."""
    if _is_loopback(host):
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: only picks the route
        return s.getsockname()[0]


def _make_transport(backend: str, master_address: str, timeout_s: float, bucket_bytes: int | None):
    if backend == "gloo":
        from megatron_grpo.weight_sync.gloo import GlooTransport
        return GlooTransport(master_address=master_address, timeout_s=timeout_s)
    if backend == "nccl":
        from megatron_grpo.weight_sync.nccl import NcclTransport
        kw = {"packed_buffer_size_bytes": bucket_bytes} if bucket_bytes else {}
        return NcclTransport(master_address=master_address, **kw)
    if backend == "nccl_m2n":
        from megatron_grpo.weight_sync.m2n_link import M2NLink
        return M2NLink(master_address=master_address)
    raise ValueError(f"unknown weight transfer backend {backend!r} (gloo, nccl or nccl_m2n)")


class WeightReceiver:
    """One vLLM server that takes weight pushes: its HTTP control plane plus its data-plane transport.

    `url` is the server's base URL (``http://host:port``); `backend` must match the server's
    ``--weight-transfer-config`` (default: `default_backend()`, which is what `rollout.server`
    starts). `api_key` is sent as a bearer token on every call (servers started with one guard the
    weight endpoints with it too, see docs/rollout.md). The transport's rendezvous listens on
    `master_address` (default: loopback for a loopback server, else this machine's address on the
    route to the server).
    """

    def __init__(self, url: str, *, backend: str | None = None, api_key: str | None = None,
                 master_address: str | None = None, transfer_timeout_s: float = 600.0,
                 http_timeout_s: float = 600.0, bucket_bytes: int | None = None, transport=None):
        self.url = url.rstrip("/")
        host = urlparse(self.url).hostname or "127.0.0.1"
        self.backend = backend or (transport.backend if transport is not None else default_backend())
        self.api_key = api_key
        self.http_timeout_s = http_timeout_s
        self.transport = transport or _make_transport(
            self.backend, master_address or _trainer_address_for(host), transfer_timeout_s, bucket_bytes)
        self._session = requests.Session()
        # one connection per call: a pooled keep-alive connection that the server closed while idle
        # fails the next call with "connection reset" (seen in a push's recovery path)
        self._session.headers["Connection"] = "close"
        if api_key:
            self._session.headers["Authorization"] = f"Bearer {api_key}"
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mgrpo-weight-rpc")
        self._inflight: Future | None = None

    def __repr__(self) -> str:
        return f"WeightReceiver({self.url!r}, backend={self.backend!r})"

    # ---------------------------------------------------------------- HTTP
    def _call(self, method: str, path: str, *, json: Any = None, params: dict | None = None,
              timeout: float | None = None, idempotent: bool = False) -> Any:
        attempts = 2 if idempotent or method == "GET" else 1
        for attempt in range(attempts):
            try:
                r = self._session.request(method, f"{self.url}/{path}", json=json, params=params,
                                          timeout=timeout or self.http_timeout_s)
                break
            except requests.ConnectionError as e:
                if attempt + 1 < attempts:
                    time.sleep(0.5)
                    continue
                raise ServerRequestError(f"{method} {self.url}/{path}: {e}") from e
            except requests.RequestException as e:
                raise ServerRequestError(f"{method} {self.url}/{path}: {e}") from e
        if r.status_code != 200:
            hint = ""
            if r.status_code == 404:
                hint = (" (is the server in dev mode, VLLM_SERVER_DEV_MODE=1, and started with a "
                        "--weight-transfer-config? `mgrpo serve` does both)")
            elif r.status_code == 401:
                hint = " (wrong or missing API key)"
            raise ServerRequestError(f"{method} {self.url}/{path} -> HTTP {r.status_code}{hint}: "
                                     f"{r.text[:2000]}")
        try:
            return r.json()
        except ValueError:
            return r.text

    def world_size(self) -> int:
        """Inference workers behind this server (TP x PP x DP): each joins the transfer group."""
        return int(self._call("GET", "get_world_size")["world_size"])

    def weight_version(self) -> str:
        return self._call("GET", "weight_info")["weight_version"]

    def is_paused(self) -> bool:
        return bool(self._call("GET", "is_paused")["is_paused"])

    def pause(self, mode: str = "abort") -> None:
        self._call("POST", "pause", params={"mode": mode}, idempotent=True)

    def resume(self) -> None:
        self._call("POST", "resume", idempotent=True)

    def start_weight_update(self) -> None:
        self._call("POST", "start_weight_update")

    def finish_weight_update(self, weight_version: str | None) -> None:
        self._call("POST", "finish_weight_update",
                   json={"weight_version": weight_version} if weight_version is not None else None)

    def abort_weight_update(self) -> list[dict]:
        """Our worker extension's abort (see `rollout.vllm_ext.WorkerExtension`); one dict per worker."""
        res = self._call("POST", "collective_rpc", json={"method": "mgrpo_abort_weight_update"},
                         timeout=min(self.http_timeout_s, 120), idempotent=True)
        return res.get("results", []) if isinstance(res, dict) else []

    # ---------------------------------------------------------------- data plane
    @property
    def connected(self) -> bool:
        return self.transport.connected

    def _rpc_async(self, path: str, payload: dict) -> Future:
        self._inflight = self._pool.submit(self._call, "POST", path, json=payload)
        return self._inflight

    def _wait_inflight(self, timeout: float) -> None:
        fut, self._inflight = self._inflight, None
        if fut is not None:
            try:
                fut.result(timeout=timeout)
            except Exception:  # noqa: BLE001 - only draining; the error was already reported
                pass

    def use_senders(self, ranks: list[int]) -> None:
        """The trainer ranks that send over this receiver's data plane (group ranks 0..S-1): [0] for
        `push`, every shard owner for a multi-source push; a change drops the group (the next
        `connect` forms it again with the new senders)."""
        if list(getattr(self.transport, "sender_ranks", [0])) == list(ranks):
            return
        self.drop_transport()
        self.transport.sender_ranks = list(ranks)

    def connect(self, on_prepared: Callable[[dict], None] | None = None) -> None:
        """Rendezvous with the server's workers (`/init_weight_transfer_engine`), once.
        `on_prepared(init_info)` runs before anyone joins (a multi-source push hands the rendezvous
        to its other senders there)."""
        if self.transport.connected:
            return
        senders = len(getattr(self.transport, "sender_ranks", [0]))
        init_info = self.transport.prepare(senders + self.world_size())
        if on_prepared is not None:
            on_prepared(init_info)
        fut = self._rpc_async("init_weight_transfer_engine", {"init_info": init_info})
        box: dict[str, BaseException] = {}

        def _connect():
            try:
                self.transport.connect()
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                box["e"] = e

        # the transport blocks until every worker joined; if the server refuses the init (e.g. no
        # weight transfer configured) the workers never come, so watch the RPC meanwhile
        th = threading.Thread(target=_connect, daemon=True, name="mgrpo-weight-connect")
        th.start()
        while th.is_alive():
            if fut.done() and fut.exception() is not None:
                self.transport.close()
                self._inflight = None
                raise fut.exception()
            th.join(0.05)
        if "e" in box:
            self.transport.close()
            self._wait_inflight(30)
            raise box["e"]
        self._inflight = None
        fut.result()

    def send(self, bucket: Bucket) -> None:
        """`/update_weights` for one bucket, concurrently with the transport shipping its bytes."""
        payload = self.transport.pack(bucket)  # before the server waits for it
        fut = self._rpc_async("update_weights", {"update_info": bucket.metadata()})

        def poll():
            if fut.done() and fut.exception() is not None:
                raise fut.exception()

        self.transport.send(payload, poll)
        del payload
        fut.result()
        self._inflight = None

    def send_round(self, update_info: dict, buf: torch.Tensor | None) -> None:
        """Multi-source push (`multisource`): one round's `/update_weights` (every sender's bucket),
        with this process's own packed bucket `buf` (None: none this round) sent meanwhile; fails
        as soon as the server answers an error or a member of the push sets the abort key."""
        from megatron_grpo.weight_sync.gloo import TransportError, abort_reason

        fut = self._rpc_async("update_weights", {"update_info": update_info})

        def poll():
            if fut.done() and fut.exception() is not None:
                raise fut.exception()
            reason = abort_reason(self.transport.store)
            if reason is not None:
                raise TransportError(reason)

        if buf is not None:
            self.transport.send_p2p(buf, poll)
        fut.result()
        self._inflight = None

    def drop_transport(self) -> None:
        """Close our end of the data plane (a worker blocked in a receive then fails fast) and wait
        briefly for an in-flight control call to come back."""
        self.transport.close()
        self._wait_inflight(60)

    def disconnect(self) -> None:
        """Close the data plane on both ends; the next push reconnects."""
        self.drop_transport()
        try:
            self._call("POST", "shutdown_weight_transfer_engine", timeout=30, idempotent=True)
        except ServerRequestError:
            pass

    def close(self) -> None:
        self.disconnect()
        self._pool.shutdown(wait=False)
        self._session.close()


@dataclass
class PushStats:
    """What one push moved and how long it took (seconds are wall clock, all servers)."""

    version: str
    servers: int
    tensors: int = 0
    buckets: int = 0
    bytes: int = 0
    """Payload bytes per server."""
    seconds: float = 0.0
    """Whole push, pause to resume."""
    stage_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def gb_per_s(self) -> float:
        """Payload bytes per server / total seconds, in GB/s (1e9)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def summary(self) -> str:
        stages = ", ".join(f"{k} {v:.2f}s" for k, v in self.stage_seconds.items())
        return (f"weight push v{self.version}: {self.tensors} tensors, {self.bytes / 1e6:.1f} MB in "
                f"{self.buckets} buckets to {self.servers} server(s) in {self.seconds:.2f}s "
                f"({self.gb_per_s:.3f} GB/s; {stages})")


def _cast(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None
          ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in weights:
        yield name, (t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype
                     else t)


def push(weights: Iterable[tuple[str, torch.Tensor]], version: int | str,
         servers: list[WeightReceiver], *, bucket_bytes: int | None = None,
         dtype: torch.dtype | None = None, pause_mode: str = "abort") -> PushStats:
    """Load `weights` (HF checkpoint names, full tensors) into every server as `version`.

    `bucket_bytes` bounds one transfer (default `buckets.default_bucket_bytes()`); `dtype` casts
    floating tensors before sending (e.g. the server's bf16, halving the bytes); `pause_mode`
    'abort' drops in-flight requests, 'wait' lets them finish on the old weights first.
    Returns `PushStats`; raises `WeightPushError` (see the module doc for the servers' state then).
    """
    if not servers:
        raise ValueError("push() needs at least one WeightReceiver")
    if pause_mode not in PAUSE_MODES:
        raise ValueError(f"pause_mode must be one of {PAUSE_MODES} ('keep' would resume old requests "
                         f"with prefix caches computed from the old weights), got {pause_mode!r}")
    version = str(version)
    stats = PushStats(version=version, servers=len(servers))
    steps = PushSteps(servers, stats)
    bucket_i = -1
    try:
        for s in servers:
            steps.current = s
            s.use_senders([0])
            s.connect()
        steps.pause_and_start(pause_mode)
        buckets = iter_buckets(_cast(weights, dtype), bucket_bytes)
        while True:
            steps.current = None  # an error while producing the next bucket is the trainer's
            bucket = next(buckets, None)
            if bucket is None:
                break
            bucket_i += 1
            for s in servers:
                steps.current = s
                s.send(bucket)
            stats.buckets += 1
            stats.tensors += len(bucket)
            stats.bytes += bucket.nbytes
            del bucket
        steps.finish_and_resume(version)
    except BaseException as exc:
        states = steps.recover(version)
        stage, current = steps.stage, steps.current
        where = f"bucket {bucket_i + 1} " if stage == "update_weights" else ""
        who = current.url if current is not None else "the trainer (weight stream)"
        msg = (f"weight push of version {version!r} failed at {stage} {where}on {who}: "
               f"{type(exc).__name__}: {exc}\nserver states after recovery:\n" +
               "\n".join(f"  {url}: {st}" for url, st in states.items()))
        if isinstance(exc, Exception):
            raise WeightPushError(msg, server=current.url if current else None, version=version,
                                  stage=stage, states=states) from exc
        raise
    return stats


class PushSteps:
    """The server side of one push, in order: pause and start every server, (the caller's
    transfers,) finish and resume every server. Records where the push stands for the error and
    the recovery: ``stage``, the server being talked to (``current``; None while the trainer
    produces data) and the servers paused, started and finished; times each stage into
    ``stats.stage_seconds`` and the whole push into ``stats.seconds``."""

    def __init__(self, servers: list[WeightReceiver], stats: PushStats):
        self.servers, self.stats = servers, stats
        self.paused: list[WeightReceiver] = []
        self.started: list[WeightReceiver] = []
        self.finished: list[WeightReceiver] = []
        self.stage, self.current = "connect", None
        self._t_push = self._t_stage = time.perf_counter()

    def next_stage(self, name: str) -> None:
        now = time.perf_counter()
        self.stats.stage_seconds[self.stage] = self.stats.stage_seconds.get(self.stage, 0.0) + now - self._t_stage
        self.stage, self._t_stage = name, now

    def pause_and_start(self, pause_mode: str) -> None:
        """Pause every server, then start its update; the stage is ``update_weights`` after."""
        self.next_stage("pause")
        for s in self.servers:
            self.current = s
            self.paused.append(s)
            s.pause(pause_mode)
        self.next_stage("start_weight_update")
        for s in self.servers:
            self.current = s
            self.started.append(s)
            s.start_weight_update()
        self.next_stage("update_weights")

    def finish_and_resume(self, version: str) -> None:
        """Finish every server's update as ``version``, then resume it; closes the push's timing."""
        self.next_stage("finish_weight_update")
        for s in self.servers:
            self.current = s
            s.finish_weight_update(version)
            self.finished.append(s)
        self.next_stage("resume")
        for s in self.servers:
            self.current = s
            s.resume()
            self.paused.remove(s)
        self.next_stage("done")
        self.stats.stage_seconds.pop("done", None)
        self.stats.seconds = time.perf_counter() - self._t_push

    def recover(self, version: str) -> dict[str, str]:
        """After a failure: every touched server to a defined state (``_recover``)."""
        return _recover(self.servers, self.paused, self.started, self.finished, version)


def _recover(servers: list[WeightReceiver], paused: list[WeightReceiver],
             started: list[WeightReceiver], finished: list[WeightReceiver], version: str
             ) -> dict[str, str]:
    """Bring every touched server to a defined state; returns a human-readable state per server."""
    states: dict[str, str] = {}
    for s in servers:
        if s in started and s not in finished:
            # close the data plane first: a worker blocked in a receive then fails fast instead of
            # holding the engine (and our abort RPC) until the transfer timeout
            s.drop_transport()
            try:
                answers = s.abort_weight_update()
            except ServerRequestError as e:
                states[s.url] = (f"UNKNOWN: abort failed ({e}); left paused - check the server, "
                                 "push again or restart it")
                continue
            s.disconnect()  # the server's end too (allowed now that no update is active)
            processed = sum(int(a.get("processed", 0)) for a in answers if isinstance(a, dict))
            if processed:
                states[s.url] = (f"PAUSED with a partial update ({processed} layers hold version "
                                 f"{version!r}, the rest the previous one); push again or restart it")
                continue
            states[s.url] = "previous version"
        elif s in finished:
            states[s.url] = f"new version {version!r}"
        elif s in paused or s in started:
            states[s.url] = "previous version"
        else:
            states[s.url] = "untouched"
            continue
        if s in paused:
            try:
                s.resume()
                states[s.url] += ", resumed"
            except ServerRequestError as e:
                states[s.url] += f", but /resume failed: {e}"
    return states
