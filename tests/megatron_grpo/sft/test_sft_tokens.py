"""SFT samples: the loss mask covers exactly the assistant replies (think blocks, tool calls, the
stop token) as the chat template renders them; audio placeholders become their clips' runs."""
import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from megatron_grpo.data.features import audio_token_counts
from megatron_grpo.data.synth import CROP_AUDIO_TOOL
from megatron_grpo.rollout.render import ToolTurnRenderer, template_messages
from megatron_grpo.rollout.tools import parse_tool_calls
from megatron_grpo.sft.rows import SftRow
from megatron_grpo.sft.tokens import SftTemplateError, sft_sample

AUDIO_ID = 512  # the tiny checkpoint's <|audio_pad|>
CALL = '<tool_call>\n{"name": "crop_audio", "arguments": {"start_sec": 8.0, "end_sec": 14.0}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return AutoTokenizer.from_pretrained(tiny_ckpt)


def _row(messages, tools=(CROP_AUDIO_TOOL,)):
    return SftRow(prompt_index=3, messages=messages, tools=list(tools), clips=(), audio_paths=(), columns={},
                  source="mem.jsonl", line=4)


def _conversation(second_call_as_tool_calls: bool):
    reply1 = ({"role": "assistant", "content": "<think>\nThe beep is early.\n</think>\n\n",
               "tool_calls": [{"type": "function", "function": {"name": "crop_audio",
                                                                "arguments": {"start_sec": 8.0, "end_sec": 14.0}}}]}
              if second_call_as_tool_calls else
              {"role": "assistant", "content": f"<think>\nThe beep is early.\n</think>\n\n{CALL}"})
    return [
        {"role": "user", "content": [{"type": "audio", "audio_index": 0}, {"type": "text", "text": "\nWhen?"}]},
        reply1,
        {"role": "tool", "name": "crop_audio",
         "content": [{"type": "text", "text": "Audio from 00:08 to 00:14 (6.00 s) of the recording:"},
                     {"type": "audio", "audio_index": 1}]},
        # the template rewrites the think block: newlines stripped, then exactly one on each side
        {"role": "assistant", "content": "<think>\n\nIt starts at 10 s.</think>[00:10 - 00:12]"},
    ]


def _runs(mask):
    out, t = [], 0
    while t < len(mask):
        if mask[t]:
            u = t
            while u < len(mask) and mask[u]:
                u += 1
            out.append((t, u))
            t = u
        else:
            t += 1
    return out


@pytest.mark.parametrize("as_tool_calls", [False, True], ids=["inline_call", "tool_calls_field"])
def test_mask_is_exactly_the_replies_as_rendered(tok, as_tool_calls):
    msgs = _conversation(as_tool_calls)
    audios = [np.zeros(16000 * 20, np.float32), np.zeros(16000 * 6, np.float32)]
    s = sft_sample(_row(msgs), tok, audios, audio_token_id=AUDIO_ID)
    counts = audio_token_counts(audios)
    assert s.audio_token_counts == counts

    # the masked runs decode to each reply as the template writes it, stop token included
    replies = [tok.decode(s.input_ids_T[a:b]) for a, b in _runs(s.loss_mask_T)]
    assert replies == [f"<think>\nThe beep is early.\n</think>\n\n{CALL}<|im_end|>",
                       "<think>\nIt starts at 10 s.\n</think>\n\n[00:10 - 00:12]<|im_end|>"]
    assert parse_tool_calls(replies[0])[0].arguments == {"start_sec": 8.0, "end_sec": 14.0}

    # every token is the full template's, the audio pads expanded to their runs (mask 0); the
    # sample ends at the last stop token as a rollout does
    full = ToolTurnRenderer(tok).render(template_messages(msgs), [CROP_AUDIO_TOOL], False)
    assert full.endswith("<|im_end|>\n")
    want = []
    pads = iter(counts)
    for t in tok.encode(full[:-1], add_special_tokens=False):
        want += [t] * next(pads) if t == AUDIO_ID else [t]
    assert s.input_ids_T == want
    audio_runs = [b - a for a, b in _runs([int(t == AUDIO_ID) for t in s.input_ids_T])]
    assert audio_runs == counts
    assert not any(m for t, m in zip(s.input_ids_T, s.loss_mask_T) if t == AUDIO_ID)
    assert s.rollout_logprobs_T == [0.0] * len(want) and s.num_turns == 2


def test_clip_count_mismatch_is_refused(tok):
    msgs = _conversation(False)
    with pytest.raises(SftTemplateError) as e:
        sft_sample(_row(msgs), tok, [np.zeros(16000, np.float32)], audio_token_id=AUDIO_ID)
    assert str(e.value) == "mem.jsonl line 4: the chat template renders 2 audio placeholders for 1 clips"


def test_tool_arguments_roundtrip_json(tok):
    """The inline call's arguments are the JSON the rollout's parser reads back."""
    msgs = _conversation(True)
    s = sft_sample(_row(msgs), tok, [np.zeros(16000, np.float32)] * 2, audio_token_id=AUDIO_ID)
    first = tok.decode(s.input_ids_T[slice(*_runs(s.loss_mask_T)[0])])
    call = first.split("<tool_call>\n")[1].split("\n</tool_call>")[0]
    assert json.loads(call) == {"name": "crop_audio", "arguments": {"start_sec": 8.0, "end_sec": 14.0}}
