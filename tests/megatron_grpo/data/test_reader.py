"""JSONL reader: message/audio representation, the bad-input catalogue (exact messages, or counted
skips with skip_bad_rows), seeded resumable iteration, DataConfig checks, and make-data end to end."""
import json
import logging
import os

import numpy as np
import pytest
import soundfile as sf

from megatron_grpo.data.config import DataConfig
from megatron_grpo.data.reader import (DataIterator, PromptRow, map_audio_parts, read_jsonl,
                                       split_audio_tags)
from megatron_grpo.data.schema import DataError
from megatron_grpo.data.synth import CROP_AUDIO_TOOL, TOOLS_JSON

SR = 16000
Q = "<audio>\nWhen is the beep? Answer [MM:SS - MM:SS]."


@pytest.fixture
def d(tmp_path):
    """A dataset dir with one audio file of each kind the catalogue needs."""
    a = tmp_path / "audio"
    a.mkdir()
    rng = np.random.default_rng(0)
    x = (0.1 * rng.standard_normal(2 * SR)).astype(np.float32)
    sf.write(a / "good.wav", x, SR, subtype="PCM_16")
    sf.write(a / "good.flac", x[:SR], SR)
    sf.write(a / "good.mp3", x, SR, format="MP3")
    sf.write(a / "hi.wav", np.zeros(44100, np.float32), 44100)
    sf.write(a / "zero.wav", np.zeros(0, np.float32), SR)
    (a / "empty.mp3").write_bytes(b"")
    (a / "bad.mp3").write_bytes(b"\x00garbage" * 100)
    sf.write(a / "long.wav", np.zeros(5 * SR, np.float32), SR)
    return tmp_path


def row(**over):
    r = {"tools": TOOLS_JSON, "audios": ["audio/good.wav"],
         "messages": [{"role": "user", "content": Q}], "ground_truth": "[00:00 - 00:01]"}
    r.update(over)
    return {k: v for k, v in r.items() if v is not None}


def write(d, lines, name="train.jsonl"):
    p = d / name
    with open(p, "wb") as f:
        for ln in lines:
            f.write(ln if isinstance(ln, bytes) else (ln if isinstance(ln, str) else json.dumps(ln)).encode())
            f.write(b"\n")
    return p


def read_err(p, **cfg) -> DataError:
    with pytest.raises(DataError) as ei:
        read_jsonl(p, DataConfig(**cfg))
    return ei.value


# ---- good rows -----------------------------------------------------------------------------------

def test_messages_tools_audio_and_columns(d):
    p = write(d, [
        "",
        row(id="a", event={"type": "beep"}),
        "   ",
        row(tools=[CROP_AUDIO_TOOL], audios=["audio/good.mp3", str(d / "audio" / "good.flac")],
            messages=[{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "First <audio>"},
                      {"role": "assistant", "content": "ok"},
                      {"role": "user", "content": "then <audio>?"}], ground_truth=None),
        row(tools=None),
    ])
    ds = read_jsonl(p)
    assert len(ds) == 3 and ds.num_lines == 3 and ds.summary() == "read 3 rows, none skipped"
    r0, r1, r2 = ds
    assert isinstance(r0, PromptRow)
    assert (r0.prompt_index, r0.line, r0.source) == (0, 2, str(p))
    assert r0.messages == [{"role": "user", "content": [
        {"type": "audio", "audio_index": 0},
        {"type": "text", "text": "\nWhen is the beep? Answer [MM:SS - MM:SS]."}]}]
    assert r0.tools == [CROP_AUDIO_TOOL]                                  # JSON string parsed
    assert r0.audio_paths == (str(d / "audio" / "good.wav"),)
    assert r0.columns == {"ground_truth": "[00:00 - 00:01]", "id": "a", "event": {"type": "beep"}}
    assert r0.audio_info[0].frames == 2 * SR and r0.audio_info[0].format == "WAV"
    assert (r1.prompt_index, r1.line) == (1, 4)
    assert r1.tools == [CROP_AUDIO_TOOL] and r1.columns == {}
    assert r1.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "First "}, {"type": "audio", "audio_index": 0}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "then "}, {"type": "audio", "audio_index": 1},
                                     {"type": "text", "text": "?"}]}]
    assert r1.audio_paths == (str(d / "audio" / "good.mp3"), str(d / "audio" / "good.flac"))
    assert r2.tools == []
    w = r1.load_audios()
    assert [len(x) for x in w] == [2 * SR, SR] and all(x.dtype == np.float32 for x in w)
    oa = r1.openai_messages(w)
    part = oa[1]["content"][1]
    assert part["type"] == "audio_url" and part["audio_url"]["url"].startswith("data:audio/wav;base64,")
    ia = r1.openai_messages(w, part="input_audio")[3]["content"][1]
    assert ia["type"] == "input_audio" and ia["input_audio"]["format"] == "wav"
    hf = r1.hf_messages(w)
    assert hf[3]["content"][1]["audio"] is w[1]
    assert r1.messages[1]["content"][1] == {"type": "audio", "audio_index": 0}   # untouched


