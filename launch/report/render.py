"""Build the report: read what the run recorded (``load``), write clips once (``audio``) and the pages
(``pages``). ``build_report`` returns what it wrote; bad inputs raise ``load.ReportError``."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

from launch.cli_help import file_in_the_way

from .audio import ClipWriter
from .load import ReportError, find_inputs, load_step, select_steps
from .pages import index_html, step_file, step_html
from .tokens import Detokenizer

AUDIO_PAD = "<|audio_pad|>"


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _tokenizer(model_dir, manifest_path: Path, given: bool):
    """``given``: ``model_dir`` is the user's --tokenizer, not the manifest's (the error blames that)."""
    from megatron_grpo.notices import quiet_known_notices

    from .tokens import load_tokenizer

    fix = "pass the checkpoint directory holding the tokenizer files"
    if given and not Path(model_dir).is_dir():
        # else transformers reads the path as a hub repo id and its error names neither
        what = " is not a directory" if Path(model_dir).exists() else ": no such directory"
        raise ReportError(f"--tokenizer {model_dir}{what} ({fix})")
    quiet_known_notices()
    try:
        return load_tokenizer(model_dir)
    except Exception as e:  # noqa: BLE001 - any failure to read it has the same fix
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if given:
            raise ReportError(f"--tokenizer {model_dir}: cannot read a tokenizer there ({first}): {fix}") from None
        raise ReportError(f"cannot read the tokenizer of {model_dir} (model_dir in {manifest_path}: {first}): "
                          "pass --tokenizer DIR (the run's model.hf_dir)") from None


def _out_dir(out: Optional[str], run_dir: Path) -> tuple[Path, str]:
    """The output directory and how errors name it, refused while a file stands in its way (checked
    before the tokenizer loads; created only after it did)."""
    d = Path(out) if out else run_dir / "report"
    name = f"--out {d}" if out else f"{d} (the default --out)"
    p = file_in_the_way(d)
    if p is not None:
        where = "" if p == d else f": {p}"
        raise ReportError(f"{name}{where} is a file: pass {'a directory' if out else '--out DIR'}")
    return d, name


def _nav(steps: list[int], k: int) -> str:
    parts = ['<a href="index.html">index</a>']
    if k > 0:
        parts.append(f'<a href="{step_file(steps[k - 1])}">← step {steps[k - 1]}</a>')
    if k + 1 < len(steps):
        parts.append(f'<a href="{step_file(steps[k + 1])}">step {steps[k + 1]} →</a>')
    return "".join(parts)


def _step_pages(inputs, chosen: list[int], detok, audio_id: int, clips_out: ClipWriter, out_dir: Path,
                pages: dict) -> None:
    for k, s in enumerate(chosen):
        rec = inputs.recordings[s]
        payload = load_step(rec, s)
        clips = [clips_out.add(c) for c in payload["clips"]]
        source = f"{rec.dir} ({'rollout.record_dir' if rec.kind == 'record_dir' else 'logging.trajectories'})"
        html = step_html(s, payload, inputs.metrics.get(s, {}), detok, audio_id, clips, _nav(chosen, k), source)
        _write(out_dir / step_file(s), html)
        pages[s] = step_file(s)


def build_report(run_dir, out: Optional[str] = None, steps: Optional[str] = None,
                 tokenizer: Optional[str] = None) -> dict:
    """Write ``out`` (default ``<run_dir>/report``): ``index.html``, one page per chosen step,
    ``audio/``. Returns {"out", "index", "steps", "clips_written", "seconds"}."""
    t0 = time.perf_counter()
    inputs = find_inputs(run_dir)
    chosen = select_steps(inputs, steps)
    out_dir, out_name = _out_dir(out, inputs.run_dir)
    first = inputs.recordings[chosen[0]]
    man_path = first.dir / "manifest.json"
    tok = _tokenizer(tokenizer or first.manifest.get("model_dir"), man_path, given=bool(tokenizer))
    detok = Detokenizer(tok)
    audio_id = (first.manifest.get("special_token_ids") or {}).get("audio_token_id")
    if audio_id is None:
        audio_id = detok.token_id(AUDIO_PAD)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReportError(f"{out_name}: cannot create it ({e.strerror}): pass --out DIR you can write to") from None
    clips_out = ClipWriter(out_dir, (first.manifest.get("audio") or {}).get("sampling_rate", 16000))
    pages: dict[int, str] = {}
    try:
        _step_pages(inputs, chosen, detok, int(audio_id), clips_out, out_dir, pages)
    finally:
        clips_out.close()
    note = (f"{inputs.run_dir} · model {first.manifest.get('model_dir')} · {len(pages)} step pages · "
            f"{len(inputs.metrics)} metrics.jsonl rows")
    _write(out_dir / "index.html", index_html(inputs.run_dir.name, inputs.metrics, pages, note))
    return {"out": out_dir, "index": out_dir / "index.html", "steps": chosen, "clips_written": clips_out.written,
            "seconds": time.perf_counter() - t0}
