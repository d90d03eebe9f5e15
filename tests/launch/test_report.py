"""`mgrpo report`: a recorded run (tests/launch/report_fixture.py: production recording code, real
tokenizer, chat template, reward functions) as pages loaded in a real headless Chromium (Debian's
`chromium`, installed by scripts/install.sh): no console errors, every clip's file decodes and
holds the recorded waveform, the numbers on the pages are metrics.jsonl's and the recording's, a
screenshot has content; bad inputs are one line naming the file and the fix."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch

from launch.report.conversation import SHADES, TITLED
from launch.report.pages import fmt
from launch.cli import main

from report_fixture import record_run

CHROMIUM = shutil.which("chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0"]


def chromium(url: str, tmp: Path, *extra) -> tuple[str, list[str]]:
    """(the DOM after load or the screenshot's stdout, console lines) of ``url`` in headless Chromium."""
    assert CHROMIUM, "chromium is not installed: run scripts/install.sh (as root it apt-installs Debian's chromium)"
    r = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp / 'chromium-profile'}", *extra, url],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout, [line for line in r.stderr.splitlines() if ":CONSOLE" in line]


class Node:
    def __init__(self, tag, attrs, parent=None):
        self.tag, self.attrs, self.parent, self.children, self.text = tag, dict(attrs), parent, [], ""

    def iter(self):
        yield self
        for c in self.children:
            yield from c.iter()

    def find_all(self, tag=None, **attrs):
        want = {k.rstrip("_").replace("_", "-"): v for k, v in attrs.items()}  # class_ -> class
        return [n for n in self.iter() if (tag is None or n.tag == tag)
                and all(k in n.attrs if v is True else n.attrs.get(k) == v for k, v in want.items())]

    def all_text(self) -> str:
        return self.text + "".join(c.all_text() + c.tail for c in self.children)


class Tree(HTMLParser):
    VOID = {"meta", "br", "img", "input", "link", "hr", "source"}

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.root = self.cur = Node("root", {})
        self.cur.tail = ""
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        n = Node(tag, attrs, self.cur)
        n.tail = ""
        self.cur.children.append(n)
        if tag not in self.VOID:
            self.cur = n

    def handle_endtag(self, tag):
        n = self.cur
        while n is not self.root and n.tag != tag:
            n = n.parent
        if n is not self.root:
            self.cur = n.parent

    def handle_data(self, data):
        if self.cur.children:
            self.cur.children[-1].tail += data
        else:
            self.cur.text += data


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, tiny_ckpt):
    return record_run(tmp_path_factory.mktemp("report"), tiny_ckpt)


def _delta_stats(sample: Node) -> list[float]:
    """A sample's |rollout - trainer| max and mean as its header gives them (exact values)."""
    return [float(x.attrs["data-v"]) for x in sample.find_all("span", class_="num") if "data-v" in x.attrs]


def _report(*args) -> int:
    return main(["report", *map(str, args)])