def test_split_and_map_helpers():
    assert split_audio_tags("<audio><audio>x", 2) == (
        [{"type": "audio", "audio_index": 2}, {"type": "audio", "audio_index": 3}, {"type": "text", "text": "x"}], 4)
    assert split_audio_tags("no tags") == ([{"type": "text", "text": "no tags"}], 0)
    msgs = [{"role": "user", "content": [{"type": "audio", "audio_index": 1}]}, {"role": "user", "content": "s"}]
    assert map_audio_parts(msgs, lambda i: {"i": i}) == [{"role": "user", "content": [{"i": 1}]},
                                                         {"role": "user", "content": "s"}]


def test_crlf_and_bom(d):
    p = d / "win.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps(row()).encode() + b"\r\n\r\n" + json.dumps(row()).encode() + b"\r\n")
    ds = read_jsonl(p)
    assert [r.line for r in ds] == [1, 3]


def test_text_only_row(d):
    (r,) = read_jsonl(write(d, [row(audios=[], messages=[{"role": "user", "content": "Hi"}])]))
    assert r.messages == [{"role": "user", "content": "Hi"}] and r.audio_paths == () and r.load_audios() == []


def test_resample_on_by_default(d):
    ds = read_jsonl(write(d, [row(audios=["audio/hi.wav"])]))
    assert ds[0].audio_info[0].sample_rate == 44100
    assert len(ds[0].load_audios()[0]) == SR


# ---- bad-input catalogue ---------------------------------------------------------------------------

