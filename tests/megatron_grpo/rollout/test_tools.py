"""Tool-call parsing, argument checks, safe execution and the built-in crop_audio (no server)."""
import asyncio

import numpy as np
import pytest
import soundfile as sf

from megatron_grpo.rollout.config import RolloutConfig
from megatron_grpo.rollout.tools import (BUILTIN_TOOLS, Tool, ToolCall, ToolContext, ToolRefused,
                                         ToolRegistry, ToolResult, crop_audio, format_seconds,
                                         parse_tool_calls, validate_arguments)

SR = 16000


def run(coro):
    return asyncio.run(coro)


def _wave(seconds=10.0):
    return (np.arange(int(seconds * SR)) / SR).astype(np.float32)   # sample value = its time


# ----------------------------------------------------------------------------------- parsing
def test_parse_hermes_calls():
    text = ('<think>\nlet me listen\n</think>\n<tool_call>\n{"name": "crop_audio", "arguments": '
            '{"start_sec": 1.5, "end_sec": 3}}\n</tool_call>\n<tool_call>{"name": "x", "arguments": '
            '"{\\"a\\": 1}"}</tool_call>')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("crop_audio", {"start_sec": 1.5, "end_sec": 3}, None), ("x", {"a": 1}, None)]
    assert parse_tool_calls("no calls [00:01 - 00:02]") == []