def test_pages_in_chromium_show_the_recording_and_metrics(recorded, tmp_path, capsys):
    run, rec = recorded["run"], recorded["rec"]
    out = tmp_path / "report"
    assert _report(run, "--out", out) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("mgrpo report: 2 step pages (1..2) and 6 new audio clips in ") and \
        line.endswith(f"open file://{(out / 'index.html').resolve()}"), line
    metrics = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}

    dom, console = chromium((out / "index.html").as_uri(), tmp_path, "--dump-dom")
    assert console == []
    index = Tree(dom).root
    rows = index.find_all("tr", data_step=True)
    assert [int(r.attrs["data-step"]) for r in rows] == [1, 2]
    for r in rows:
        m = metrics[int(r.attrs["data-step"])]
        cells = [c for c in r.find_all("td") if "data-v" in c.attrs]
        assert len(cells) == 8  # reward/mean reward/std mismatch_kl_k3 kl loss grad_norm time/step samples
        got = sorted(float(c.attrs["data-v"]) for c in cells)
        want = sorted(m[k] for k in ("reward/mean", "reward/std", "mismatch_kl_k3", "kl", "loss", "grad_norm",
                                     "time/step", "samples"))
        assert got == want
        assert [a.attrs["href"] for a in r.find_all("a")] == [f"step_{int(r.attrs['data-step']):06d}.html"]
    assert len(index.find_all("svg")) == 3 and len(index.find_all("polyline")) == 4  # reward, KL (2), step time

    titled = 0
    for step, (trajs, trainer_lps) in recorded["steps"].items():
        page = out / f"step_{step:06d}.html"
        dom, console = chromium(page.as_uri(), tmp_path, "--dump-dom")
        assert console == []
        root = Tree(dom).root
        m = metrics[step]
        shown = {tr.attrs["data-key"]: tr.find_all("td")[0] for tr in root.find_all("tr", data_key=True)}
        assert set(shown) == {k for k, v in m.items() if k not in ("step", "time") and isinstance(v, (int, float))}
        for k, td in shown.items():
            assert float(td.attrs["data-v"]) == m[k] and td.all_text() == fmt(m[k]), k
        samples = root.find_all("div", data_sample=True)
        assert [int(s.attrs["data-sample"]) for s in samples] == list(range(len(trajs)))
        for s, t in zip(samples, trajs):
            i = int(s.attrs["data-sample"])
            assert float(s.attrs["data-reward"]) == t.reward and float(s.attrs["data-advantage"]) == t.advantage
            assert s.attrs["data-finish"] == t.finish_reason
            assert f"reward {fmt(t.reward)} · advantage {fmt(t.advantage)} · finish {t.finish_reason}" in s.all_text()
            terms = {tr.attrs["data-term"]: float(tr.find_all("td")[0].attrs["data-v"])
                     for tr in s.find_all("tr", data_term=True)}
            assert terms == t.reward_terms
            gen = np.asarray(t.loss_mask_T) == 1
            d = np.abs(np.asarray(t.rollout_logprobs_T) - trainer_lps[i].double().numpy())[gen]
            assert _delta_stats(s) == [float(d.max()), float(d.mean())]
            titles = [x.attrs["title"] for x in s.iter() if x.attrs.get("title", "").startswith("rollout ")]
            assert bool(titles) == (d.max() >= SHADES[TITLED - 1])  # the large differences carry both values
            titled += bool(titles)
            for title in titles:  # each shaded piece names a generated token's two logprobs
                r_, t_ = map(float, re.fullmatch(r"rollout (\S+) trainer (\S+)", title).groups())
                hits = [k for k in np.flatnonzero(gen) if f"{t.rollout_logprobs_T[k]:.4f}" == f"{r_:.4f}"
                        and f"{float(trainer_lps[i][k]):.4f}" == f"{t_:.4f}"]
                assert hits, title
            # the sample's clips: the prompt's recording (in its group's prompt) and the crop it asked for
            srcs = [a.attrs["src"] for a in s.find_all("audio")]
            assert len(srcs) == 1  # the crop; the recording plays in the group's prompt
            group = s.parent
            # the prompt row's ground truth in its group's heading: what the rewards compared against
            assert f"ground_truth {t.columns['ground_truth']}" in group.children[0].all_text()
            prompt_srcs = [a.attrs["src"] for a in group.children[1].find_all("audio")]
            assert len(prompt_srcs) == 1
            for src, want in zip(prompt_srcs + srcs, t.audios):
                import soundfile as sf

                wav, rate = sf.read(out / src, dtype="float32")
                assert rate == 16000 and wav.shape == want.shape
                assert np.max(np.abs(wav - want)) <= 1 / 32768 + 1e-7  # 16-bit PCM
    assert 0 < titled < sum(len(t) for t, _ in recorded["steps"].values())
    all_srcs = {a.attrs["src"] for p in out.glob("step_*.html") for a in Tree(p.read_text()).root.find_all("audio")}
    assert {f"audio/{p.name}" for p in (out / "audio").iterdir()} == all_srcs and len(all_srcs) == 6

    png = tmp_path / "step.png"
    chromium((out / "step_000001.html").as_uri(), tmp_path, f"--screenshot={png}", "--window-size=1200,900")
    from PIL import Image

    img = np.asarray(Image.open(png).convert("L"), dtype=np.float32)
    assert img.shape == (900, 1200)
    assert (img < 200).mean() > 0.02 and img.std() > 20  # text, tables and shading, not a blank page

    assert _report(run, "--out", out, "--steps", "2") == 0  # built again: every clip is already there
    assert " and 0 new audio clips in " in capsys.readouterr().out