def catalogue(d):
    """(line content, kind, exact message after "train.jsonl line N: ")."""
    a = d / "audio"
    return [
        ('{"messages": [', "malformed JSON",
         "not valid JSON (Expecting value at column 15) — write each row as one complete JSON "
         "object on a single line"),
        (b'{"messages": [{"role": "user", "content": "caf\xe9 <audio>"}], "audios": ["audio/good.wav"]}',
         "not UTF-8",
         "the line is not valid UTF-8 (byte 0xe9 at column 47) — save the file as UTF-8 "
         "(e.g. iconv -f latin1 -t utf-8 IN > OUT)"),
        (row(messages=None), "missing key",
         "missing 'messages' — add \"messages\": [{\"role\": \"user\", \"content\": \"<audio>\\n...\"}]"),
        (row(audios=None), "missing key",
         "missing 'audios' — add \"audios\": [\"path/to/file.mp3\"] with one entry per <audio> tag"),
        (row(tools="[{not json"), "tools not JSON",
         "'tools' is a string but not valid JSON (Expecting property name enclosed in double quotes "
         "at char 2) — write it as json.dumps(list_of_tool_specs)"),
        (row(messages=[{"role": "user", "content": "<audio> and <audio>"}]), "audio tag count mismatch",
         "2 <audio> tags but 1 entry in 'audios' — add the missing audio path or remove a tag"),
        (row(audios=["audio/good.wav", "audio/good.mp3"]), "audio tag count mismatch",
         "1 <audio> tag but 2 entries in 'audios' — add an <audio> tag to the message text or remove "
         "the extra path"),
        (row(audios=["audio/nope.wav"]), "missing audio",
         f"audio file not found: 'audio/nope.wav' (looked at {a / 'nope.wav'}) — fix the path; "
         "relative paths are resolved against the JSONL file's directory"),
        (row(audios=["audio/bad.mp3"]), "corrupt audio",
         "audio 'audio/bad.mp3': cannot decode the audio (unrecognised or damaged audio data) — check "
         "that it is a valid wav/mp3/flac file (e.g. `ffprobe FILE`) and re-export it"),
        (row(audios=["audio/empty.mp3"]), "empty audio",
         "audio 'audio/empty.mp3': the audio file is empty (0 bytes) — re-export the audio or drop the row"),
        (row(audios=["audio/zero.wav"]), "empty audio",
         "audio 'audio/zero.wav': the audio has no samples (0 frames) — re-export the audio or drop the row"),
        (row(audios=["audio/long.wav"]), "audio too long",
         "audio 'audio/long.wav': the audio is 5 s long, over data.max_audio_seconds = 4 s — cut it "
         "into shorter clips or raise data.max_audio_seconds"),
        (row(audios=["audio/hi.wav"]), "wrong sample rate",
         "audio 'audio/hi.wav': the audio is sampled at 44100 Hz, the model needs 16000 Hz (and "
         "data.resample is false) — resample the file (e.g. ffmpeg -i IN -ar 16000 -ac 1 OUT.wav) or "
         "set data.resample=true"),
        (row(audios=["../outside.wav"]), "audio outside audio_roots",
         f"audio '../outside.wav': the audio lies outside data.audio_roots ({d}) — move it under one "
         "of them or add its directory to data.audio_roots"),
        (row(messages=[{"role": "assistant", "content": Q}]), "bad messages",
         "messages[0] (assistant) holds an <audio> tag; audio may only be in user messages — move the "
         "<audio> tag into a user message"),
        (row(ground_truth="12-14"), "bad ground_truth",
         "'ground_truth' '12-14' is not a time span — write it as '[MM:SS - MM:SS]', e.g. "
         "'[01:05 - 01:20]', with start <= end"),
        (row(ground_truth="[00:01 - 00:04]"), "bad ground_truth",  # good.wav is 2 s long
         "'ground_truth' '[00:01 - 00:04]' ends at 4 s, after the recording ends (2.0 s) — fix the span, or "
         "the audio file the row names"),
    ]


CFG = dict(max_audio_seconds=4.0, resample=False)


def test_each_bad_row_fails_with_exact_message(d):
    sf.write(d.parent / "outside.wav", np.zeros(SR, np.float32), SR)
    for i, (line, kind, msg) in enumerate(catalogue(d)):
        p = write(d, [row(), "", line], name=f"bad{i}.jsonl")
        e = read_err(p, **CFG)
        assert str(e) == f"{p} line 3: {msg}", kind
        assert (e.kind, e.line, e.path) == (kind, 3, str(p))


def test_too_large_file(d):
    p = write(d, [row(audios=["audio/good.mp3"])])
    e = read_err(p, max_audio_bytes=1000)
    assert str(e).startswith(f"{p} line 1: audio 'audio/good.mp3': the audio file is 0.0")
    assert str(e).endswith("MiB, over data.max_audio_bytes = 0.0 MiB — cut the recording into shorter "
                           "files or raise data.max_audio_bytes")
    assert e.kind == "audio file too large"


