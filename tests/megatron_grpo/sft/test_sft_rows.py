"""SFT rows: one exact line per bad row (file, line, field, fix); `make-data --sft` writes expert
trajectories that read back, call crop_audio as the rollout tool answers it, and earn the top
format and IoU rewards."""
import json

import numpy as np
import pytest
import soundfile as sf

from megatron_grpo.data.synth import make_data
from megatron_grpo.rollout.rewards import format_reward, iou_reward, think_length_reward
from megatron_grpo.rollout.tools import ToolContext, crop_audio, parse_tool_calls
from megatron_grpo.sft.rows import read_sft_jsonl

U = {"role": "user", "content": "<audio>\nWhen?"}
A = {"role": "assistant", "content": "<think>\nx\n</think>\n\n[00:01 - 00:02]"}


def T(clips, content="Audio:<audio>"):
    return {"role": "tool", "name": "crop_audio", "content": content, "clips": clips}


BAD = {
    "{not json": "not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1)) — "
                 "write each row as one JSON object on a single line",
    json.dumps({"audios": ["rec.wav"], "messages": [U, A, T([[1, 2], [3, 4]]), A]}):
        "messages[2].clips has 2 entries for 1 <audio> tags in its content — give one clip (a path or "
        "[start_sec, end_sec]) per tag",
    json.dumps({"audios": ["rec.wav"], "messages": [U, A, T([[25, 30]]), A]}):
        "messages[2].clips[0] [25, 30]: start_sec (25) is at or past the end of the recording (20.00 s long) — "
        "crop inside the recording, start < end",
    json.dumps({"audios": ["rec.wav"], "messages": [U, A, T([{"start": 1}]), A]}):
        'messages[2].clips[0] must be a path or [start_sec, end_sec], got {"start": 1} — write a crop of the '
        "recording as two numbers of seconds, e.g. [10.0, 16.0]",
    json.dumps({"audios": ["rec.wav"], "messages": [U, A, T(["nope.wav"]), A]}):
        "messages[2].clips[0] 'nope.wav': audio file not found — fix the path or restore the file",
    json.dumps({"audios": ["rec.wav"], "messages": [U]}):
        "messages has no assistant turn: nothing to train on — add the assistant's reply (SFT trains on "
        "assistant turns only)",
    json.dumps({"audios": ["rec.wav"], "messages": [U, A, T([[1, 2]])]}):
        "messages[2] (tool) comes after the last assistant turn — end the conversation with an assistant turn",
    json.dumps({"audios": ["rec.wav"], "messages": [U, {"role": "assistant", "content": None}]}):
        "messages[1].content must be a string, got null — write the text (with <audio> tags for clips) as a string",
    json.dumps({"audios": ["rec.wav", "rec.wav"], "messages": [U, A]}):
        "1 <audio> tags in user messages but 2 entries in 'audios' — add an <audio> tag or remove the extra path",
}


@pytest.mark.parametrize("line", list(BAD), ids=range(len(BAD)))
def test_bad_row_names_file_line_field_and_fix(tmp_path, line):
    sf.write(tmp_path / "rec.wav", np.zeros(16000 * 20, np.float32), 16000)
    p = tmp_path / "sft.jsonl"
    p.write_text(json.dumps({"audios": ["rec.wav"], "messages": [U, A]}) + "\n\n" + line + "\n")
    with pytest.raises(ValueError) as e:
        read_sft_jsonl(p)
    assert str(e.value) == f"{p} line 3: {BAD[line]}"


def test_reply_with_only_tool_calls_and_clips_by_path(tmp_path):
    sf.write(tmp_path / "rec.wav", np.zeros(16000 * 20, np.float32), 16000)
    sf.write(tmp_path / "clip.wav", np.full(16000 * 2, 0.5, np.float32), 16000)
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "crop_audio", "arguments": {}}}]}
    p = tmp_path / "sft.jsonl"
    p.write_text(json.dumps({"audios": ["rec.wav"], "messages": [U, call, T(["clip.wav", [1.5, 3.0]],
                                                                          "<audio>and<audio>"), A]}) + "\n")
    row = read_sft_jsonl(p).rows[0]
    assert row.messages[1]["content"] == "" and [c[0] for c in row.clips] == ["file", "file", "crop"]
    assert row.messages[2]["content"] == [{"type": "audio", "audio_index": 1}, {"type": "text", "text": "and"},
                                          {"type": "audio", "audio_index": 2}]
    waves = row.load_audios()
    assert [len(w) for w in waves] == [16000 * 20, 16000 * 2, 24000] and float(waves[1][0]) == 0.5


def test_make_data_sft_expert_trajectories(tmp_path):
    make_data(tmp_path, n=3, n_dev=0, seed=5, progress=False, sft=True)
    prompts = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    rows = read_sft_jsonl(tmp_path / "sft.jsonl").rows
    assert len(rows) == 3
    for prompt, row in zip(prompts, rows):
        roles = [m["role"] for m in row.messages]
        assert roles == ["user", "assistant", "tool", "assistant"]
        assert row.messages[0]["content"][1]["text"] == prompt["messages"][0]["content"].removeprefix("<audio>")
        # the call parses as the rollout parses it, and the tool turn is the tool's own answer
        (call,) = parse_tool_calls(row.messages[1]["content"])
        wave = row.load_audios()[0]
        res = crop_audio(**call.arguments, ctx=ToolContext(audios=[wave]))
        assert row.messages[2]["content"][0]["text"] == res.text
        assert row.clips[1] == ("crop", call.arguments["start_sec"], call.arguments["end_sec"])
        ev = prompt["event"]
        assert call.arguments["start_sec"] <= ev["start_sec"] and ev["end_sec"] <= call.arguments["end_sec"]
        answer = row.messages[3]["content"]
        assert format_reward([answer]) == [1.0]
        assert iou_reward([answer], ground_truth=[prompt["ground_truth"]]) == [2.0]
        assert think_length_reward([answer]) == [1.0]
