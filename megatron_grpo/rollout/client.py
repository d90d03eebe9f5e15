"""Async client of one or more vLLM servers' token-in/token-out endpoint ``/inference/v1/generate``.

Why this endpoint: the multi-turn engine must continue a conversation from the exact token ids
vLLM sampled, never from re-rendered text.  vLLM 0.32's ``/inference/v1/generate`` takes
``token_ids`` plus ``content_parts`` (audio as ``audio_url`` data URLs) and returns the sampled
``token_ids``, their ``logprobs``, the server's final ``prompt_token_ids`` (audio placeholders
expanded), ``mm_placeholders``, ``weight_versions`` and, when enabled, ``routed_experts``.  The
chat/completions API cannot take token ids and ``/v1/completions`` takes no audio.  The server
registers the endpoint only with ``--enable-scale-out`` (`mgrpo serve` passes it).

Placeholders: the server expands every ``<|audio_pad|>`` of the prompt it receives into N audio
tokens, one clip (content part) per pad, in order.  A prompt must therefore carry ONE pad per
clip: ids whose earlier clips are already expanded get the first clip matched to the first pad
of the expanded run; on vLLM 0.32 CPU that killed the engine ("Position ids length mismatch with
input ids length").  `collapse_audio_runs` makes the prompt; the server's answer gives the
expanded ids back.

Transport: bounded concurrency (one semaphore over all servers, optionally one per server),
per-request timeout, retries with exponential backoff on connection errors, timeouts, 5xx answers
and aborted requests, least-loaded dispatch over several servers (with an affinity for the server
that served a conversation's previous turn, whose prefix cache holds it).  A request that still
fails raises `RolloutServerError` naming the server(s) and the cause.
"""
from __future__ import annotations

import asyncio
import base64
import errno
import hashlib
import io
import itertools
import json
import logging
import random
import time
import uuid as uuidlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

log = logging.getLogger("megatron_grpo.rollout")

__all__ = ["RolloutClient", "RolloutServerError", "RolloutRequestError", "GenerateResult",
           "AudioItem", "collapse_audio_runs", "GENERATE_PATH"]

GENERATE_PATH = "/inference/v1/generate"
_RETRY_STATUS = {408, 429, 500, 502, 503, 504}
_RECOVER_S, _RECOVER_MAX_S = 5.0, 60.0
"""A server whose last request failed is picked last for 5 s per consecutive failure (at most 60 s)."""


class RolloutServerError(RuntimeError):
    """A rollout server could not be reached, died, or kept failing; the message names the URL."""

    def __init__(self, message: str, *, url: Optional[str] = None, retryable: bool = True):
        super().__init__(message)
        self.url = url
        self.retryable = retryable


class RolloutRequestError(RolloutServerError):
    """The server refused the request (4xx): retrying would not help; the message quotes it."""

    def __init__(self, message: str, *, url: Optional[str] = None, status: int = 400):
        super().__init__(message, url=url, retryable=False)
        self.status = status


KEEPALIVE_S = 2.0
"""Seconds an idle pooled connection is kept. Below vLLM's server-side keep-alive (uvicorn,
``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s by default): with aiohttp's 15 s default the client reused
connections the server was closing at that moment, and a healthy server showed up as
"ServerDisconnectedError" (seen on CI, where it used up a request's retries)."""


@dataclass
class AudioItem:
    """One audio clip of a conversation as the server receives it (encoded once, sent every turn)."""

    waveform: np.ndarray
    """float32 mono 16 kHz samples (what the trainer's audio tower gets)."""
    url: str
    """``data:audio/wav;base64,...`` of the lossless float32 WAV of ``waveform``."""
    uuid: str
    """sha256 of the WAV bytes: vLLM's multimodal cache key (a clip is processed once per server)."""

    @classmethod
    def from_waveform(cls, waveform: np.ndarray, sample_rate: int = 16000) -> "AudioItem":
        from megatron_grpo.data.audio import wav_bytes

        w = np.ascontiguousarray(waveform, dtype=np.float32)
        data = wav_bytes(w, sample_rate)
        return cls(waveform=w, url="data:audio/wav;base64," + base64.b64encode(data).decode("ascii"),
                   uuid="mgrpo-" + hashlib.sha256(data).hexdigest())

    def content_part(self) -> dict:
        return {"type": "audio_url", "url": self.url, "uuid": self.uuid}