def test_skip_bad_rows_counts_and_reports(d, caplog):
    sf.write(d.parent / "outside.wav", np.zeros(SR, np.float32), SR)
    cat = catalogue(d)
    lines = [row(id=0)] + [c[0] for c in cat] + ["", row(id=1)]
    p = write(d, lines)
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.data"):
        ds = read_jsonl(p, DataConfig(skip_bad_rows=True, **CFG))
    assert [r.columns["id"] for r in ds] == [0, 1] and [r.prompt_index for r in ds] == [0, 1]
    assert [r.line for r in ds] == [1, len(lines)]
    assert [s.line for s in ds.skipped] == list(range(2, 2 + len(cat)))
    assert [s.message for s in ds.skipped] == [f"{p} line {i + 2}: {c[2]}" for i, c in enumerate(cat)]
    assert ds.summary() == (
        "skipped 17 of 19 rows: 2 audio tag count mismatch, 2 bad ground_truth, 2 empty audio, 2 missing key, "
        "1 audio outside audio_roots, 1 audio too long, 1 bad messages, "
        "1 corrupt audio, 1 malformed JSON, 1 missing audio, 1 not UTF-8, 1 tools not JSON, "
        "1 wrong sample rate")
    logged = [r.getMessage() for r in caplog.records]
    assert logged[-1] == f"{p}: {ds.summary()}"
    assert logged[0] == f"skipping bad row: {p} line 2: {cat[0][2]}"
    # the check before a run reads the file too, and leaves the logging to the run
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_grpo.data"):
        quiet = read_jsonl(p, DataConfig(skip_bad_rows=True, **CFG), log_skips=False)
    assert caplog.records == [] and quiet.summary() == ds.summary()


def test_summary_example_and_no_usable_rows(d):
    p = write(d, [row(audios=["audio/nope.wav"]), "{oops", row(audios=["audio/gone.wav"])]
              + [row()] * 197)
    ds = read_jsonl(p, DataConfig(skip_bad_rows=True))
    assert ds.summary() == "skipped 3 of 200 rows: 2 missing audio, 1 malformed JSON"
    # the check before a run logs no skipped row: the error names the first few itself
    p = write(d, [row(audios=["audio/nope.wav"]), "{oops"], name="allbad.jsonl")
    e = read_err(p, skip_bad_rows=True)
    missing = f"audio file not found: 'audio/nope.wav' (looked at {d / 'audio' / 'nope.wav'})"
    bad_json = "not valid JSON (Expecting property name enclosed in double quotes at column 2)"
    fix = "fix these rows (data.skip_bad_rows=false stops at the first one and says how)"
    assert str(e) == (f"{p}: no usable rows (skipped 2 of 2 rows: 1 malformed JSON, 1 missing audio): "
                      f"line 1: {missing}; line 2: {bad_json} — {fix}")
    p = write(d, [row(audios=["audio/nope.wav"]), "{oops", "", "{oops", "{oops"], name="allbad5.jsonl")
    with pytest.raises(DataError) as ei:
        read_jsonl(p, DataConfig(skip_bad_rows=True), log_skips=False)
    assert str(ei.value) == (f"{p}: no usable rows (skipped 4 of 4 rows: 3 malformed JSON, 1 missing audio): "
                             f"line 1: {missing}; line 2: {bad_json}; line 4: {bad_json}; and 1 more — {fix}")
    p = write(d, ["", "  "], name="blank.jsonl")
    assert str(read_err(p)) == f"{p}: the file has no rows — write one JSON object per line"
    assert str(read_err(d / "nope.jsonl")) == (f"{d / 'nope.jsonl'}: file not found — check the path "
                                                "(data.train_jsonl / data.dev_jsonl)")


def test_decode_check_catches_what_the_header_hides(d):
    sf.write(d / "audio" / "nan.wav", np.array([0.1, np.nan] * SR, np.float32), SR, subtype="FLOAT")
    p = write(d, [row(audios=["audio/nan.wav"])])
    read_jsonl(p)                                               # header check: passes
    e = read_err(p, audio_check="decode")
    assert e.kind == "corrupt audio"
    assert str(e) == (f"{p} line 1: audio 'audio/nan.wav': the audio holds non-finite samples (NaN or "
                      "inf) — re-export the audio")
    with pytest.raises(DataError) as ei:                        # lazily: names the row too
        read_jsonl(p)[0].load_audios()
    assert str(ei.value) == str(e)


def test_audio_roots(d, tmp_path_factory):
    other = tmp_path_factory.mktemp("elsewhere")
    sf.write(other / "x.wav", np.zeros(SR, np.float32), SR)
    p = write(d, [row(audios=[str(other / "x.wav")])])
    assert read_err(p, train_jsonl=str(p)).kind == "audio outside audio_roots"
    ds = read_jsonl(p, DataConfig(train_jsonl=str(p), audio_roots=[str(d), str(other)]))
    assert ds[0].audio_paths == (str(other / "x.wav"),)


