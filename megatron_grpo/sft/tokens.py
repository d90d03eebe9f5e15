"""An SFT conversation as the trainer's sample: token ids from the chat template, the loss mask on
what the model generates, the clips' audio-token runs.

The ids are cut out of the tokenizer's own chat template by prefix renders, the way a rollout
builds them: for assistant message i,

    prefix_i = template(messages[:i], add_generation_prompt=True)      everything before the reply
    full_i   = template(messages[:i + 1])                              ... and the reply

``full_i[len(prefix_i):]`` is the reply as the template writes it (a think block reformatted,
``tool_calls`` rendered as ``<tool_call>`` blocks), followed by the template's close
(``<|im_end|>\\n``). The reply and the close's first token (the stop token the model samples)
carry the loss (mask 1); the rest of the close and every prompt, tool and template token do not
(mask 0), exactly as in a rollout trajectory (``rollout.conversation``); the sample ends at the
last stop token. Each ``<|audio_pad|>`` then becomes its clip's run of audio tokens
(``data.features``: the count vLLM and the trainer both use).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from megatron_grpo.rollout.render import ToolTurnRenderer, template_messages
from megatron_grpo.trajectory import Trajectory

__all__ = ["SftTemplateError", "conversation_pieces", "sft_sample"]


class SftTemplateError(ValueError):
    """The chat template renders a conversation so that its replies cannot be cut out of it."""


def conversation_pieces(renderer: ToolTurnRenderer, messages: list, tools: Optional[list]
                        ) -> list[tuple[str, bool]]:
    """``[(text, trained)]`` whose texts concatenate to the template's rendering of ``messages``
    up to the last reply's stop token; ``trained`` marks each reply with its stop token."""
    msgs = template_messages(messages)
    probe = renderer.render([{"role": "user", "content": "u"}, {"role": "assistant", "content": "MGRPO_A"}],
                            tools, False)
    close = probe[probe.rindex("MGRPO_A") + len("MGRPO_A"):]
    stop = renderer.tokenizer.decode(renderer.tokenizer.encode(close, add_special_tokens=False)[:1])
    if not close.startswith(stop) or not stop:
        raise SftTemplateError(f"the chat template closes an assistant turn with {close!r}: no stop token found")
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prefix = renderer.render(msgs[:i], tools, True)
        full = renderer.render(msgs[:i + 1], tools, False)
        if not prefix.startswith(done) or not full.startswith(prefix) or not full.endswith(close):
            raise SftTemplateError(
                f"messages[{i}]: the chat template renders the conversation before this reply differently "
                "once the reply follows (or the reply does not end with the template's close "
                f"{close!r}); the reply's tokens cannot be cut out of it")
        pieces.append((prefix[len(done):], False))
        pieces.append((full[len(prefix):len(full) - len(close)] + stop, True))
        done = full[:len(full) - len(close)] + stop  # the close's rest opens the next piece
    return [p for p in pieces if p[0]]


def sft_sample(row, tokenizer, audios: Sequence[np.ndarray], *, audio_token_id: int,
               chat_template_kwargs: Optional[dict] = None, hop_length: int = 160, n_window: int = 50
               ) -> Trajectory:
    """The :class:`~megatron_grpo.trajectory.Trajectory` of SFT row ``row`` (``sft.rows.SftRow``)
    with its clips' waveforms ``audios``: ids, assistant-only loss mask, audio runs; no logprobs."""
    from megatron_grpo.data.features import audio_token_counts

    renderer = ToolTurnRenderer(tokenizer, chat_template_kwargs)
    ids, mask = [], []
    for text, trained in conversation_pieces(renderer, row.messages, row.tools or None):
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        mask += [int(trained)] * len(piece)
    counts = audio_token_counts(list(audios), hop_length, n_window) if len(audios) else []
    pads = [t for t, x in enumerate(ids) if x == audio_token_id]
    where = f"{row.source} line {row.line}"
    if len(pads) != len(audios):
        raise SftTemplateError(f"{where}: the chat template renders {len(pads)} audio placeholders for "
                               f"{len(audios)} clips")
    if any(mask[t] for t in pads):
        raise SftTemplateError(f"{where}: an assistant turn holds an audio placeholder; audio goes into user or "
                               "tool messages")
    out_ids, out_mask, last = [], [], 0
    for t, n in zip(pads, counts):
        out_ids += ids[last:t] + [audio_token_id] * int(n)
        out_mask += mask[last:t] + [0] * int(n)
        last = t + 1
    out_ids += ids[last:]
    out_mask += mask[last:]
    return Trajectory(prompt_index=row.prompt_index, group_id=row.prompt_index, input_ids_T=out_ids,
                      loss_mask_T=out_mask, rollout_logprobs_T=[0.0] * len(out_ids), audios=list(audios),
                      audio_token_counts=[int(n) for n in counts], columns=dict(row.columns), num_turns=sum(
                          1 for m in row.messages if m["role"] == "assistant"), finish_reason="sft")
