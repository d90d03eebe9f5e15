"""One sample's conversation as HTML: context turns (prompt, tool results) as text with their clips
playable in place, generated turns with each token piece shaded by how far the rollout's logprob
is from the trainer's.

Segments follow ``loss_mask_T``: a run of 0s is context (its audio-token runs become players of
the trajectory's clips, in order), a run of 1s is a generated turn. Shading: ``|rollout - trainer|``
of a piece's tokens (the largest), in :data:`SHADES` buckets; a piece shaded from :data:`TITLED` up
gives both logprobs of that token in its title.
"""
from __future__ import annotations


import numpy as np

SHADES = (0.01, 0.05, 0.2, 0.5, 1.0)
"""|rollout - trainer| logprob (nats) from which a piece gets shade 1, 2, ... (class d1..d5)."""
TITLED = 3
"""Pieces from this shade up (|diff| >= 0.2) carry both logprobs in their title: a title per token
would triple a large page and the browser's load time (measured: 13 MB -> 5.8 MB, 21 s -> 6 s)."""


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
            out.append(f'<span class="sp">{text}</span>' if added else text)
        k = j
    return "".join(out), clip_no


def generated_html(ids, rollout_lp: list, trainer_lp, detok) -> str:
    """HTML of a generated run (logprobs as lists); ``trainer_lp`` None: not shaded."""
    pieces = detok.pieces(ids)
    if trainer_lp is None:
        return "".join(f'<span class="sp">{t}</span>' if added else t for _, _, t, added in pieces)
    diff = [abs(r - t) for r, t in zip(rollout_lp, trainer_lp)]
    shades = np.searchsorted(SHADES, diff, side="right").tolist()
    out = []
    for a, b, text, added in pieces:
        d = a if b - a == 1 else max(range(a, b), key=diff.__getitem__)
        s, t = shades[d], text
        if s >= TITLED:
            sp = "sp " if added else ""
            out.append(f'<span class="{sp}d{s}" title="rollout {rollout_lp[d]:.4f} trainer {trainer_lp[d]:.4f}">{t}</span>')
        elif s:
            out.append(f'<span class="{"sp " if added else ""}d{s}">{t}</span>')
        else:
            out.append(f'<span class="sp">{t}</span>' if added else t)
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
