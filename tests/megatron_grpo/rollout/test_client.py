"""Rollout client: retries with backoff, timeouts, clear errors naming the URL, least-loaded
dispatch over several servers, bounded concurrency (fake in-process servers), and one request with
audio against the real vLLM server."""
import asyncio
import socket
import time

import numpy as np
import pytest
from aiohttp import web

from megatron_grpo.rollout.client import (AudioItem, RolloutClient, RolloutRequestError,
                                          RolloutServerError, collapse_audio_runs)
from megatron_grpo.rollout.config import RolloutConfig


def test_collapse_audio_runs():
    assert collapse_audio_runs([1, 9, 9, 9, 2, 9, 3, 9, 9], 9) == [1, 9, 2, 9, 3, 9]
    assert collapse_audio_runs([], 9) == [] and collapse_audio_runs([1, 2], 9) == [1, 2]


def _ok_body(data):
    ids = data["token_ids"]
    return {"prompt_token_ids": ids, "mm_placeholders": None, "output_mode": "tokens",
            "choices": [{"index": 0, "finish_reason": "stop", "token_ids": [5, 6],
                         "weight_versions": [{"version": "3", "start": 0, "end": 2}],
                         "logprobs": {"content": [{"token_id": 5, "logprob": -0.5},
                                                  {"token_id": 6, "logprob": -1.5}]}}]}


class FakeServer:
    """An aiohttp server that speaks enough of vLLM's API; ``behave(n, data)`` picks the answer."""

    def __init__(self, behave=None, delay=0.0):
        self.behave = behave or (lambda n, data: "ok")
        self.delay = delay
        self.hits = 0
        self.inflight = 0
        self.max_inflight = 0
        self.peers = []

    async def models(self, request):
        return web.json_response({"data": [{"id": "fake", "max_model_len": 100}]})

    async def generate(self, request):
        data = await request.json()
        self.hits += 1
        self.peers.append(request.transport.get_extra_info("peername"))
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            what = self.behave(self.hits, data)
            if self.delay:
                await asyncio.sleep(self.delay)
            if what == "ok":
                return web.json_response(_ok_body(data))
            if what == "drop":
                request.transport.close()
                await asyncio.sleep(0.1)
                return web.Response(status=500)
            if what == "sleep":
                await asyncio.sleep(2.0)
                return web.json_response(_ok_body(data))
            if what == "abort":
                body = _ok_body(data)
                body["choices"][0]["finish_reason"] = "abort"
                return web.json_response(body)
            if what == "scaleout":
                return web.json_response({"error": {"message": "Scale-out endpoints are disabled. Restart "
                                                               "vllm serve with --enable-scale-out"}},
                                         status=403)
            if what == "audio_size":  # vLLM 0.32's answer to a clip over VLLM_MAX_AUDIO_CLIP_FILESIZE_MB
                return web.json_response({"error": {"message": "Maximum file size exceeded (parameter=audio_filesize_mb, "
                                                               "value=73.24224472045898)", "code": 400}}, status=400)
            status = int(what)
            return web.json_response({"error": {"message": f"fake error {status}", "code": status}},
                                     status=status)
        finally:
            self.inflight -= 1

    async def start(self):
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/inference/v1/generate", self.generate)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self):
        await self.runner.cleanup()


def _dead_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _cfg(urls, **kw):
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("backoff_max_s", 0.05)
    return RolloutConfig(server_urls=urls, **kw)


async def _with_servers(fakes, fn, **kw):
    servers = [await f.start() for f in fakes]
    try:
        async with RolloutClient(_cfg([s.url for s in servers] + kw.pop("extra_urls", []), **kw)) as c:
            return await fn(c)
    finally:
        for s in servers:
            await s.stop()


def _gen(c, **kw):
    return c.generate([1, 2, 3], [], max_tokens=2, **kw)


def test_ok_result_parsed():
    fake = FakeServer()
    res = asyncio.run(_with_servers([fake], _gen))
    assert res.token_ids == [5, 6] and res.logprobs == [-0.5, -1.5] and res.prompt_token_ids == [1, 2, 3]
    assert res.weight_version == "3" and res.finish_reason == "stop" and res.url == fake.url


