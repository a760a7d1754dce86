"""Pictures of the demo: the Compare grid, the trajectory strip and the trajectory plot (PIL, matplotlib)."""

from __future__ import annotations

import io
import math
from typing import Sequence

import torch

from flowrl.eval.grid import BACKGROUND, PAD, TEXT, _cut, _font, _tile, to_pil
from flowrl.eval.grid import image_grid as grid_image  # the one grid, shared with flowrl sample and the runs

__all__ = ["grid_image", "strip_image", "trajectory_plot", "to_pil"]


def strip_image(x0_images: torch.Tensor, final: torch.Tensor, sigmas: torch.Tensor, *, cell: int = 64,
                per_row: int = 20, turning: Sequence[bool] | None = None):
    """The predicted clean image at every step, then the final sample, left to right (wrapped every
    ``per_row`` cells). Each cell is labelled with its step and sigma; turning points get a red frame.

    Args:
        x0_images: ``[T, 3, H, W]``, the prediction at the state each step starts from.
        final: ``[3, H, W]``.
        sigmas: ``[T + 1]``.
        turning: optional ``[n]`` flags of SDE steps ``1..n``; step ``t``'s flag frames the prediction made
            after it, i.e. the cell of step ``t + 1`` (or the final image).
    """
    from PIL import Image, ImageDraw

    T = x0_images.shape[0]
    images = torch.cat([x0_images, final[None]])
    labels = [f"{t + 1}: s={float(sigmas[t]):.2f}" for t in range(T)] + ["final"]
    cols = min(per_row, T + 1)
    rows = math.ceil((T + 1) / cols)
    font = _font(11)
    tiles = [_tile(img, cell) for img in images]
    tw, th = tiles[0].size
    label_h = 16
    width = cols * (tw + PAD) + PAD
    height = rows * (th + label_h + PAD) + PAD
    canvas = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    marked = set()
    if turning is not None:
        marked = {t + 1 for t, flag in enumerate(turning) if flag}  # 0-based cell after SDE step t + 1
    for i, (tile, label) in enumerate(zip(tiles, labels)):
        r, c = divmod(i, cols)
        x, y = PAD + c * (tw + PAD), PAD + r * (th + label_h + PAD)
        draw.text((x + tw / 2, y + label_h / 2), _cut(label, font, tw + PAD), fill=TEXT, font=font, anchor="mm")
        canvas.paste(tile, (x, y + label_h))
        color, w = ((220, 30, 30), 2) if i in marked else ((205, 205, 205), 1)
        draw.rectangle([x - w, y + label_h - w, x + tw - 1 + w, y + label_h + th - 1 + w], outline=color, width=w)
    return canvas


def trajectory_plot(result, *, width_px: int = 900):
    """Two panels: the ODE-completed reward ``R_t`` per SDE step with turning points marked (and ``R_0``, the
    pure ODE rollout, dashed), and the cosine-credit weights ``w_t`` (bars) with the reward-to-go ``rho_t``.

    Args:
        result: a :class:`flowrl.demo.engine.TrajectoryResult`.

    Returns:
        An RGB PIL image.
    """
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state
    from PIL import Image

    fig = Figure(figsize=(width_px / 100, 3.4), dpi=100)
    ax_r, ax_c = fig.subplots(1, 2)
    n = result.num_sde
    if result.R is not None and n > 0:
        t = list(range(0, n + 1))
        R = result.R.tolist()
        ax_r.plot(t, R, "-o", color="#1f77b4", markersize=4, label=f"R_t ({result.reward_name})")
        ax_r.axhline(R[0], color="#7f7f7f", linestyle="--", linewidth=1, label="R_0 (pure ODE)")
        if result.turning is not None and bool(result.turning.any()):
            idx = [k + 1 for k, flag in enumerate(result.turning.tolist()) if flag]
            ax_r.scatter(idx, [R[k] for k in idx], s=90, facecolors="none", edgecolors="#d62728", linewidths=2,
                         zorder=3, label="turning point")
        ax_r.set_xlabel("SDE step t (0: before the first)")
        ax_r.legend(fontsize=8, loc="best")
    elif result.R is not None:
        ax_r.text(0.5, 0.5, f"ODE sampler: every completion is the sample itself\n{result.reward_name} = "
                  f"{float(result.R[0]):.3f}; choose an SDE sampler for R_t", ha="center", va="center",
                  fontsize=9, transform=ax_r.transAxes)
    else:
        ax_r.text(0.5, 0.5, "no reward selected", ha="center", va="center", transform=ax_r.transAxes)
    ax_r.set_title("ODE-completed reward per step (TP-GRPO)", fontsize=10)
    ax_r.grid(alpha=0.3)
    if result.rho is not None:
        steps = list(range(1, result.num_steps + 1))
        ax_c.bar(steps, result.weights.tolist(), color="#2ca02c", alpha=0.7, label="weight w_t")
        ax_c.plot(steps, result.rho.tolist(), "-o", color="#9467bd", markersize=3, label="reward-to-go rho_t")
        ax_c.set_ylim(0, 1.05)
        ax_c.set_xlabel("step t")
        ax_c.legend(fontsize=8, loc="best")
    else:
        ax_c.text(0.5, 0.5, "cosine credit unavailable", ha="center", va="center", transform=ax_c.transAxes)
    ax_c.set_title("cosine credit (CoCA)", fontsize=10)
    ax_c.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    buffer.seek(0)
    return Image.open(buffer, formats=["PNG"]).convert("RGB")