def test_light_log_alone_keeps_whole_groups_and_trainer_logprobs(recorded, tmp_path, capsys):
    """Without the recording, the report reads run_dir/trajectories (logging.trajectories): the first
    group of 4 samples (max_samples 4), with the trainer's logprobs of those samples."""
    run = tmp_path / "run"
    shutil.copytree(recorded["run"], run)
    cfg = json.loads((run / "config.json").read_text())
    cfg["rollout"]["record_dir"] = None
    (run / "config.json").write_text(json.dumps(cfg))
    assert _report(run, "--steps", "2:") == 0
    assert "1 step page (2..2)" in capsys.readouterr().out
    root = Tree((run / "report" / "step_000002.html").read_text()).root
    trajs, lps = recorded["steps"][2]
    samples = root.find_all("div", data_sample=True)
    assert [int(s.attrs["data-sample"]) for s in samples] == [0, 1, 2, 3]
    assert {t.group_id for t in trajs[:4]} == {20000} and "logging.trajectories" in root.all_text()
    for s in samples:
        i = int(s.attrs["data-sample"])
        d = np.abs(np.asarray(trajs[i].rollout_logprobs_T) - lps[i].double().numpy())[np.asarray(trajs[i].loss_mask_T) == 1]
        assert _delta_stats(s) == [float(d.max()), float(d.mean())]