def test_idle_connection_not_reused_past_server_keepalive():
    """A pooled connection idle for longer than KEEPALIVE_S is not reused: vLLM's server closes idle
    connections after VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s), and reusing one it is closing at that
    moment fails a request on a healthy server. Two requests 1.5*KEEPALIVE_S apart must use two
    connections (aiohttp's default pool would reuse the first)."""
    from vllm import envs

    from megatron_grpo.rollout.client import KEEPALIVE_S

    assert KEEPALIVE_S < envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    fake = FakeServer()

    async def go(c):
        await _gen(c)
        await _gen(c)           # back to back: the pooled connection is reused
        await asyncio.sleep(1.5 * KEEPALIVE_S)
        await _gen(c)           # after an idle gap: a fresh connection
    asyncio.run(_with_servers([fake], go))
    assert fake.peers[0] == fake.peers[1] and fake.peers[2] != fake.peers[1], fake.peers


def test_retry_then_success():
    fake = FakeServer(lambda n, d: "503" if n <= 2 else "ok")

    async def go(c):
        res = await _gen(c)
        return res, dict(c.stats)
    res, stats = asyncio.run(_with_servers([fake], go, max_retries=3))
    assert res.token_ids == [5, 6] and fake.hits == 3 and stats["retries"] == 2


def test_retries_exhausted_names_url():
    fake = FakeServer(lambda n, d: "500")
    with pytest.raises(RolloutServerError) as ei:
        asyncio.run(_with_servers([fake], _gen, max_retries=1))
    msg = str(ei.value)
    assert fake.hits == 2 and "after 2 attempts" in msg and fake.url in msg and "answered 500" in msg


def test_backoff_is_exponential():
    fake = FakeServer(lambda n, d: "503")
    t0 = time.monotonic()
    with pytest.raises(RolloutServerError):
        asyncio.run(_with_servers([fake], _gen, max_retries=3, backoff_s=0.1, backoff_max_s=10))
    # waits 0.1, 0.2, 0.4 (+-25% jitter) -> at least 0.525 s
    assert time.monotonic() - t0 >= 0.5


def test_unreachable_server_named():
    url = _dead_url()

    async def go():
        async with RolloutClient(_cfg([url], max_retries=0, model="fake")) as c:
            await _gen(c)
    with pytest.raises(RolloutServerError, match=f"rollout server {url} is unreachable"):
        asyncio.run(go())


def test_server_dies_mid_request_named():
    fake = FakeServer(lambda n, d: "drop")
    with pytest.raises(RolloutServerError, match="closed the connection mid-request") as ei:
        asyncio.run(_with_servers([fake], _gen, max_retries=0))
    assert fake.url in str(ei.value)


def test_timeout():
    fake = FakeServer(lambda n, d: "sleep")
    with pytest.raises(RolloutServerError, match="did not answer in time"):
        asyncio.run(_with_servers([fake], _gen, max_retries=0, request_timeout_s=0.3))


def test_client_errors_not_retried():
    fake = FakeServer(lambda n, d: "400")
    with pytest.raises(RolloutRequestError, match="refused the request \\(400\\): fake error 400"):
        asyncio.run(_with_servers([fake], _gen, max_retries=3))
    assert fake.hits == 1
    fake = FakeServer(lambda n, d: "audio_size")
    with pytest.raises(RolloutRequestError, match=r"refused the request \(400\): Maximum file size exceeded .* — a clip "
                                                  r"is longer than the server's audio limits: start it with `mgrpo serve "
                                                  r"--max-audio-seconds N`"):
        asyncio.run(_with_servers([fake], _gen, max_retries=3))
    assert fake.hits == 1
    fake = FakeServer(lambda n, d: "scaleout")
    with pytest.raises(RolloutRequestError, match="does not serve /inference/v1/generate: start it with `mgrpo serve`"):
        asyncio.run(_with_servers([fake], _gen, max_retries=3))
    assert fake.hits == 1


