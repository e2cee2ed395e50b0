"""What the DLRM example shows and keeps: a progress bar, a JSONL metrics log, a PNG of the curves.

Only rank 0 reports. The bar redraws in place on a terminal and otherwise prints one plain
line per update, which the trainer makes every ``log_every`` steps (logs of batch jobs stay
readable; recopt.progress.ProgressLine); matplotlib is optional. When ``tensorboard`` is
installed (``pip install 'recopt[tensorboard]'``) the metrics log writes every record as
TensorBoard scalars too, under ``<output_dir>/tensorboard``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, TextIO

from recopt.progress import ProgressLine


class ProgressBar:
    """``step 120/600 [=====>    ] 20% | 45.3k samples/s | loss 0.512 auc 0.731``.

    Args:
        total: steps of the run.
        stream: where to draw (stderr by default).
        width: characters of the bar itself.
    """

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 24) -> None:
        self.total = max(total, 1)
        self.width = width
        self._line = ProgressLine(stream if stream is not None else sys.stderr)
        self.stream = self._line.stream
        self.interactive = self._line.interactive

    def update(
        self,
        step: int,
        samples_per_s: float,
        metrics: dict[str, float],
        skipped: int = 0,
        extra: str = "",
    ) -> None:
        """Redraws the bar at ``step`` with the throughput, the latest metrics, if any the
        number of steps skipped for a NaN/inf loss or gradient, and ``extra`` (the id maps'
        short form)."""
        done = min(step / self.total, 1.0)
        filled = int(done * self.width)
        bar = "=" * filled + (">" if filled < self.width else "") + " " * (self.width - filled - 1)
        shown = " ".join(f"{k} {v:.4f}" for k, v in metrics.items() if math.isfinite(v))
        line = (
            f"step {step}/{self.total} [{bar[: self.width]}] {done:4.0%} | "
            f"{samples_per_s / 1e3:.1f}k samples/s | {shown}"
        )
        if skipped:
            line += f" | skipped {skipped} (NaN/inf)"
        if extra:
            line += f" | {extra}"
        self._line.show(line, final=step >= self.total)

    def message(self, text: str) -> None:
        """Prints a line (validation results, notices) without breaking the bar."""
        self._line.message(text)

    def close(self) -> None:
        """Ends the bar's line."""
        self._line.close()


TENSORBOARD_DIR = "tensorboard"


class MetricsLog:
    """Appends one JSON object per record to ``path`` and keeps them for the final plot.

    With ``tensorboard`` installed, each record's values are also TensorBoard scalars
    ``<split>/<name>`` (``train/loss``, ``val/auc``) at its step, in ``TENSORBOARD_DIR``
    beside ``path`` (a resumed run adds an events file there; TensorBoard joins them).

    Args:
        path: the ``.jsonl`` file (appended to, so a resumed run continues it).
        tensorboard: also write TensorBoard events when the package is installed.
    """

    def __init__(self, path: str, tensorboard: bool = True, fresh: bool = False) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self.records: list[dict[str, Any]] = []
        if fresh and os.path.exists(path):  # a new run: not appended to an old run's records
            os.remove(path)
        self._start = time.time()
        events_dir = os.path.join(os.path.dirname(path) or ".", TENSORBOARD_DIR)
        self.events: Any = _event_writer(events_dir) if tensorboard else None

    def write(self, step: int, split: str, values: dict[str, float]) -> None:
        """Writes ``{"step", "split", "time_s", **values}`` (and the values as scalars)."""
        record = {"step": step, "split": split, "time_s": round(time.time() - self._start, 3)}
        record.update({k: float(v) for k, v in values.items()})
        self.records.append(record)
        # strict JSON: an undefined value (NaN, inf: e.g. the entropy of one class) is null
        strict = {k: v if not isinstance(v, float) or math.isfinite(v) else None
                  for k, v in record.items()}  # fmt: skip
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(strict, allow_nan=False) + "\n")
        if self.events is not None:
            for name, value in values.items():
                self.events.add_scalar(f"{split}/{name}", float(value), step)
            self.events.flush()  # readable at once, as the JSONL is

    def resumed(self, step: int) -> None:
        """A run resumed at ``step``: the earlier records (up to it) are kept, in the file and
        for the final plot; those past it came from steps trained again now."""
        if not os.path.exists(self.path):
            return
        with open(self.path, encoding="utf-8") as f:
            earlier = [json.loads(line) for line in f if line.strip()]
        self.records = [r for r in earlier if r.get("step", 0) <= step]
        with open(self.path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, allow_nan=False) + "\n" for r in self.records)
        if self.records:
            self._start -= max(float(r.get("time_s") or 0.0) for r in self.records)

    def close(self) -> None:
        """Closes the TensorBoard events file (the JSONL is closed after every write)."""
        if self.events is not None:
            self.events.close()
            self.events = None


def _event_writer(directory: str) -> Any:
    """torch's TensorBoard ``SummaryWriter`` on ``directory``, or None without tensorboard."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # the optional extra is not installed
        return None
    return SummaryWriter(log_dir=directory)


def plot_curves(records: list[dict[str, Any]], path: str) -> str | None:
    """Draws loss and AUC against the step, train and validation, into a PNG.

    Args:
        records: MetricsLog records.
        path: the PNG to write.

    Returns:
        None when written, else a one-line notice of why not (matplotlib missing).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install 'recopt[plot]')"
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("loss", "auc"), strict=True):
        for split, style in (("train", "-"), ("val", "o-")):
            points = [
                (r["step"], r[metric]) for r in records if r["split"] == split and metric in r
            ]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, style, label=split)
        ax.set_xlabel("step")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