def _one_line_error(capsys, *args) -> str:
    assert _report(*args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


def test_bad_inputs_are_one_line_naming_the_file_and_the_fix(recorded, tmp_path, capsys):
    run = tmp_path / "bare"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"rollout": {"record_dir": None}}))
    assert _one_line_error(capsys, run) == (
        f"mgrpo report: {run} has no recorded trajectories (no {run / 'trajectories'}/ and rollout.record_dir is "
        f"unset in {run / 'config.json'}): train with logging.trajectories.every=N (or rollout.record_dir=DIR) to "
        "record them")
    (run / "config.json").write_text(json.dumps({"rollout": {"record_dir": str(tmp_path / "gone")}}))
    assert _one_line_error(capsys, run) == (
        f"mgrpo report: {run} has no recorded trajectories (rollout.record_dir {tmp_path / 'gone'} from "
        f"{run / 'config.json'} does not exist): train with logging.trajectories.every=N (or "
        "rollout.record_dir=DIR) to record them")
    assert _one_line_error(capsys, tmp_path / "nope") == (
        f"mgrpo report: {tmp_path / 'nope'} does not exist: pass the trainer.run_dir of a `mgrpo train` run")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _one_line_error(capsys, empty) == (
        f"mgrpo report: {empty} has no config.json: not a run directory of `mgrpo train` (pass its "
        "trainer.run_dir, or a rollout.record_dir)")
    rec = recorded["rec"]
    assert _one_line_error(capsys, recorded["run"], "--steps", "7") == (
        f"mgrpo report: step 7 is not recorded in {rec}, {recorded['run'] / 'trajectories'} (recorded: 1-2): "
        "choose --steps among those")
    assert _one_line_error(capsys, recorded["run"], "--steps", "x") == \
        "mgrpo report: --steps 'x': use N, A:B, A: or :B (step numbers, B included)"

    cut = tmp_path / "cut"  # a recording whose step 2 was cut short (a full disk, a killed copy)
    shutil.copytree(rec, cut)
    data = (cut / "step_000002.pt").read_bytes()
    (cut / "step_000002.pt").write_bytes(data[: len(data) // 2])
    err = _one_line_error(capsys, cut, "--out", tmp_path / "o")
    assert err.startswith(f"mgrpo report: {cut / 'step_000002.pt'} is truncated or not a recorded step (")
    assert err.endswith("): record step 2 again, or leave it out with --steps")
    assert _report(cut, "--steps", "1", "--out", tmp_path / "o") == 0  # the fix works
    side = cut / "step_000001.trainer.pt"
    side.write_bytes(side.read_bytes()[:100])
    err = _one_line_error(capsys, cut, "--steps", "1", "--out", tmp_path / "o")
    assert err.startswith(f"mgrpo report: {side} is truncated or not a trainer-logprob file (")
    (cut / "step_000001.pt").unlink()
    assert _one_line_error(capsys, cut, "--steps", "1") == (
        f"mgrpo report: {cut / 'step_000001.pt'} is missing though {cut / 'manifest.json'} lists step 1: "
        "record that step again, or leave it out with --steps")


def test_bad_arguments_name_the_flag_and_the_fix(recorded, tmp_path, capsys):
    run, rec = recorded["run"], recorded["rec"]
    assert _one_line_error(capsys, run, "--steps", "3:4") == (
        f"mgrpo report: no step in 3:4 is recorded in {rec}, {run / 'trajectories'} (recorded: 1-2): "
        "choose --steps among those")
    assert _one_line_error(capsys, run, "--steps", "5:2") == \
        "mgrpo report: --steps 5:2: the range is reversed; pass 2:5"

    out = tmp_path / "o"
    fix = "(pass the checkpoint directory holding the tokenizer files)"
    assert _one_line_error(capsys, run, "--steps", "1", "--out", out, "--tokenizer", tmp_path / "nope") == \
        f"mgrpo report: --tokenizer {tmp_path / 'nope'}: no such directory {fix}"
    afile = tmp_path / "afile"
    afile.write_text("keep")
    assert _one_line_error(capsys, run, "--steps", "1", "--out", out, "--tokenizer", afile) == \
        f"mgrpo report: --tokenizer {afile} is not a directory {fix}"
    assert not out.exists()  # refused before anything is written
    moved = tmp_path / "moved"  # a recording whose model_dir is gone: the manifest is blamed, --tokenizer is the fix
    shutil.copytree(rec, moved)
    man = json.loads((moved / "manifest.json").read_text())
    man["model_dir"] = str(tmp_path / "gone")
    (moved / "manifest.json").write_text(json.dumps(man))
    err = _one_line_error(capsys, moved, "--steps", "1", "--out", out)
    assert err.startswith(f"mgrpo report: cannot read the tokenizer of {tmp_path / 'gone'} (model_dir in "
                          f"{moved / 'manifest.json'}: ") and err.endswith("): pass --tokenizer DIR (the run's model.hf_dir)")

    assert _one_line_error(capsys, run, "--steps", "1", "--out", afile) == \
        f"mgrpo report: --out {afile} is a file: pass a directory"
    assert _one_line_error(capsys, run, "--steps", "1", "--out", afile / "sub") == \
        f"mgrpo report: --out {afile / 'sub'}: {afile} is a file: pass a directory"
    assert afile.read_text() == "keep"
    (moved / "report").write_text("")
    assert _one_line_error(capsys, moved, "--steps", "1") == \
        f"mgrpo report: {moved / 'report'} (the default --out) is a file: pass --out DIR"


def test_pick_samples_and_single_rank_gather():
    from types import SimpleNamespace

    from megatron_grpo.run.trajlog import gather_sample_logprobs, pick_samples

    trajs = [SimpleNamespace(group_id=g) for g in (5, 5, 5, 7, 7, 9)]
    assert pick_samples(trajs, 6) == [0, 1, 2, 3, 4, 5]
    assert pick_samples(trajs, 5) == [0, 1, 2, 3, 4]
    assert pick_samples(trajs, 4) == [0, 1, 2]
    assert pick_samples(trajs, 2) == [0, 1]  # a group larger than max_samples: its first samples
    a, b = torch.tensor([0.0, -1.0]), torch.tensor([0.0, -2.0, -3.0])
    assert gather_sample_logprobs({1: b, 0: a}, 3) == [a, b, None]
