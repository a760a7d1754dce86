"""The one labelled image grid of flowrl: ``flowrl sample``, the demo's Compare tab, the run's
``samples/`` and the TensorBoard / wandb images all draw with :func:`image_grid` (PIL).

Rows are labelled on the left (a label may have a second, muted line), columns on top, and each image
may carry a caption of one or more lines under it (its rewards).

A video ``[F, 3, H, W]`` (a video model's frames) takes the place of an image as its frame strip: the frames side
by side, left to right, each fitted to the cell as an image would be (:func:`frame_strip`).

:func:`prompt_grid` is the compact layout of a run's ``samples/``: a few prompts per row, each prompt's whole
text wrapped above its images (e.g. the base model's and the current one's, side by side, from the same noise).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["image_grid", "prompt_grid", "to_pil", "frame_strip", "save_gif", "PAD", "HEADER", "LINE_HEIGHT"]

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


FRAME_GAP = 2  # px between the frames of a strip


def frame_strip(video: torch.Tensor, cell: int | None = None):
    """``[F, 3, H, W]`` in [0, 1] -> an RGB PIL image of the frames side by side (``FRAME_GAP`` px of white
    between them), each frame fitted to ``cell`` px as :func:`image_grid` fits an image (None: actual size)."""
    from PIL import Image

    if video.dim() != 4 or video.shape[1] != 3:
        raise ValueError(f"a video must be [F, 3, H, W] in [0, 1], got {tuple(video.shape)}")
    frames = [_tile(frame, cell) if cell else to_pil(frame) for frame in video]
    w, h = frames[0].size
    strip = Image.new("RGB", (len(frames) * (w + FRAME_GAP) - FRAME_GAP, h), BACKGROUND)
    for k, frame in enumerate(frames):
        strip.paste(frame, (k * (w + FRAME_GAP), 0))
    return strip


def save_gif(video: torch.Tensor, path, fps: float = 16.0) -> None:
    """Write ``[F, 3, H, W]`` in [0, 1] as a looping animated GIF at ``fps`` frames per second (Pillow's writer;
    GIF stores frame durations in 10 ms units, so 16 fps plays at 1 / 0.06 s)."""
    if video.dim() != 4 or video.shape[1] != 3:
        raise ValueError(f"a video must be [F, 3, H, W] in [0, 1], got {tuple(video.shape)}")
    frames = [to_pil(frame) for frame in video]
    frames[0].save(path, format="GIF", save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0)


def _tile(image: torch.Tensor, cell: int):
    """The image fitted to a ``cell`` px square: integer nearest-neighbour upscaling for small images (the
    shapes model's 32 px stay crisp), Lanczos downscaling for large ones. A video ``[F, 3, H, W]``: its
    :func:`frame_strip`, each frame fitted so."""
    from PIL import Image

    if image.dim() == 4:
        return frame_strip(image, cell)
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
        images: ``[R * C, 3, H, W]`` in [0, 1], row-major (or videos ``[R * C, F, 3, H, W]``: frame strips).
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




def _wrap(text: str, font, width: float) -> list[str]:
    """``text`` broken into lines that fit ``width`` px (words kept whole unless one is wider than a line)."""
    lines: list[str] = []
    for word in text.split():
        if lines and font.getlength(f"{lines[-1]} {word}") <= width:
            lines[-1] = f"{lines[-1]} {word}"
            continue
        while font.getlength(word) > width and len(word) > 1:  # a very long word: break it
            cut = len(word)
            while cut > 1 and font.getlength(word[:cut]) > width:
                cut -= 1
            lines.append(word[:cut])
            word = word[cut:]
        lines.append(word)
    return lines or [""]


def prompt_grid(prompts: Sequence[str], columns: dict[str, torch.Tensor],
                captions: dict[str, Sequence[str]] | None = None, *, per_row: int = 4, cell: int = 96,
                notes: Sequence[str] | None = None, boxes: dict | None = None):
    """A compact grid of prompts: ``per_row`` prompts side by side, each a panel with its whole prompt wrapped
    on top and one image per column (labelled) under it, each with its caption.

    Args:
        prompts: ``P`` prompts.
        columns: ``{label: [P, 3, H, W] images in [0, 1]}``, e.g. ``{"base": ..., "epoch 30": ...}`` (or videos
            ``[P, F, 3, H, W]``: frame strips).
        captions: ``{label: P captions}`` (lines separated by ``\\n``), or None.
        per_row: panels per row of the grid.
        cell: the image cell size in px.
        notes: ``P`` muted lines under each prompt (e.g. ``seed 17``), or None.
        boxes: if given, filled with ``{(prompt index, label): (left, top, right, bottom)}`` of every image.

    Returns:
        An RGB PIL image.
    """
    from PIL import Image, ImageDraw

    labels = list(columns)
    n = len(prompts)
    for label in labels:
        if columns[label].shape[0] != n:
            raise ValueError(f"column {label!r} has {columns[label].shape[0]} images for {n} prompts")
    font, small = _font(12), _font(11)
    tiles = {label: [_tile(img, cell) for img in columns[label]] for label in labels}
    tile = max((t.size[0] for ts in tiles.values() for t in ts), default=cell)  # a cell's width
    tile_h = max((t.size[1] for ts in tiles.values() for t in ts), default=cell)  # its height (a strip: < width)
    panel_w = len(labels) * (tile + PAD) - PAD
    texts = [_wrap(p, font, panel_w) for p in prompts]
    caption_lines = max((len(c.split("\n")) for cs in (captions or {}).values() for c in cs), default=0)
    # Every panel of the grid has the same height: the longest prompt's lines, its note, the column labels.
    head = (max((len(t) for t in texts), default=1) + (1 if notes else 0) + 1) * LINE_HEIGHT + 4
    panel_h = head + tile_h + caption_lines * LINE_HEIGHT + 4
    rows, cols = (n + per_row - 1) // per_row, min(per_row, max(n, 1))
    canvas = Image.new("RGB", (PAD + cols * (panel_w + 3 * PAD), PAD + rows * (panel_h + 2 * PAD)), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    for i in range(n):
        x0, y0 = PAD + (i % per_row) * (panel_w + 3 * PAD), PAD + (i // per_row) * (panel_h + 2 * PAD)
        for k, line in enumerate(texts[i]):
            draw.text((x0, y0 + k * LINE_HEIGHT), line, fill=TEXT, font=font)
        if notes:
            draw.text((x0, y0 + len(texts[i]) * LINE_HEIGHT), notes[i], fill=MUTED, font=small)
        label_y = y0 + head - LINE_HEIGHT - 2
        top = label_y + LINE_HEIGHT + 2
        for c, label in enumerate(labels):
            x = x0 + c * (tile + PAD)
            draw.text((x + tile / 2, label_y + LINE_HEIGHT / 2), _cut(label, small, tile), fill=MUTED, font=small,
                      anchor="mm")
            image = tiles[label][i]
            left, upper = x + (tile - image.size[0]) // 2, top + (tile_h - image.size[1]) // 2
            canvas.paste(image, (left, upper))
            if boxes is not None:
                boxes[(i, label)] = (left, upper, left + image.size[0], upper + image.size[1])
            draw.rectangle([x - 1, top - 1, x + tile, top + tile_h], outline=(205, 205, 205))
            for k, line in enumerate(((captions or {}).get(label) or [""] * n)[i].split("\n")):
                draw.text((x + tile / 2, top + tile_h + 3 + k * LINE_HEIGHT + LINE_HEIGHT / 2),
                          _cut(line, small, tile + PAD), fill=MUTED, font=small, anchor="mm")
    return canvas
