'''Tokenizer and processor files of the tiny Qwen3-Omni checkpoint.

A byte-level BPE (Qwen2's pre-tokenizer regex, NFC, byte-level alphabet) is trained on the
corpus embedded below, so every machine gets the same vocabulary, then wrapped as a
``Qwen2Tokenizer`` with Qwen3-Omni's added tokens appended in their released order (ids stay
consecutive, ``<think>``/``<tool_call>`` non-special as in Qwen3). The chat template renders
hermes-style tools, multimodal list content, assistant ``reasoning_content`` and tool messages.
The processor side (Whisper features, 128 mel, 16 kHz; Qwen2-VL image/video processors) is
written as plain JSON, which works with or without a working torchvision.
'''
from __future__ import annotations

import json
from pathlib import Path

# Qwen2/Qwen3 pre-tokenizer: contractions, letters, single digits, punctuation runs, newlines.
PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                     r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

#: Qwen3-Omni's added tokens in their released order (ids 151643..151675 in the real vocab;
#: here they follow the BPE vocabulary). (token, special): Qwen3 marks <tool_call>, <think>,
#: fim/repo and <tool_response> tokens as non-special so they survive decoding.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
    ("<|audio_start|>", True), ("<|audio_end|>", True), ("<tts_pad>", True),
    ("<tts_text_bos>", True), ("<tts_text_eod>", True), ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)

#: tokenizer attributes the Qwen3-Omni processor reads (``tokenizer.audio_token`` ...).
NAMED_TOKENS = {
    "image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>", "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
}

#: role words that must be single tokens (config's system/user/assistant_token_id).
ROLE_WORDS = ("system", "user", "assistant")

# Training text for the BPE. Plain English about the product's task (listening, cropping audio,
# answering time spans), chat roles and tool-call JSON, so common words become single tokens.
# Kept in the package (not read from the OS) so the vocabulary is the same everywhere.
CORPUS = r"""
system
You are a helpful assistant. You listen to the audio and answer the question of the user.
user
Listen to the recording and tell me when the speaker talks about the weather.
assistant
The speaker talks about the weather between [00:12 - 00:31]. The answer is [00:12 - 00:31].
user
When does the music start? When does the music stop? Please answer with a time span.
assistant
I will crop the audio first to listen to the part that matters.
user
What is said at the start of the recording? What is said at the end of the recording?
assistant
The recording starts with a short greeting. At the end the speaker says thank you and goodbye.
system
You may call one or more functions to assist with the user query.
user
Find the part of the audio where a dog barks, then give the start and the end of that part.
assistant
The dog barks from [01:05 - 01:09]. The answer is [01:05 - 01:09].
{"name": "crop_audio", "arguments": {"start_sec": 10, "end_sec": 20}}
{"name": "crop_audio", "arguments": {"start_sec": 65.5, "end_sec": 70.25}}
{"name": "crop_audio", "arguments": {"start_sec": 0, "end_sec": 30}}
{"type": "function", "function": {"name": "crop_audio", "description": "Crop the audio to a
time range and return the new audio clip.", "parameters": {"type": "object", "properties":
{"start_sec": {"type": "number", "description": "Start of the range in seconds."}, "end_sec":
{"type": "number", "description": "End of the range in seconds."}}, "required": ["start_sec",
"end_sec"]}}}
The tool returns a new audio clip. The clip starts at the start second and ends at the end
second. The clip is shorter than the whole recording, so it is easier to listen to.
Hello! Hello world. What? Yes. No. Maybe. Thank you. Goodbye. The answer is yes.
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 20 25 30 45 50 60 90 100 120 1000 2024 2025
00:00 00:05 00:10 00:15 00:20 00:25 00:30 00:45 01:00 01:30 02:00 05:00 10:00 59:59
[00:00 - 00:10] [00:10 - 00:20] [00:20 - 00:30] [01:00 - 01:30] [02:15 - 02:45]
The meeting starts at ten and the speaker explains the plan for the week. Then the second
speaker asks a question about the budget, and the first speaker answers it. After that there
is a long pause, some noise, and then music until the end of the recording.
A train passes in the distance while two people talk on the platform. One of them laughs.
The weather report says it will rain in the morning and be sunny in the afternoon.
The teacher reads a story to the children. The story is about a small bird that learns to
sing. The children listen, and at the end they clap their hands.
In the first minute the host introduces the show. In the second minute the guest tells a
story about the city where she grew up. In the third minute they talk about food and music.
user
Where in the audio does the second speaker begin? Give the time span in minutes and seconds.
assistant
Let me think. The second speaker begins after the pause. I will crop the audio to check.
The second speaker begins at [00:42 - 00:58]. The answer is [00:42 - 00:58].
user
How long is the silence in the middle of the recording?
assistant
The silence lasts about four seconds, from [00:33 - 00:37].
This is a test. This is only a test. The quick brown fox jumps over the lazy dog.
The sound of the wind, the sound of the rain, the sound of the sea, the sound of a bell.
system
You are a careful listener. Think step by step, call the tool when you need a closer listen,
and give the final answer as a time span in the form [MM:SS - MM:SS].
user
Listen to the audio. When does the speaker say the word "river"?
assistant
The word river is said near the middle. I will crop the audio around that time.
The word river is said at [00:51 - 00:53]. The answer is [00:51 - 00:53].
The function takes the start and the end of the range in seconds and returns the audio clip.
If the range is outside the recording, the tool returns an error and the assistant tries again.
A good answer covers the whole event and not much more. The reward is the overlap of the
answer with the true time span, divided by the size of their union.
"""

