"""Run-directory outputs of `mgrpo train`: metrics.jsonl, TensorBoard events, curves.png.

Only the logging rank (global rank 0) creates one of these. Every step appends one JSON line
(`{"step": N, "time": ..., <metric>: value, ...}`), writes the same scalars to TensorBoard, and
redraws `curves.png` (reward and loss against step) so a user can watch learning happen.
"""
from __future__ import annotations

import json
import math
import time
import warnings
from pathlib import Path

PLOTTED = (("reward/mean", "reward (mean over samples)"), ("loss", "policy loss"))


def read_metrics(path: str | Path, text: str | None = None) -> list[dict]:
    """The rows of a ``metrics.jsonl`` (``text``: its contents, if already read). A last line cut
    short (a run killed while writing it) is dropped with a warning, as its step is replayed on
    resume; a bad line before it raises."""
    path = Path(path)
    text = path.read_text() if text is None else text
    lines = [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    rows = []
    for k, (i, line) in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if k == len(lines) - 1:
                warnings.warn(f"{path}: line {i} is cut short ({e.msg}); dropped (its step is replayed on resume)",
                              stacklevel=2)
                break
            raise ValueError(f"{path}: line {i} is not JSON ({e.msg}): {line[:80]!r}; delete or fix that line "
                             f"(each line is one step's metrics)") from None
    return rows


class MetricsLogger:
    """Appends per-step metrics to run_dir/metrics.jsonl (+ TensorBoard, + curves.png)."""

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, plot: bool = True,
                 plotted: tuple = PLOTTED):
        self.run_dir = Path(run_dir)
        self.plotted = plotted
        """(metric, title) of each panel of curves.png."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.plot_path = self.run_dir / "curves.png" if plot else None
        self.history: list[dict] = []
        if self.path.exists():  # a resumed run keeps its history (entries up to the resume step)
            text = self.path.read_text()
            self.history = read_metrics(self.path, text)
            if text and not text.endswith("\n"):  # a cut-short last line: the next row starts clean
                self._rewrite()
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))

    def truncate_after(self, step: int) -> None:
        """Drop entries after `step` (a resume replays those steps)."""
        self.history = [h for h in self.history if h["step"] <= step]
        self._rewrite()

    def _rewrite(self) -> None:
        self.path.write_text("".join(json.dumps(h) + "\n" for h in self.history))

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": int(step), "time": round(time.time(), 3)}
        row.update({k: (float(v) if isinstance(v, (int, float)) else v) for k, v in sorted(metrics.items())})
        self.history.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k not in ("step", "time") and isinstance(v, float) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.plot_path is not None:
            self.plot()

    def plot(self) -> None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(self.plotted), figsize=(5 * len(self.plotted), 3.5))
        for ax, (key, title) in zip(axes, self.plotted):
            pts = [(h["step"], h[key]) for h in self.history if isinstance(h.get(key), float)]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3)
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        tmp = self.plot_path.with_suffix(".tmp.png")
        fig.savefig(tmp, dpi=90)
        plt.close(fig)
        tmp.replace(self.plot_path)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


RUN_DIR_OUTPUTS = (("metrics.jsonl", "metrics.jsonl"), ("curves.png", "curves.png"), ("tensorboard", "tensorboard/"),
                   ("checkpoints", "checkpoints/"), ("vllm-server.log", "vllm-server.log"))
"""What a finished run leaves in its run dir, as :func:`run_summary` lists it (those present)."""


def run_summary(run_dir: str | Path) -> list[str]:
    """The lines `mgrpo train` prints when a run ends: the reward from the first to the last
    logged step, the turns per conversation (and the `tool_call` reward) likewise, the mean step
    time and its parts, and where the outputs are. Empty when the run logged no step."""
    run = Path(run_dir)
    path = run / "metrics.jsonl"
    rows = read_metrics(path) if path.exists() else []
    if not rows:
        return []
    first, last = rows[0], rows[-1]
    lines = [f"reward: step {first['step']} {first.get('reward/mean', float('nan')):.3f} -> "
             f"step {last['step']} {last.get('reward/mean', float('nan')):.3f}"]
    if "turns/mean" in first and "turns/mean" in last:  # the agent's tool use (a rollout, not a replay)
        tools = (f"; reward/tool_call {first['reward/tool_call']:.2f} -> {last['reward/tool_call']:.2f}"
                 if "reward/tool_call" in first and "reward/tool_call" in last else "")
        lines.append(f"turns per conversation (a turn past the first follows a tool call): step {first['step']} "
                     f"{first['turns/mean']:.2f} -> step {last['step']} {last['turns/mean']:.2f}{tools}")

    def mean(key: str) -> float:
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else float("nan")

    parts = [(name, mean(f"time/{name}")) for name in ("rollout", "train", "push")]
    lines.append(f"mean step {mean('time/step'):.1f} s = " + " + ".join(
        f"{name} {v:.2f}" if name == "push" else f"{name} {v:.1f}" for name, v in parts if not math.isnan(v)))
    outputs = [label for name, label in RUN_DIR_OUTPUTS if (run / name).exists()]
    lines.append(f"run dir: {run}/ ({', '.join(outputs)})")
    return lines