@pytest.mark.parametrize("body, err", [
    ('{"name": "crop_audio", "arguments": {"start_sec": 1 "end_sec": 2}}', "malformed tool call JSON"),
    ("", "empty <tool_call>"),
    ('["crop_audio"]', "must be a JSON object"),
    ('{"arguments": {}}', 'has no "name"'),
    ('{"name": "crop_audio", "arguments": [1, 2]}', '"arguments" must be a JSON object'),
    ('{"name": "crop_audio", "arguments": "{bad"}', '"arguments" is a string but not JSON'),
])
def test_parse_malformed_calls(body, err):
    (c,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert c.error is not None and err in c.error, c.error


def test_parse_unclosed_call():
    (c,) = parse_tool_calls('<tool_call>\n{"name": "crop_audio", "arguments": {"start_sec": 1')
    assert "not closed" in c.error and c.name == "crop_audio"
    (c,) = parse_tool_calls('<tool_call>{"name": "crop_audio", "arguments": {"start_sec": 1, "end_sec": 2}}')
    assert c.error is None and c.arguments == {"start_sec": 1, "end_sec": 2}


def test_parse_stray_close_is_a_failed_call():
    """A turn that closes a call it never opened (a tiny model's garble) is a call attempt with an
    error, so the policy answers it with an error tool turn rather than ending the rollout."""
    text = 'I will crop the part from 23. "crop_audio", "end_sec": 80}}\n</tool_call>'
    (c,) = parse_tool_calls(text)
    assert c.error == ("</tool_call> without an opening <tool_call>: write a call as <tool_call>{\"name\": ..., "
                       "\"arguments\": {...}}</tool_call>")
    assert c.name is None and c.arguments == {} and c.raw.endswith('"end_sec": 80}}')
    (c,) = parse_tool_calls('x {"name": "crop_audio", "arguments": {"start_sec": 1}}</tool_call>')
    assert c.name == "crop_audio" and c.error.startswith("</tool_call> without an opening")
    # an opening tag anywhere: the usual parse (here a closed call with a stray closer after it)
    calls = parse_tool_calls('<tool_call>{"name": "x", "arguments": {}}</tool_call> </tool_call>')
    assert [(c.name, c.error) for c in calls] == [("x", None)]
    assert parse_tool_calls("the answer [00:01 - 00:02]") == []


def test_validate_arguments():
    schema = BUILTIN_TOOLS["crop_audio"].parameters
    assert validate_arguments(schema, {"start_sec": 1, "end_sec": 2.5}) is None
    assert "missing required argument: end_sec" in validate_arguments(schema, {"start_sec": 1})
    assert "must be number" in validate_arguments(schema, {"start_sec": "1", "end_sec": 2})
    assert "must be number" in validate_arguments(schema, {"start_sec": True, "end_sec": 2})
    strict = dict(schema, additionalProperties=False)
    assert "unknown argument: foo" in validate_arguments(strict, {"start_sec": 1, "end_sec": 2, "foo": 1})


# ----------------------------------------------------------------------------------- execution
def _ctx(tmp_path=None, wave=None, paths=(), roots=None, **cfg):
    return ToolContext(audios=[wave if wave is not None else _wave()], audio_paths=paths,
                       audio_roots=roots, config=RolloutConfig(**cfg))


def test_execute_errors_never_raise():
    def boom(x, *, ctx):
        raise RuntimeError("disk on fire")

    async def slow(*, ctx):
        await asyncio.sleep(5)

    def bad_return(*, ctx):
        return object()

    reg = ToolRegistry([
        Tool("boom", boom, {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}),
        Tool("slow", slow, timeout_s=0.05), Tool("bad_return", bad_return)])
    ctx = _ctx()
    cases = [
        (ToolCall("boom", {"x": 1}, ""), "error: boom failed: RuntimeError: disk on fire"),
        (ToolCall("boom", {}, ""), "error: boom: missing required argument: x"),
        (ToolCall("nope", {}, ""), "error: unknown tool 'nope'; available tools: bad_return, boom, slow"),
        (ToolCall(None, {}, "", error="malformed tool call JSON (x)"), "error: malformed tool call JSON (x). Write"),
        (ToolCall("slow", {}, ""), "error: slow did not finish within 0.05 s"),
        (ToolCall("bad_return", {}, ""), "error: bad_return returned a object"),
    ]
    for call, want in cases:
        res = run(reg.execute(call, ctx))
        assert res.error and res.text.startswith(want), (want, res.text)


def test_tool_returns_normalised():
    reg = ToolRegistry([Tool("t", lambda *, ctx: ("hi", np.ones(400, np.float64)))])
    res = run(reg.execute(ToolCall("t", {}, ""), _ctx()))
    assert res.text == "hi" and res.audios[0].dtype == np.float32 and not res.error
    reg = ToolRegistry([Tool("t", lambda *, ctx: np.full(10, np.nan, np.float32))])
    assert run(reg.execute(ToolCall("t", {}, ""), _ctx())).error


def test_tool_definition_errors():
    with pytest.raises(ValueError, match="must accept a keyword argument `ctx`"):
        Tool("t", lambda a: a)
    with pytest.raises(ValueError, match="identifier-like"):
        Tool("bad name!", lambda *, ctx: "")
    with pytest.raises(ValueError, match="required"):
        Tool("t", lambda *, ctx: "", {"type": "object", "properties": {}, "required": ["x"]})


# ----------------------------------------------------------------------------------- crop_audio
def test_crop_exact_samples_and_clamping():
    w = _wave(10.0)
    res = crop_audio(2.0, 3.5, ctx=_ctx(wave=w))
    (clip,) = res.audios
    assert len(clip) == int(1.5 * SR) and clip[0] == w[2 * SR] and clip[-1] == w[int(3.5 * SR) - 1]
    assert res.text == "Audio from 00:02 to 00:03.50 (1.50 s) of the recording:"
    res = crop_audio(-4, 99, ctx=_ctx(wave=w))
    assert len(res.audios[0]) == len(w)
    assert "start clamped to 0" in res.text and "end clamped to 00:10" in res.text
    res = crop_audio(1, 9, ctx=_ctx(wave=w, crop_max_seconds=2.0))
    assert len(res.audios[0]) == 2 * SR and "longest allowed clip of 2 s" in res.text


@pytest.mark.parametrize("start, end, msg", [
    (5, 5, "must be less than end_sec"), (7, 3, "must be less than end_sec"),
    (12, 15, "past the end of the recording"), (-5, -1, "before the start"),
    (1.0, 1.05, "crop at least 0.1 s"), (float("nan"), 2, "finite number"),
])
def test_crop_invalid_seconds_refused(start, end, msg):
    with pytest.raises(ToolRefused, match=msg):
        crop_audio(start, end, ctx=_ctx(wave=_wave(10.0)))


def test_crop_file_access_confined_to_roots(tmp_path):
    inside, outside = tmp_path / "data", tmp_path / "elsewhere"
    inside.mkdir(), outside.mkdir()
    w = _wave(4.0)
    sf.write(inside / "a.wav", w, SR, subtype="FLOAT")
    sf.write(inside / "b.wav", w[::-1].copy(), SR, subtype="FLOAT")
    sf.write(outside / "secret.wav", w, SR, subtype="FLOAT")
    ctx = _ctx(wave=w, paths=(str(inside / "a.wav"),), roots=[str(inside)])
    reg = ToolRegistry([BUILTIN_TOOLS["crop_audio"]])

    ok = run(reg.execute(ToolCall("crop_audio", {"start_sec": 0, "end_sec": 1, "audio_path": "b.wav"}, ""), ctx))
    assert not ok.error and np.array_equal(ok.audios[0], w[::-1][:SR])
    for path in (str(outside / "secret.wav"), "../elsewhere/secret.wav", "/etc/hosts"):
        res = run(reg.execute(ToolCall("crop_audio", {"start_sec": 0, "end_sec": 1, "audio_path": path}, ""), ctx))
        assert res.error and "outside the dataset's audio roots" in res.text and not res.audios, res.text
    # the conversation's own recording lies outside the configured roots: refused too
    ctx2 = _ctx(wave=w, paths=(str(outside / "secret.wav"),), roots=[str(inside)])
    res = run(reg.execute(ToolCall("crop_audio", {"start_sec": 0, "end_sec": 1}, ""), ctx2))
    assert res.error and "outside the dataset's audio roots" in res.text
    # no roots at all: the prompt's own clip can be cropped, no file can be read
    ctx3 = _ctx(wave=w, paths=(str(inside / "a.wav"),), roots=None)
    assert not run(reg.execute(ToolCall("crop_audio", {"start_sec": 0, "end_sec": 1}, ""), ctx3)).error
    res = run(reg.execute(ToolCall("crop_audio", {"start_sec": 0, "end_sec": 1, "audio_path": "b.wav"}, ""), ctx3))
    assert res.error and "outside" in res.text


def test_format_seconds():
    assert format_seconds(65) == "01:05" and format_seconds(65.25) == "01:05.25"
    assert format_seconds(0.5) == "00:00.50" and format_seconds(600) == "10:00"
