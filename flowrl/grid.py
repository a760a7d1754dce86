"""The one labelled image grid of flowrl: ``flowrl sample``, the demo's Compare tab, the run's
``samples/`` and the TensorBoard / wandb images all draw with :func:`image_grid` (PIL).

Rows are labelled on the left (a label may have a second, muted line), columns on top, and each image
may carry a caption of one or more lines under it (its rewards).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["image_grid", "to_pil", "PAD", "HEADER", "LINE_HEIGHT"]

HEADER = 22  # px of the column-label strip on top
PAD = 6
BACKGROUND = (255, 255, 255)
TEXT = (20, 20, 20)
MUTED = (90, 90, 90)
LINE_HEIGHT = 14


def _font(size: int = 12):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: a fixed bitmap font
        return ImageFont.load_default()


def to_pil(image: torch.Tensor):
    """``[3, H, W]`` in [0, 1] -> an RGB PIL image."""
    from PIL import Image

    array = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    return Image.fromarray(array)


def _tile(image: torch.Tensor, cell: int):
    """The image fitted to a ``cell`` px square: integer nearest-neighbour upscaling for small images (the
    shapes model's 32 px stay crisp), Lanczos downscaling for large ones."""
    from PIL import Image

    pil = to_pil(image)
    w, h = pil.size
    if max(w, h) <= cell:
        k = max(1, cell // max(w, h))
        return pil.resize((w * k, h * k), Image.Resampling.NEAREST)
    scale = cell / max(w, h)
    return pil.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.LANCZOS)


def _cut(text: str, font, width: float) -> str:
    if font.getlength(text) <= width:
        return text
    while text and font.getlength(text + "...") > width:
        text = text[:-1]
    return text + "..."


def image_grid(images: torch.Tensor, row_labels: Sequence[str], col_labels: Sequence[str],
               captions: Sequence[str] | None = None, *, cell: int = 128, row_label_width: int = 170):
    """A labelled grid: one row per row label (left), one column per column label (top), each image with a
    caption of one or more lines under it.

    Args:
        images: ``[R * C, 3, H, W]`` in [0, 1], row-major.
        row_labels: ``R`` labels; a label may have two lines (``"model\\nprompt"``).
        col_labels: ``C`` labels.
        captions: ``R * C`` captions (lines separated by ``\\n``), or None.
        cell: the image cell size in px.
        row_label_width: px reserved for the row labels.

    Returns:
        An RGB PIL image.
    """
    from PIL import Image, ImageDraw

    rows, cols = len(row_labels), len(col_labels)
    if images.shape[0] != rows * cols:
        raise ValueError(f"{images.shape[0]} images for a {rows} x {cols} grid")
    font, small = _font(13), _font(11)
    tiles = [_tile(img, cell) for img in images]
    tile_h = max(t.size[1] for t in tiles) if tiles else cell
    tile_w = max(t.size[0] for t in tiles) if tiles else cell
    caption_lines = max((len(c.split("\n")) for c in captions), default=0) if captions else 0
    cell_h = tile_h + caption_lines * LINE_HEIGHT + (4 if caption_lines else 0)
    width = row_label_width + cols * (tile_w + PAD) + PAD
    height = HEADER + rows * (cell_h + PAD) + PAD
    canvas = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    for c, text in enumerate(col_labels):
        x = row_label_width + c * (tile_w + PAD) + tile_w / 2
        draw.text((x, HEADER / 2 + 1), _cut(text, font, tile_w), fill=TEXT, font=font, anchor="mm")
    for r, label in enumerate(row_labels):
        y = HEADER + r * (cell_h + PAD)
        lines = label.split("\n")
        for k, line in enumerate(lines):
            yy = y + tile_h / 2 + (k - (len(lines) - 1) / 2) * (LINE_HEIGHT + 2)
            draw.text((PAD, yy), _cut(line, font if k == 0 else small, row_label_width - 2 * PAD),
                      fill=TEXT if k == 0 else MUTED, font=font if k == 0 else small, anchor="lm")
        for c in range(cols):
            i = r * cols + c
            x = row_label_width + c * (tile_w + PAD)
            tile = tiles[i]
            canvas.paste(tile, (x + (tile_w - tile.size[0]) // 2, y + (tile_h - tile.size[1]) // 2))
            draw.rectangle([x - 1, y - 1, x + tile_w, y + tile_h], outline=(205, 205, 205))
            if captions:
                for k, line in enumerate(captions[i].split("\n")):
                    draw.text((x + tile_w / 2, y + tile_h + 4 + k * LINE_HEIGHT + LINE_HEIGHT / 2),
                              _cut(line, small, tile_w + PAD), fill=MUTED, font=small, anchor="mm")
    return canvas