# ---- iteration -------------------------------------------------------------------------------------

def _ds(d, n):
    return read_jsonl(write(d, [row(id=i) for i in range(n)], name=f"n{n}.jsonl"))


def ids(batch):
    return [r.prompt_index for r in batch]


def test_epochs_are_seeded_permutations(d):
    ds = _ds(d, 10)
    it = DataIterator(ds, 4, seed=3)
    stream = [i for _ in range(5) for i in ids(next(it))]          # 20 prompts = 2 epochs exactly
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))
    assert stream[:10] != stream[10:] and stream[:10] != list(range(10))
    assert stream[:10] == np.random.default_rng(np.random.SeedSequence([3, 0])).permutation(10).tolist()
    assert (it.epoch, it.index, it.consumed) == (2, 0, 20)
    again = DataIterator(ds, 4, seed=3)
    assert [i for _ in range(5) for i in ids(next(again))] == stream
    other = DataIterator(ds, 4, seed=4)
    assert [i for _ in range(5) for i in ids(next(other))] != stream
    plain = DataIterator.from_config(ds, DataConfig(shuffle=False), 3)
    assert [ids(next(plain)) for _ in range(4)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 1]]


def test_exact_resume(d):
    ds = _ds(d, 7)
    ref = DataIterator(ds, 3, seed=11)
    ref_batches = [ids(next(ref)) for _ in range(9)]
    it = DataIterator(ds, 3, seed=11)
    for _ in range(4):
        next(it)
    state = json.loads(json.dumps(it.state_dict()))                  # survives a checkpoint file
    assert state == {"epoch": 1, "index": 5, "seed": 11, "shuffle": True, "num_rows": 7,
                     "fingerprint": ds.fingerprint}
    resumed = DataIterator(ds, 3, seed=11)
    resumed.load_state_dict(state)
    assert [ids(next(resumed)) for _ in range(5)] == ref_batches[4:]


def test_resume_refuses_other_data(d):
    ds = _ds(d, 7)
    state = DataIterator(ds, 3, seed=11).state_dict()
    with pytest.raises(ValueError) as ei:
        DataIterator(ds, 3, seed=12).load_state_dict(state)
    assert str(ei.value) == (f"{ds.path}: the saved data position does not fit this data: saved with seed 11 "
                             "(now 12) — restore the original file/settings, or load with strict=False to "
                             "continue at the saved position anyway")
    other = _ds(d, 8)
    with pytest.raises(ValueError, match=r"saved with num_rows 7 \(now 8\), fingerprint"):
        DataIterator(other, 3, seed=11).load_state_dict(state)
    it = DataIterator(other, 3, seed=11)
    it.load_state_dict({**state, "index": 5}, strict=False)
    assert (it.epoch, it.index) == (0, 5)
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        DataIterator(ds, 0)


# ---- config -----------------------------------------------------------------------------------------

