"""The report's HTML: ``index.html`` (curves of reward, KL and step time from metrics.jsonl, a row and
a link per step) and ``step_{k:06d}.html`` (the step's metrics, then per group its prompt and its
row's short columns such as ``ground_truth``, and per
sample the reward terms, advantage, finish reason and turns). One inline stylesheet, no script, no
external asset: the pages work from a file:// URL. Exact values sit in ``data-v`` attributes beside
the rounded text, so a reader (or a test) can compare them with metrics.jsonl and the recording.
"""
from __future__ import annotations

import math
from html import escape

import numpy as np

from .conversation import SHADES, TITLED, conversation_html, segments

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:1.2em 2em;color:#1b1b1b;background:#fff}
h1{font-size:1.5em;margin:.2em 0}h2{font-size:1.15em;margin:.3em 0}
nav{margin-bottom:.6em}nav a{margin-right:1em}
table{border-collapse:collapse;margin:.4em 0}td,th{padding:1px 8px;text-align:right;border-bottom:1px solid #eee}
th:first-child,td:first-child{text-align:left}
.charts{display:flex;flex-wrap:wrap;gap:1em}.charts figure{margin:0}figcaption{font-size:.9em;color:#555}
.g{border:1px solid #ccd;border-radius:6px;margin:1em 0;padding:.4em .8em;background:#fafbff;content-visibility:auto;contain-intrinsic-size:auto 3000px}
.s{border-top:1px dashed #bbc;margin-top:.5em;padding-top:.4em}
.h{margin-bottom:.2em}.num{font-variant-numeric:tabular-nums;font-weight:600}
.terms{font-size:.9em}
#metrics{display:block}#metrics tbody{display:grid;grid-template-columns:repeat(auto-fill,minmax(240px,1fr));column-gap:2em}
#metrics tr{display:flex;justify-content:space-between}
.conv{white-space:pre-wrap;font:13px/1.5 ui-monospace,monospace;word-break:break-word}
.ctx,.gen{padding:.2em .4em;margin:.2em 0;border-radius:4px}.ctx{background:#f1f1f1}.gen{background:#eef7ee}
.lab{font:11px system-ui,sans-serif;color:#667;text-transform:uppercase;letter-spacing:.04em}
.sp{color:#8a8aa0}.clip{display:inline-flex;align-items:center;gap:.4em;vertical-align:middle}
.clip audio{height:28px}.cl{font:11px system-ui,sans-serif;color:#556}
.d1{background:#fde9d9}.d2{background:#fbc8a6}.d3{background:#f79a6e}.d4{background:#ee6a4a}.d5{background:#d7301f;color:#fff}
.legend span{padding:0 .4em;margin-right:.3em;border-radius:3px}
"""


def fmt(v) -> str:
    """A number as shown: 4 decimals from 0.001 up, else 3 significant digits with an exponent."""
    if isinstance(v, bool) or v is None or not isinstance(v, (int, float)):
        return escape(str(v))
    if isinstance(v, int) or (v.is_integer() and abs(v) < 1e15):
        return str(int(v))
    return f"{v:.4f}" if 1e-3 <= abs(v) < 1e7 else f"{v:.3e}"


def num(v) -> str:
    """A number's cell: the text of :func:`fmt`, the exact value in data-v."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return f'<td data-v="{v!r}">{fmt(v)}</td>'
    return f"<td>{fmt(v)}</td>"


def page(title: str, body: str) -> str:
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{CSS}</style></head><body>\n{body}\n</body></html>\n")


def step_file(step: int) -> str:
    return f"step_{step:06d}.html"


# ---- curves ---------------------------------------------------------------------------------------

COLORS = ("#1f77b4", "#d62728", "#2ca02c")


def svg_chart(series: list[tuple[str, list[tuple[float, float]]]], w: int = 380, h: int = 170) -> str:
    """A line chart of (label, [(x, y)]) series as inline SVG (non-finite points left out)."""
    series = [(n, [(x, y) for x, y in pts if isinstance(y, (int, float)) and math.isfinite(y)]) for n, pts in series]
    pts = [p for _, s in series for p in s]
    if not pts:
        return f'<svg width="{w}" height="{h}"><text x="10" y="20" font-size="12">no data</text></svg>'
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5 * (abs(y0) or 1), y1 + 0.5 * (abs(y1) or 1)
    L, R, T, B = 58, 8, 8, 22

    def X(x):
        return L + (x - x0) / (x1 - x0) * (w - L - R)

    def Y(y):
        return T + (y1 - y) / (y1 - y0) * (h - T - B)

    out = [f'<svg width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-size="11" font-family="sans-serif">',
           f'<rect x="{L}" y="{T}" width="{w - L - R}" height="{h - T - B}" fill="#fcfcfc" stroke="#ccc"/>',
           f'<text x="{L - 4}" y="{T + 9}" text-anchor="end">{y1:.3g}</text>',
           f'<text x="{L - 4}" y="{h - B}" text-anchor="end">{y0:.3g}</text>',
           f'<text x="{L}" y="{h - 6}">{x0:g}</text><text x="{w - R}" y="{h - 6}" text-anchor="end">{x1:g}</text>']
    for k, (name, s) in enumerate(series):
        c = COLORS[k % len(COLORS)]
        line = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in s)
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.6" points="{line}"/>')
        out += [f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="2" fill="{c}"/>' for x, y in s]
        if len(series) > 1:
            out.append(f'<text x="{L + 6}" y="{T + 14 + 12 * k}" fill="{c}">{escape(name)}</text>')
    out.append("</svg>")
    return "".join(out)


CHARTS = (("reward", ("reward/mean",)), ("KL", ("mismatch_kl_k3", "kl")), ("step time (s)", ("time/step",)))
INDEX_COLUMNS = ("reward/mean", "reward/std", "mismatch_kl_k3", "kl", "loss", "grad_norm", "time/step", "samples")


def index_html(run_name: str, metrics: dict[int, dict], pages: dict[int, str], note: str) -> str:
    rows = [metrics[s] for s in sorted(metrics)]
    charts = []
    for title, keys in CHARTS:
        series = [(k, [(r["step"], r.get(k)) for r in rows]) for k in keys if any(k in r for r in rows)]
        if series:
            charts.append(f'<figure data-chart="{escape(title)}">{svg_chart(series)}<figcaption>{escape(title)}: '
                          f'{escape(", ".join(k for k, _ in series))}</figcaption></figure>')
    cols = [c for c in INDEX_COLUMNS if any(c in r for r in rows)]
    head = "".join(f"<th>{escape(c)}</th>" for c in ["step", *cols, "page"])
    body = []
    for s in sorted(set(metrics) | set(pages)):
        r = metrics.get(s, {})
        link = f'<a href="{pages[s]}">step {s}</a>' if s in pages else ""
        body.append(f'<tr data-step="{s}"><td>{s}</td>' + "".join(num(r.get(c)) if c in r else "<td></td>"
                                                                for c in cols) + f"<td>{link}</td></tr>")
    return page(f"{run_name} · report", f"<h1>Run {escape(run_name)}</h1><p>{note}</p>"
                f'<div class="charts">{"".join(charts) or "<p>no metrics.jsonl rows</p>"}</div>'
                f'<table id="steps"><tr>{head}</tr>{"".join(body)}</table>')


# ---- step page ------------------------------------------------------------------------------------

def _legend() -> str:
    edges = list(SHADES) + [math.inf]
    parts = [f'<span class="d{k + 1}">≥ {edges[k]:g}</span>' for k in range(len(SHADES))]
    return ('<p class="legend">Generated tokens are shaded by |rollout − trainer| logprob (nats): '
            + "".join(parts) + f" (hover a piece from ≥ {SHADES[TITLED - 1]:g} for both).</p>")


def _first_generated(mask) -> int:
    m = np.flatnonzero(np.asarray(mask) == 1)
    return int(m[0]) if m.size else len(mask)


def _audio_runs(ids, audio_token_id: int) -> int:
    return sum(1 for a, b, v in segments(np.asarray(ids) == audio_token_id) if v)


def sample_html(i: int, t: dict, trainer_lp, detok, audio_token_id: int, clips: list, start: int) -> str:
    ids, mask, lp = t["input_ids_T"].tolist(), t["loss_mask_T"].tolist(), t["rollout_logprobs_T"].tolist()
    tl = None if trainer_lp is None else trainer_lp.tolist()
    gen = [k for k, m in enumerate(mask) if m]
    stats = ""
    if tl is not None and gen:
        d = np.abs(np.asarray([lp[k] for k in gen]) - np.asarray([tl[k] for k in gen]))
        stats = (f' · |Δ logprob| max <span class="num" data-v="{float(d.max())!r}">{fmt(float(d.max()))}</span>'
                 f' mean <span class="num" data-v="{float(d.mean())!r}">{fmt(float(d.mean()))}</span>')
    terms = "".join(f'<tr data-term="{escape(str(k))}"><th>{escape(str(k))}</th>{num(v)}</tr>'
                    for k, v in (t.get("reward_terms") or {}).items())
    my_clips = [clips[c] for c in t.get("audios", [])]
    conv = conversation_html(ids, mask, lp, tl, detok, audio_token_id, my_clips, start=start,
                             clip_no=_audio_runs(ids[:start], audio_token_id))
    r, a = float(t.get("reward", 0.0)), float(t.get("advantage", 0.0))
    return (f'<div class="s" id="s{i}" data-sample="{i}" data-reward="{r!r}" data-advantage="{a!r}" '
            f'data-finish="{escape(str(t.get("finish_reason", "")))}">'
            f'<div class="h"><b>sample {i}</b> · reward <span class="num">{fmt(r)}</span> · advantage '
            f'<span class="num">{fmt(a)}</span> · finish <b>{escape(str(t.get("finish_reason", "")))}</b> · '
            f'{t.get("num_turns", 0)} turns · {len(gen)} generated tokens · policy v{t.get("weight_version", 0)}'
            f'{stats}</div><table class="terms">{terms}</table><div class="conv">{conv}</div></div>')


_MAX_COLUMN_CHARS = 80
"""A dataset column longer than this (or not a scalar) stays off the group's heading."""


def _columns_html(columns: dict) -> str:
    """The prompt row's short scalar columns (``ground_truth``, ``id``, ...): what the rewards compare against."""
    return "".join(f' · <span class="col" data-col="{escape(str(k))}">{escape(str(k))} <b>{escape(str(v))}</b></span>'
                   for k, v in columns.items()
                   if isinstance(v, (str, int, float, bool)) and len(str(v)) <= _MAX_COLUMN_CHARS)


def step_html(step: int, payload: dict, metrics_row: dict, detok, audio_token_id: int, clips: list,
              nav: str, source: str) -> str:
    trajs, lps, index = payload["trajectories"], payload["trainer_logprobs"], payload["sample_index"]
    groups: dict = {}
    for k, t in enumerate(trajs):
        groups.setdefault(int(t["group_id"]), []).append(k)
    summary, sections = [], []
    for gid, members in groups.items():
        first = trajs[members[0]]
        start = _first_generated(first["loss_mask_T"])
        prompt_ids = first["input_ids_T"][:start]
        shared = all(trajs[k]["input_ids_T"][:start].equal(prompt_ids) for k in members)
        start = start if shared else 0
        rewards = [float(trajs[k].get("reward", 0.0)) for k in members]
        summary.append(f'<tr data-group="{gid}"><td><a href="#g{gid}">group {gid}</a></td><td>{first["prompt_index"]}</td>'
                       f'<td>{len(members)}</td>{num(float(np.mean(rewards)))}{num(float(max(rewards)))}</tr>')
        prompt = ""
        if start:
            prompt_clips = [clips[c] for c in first.get("audios", [])]
            prompt = conversation_html(prompt_ids.tolist(), [0] * start, [0.0] * start, None, detok, audio_token_id,
                                       prompt_clips)
        samples = "".join(sample_html(index[k], trajs[k], lps[k], detok, audio_token_id, clips, start)
                          for k in members)
        sections.append(f'<section class="g" id="g{gid}"><h2>group {gid} · prompt {first["prompt_index"]} · '
                        f'{len(members)} samples · mean reward {fmt(float(np.mean(rewards)))}'
                        f'{_columns_html(first.get("columns") or {})}</h2>'
                        f'<div class="conv">{prompt}</div>{samples}</section>')
    mrows = "".join(f'<tr data-key="{escape(k)}"><th>{escape(k)}</th>{num(v)}</tr>'
                    for k, v in sorted(metrics_row.items()) if k not in ("step", "time") and isinstance(v, (int, float)))
    stats = "".join(f'<tr><th>{escape(str(k))}</th>{num(v)}</tr>' for k, v in sorted(payload["stats"].items())
                    if isinstance(v, (int, float)))
    no_tl = "" if any(x is not None for x in lps) else \
        "<p><b>No trainer logprobs recorded for this step</b>: generated tokens are not shaded.</p>"
    body = (f"<nav>{nav}</nav><h1>Step {step}</h1><p>{len(trajs)} samples in {len(groups)} groups, from "
            f"{escape(source)}.</p>{no_tl}{_legend()}"
            f'<details open><summary>metrics.jsonl</summary><table id="metrics">{mrows or "<tr><td>no row for this step</td></tr>"}'
            f'</table></details>' + (f'<details><summary>rollout counters</summary><table>{stats}</table></details>'
                                     if stats else "")
            + f'<table id="groups"><tr><th>group</th><th>prompt</th><th>samples</th><th>mean reward</th>'
            f'<th>max reward</th></tr>{"".join(summary)}</table>' + "".join(sections))
    return page(f"step {step} · report", body)
