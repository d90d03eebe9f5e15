"""One sample's conversation as HTML: context turns (prompt, tool results) as text with their clips
playable in place, generated turns with each token piece shaded by how far the rollout's logprob
is from the trainer's.

Segments follow ``loss_mask_T``: a run of 0s is context (its audio-token runs become players of
the trajectory's clips, in order), a run of 1s is a generated turn. Shading: ``|rollout - trainer|``
of a piece's tokens (the largest), in :data:`SHADES` buckets; a shaded piece's title gives both
logprobs of its last token.
"""
from __future__ import annotations

from html import escape

import numpy as np

SHADES = (0.01, 0.05, 0.2, 0.5, 1.0)
"""|rollout - trainer| logprob (nats) from which a piece gets shade 1, 2, ... (class d1..d5)."""


def shade(diff: float) -> int:
    return int(np.searchsorted(SHADES, diff, side="right"))


def segments(mask) -> list[tuple[int, int, int]]:
    """(start, end, mask value) runs of ``mask``."""
    m = np.asarray(mask, dtype=np.int64)
    if m.size == 0:
        return []
    cut = np.flatnonzero(m[1:] != m[:-1]) + 1
    starts = np.concatenate([[0], cut])
    ends = np.concatenate([cut, [m.size]])
    return [(int(a), int(b), int(m[a])) for a, b in zip(starts, ends)]


def _clip_html(path: str, seconds: float, k: int) -> str:
    return (f'<span class="clip"><audio controls preload="none" src="{path}"></audio>'
            f'<span class="cl">clip {k} · {seconds:.1f} s</span></span>')


def context_html(ids, detok, audio_token_id: int, clips: list, clip_no: int) -> tuple[str, int]:
    """HTML of a context run; its audio runs play ``clips[clip_no:]`` in order. Returns the next clip_no."""
    out, k, n = [], 0, len(ids)
    while k < n:
        if int(ids[k]) == audio_token_id:
            j = k
            while j < n and int(ids[j]) == audio_token_id:
                j += 1
            if clip_no < len(clips):
                out.append(_clip_html(*clips[clip_no], clip_no))
            else:
                out.append(f'<span class="sp">[{j - k} audio tokens, no clip recorded]</span>')
            clip_no += 1
            k = j
            continue
        j = k
        while j < n and int(ids[j]) != audio_token_id:
            j += 1
        for _, _, text, added in detok.pieces(ids[k:j]):
            out.append(f'<span class="sp">{escape(text)}</span>' if added else escape(text))
        k = j
    return "".join(out), clip_no


def generated_html(ids, rollout_lp, trainer_lp, detok) -> str:
    """HTML of a generated run; ``trainer_lp`` None: not shaded."""
    out = []
    diff = None if trainer_lp is None else np.abs(np.asarray(rollout_lp, np.float64) - np.asarray(trainer_lp, np.float64))
    for a, b, text, added in detok.pieces(ids):
        t = escape(text)
        cls = "sp" if added else ""
        title = ""
        if diff is not None:
            d = int(np.argmax(diff[a:b])) + a
            s = shade(float(diff[d]))
            if s:
                cls = f"{cls} d{s}".strip()
                title = f' title="rollout {rollout_lp[d]:.4f} trainer {trainer_lp[d]:.4f}"'
        out.append(f'<span class="{cls}"{title}>{t}</span>' if cls else t)
    return "".join(out)


def conversation_html(ids, mask, rollout_lp, trainer_lp, detok, audio_token_id: int, clips: list,
                      start: int = 0, clip_no: int = 0) -> str:
    """The turns of ``ids[start:]`` (``clips``: (path, seconds) of each clip of the trajectory;
    ``clip_no``: clips already shown before ``start``)."""
    html, turn = [], 0
    for a, b, m in segments(mask):
        if b <= start:
            continue
        a = max(a, start)
        if m:
            turn += 1
            body = generated_html(ids[a:b], rollout_lp[a:b], None if trainer_lp is None else trainer_lp[a:b], detok)
            kind = "tool call" if "&lt;tool_call&gt;" in body or "tool_call" in body else "answer"
            html.append(f'<div class="gen"><div class="lab">turn {turn} · generated · {kind}</div>{body}</div>')
        else:
            body, clip_no = context_html(ids[a:b], detok, audio_token_id, clips, clip_no)
            kind = "tool result" if "tool_response" in body else "context"
            html.append(f'<div class="ctx"><div class="lab">{kind}</div>{body}</div>')
    return "".join(html)