@dataclass
class GenerateResult:
    """One answer of ``/inference/v1/generate`` (n = 1)."""

    url: str
    """Server that produced it."""
    prompt_token_ids: list
    """The prompt as the server saw it: audio placeholders expanded."""
    audio_placeholders: list
    """(offset, length) of each clip's audio-token run in ``prompt_token_ids``."""
    token_ids: list
    """Sampled ids, the stop token (e.g. ``<|im_end|>``) included when the turn ended on one."""
    logprobs: list
    """log p of each sampled id (vLLM's raw logprobs)."""
    finish_reason: str
    """"stop" (EOS or stop token), "length" (max_tokens)."""
    stop_reason: Any = None
    """The stop token id for a stop token that is not the tokenizer's EOS; None on EOS / length."""
    weight_version: Optional[str] = None
    """The oldest weight version that sampled a token of this turn."""
    routed_experts: Optional[np.ndarray] = None
    """[rows, layers, top_k] routed experts of positions [routed_experts_prompt_start, P + O - 1)."""
    prompt_logprobs: Optional[list] = None
    """log p of each prompt token given the tokens before it (None at 0) when asked for."""
    seconds: float = 0.0
    forced: bool = False
    """True for a scripted (teacher-forced) turn: ids given, logprobs scored by the server."""


def collapse_audio_runs(ids: Sequence[int], audio_token_id: int) -> list[int]:
    """``ids`` with every run of ``audio_token_id`` replaced by a single one (the form the server
    expands: one placeholder per clip)."""
    out: list[int] = []
    prev_audio = False
    for t in ids:
        if t == audio_token_id:
            if not prev_audio:
                out.append(t)
            prev_audio = True
        else:
            out.append(t)
            prev_audio = False
    return out


@dataclass
class _Server:
    url: str
    inflight: int = 0
    served: int = 0
    failures: int = 0
    """Consecutive failed requests (reset by a success); a failing server is picked last."""
    last_failure: float = 0.0
    model: Optional[str] = None
    max_model_len: Optional[int] = None


