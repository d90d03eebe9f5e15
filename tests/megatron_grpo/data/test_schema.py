"""Row schema check: exact error messages (file, line, reason, fix) and the span helpers."""
import json

import pytest

from megatron_grpo.data.schema import DataError, check_row, format_span, parse_span

TOOLS = json.dumps([{"type": "function", "function": {"name": "crop_audio", "parameters": {
    "type": "object", "properties": {"start_sec": {"type": "number"}, "end_sec": {"type": "number"}},
    "required": ["start_sec", "end_sec"]}}}])


@pytest.fixture
def base(tmp_path):
    (tmp_path / "audio").mkdir()
    (tmp_path / "audio" / "a.mp3").write_bytes(b"x")
    (tmp_path / "audio" / "b.wav").write_bytes(b"x")
    return tmp_path


def good_row(**over):
    row = {"tools": TOOLS, "audios": ["audio/a.mp3"],
           "messages": [{"role": "user", "content": "<audio>\nWhen is the beep? Answer [MM:SS - MM:SS]."}],
           "ground_truth": "[00:12 - 00:14]"}
    row.update(over)
    return {k: v for k, v in row.items() if v is not _DROP}


_DROP = object()


def err(row, base, line_no=7, path="train.jsonl"):
    with pytest.raises(DataError) as ei:
        check_row(row, path=path, line_no=line_no, base_dir=base)
    assert isinstance(ei.value, ValueError)
    return str(ei.value)


def test_good_rows_pass(base):
    check_row(good_row(), path="train.jsonl", line_no=1, base_dir=base)
    # tools as a list, no ground truth, extra columns, two audios, absolute path, system message
    check_row(good_row(tools=json.loads(TOOLS), ground_truth=_DROP, event={"type": "beep"},
                       audios=["audio/a.mp3", str(base / "audio" / "b.wav")],
                       messages=[{"role": "system", "content": "You are helpful."},
                                 {"role": "user", "content": "<audio> then <audio>\nCompare."}]),
              path="train.jsonl", line_no=2, base_dir=base)
    check_row(good_row(tools=_DROP), path="x.jsonl", line_no=3, base_dir=base)


def test_not_an_object(base):
    assert err([1, 2], base) == ("train.jsonl line 7: a row must be a JSON object, got list — write one "
                                 'object per line: {"messages": [...], "audios": [...], ...}')


def test_missing_messages(base):
    assert err(good_row(messages=_DROP), base) == (
        "train.jsonl line 7: missing 'messages' — add \"messages\": "
        "[{\"role\": \"user\", \"content\": \"<audio>\\n...\"}]")


def test_messages_not_a_list(base):
    assert err(good_row(messages="hi"), base, line_no=3) == (
        "train.jsonl line 3: 'messages' must be a non-empty list, got string — "
        'write "messages": [{"role": "user", "content": "..."}]')
    assert "got an empty list" in err(good_row(messages=[]), base)


def test_message_without_role_or_content(base):
    assert err(good_row(messages=[{"content": "<audio>"}]), base) == (
        "train.jsonl line 7: messages[0] has no 'role' — each message needs "
        '{"role": "user"|"assistant"|"system"|"tool", "content": "..."}')
    assert err(good_row(messages=[{"role": "user", "content": None}]), base) == (
        "train.jsonl line 7: messages[0]['content'] must be a string, got null — "
        "write the text (with one <audio> tag per audio) as a string")


def test_audios_missing_or_not_list(base):
    assert err(good_row(audios=_DROP), base) == (
        "train.jsonl line 7: missing 'audios' — add \"audios\": [\"path/to/file.mp3\"] "
        "with one entry per <audio> tag")
    assert err(good_row(audios="audio/a.mp3"), base) == (
        "train.jsonl line 7: 'audios' must be a list of path strings, got string — "
        'write "audios": ["audio/0001.mp3", ...]')
    assert err(good_row(audios=[3]), base) == (
        "train.jsonl line 7: 'audios' must be a list of path strings, got list with a non-string "
        'or empty entry — write "audios": ["audio/0001.mp3", ...]')


def test_tag_count_mismatch(base):
    two_tags = [{"role": "user", "content": "<audio><audio>\nWhen?"}]
    assert err(good_row(messages=two_tags), base) == (
        "train.jsonl line 7: 2 <audio> tags but 1 entry in 'audios' — "
        "add the missing audio path or remove a tag")
    no_tag = [{"role": "user", "content": "When?"}]
    assert err(good_row(messages=no_tag, audios=["audio/a.mp3", "audio/b.wav"]), base) == (
        "train.jsonl line 7: 0 <audio> tags but 2 entries in 'audios' — "
        "add an <audio> tag to the message text or remove the extra path")


def test_missing_audio_file(base):
    msg = err(good_row(audios=["audio/nope.mp3"]), base, path="data/train.jsonl", line_no=12)
    assert msg == (f"data/train.jsonl line 12: audio file not found: 'audio/nope.mp3' "
                   f"(looked at {base / 'audio' / 'nope.mp3'}) — fix the path; relative paths are "
                   "resolved against the JSONL file's directory")


def test_tools_not_json(base):
    assert err(good_row(tools="[{not json"), base) == (
        "train.jsonl line 7: 'tools' is a string but not valid JSON "
        "(Expecting property name enclosed in double quotes at char 2) — "
        "write it as json.dumps(list_of_tool_specs)")
    assert err(good_row(tools=json.dumps({"name": "crop_audio"})), base) == (
        "train.jsonl line 7: 'tools' must be a list of tool specs, got object — "
        'use a list such as [{"type": "function", "function": {"name": ...}}]')
    assert err(good_row(tools=json.dumps([{"type": "function", "function": {}}])), base) == (
        "train.jsonl line 7: 'tools'[0] has no function name — give each spec "
        '{"type": "function", "function": {"name": ..., "parameters": ...}}')


@pytest.mark.parametrize("gt", ["00:12 - 00:14", "[0:12-0:75]", "[00:14 - 00:12]", "[12 - 14]", 12])
def test_bad_ground_truth(base, gt):
    assert err(good_row(ground_truth=gt), base) == (
        f"train.jsonl line 7: 'ground_truth' {gt!r} is not a time span — write it as "
        "'[MM:SS - MM:SS]', e.g. '[01:05 - 01:20]', with start <= end")


def test_parse_and_format_span():
    assert parse_span("[01:05 - 01:20]") == (65.0, 80.0)
    assert parse_span(" [1:05-1:20] ") == (65.0, 80.0)
    assert parse_span("[00:01.5 - 00:02]") == (1.5, 2.0)
    assert parse_span("[100:00 - 100:30]") == (6000.0, 6030.0)
    assert format_span(65, 80) == "[01:05 - 01:20]"
    assert format_span(65.4, 79.2) == "[01:05 - 01:20]"           # floor start, ceil end
    assert format_span(0, 0) == "[00:00 - 00:00]"
    for a, b in [(0, 1), (59, 61), (65, 80), (299, 300), (3599, 3660)]:
        assert parse_span(format_span(a, b)) == (a, b)
    for bad in ["", "01:05 - 01:20", "[01:65 - 01:70]", "[01:20 - 01:05]", "[a:b - c:d]", None]:
        with pytest.raises(ValueError) as ei:
            parse_span(bad)
        assert not isinstance(ei.value, DataError)
    for a, b in [(-1, 2), (5, 4), (float("nan"), 3)]:
        with pytest.raises(ValueError):
            format_span(a, b)