# Qwen3-style chat template (hermes tools) extended with Qwen3-Omni's multimodal parts.
# - tools: a system turn listing the tool signatures inside <tools></tools>;
# - content may be a string or a list of parts (text / audio / image / video), for every role,
#   including tool messages (a tool that returns an audio clip);
# - assistant turns after the last real user query render ``reasoning_content`` (or a
#   <think>...</think> prefix of their content) as a think block, as Qwen3 does; earlier turns
#   drop it;
# - consecutive tool messages share one user turn of <tool_response> blocks;
# - ``enable_thinking=false`` appends an empty think block to the generation prompt.
CHAT_TEMPLATE = r"""{%- macro render_content(content) -%}
{%- if content is string -%}{{- content -}}
{%- elif content is none -%}
{%- else -%}
{%- for part in content -%}
{%- if part is string -%}{{- part -}}
{%- elif part.type == 'image' or 'image' in part or 'image_url' in part -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
{%- elif part.type == 'video' or 'video' in part or 'video_url' in part -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
{%- elif part.type == 'audio' or part.type == 'input_audio' or 'audio' in part or 'audio_url' in part or 'input_audio' in part -%}{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}
{%- elif part.type == 'text' or 'text' in part -%}{{- part.text -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- render_content(messages[0].content) + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1, found=false) %}
{%- for message in messages[::-1] %}
{%- set index = (messages|length - 1) - loop.index0 %}
{%- if not ns.found and message.role == 'user' %}
{%- set text = render_content(message.content) %}
{%- if not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) %}
{%- set ns.found = true %}{%- set ns.last_query_index = index %}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = render_content(message.content) %}
{%- if message.role == 'system' %}
{%- if not loop.first %}{{- '<|im_start|>system\n' + content + '<|im_end|>\n' }}{%- endif %}
{%- elif message.role == 'user' %}
{{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning = '' %}
{%- if message.reasoning_content is string %}{%- set reasoning = message.reasoning_content %}
{%- elif '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{{- '<|im_start|>assistant\n' }}
{%- if loop.index0 > ns.last_query_index and reasoning %}
{{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
{%- else %}{{- content }}{%- endif %}
{%- if message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- if (loop.first and content) or not loop.first %}{{- '\n' }}{%- endif %}
{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"""


def build_tokenizer(bpe_vocab_size: int = 480):
    """Train the byte-level BPE on :data:`CORPUS` and wrap it as a Qwen2Tokenizer with the
    Qwen3-Omni added tokens, special-token attributes and chat template."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import AddedToken, Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=bpe_vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    bpe.train_from_iterator([CORPUS], trainer=trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab = model["vocab"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]

    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, bos_token=None,
                         eos_token=None, pad_token=None, errors="replace",
                         clean_up_tokenization_spaces=False, model_max_length=32768,
                         split_special_tokens=False)
    # one call, in the released order, so the ids are consecutive right after the BPE vocab
    tok.add_tokens([AddedToken(t, special=s, normalized=False, lstrip=False, rstrip=False,
                               single_word=False) for t, s in ADDED_TOKENS])
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|endoftext|>"
    tok._set_model_specific_special_tokens(special_tokens=NAMED_TOKENS)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def token_ids(tok) -> dict[str, int]:
    """Ids of the added tokens and of the role words (each of which must be one token)."""
    ids = {t: tok.convert_tokens_to_ids(t) for t, _ in ADDED_TOKENS}
    for word in ROLE_WORDS:
        enc = tok.encode(word, add_special_tokens=False)
        if len(enc) != 1:
            raise RuntimeError(f"role word {word!r} is not a single token ({enc}); "
                               "add it to the embedded corpus")
        ids[word] = enc[0]
    return ids


def padded_vocab_size(tok, multiple: int = 64) -> int:
    """Embedding rows: the tokenizer length rounded up like Qwen pads its vocabulary."""
    return (len(tok) + multiple - 1) // multiple * multiple


def save_tokenizer(tok, out_dir: str | Path) -> list[str]:
    """``save_pretrained`` the tokenizer and rewrite its JSON files with sorted keys, so the bytes
    only depend on the tokenizer. Returns the file names written."""
    out_dir = Path(out_dir)
    files = [Path(f).name for f in tok.save_pretrained(str(out_dir))]
    for name in files:
        path = out_dir / name
        if path.suffix == ".json" and name != "tokenizer.json" and path.exists():
            write_json(path, json.loads(path.read_text()))
    return sorted(set(files))


_IMAGE_PROCESSING = {
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "merge_size": 2,
    "patch_size": 16, "temporal_patch_size": 2, "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"shortest_edge": 3136, "longest_edge": 65536},
}


def processor_files() -> dict[str, dict]:
    """The processor configs as the release has them: Whisper feature extractor (128 mel,
    16 kHz, 30 s windows) and Qwen2-VL image processor in ``preprocessor_config.json``, the
    video processor and the processor class."""
    pre = {
        "processor_class": "Qwen3OmniMoeProcessor",
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": 128, "sampling_rate": 16000, "hop_length": 160, "chunk_length": 30,
        "n_fft": 400, "n_samples": 480000, "nb_max_frames": 3000, "padding_side": "right",
        "padding_value": 0.0, "return_attention_mask": True, "dither": 0.0,
        "image_processor_type": "Qwen2VLImageProcessor", **_IMAGE_PROCESSING,
    }
    vid = {
        "processor_class": "Qwen3OmniMoeProcessor", "video_processor_type": "Qwen2VLVideoProcessor",
        **_IMAGE_PROCESSING, "min_frames": 2, "max_frames": 16, "fps": 2.0,
    }
    return {
        "preprocessor_config.json": pre,
        "video_preprocessor_config.json": vid,
        "processor_config.json": {"processor_class": "Qwen3OmniMoeProcessor"},
    }


def write_json(path: str | Path, obj) -> None:
    """Stable JSON: sorted keys, 2-space indent, trailing newline."""
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