class RolloutClient:
    """Async client of the rollout servers; use as ``async with RolloutClient(cfg) as client``.

    ``cfg`` is a `RolloutConfig` (server_urls, api_key, model, concurrency, max_inflight_per_server,
    affinity_slack, request_timeout_s, connect_timeout_s, max_retries, backoff_s, backoff_max_s).
    """

    def __init__(self, cfg, *, rng_seed: int = 0):
        self.cfg = cfg
        self.servers = [_Server(u) for u in cfg.server_urls]
        self._session = None
        self._sem: Optional[asyncio.Semaphore] = None
        self._rr = itertools.count()
        self._rng = random.Random(rng_seed)
        self.stats = {"requests": 0, "retries": 0, "failures": 0, "seconds": 0.0}

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> "RolloutClient":
        await self.open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def open(self) -> None:
        import aiohttp

        if self._session is not None:
            return
        self._sem = asyncio.Semaphore(self.cfg.concurrency)
        self._slots = asyncio.Condition()
        headers = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
        connector = aiohttp.TCPConnector(limit=max(self.cfg.concurrency, 1) + 8,
                                         keepalive_timeout=KEEPALIVE_S)
        self._session = aiohttp.ClientSession(headers=headers, connector=connector)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ server info
    async def model_info(self, url: Optional[str] = None) -> dict:
        """``GET /v1/models`` of each server (or one): fills the served name and max_model_len;
        raises `RolloutServerError` when a server does not answer or serves several/no models."""
        import aiohttp

        targets = [s for s in self.servers if url is None or s.url == url]
        out = {}
        for s in targets:
            try:
                async with self._session.get(f"{s.url}/v1/models",
                                             timeout=aiohttp.ClientTimeout(total=self.cfg.connect_timeout_s + 20)) as r:
                    body = await r.text()
                    if r.status == 401:
                        raise RolloutServerError(f"rollout server {s.url} refused the API key (401): set "
                                                 "rollout.api_key / VLLM_API_KEY to the server's key",
                                                 url=s.url, retryable=False)
                    if r.status != 200:
                        raise RolloutServerError(f"rollout server {s.url}: GET /v1/models answered "
                                                 f"{r.status}: {body[:300]}", url=s.url)
                    data = json.loads(body).get("data") or []
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                raise RolloutServerError(f"rollout server {s.url} is unreachable ({_describe(e)}); "
                                         "is `mgrpo serve` running there?", url=s.url) from None
            names = [m.get("id") for m in data]
            want = self.cfg.model
            if want is not None and want not in names:
                raise RolloutServerError(f"rollout server {s.url} serves {names}, not rollout.model "
                                         f"{want!r}", url=s.url, retryable=False)
            if want is None and len(names) != 1:
                raise RolloutServerError(f"rollout server {s.url} serves {names}: set rollout.model",
                                         url=s.url, retryable=False)
            m = data[names.index(want)] if want is not None else data[0]
            s.model, s.max_model_len = m.get("id"), m.get("max_model_len")
            out[s.url] = {"model": s.model, "max_model_len": s.max_model_len}
        return out

    @property
    def max_model_len(self) -> Optional[int]:
        lens = [s.max_model_len for s in self.servers if s.max_model_len]
        return min(lens) if lens else None

    # ------------------------------------------------------------------ dispatch
    def _free(self, s: _Server) -> bool:
        cap = self.cfg.max_inflight_per_server
        return cap is None or s.inflight < cap

    def _pick(self, prefer: Optional[str], exclude: set) -> Optional[_Server]:
        """The least-loaded server with a free slot (None: all full): not ``exclude``d unless all
        are, healthy ones before ones whose last request failed (if none: the fewest failures in a row),
        ``prefer`` within the slack."""
        cands = [s for s in self.servers if s.url not in exclude] or list(self.servers)
        cands = [s for s in cands if self._free(s)]
        if not cands:
            return None
        now = time.monotonic()
        healthy = [s for s in cands if s.failures == 0 or
                   now - s.last_failure > min(_RECOVER_MAX_S, _RECOVER_S * s.failures)]
        if not healthy:  # all failed lately: the one with the fewest failures in a row (a dead server
            fewest = min(s.failures for s in cands)  # piles up failures, a hiccup has one)
            healthy = [s for s in cands if s.failures == fewest]
        least = min(s.inflight for s in healthy)
        if prefer is not None:
            for s in healthy:
                if s.url == prefer and s.inflight <= least + self.cfg.affinity_slack:
                    return s
        best = [s for s in healthy if s.inflight == least]
        return best[next(self._rr) % len(best)]

    def _backoff(self, attempt: int) -> float:
        base = min(self.cfg.backoff_max_s, self.cfg.backoff_s * (2 ** attempt))
        return base * (0.75 + 0.5 * self._rng.random()) if base > 0 else 0.0

    # ------------------------------------------------------------------ requests
    async def generate(self, token_ids: Sequence[int], audios: Sequence[AudioItem], *,
                       max_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                       top_k: int = -1, seed: Optional[int] = None,
                       stop_token_ids: Optional[Sequence[int]] = None,
                       extra_sampling_params: Optional[dict] = None,
                       prompt_logprobs: bool = False,
                       routed_experts_prompt_start: Optional[int] = None,
                       prefer: Optional[str] = None) -> GenerateResult:
        """Sample one continuation of ``token_ids`` (one ``<|audio_pad|>`` per clip of ``audios``).

        ``prompt_logprobs``: also return log p of every prompt token (teacher forcing / scoring).
        ``routed_experts_prompt_start``: return routed experts from this prompt position on (R3).
        ``prefer``: URL of the server to use if it is not much busier than the others.
        """
        sp: dict[str, Any] = {"n": 1, "max_tokens": int(max_tokens), "temperature": float(temperature),
                              "top_p": float(top_p), "logprobs": 0, "detokenize": False}
        if top_k not in (-1, 0, None):
            sp["top_k"] = int(top_k)
        if seed is not None:
            sp["seed"] = int(seed)
        if stop_token_ids:
            sp["stop_token_ids"] = [int(t) for t in stop_token_ids]
        if prompt_logprobs:
            sp["prompt_logprobs"] = 0
        if routed_experts_prompt_start is not None:
            sp["routed_experts_prompt_start"] = int(routed_experts_prompt_start)
        if extra_sampling_params:
            sp.update(extra_sampling_params)
        body = {"request_id": f"mgrpo-{uuidlib.uuid4().hex}", "token_ids": [int(t) for t in token_ids],
                "sampling_params": sp, "return_token_ids": True, "output_mode": "tokens"}
        if audios:
            body["content_parts"] = [a.content_part() for a in audios]
        return await self._request(body, prefer=prefer)

    async def _request(self, body: dict, *, prefer: Optional[str]) -> GenerateResult:
        import aiohttp

        if self._session is None:
            raise RuntimeError("RolloutClient is not open: use `async with RolloutClient(cfg) as c`")
        errors: list[str] = []
        failed: set = set()
        attempts = self.cfg.max_retries + 1
        for attempt in range(attempts):
            async with self._sem:
                async with self._slots:   # least-loaded among the servers with a free slot
                    server = None
                    while server is None:
                        server = self._pick(prefer if attempt == 0 else None, failed)
                        if server is None:
                            await self._slots.wait()
                    server.inflight += 1
                t0 = time.monotonic()
                try:
                    if server.model is None and self.cfg.model is None:
                        await self.model_info(server.url)
                    body["model"] = self.cfg.model or server.model
                    result = await self._post(server, body)
                    server.failures = 0
                    server.served += 1
                    result.seconds = time.monotonic() - t0
                    self.stats["requests"] += 1
                    self.stats["seconds"] += result.seconds
                    return result
                except RolloutServerError as e:
                    if not e.retryable:
                        raise
                    err = e
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                    err = RolloutServerError(
                        f"rollout server {server.url} {_unreachable_or_died(e)} ({_describe(e)})",
                        url=server.url)
                finally:
                    await self._release(server)
            server.failures += 1
            server.last_failure = time.monotonic()
            failed.add(server.url)
            errors.append(str(err))
            self.stats["failures"] += 1
            if attempt + 1 < attempts:
                delay = self._backoff(attempt)
                log.warning("rollout request failed (%s); retry %d/%d in %.1f s", err, attempt + 1,
                            self.cfg.max_retries, delay)
                self.stats["retries"] += 1
                await asyncio.sleep(delay)
        raise RolloutServerError(
            f"rollout request failed after {attempts} attempt{'s' if attempts != 1 else ''} "
            f"(servers tried: {', '.join(sorted(failed))}): " + " | ".join(errors[-3:]) +
            " — check that the server(s) run (`mgrpo serve`) and their logs; rollout.max_retries / "
            "rollout.request_timeout_s set the retry policy", url=",".join(sorted(failed)) or None)

    async def _release(self, server: _Server) -> None:
        async with self._slots:
            server.inflight -= 1
            self._slots.notify_all()

    async def _post(self, server: _Server, body: dict) -> GenerateResult:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.cfg.request_timeout_s,
                                        sock_connect=self.cfg.connect_timeout_s)
        async with self._session.post(server.url + GENERATE_PATH, json=body, timeout=timeout) as r:
            text = await r.text()
            if r.status != 200:
                msg = _error_message(text)
                if r.status == 403 and "scale-out" in text.lower():
                    raise RolloutRequestError(
                        f"rollout server {server.url} does not serve {GENERATE_PATH}: start it with "
                        "`mgrpo serve` (or pass --enable-scale-out to vLLM)", url=server.url, status=403)
                if r.status == 401:
                    raise RolloutRequestError(f"rollout server {server.url} refused the API key (401): "
                                              "set rollout.api_key / VLLM_API_KEY", url=server.url, status=401)
                if r.status in _RETRY_STATUS:
                    raise RolloutServerError(f"rollout server {server.url} answered {r.status}: {msg}",
                                             url=server.url)
                hint = ""
                if "may be provided in one prompt" in msg:
                    hint = (" — a conversation carries the prompt's clips plus one per tool clip: start "
                            "the server with a higher `mgrpo serve --max-audio-per-prompt` (vLLM's "
                            "--limit-mm-per-prompt) or lower rollout.max_tool_calls")
                elif "audio_filesize_mb" in msg or "audio" in msg.lower() and "duration" in msg.lower():
                    hint = (" — a clip is longer than the server's audio limits: start it with `mgrpo serve "
                            "--max-audio-seconds N`, N at least the data's longest recording in seconds "
                            "(`mgrpo launch slurm` passes data.max_audio_seconds)")
                raise RolloutRequestError(f"rollout server {server.url} refused the request "
                                          f"({r.status}): {msg}{hint}", url=server.url, status=r.status)
        try:
            data = json.loads(text)
            return _parse_generate(server.url, data, body)
        except RolloutServerError:
            raise
        except Exception as e:  # a malformed answer: treat as a server fault
            raise RolloutServerError(f"rollout server {server.url} sent an answer we cannot read "
                                     f"({type(e).__name__}: {e}): {text[:300]}", url=server.url) from None