def test_abort_is_retried():
    fake = FakeServer(lambda n, d: "abort" if n == 1 else "ok")
    res = asyncio.run(_with_servers([fake], _gen, max_retries=1))
    assert res.token_ids == [5, 6] and fake.hits == 2


def test_all_failed_picks_server_with_fewest_failures():
    """Both servers failed lately (one is dead, one had a hiccup): a retry goes to the one with fewer
    failures in a row, every time -- not round-robin (a CI run lost a request to the dead one)."""
    c = RolloutClient(_cfg(["http://127.0.0.1:1", "http://127.0.0.1:2"]))
    dead, hiccup = c.servers
    dead.failures, hiccup.failures = 3, 1
    dead.last_failure = hiccup.last_failure = time.monotonic()
    picks = {c._pick(None, {dead.url, hiccup.url}).url for _ in range(6)}
    assert picks == {hiccup.url}


def test_failover_to_other_server():
    good = FakeServer()
    bad = FakeServer(lambda n, d: "503")

    async def go(c):
        return [await _gen(c, prefer=bad.url) for _ in range(3)]
    out = asyncio.run(_with_servers([bad, good], go, max_retries=1))
    assert all(r.url == good.url for r in out)
    assert bad.hits == 1   # after one failure the bad server is picked last


def test_failover_from_unreachable_server():
    good = FakeServer()
    dead = _dead_url()
    res = asyncio.run(_with_servers([good], lambda c: _gen(c, prefer=dead), max_retries=1, extra_urls=[dead]))
    assert res.url == good.url


def test_least_loaded_dispatch_and_bounded_concurrency():
    a, b = FakeServer(delay=0.2), FakeServer(delay=0.2)

    async def go(c):
        return await asyncio.gather(*(_gen(c) for _ in range(8)))
    out = asyncio.run(_with_servers([a, b], go, concurrency=4))
    assert a.hits == b.hits == 4
    assert a.max_inflight == b.max_inflight == 2          # 4 in flight over two servers
    slow, fast = FakeServer(delay=0.5), FakeServer(delay=0.02)
    asyncio.run(_with_servers([slow, fast], go, concurrency=8, max_inflight_per_server=2))
    assert slow.max_inflight <= 2 and fast.max_inflight <= 2 and fast.hits > slow.hits


def test_affinity_prefers_previous_server_unless_busy():
    a, b = FakeServer(), FakeServer()

    async def go(c):
        return [(await _gen(c, prefer=b.url)).url for _ in range(4)]
    assert asyncio.run(_with_servers([a, b], go)) == [b.url] * 4


def test_audio_item_is_lossless_and_content_addressed():
    w = np.random.default_rng(0).standard_normal(1600).astype(np.float32)
    a, b = AudioItem.from_waveform(w), AudioItem.from_waveform(w.copy())
    assert a.uuid == b.uuid and a.url.startswith("data:audio/wav;base64,")
    import base64, io
    import soundfile as sf
    back, sr = sf.read(io.BytesIO(base64.b64decode(a.url.split(",", 1)[1])), dtype="float32")
    assert sr == 16000 and np.array_equal(back, w)


@pytest.mark.slow
def test_real_server_generate_with_audio(vllm_server):
    """One request to the real vLLM: one pad per clip in, the server's expansion comes back."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vllm_server.spec.model)
    pad = tok.convert_tokens_to_ids("<|audio_pad|>")
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "Hi"}]}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    t = np.arange(3 * 16000) / 16000
    clip = AudioItem.from_waveform((0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32))

    async def go():
        async with RolloutClient(RolloutConfig(server_urls=[vllm_server.url], max_retries=0)) as c:
            return await c.generate(ids, [clip], max_tokens=5, seed=3)
    res = asyncio.run(go())
    assert collapse_audio_runs(res.prompt_token_ids, pad) == ids
    assert sum(t == pad for t in res.prompt_token_ids) == 39          # 3 s -> 300 frames -> 39 tokens
    assert res.audio_placeholders == [(ids.index(pad), 39)]
    assert len(res.token_ids) == len(res.logprobs) == 5 or res.finish_reason == "stop"
    assert all(lp <= 0 for lp in res.logprobs) and res.weight_version is not None
