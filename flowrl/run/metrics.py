"""Run observability: ``metrics.jsonl`` (one flat JSON object per epoch), PNG plots refreshed during
the run, and optional TensorBoard / wandb backends.

Only the main process logs; other ranks get a logger whose methods do nothing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

from flowrl.config import atomic_write_text

__all__ = ["MetricsLogger", "read_metrics", "plot_metrics"]


def _plain(value: Any) -> Any:
    """JSON-able scalar (tensors and numpy numbers become floats; NaN stays NaN)."""
    if hasattr(value, "item"):
        value = value.item()
    return value


class MetricsLogger:
    """Appends one flat JSON object per call to ``output_dir/metrics.jsonl`` and mirrors it to the
    configured backends.

    Args:
        output_dir: the run directory.
        backends: any of ``"tensorboard"``, ``"wandb"`` (``metrics.jsonl`` is always written).
        enabled: False on non-main ranks.
        plot_groups: ``{plot name: [metric keys, prefixes or globs]}`` drawn to ``plots/<name>.png``.
        plot_units: ``{plot name: y-axis label}``.
        project / run_name / config: passed to wandb.
    """

    def __init__(self, output_dir: str | Path, *, backends: Sequence[str] = (), enabled: bool = True,
                 plot_groups: dict[str, list[str]] | None = None, project: str = "flowrl",
                 run_name: str | None = None, config: dict | None = None, plot_units: dict[str, str] | None = None):
        self.enabled = enabled
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / "metrics.jsonl"
        self.plot_groups = plot_groups or {}
        self.plot_units = plot_units or {}
        self._tb = None
        self._wandb = None
        self._backends, self._project, self._run_name, self._config = tuple(backends), project, run_name, config
        self._opened = not enabled
        for backend in backends:  # a bad name fails now, before the run claims its folder
            if backend not in ("tensorboard", "wandb"):
                raise ValueError(f"unknown logging backend {backend!r}; valid: tensorboard, wandb")

    def open(self) -> None:
        """Create the folder and start the backends (once; :meth:`log` calls it): a run that never starts writes
        nothing."""
        if self._opened:
            return
        self._opened = True
        self.output_dir.mkdir(parents=True, exist_ok=True)
        project, run_name, config = self._project, self._run_name, self._config
        for backend in self._backends:
            if backend == "tensorboard":
                try:
                    from torch.utils.tensorboard import SummaryWriter
                except ImportError as err:
                    raise RuntimeError("log.backends has 'tensorboard' but the tensorboard package is not "
                                       "installed: pip install tensorboard") from err
                self._tb = SummaryWriter(str(self.output_dir / "tensorboard"))
            elif backend == "wandb":
                try:
                    import wandb
                except ImportError as err:
                    raise RuntimeError("log.backends has 'wandb' but wandb is not installed: "
                                       "pip install wandb") from err
                self._wandb = wandb.init(project=project, name=run_name, config=config,
                                         dir=str(self.output_dir), resume="allow")

    def truncate_after(self, epoch: int) -> None:
        """Drop rows with ``epoch > epoch`` (a resumed run re-logs what came after its checkpoint)."""
        if not self.enabled or not self.path.is_file():
            return
        self.open()
        rows = [r for r in read_metrics(self.path) if r.get("epoch", -1) <= epoch]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in rows))

    def log(self, metrics: dict[str, Any], *, step: int | None = None) -> None:
        if not self.enabled:
            return
        self.open()
        row = {k: _plain(v) for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        step = step if step is not None else row.get("epoch")
        if self._tb is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(row, step=step)

    def log_image(self, name: str, image, *, step: int) -> None:
        """Send a PIL image (a sample grid) to the TensorBoard / wandb backends (the PNG itself is written by
        the caller into the run directory)."""
        if not self.enabled:
            return
        self.open()
        if self._tb is not None:
            import numpy as np

            self._tb.add_image(name, np.asarray(image.convert("RGB")), step, dataformats="HWC")
            self._tb.flush()
        if self._wandb is not None:
            import wandb

            self._wandb.log({name: wandb.Image(image)}, step=step)

    def plot(self) -> None:
        """Redraw ``plots/<group>.png`` from everything logged so far."""
        if self.enabled and self.plot_groups and self.path.is_file():
            plot_metrics(read_metrics(self.path), self.output_dir / "plots", self.plot_groups, units=self.plot_units)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str | Path) -> list[dict]:
    """Rows of a ``metrics.jsonl`` (a torn last line from a killed run is skipped)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _matches(key: str, pattern: str) -> bool:
    """A metric key against a plot pattern: the key itself, a prefix ending in '/', or a glob (``time/*_s``)."""
    import fnmatch

    if "*" in pattern:
        return fnmatch.fnmatchcase(key, pattern)
    return key == pattern or (pattern.endswith("/") and key.startswith(pattern))


def plot_metrics(rows: list[dict], out_dir: str | Path, groups: dict[str, list[str]], x_key: str = "epoch",
                 units: dict[str, str] | None = None) -> None:
    """One PNG per group; each line is a metric key matching one of the group's patterns (a key, a prefix
    ending in '/', or a glob). A key ``<name>_mean`` with a logged ``<name>_std`` is drawn with a +-1 std band.
    ``units`` names the y-axis of a group (one unit per axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    all_keys = list(dict.fromkeys(k for r in rows for k in r))
    for name, patterns in groups.items():
        keys = list(dict.fromkeys(k for p in patterns for k in all_keys if _matches(k, p)))
        if not keys:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for key in keys:
            points = [(r[x_key], r[key], r.get(key[:-5] + "_std") if key.endswith("_mean") else None) for r in rows
                      if key in r and x_key in r and isinstance(r[key], (int, float)) and math.isfinite(r[key])]
            if not points:
                continue
            xs, ys, spreads = zip(*points)
            (line,) = ax.plot(xs, ys, marker="o" if len(points) < 30 else None, markersize=3, label=key)
            if all(isinstance(v, (int, float)) and math.isfinite(v) for v in spreads):
                ax.fill_between(xs, [y - v for y, v in zip(ys, spreads)], [y + v for y, v in zip(ys, spreads)],
                                color=line.get_color(), alpha=0.2, linewidth=0, label=f"{key} +- std")
        ax.set_xlabel(x_key)
        if units and name in units:
            ax.set_ylabel(units[name])
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        tmp = out_dir / f".{name}.tmp.png"
        fig.savefig(tmp, dpi=100)
        plt.close(fig)
        tmp.replace(out_dir / f"{name}.png")