def _parse_generate(url: str, data: dict, body: dict) -> GenerateResult:
    choices = data.get("choices") or []
    if len(choices) != 1:
        raise RolloutServerError(f"rollout server {url} returned {len(choices)} choices, expected 1",
                                 url=url)
    ch = choices[0]
    finish = ch.get("finish_reason") or "stop"
    if finish == "abort":
        raise RolloutServerError(f"rollout server {url} aborted the request (paused for a weight "
                                 "push, or shutting down)", url=url)
    if finish not in ("stop", "length"):
        raise RolloutServerError(f"rollout server {url} ended the request with finish_reason "
                                 f"{finish!r}", url=url)
    ids = [int(t) for t in ch.get("token_ids") or []]
    lp_content = (ch.get("logprobs") or {}).get("content") or []
    if len(lp_content) != len(ids):
        raise RolloutServerError(f"rollout server {url} returned {len(ids)} tokens but "
                                 f"{len(lp_content)} logprobs", url=url)
    lps = []
    for i, (t, c) in enumerate(zip(ids, lp_content)):
        if int(c.get("token_id", t)) != t:
            raise RolloutServerError(f"rollout server {url}: logprob {i} is for token "
                                     f"{c.get('token_id')}, not the sampled {t}", url=url)
        lps.append(float(c["logprob"]))
    prompt_ids = data.get("prompt_token_ids")
    if prompt_ids is None:
        raise RolloutServerError(f"rollout server {url} did not return prompt_token_ids", url=url)
    ph = [(int(p["offset"]), int(p["length"])) for p in (data.get("mm_placeholders") or {}).get("audio", [])]
    versions = ch.get("weight_versions") or []
    version = None
    if versions:
        vs = [v.get("version") for v in versions]
        version = min(vs, key=_version_key)
    routed = None
    if ch.get("routed_experts"):
        routed = np.load(io.BytesIO(base64.b64decode(ch["routed_experts"])), allow_pickle=False)
    plp = None
    if body["sampling_params"].get("prompt_logprobs") is not None:
        raw = data.get("prompt_logprobs")
        if raw is None:
            raise RolloutServerError(f"rollout server {url} did not return prompt_logprobs", url=url)
        plp = [None]
        for pos, entry in enumerate(raw[1:], start=1):
            tok = str(prompt_ids[pos])
            if entry is None or tok not in entry:
                raise RolloutServerError(f"rollout server {url}: no prompt logprob for token "
                                         f"{prompt_ids[pos]} at {pos}", url=url)
            plp.append(float(entry[tok]["logprob"]))
    return GenerateResult(url=url, prompt_token_ids=[int(t) for t in prompt_ids], audio_placeholders=ph,
                          token_ids=ids, logprobs=lps, finish_reason=finish,
                          stop_reason=ch.get("stop_reason"), weight_version=version,
                          routed_experts=routed, prompt_logprobs=plp)


def _version_key(v) -> tuple:
    s = str(v)
    return (0, int(s), "") if s.lstrip("-").isdigit() else (1, 0, s)


def _error_message(text: str) -> str:
    try:
        d = json.loads(text)
        err = d.get("error", d)
        if isinstance(err, dict):
            return str(err.get("message") or err)[:500]
        return str(err)[:500]
    except Exception:
        return text[:500]


def _describe(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    s = str(e) or type(e).__name__
    return f"{type(e).__name__}: {s}"[:300]


def _unreachable_or_died(e: BaseException) -> str:
    import aiohttp

    if isinstance(e, (aiohttp.ClientConnectorError, ConnectionRefusedError)):
        return "is unreachable"
    if isinstance(e, asyncio.TimeoutError):
        return "did not answer in time"
    if isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError,
                      ConnectionResetError, BrokenPipeError)) or \
            getattr(e, "errno", None) in (errno.ECONNRESET, errno.EPIPE):
        return "closed the connection mid-request (died or restarted?)"
    return "failed"