def test_data_config(tmp_path):
    from megatron_grpo import configtree

    c = DataConfig(train_jsonl=str(tmp_path / "a" / "t.jsonl"), dev_jsonl=str(tmp_path / "b" / "d.jsonl"))
    assert c.audio_roots is None and c.allowed_audio_roots == (str(tmp_path / "a"), str(tmp_path / "b"))
    assert (c.sample_rate, c.resample, c.skip_bad_rows, c.shuffle, c.seed) == (16000, True, False, True, 0)
    assert DataConfig().allowed_audio_roots == ()
    c2 = DataConfig(audio_roots=["x/../y", "y"])
    assert c2.audio_roots == [os.path.abspath("y")] and c2.allowed_audio_roots == (os.path.abspath("y"),)
    # the config-tree loader round-trips it, YAML types are coerced, unknown keys are named
    for cfg in (c, c2, DataConfig()):
        assert configtree.from_dict(DataConfig, configtree.to_dict(cfg)) == cfg
    y = configtree.from_dict(DataConfig, {"max_audio_seconds": 300, "audio_check": "decode"})
    assert y.max_audio_seconds == 300.0 and y.audio_check == "decode"
    with pytest.raises(configtree.ConfigKeyError, match=r"'full' is not one of \['header', 'decode'\]"):
        configtree.from_dict(DataConfig, {"audio_check": "full"})
    with pytest.raises(configtree.ConfigKeyError, match=r"did you mean 'skip_bad_rows'"):
        configtree.from_dict(DataConfig, {"skip_bad_row": True})
    assert set(configtree.field_docs(DataConfig)) == {f.name for f in __import__("dataclasses").fields(DataConfig)}
    for kw, msg in [
        (dict(max_audio_seconds=0), "data.max_audio_seconds must be > 0, got 0"),
        (dict(max_audio_seconds=-1), "data.max_audio_seconds must be a number of seconds >= 0, got -1"),
        (dict(min_audio_seconds=5, max_audio_seconds=4), "data.min_audio_seconds (5) must not exceed "
                                                         "data.max_audio_seconds (4)"),
        (dict(max_audio_bytes=1.5), "data.max_audio_bytes must be a positive int (bytes), got 1.5"),
        (dict(sample_rate=0), "data.sample_rate must be a positive int (Hz), got 0"),
        (dict(skip_bad_rows="yes"), "data.skip_bad_rows must be true or false, got 'yes'"),
        (dict(audio_check="full"), "data.audio_check must be 'header' or 'decode', got 'full'"),
        (dict(seed=-1), "data.seed must be an int >= 0, got -1"),
        (dict(audio_roots="/data"), "data.audio_roots must be a list of directories, got the single string "
                                    "'/data'; write ['/data']"),
        (dict(audio_roots=[]), "data.audio_roots is empty: name at least one directory (['/'] allows any "
                               "path), or leave it unset for the dataset's directory"),
        (dict(train_jsonl=""), "data.train_jsonl must be a path to a .jsonl file, got ''"),
    ]:
        with pytest.raises(ValueError) as ei:
            DataConfig(**kw)
        assert str(ei.value) == msg


# ---- end to end: make-data -> reader -> audio -> features -> token counts ------------------------------

def test_make_data_reads_back(tmp_path, tiny_ckpt):
    from transformers import AutoProcessor

    from megatron_grpo.data.features import audio_features, audio_token_count, audio_token_counts
    from megatron_grpo.data.synth import make_data

    s = make_data(tmp_path / "d", n=4, n_dev=1, seed=0, progress=False)
    cfg = DataConfig(train_jsonl=s["train_jsonl"], dev_jsonl=s["dev_jsonl"], audio_check="decode")
    train, dev = read_jsonl(cfg.train_jsonl, cfg), read_jsonl(cfg.dev_jsonl, cfg)
    assert (len(train), len(dev), train.skipped, dev.skipped) == (4, 1, [], [])
    proc = AutoProcessor.from_pretrained(str(tiny_ckpt))
    pad = proc.tokenizer.convert_tokens_to_ids("<|audio_pad|>")
    for r in list(train) + list(dev):
        (w,) = r.load_audios(cfg)
        assert w.dtype == np.float32 and abs(len(w) / SR - r.columns["duration_sec"]) < 0.2
        feats, lens = audio_features(proc.feature_extractor, [w])
        assert feats.shape == (128, int(lens.sum())) and lens.tolist() == [-(-len(w) // 160)]
        # what vLLM's chat template + processor expand the prompt to
        text = proc.apply_chat_template(r.hf_messages([w]), tools=r.tools, tokenize=False,
                                        add_generation_prompt=True)
        assert "crop_audio" in text and text.count("<|audio_pad|>") == 1
        # the rollout can render PromptRow.messages as they are: audio parts become the placeholder
        assert proc.tokenizer.apply_chat_template(r.messages, tools=r.tools, tokenize=False,
                                                  add_generation_prompt=True) == text
        after_tag = r.messages[0]["content"][1]["text"]                         # "\nWhen does ..."
        assert "<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|>" + after_tag + "<|im_end|>" in text
        ids = proc(text=[text], audio=[np.pad(w, (0, -len(w) % 160))], return_tensors="pt")["input_ids"][0]
        assert int((ids == pad).sum()) == audio_token_count(int(lens[0])) == audio_token_counts([w])[0]
