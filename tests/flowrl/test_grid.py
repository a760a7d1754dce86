"""The compact prompt grid of a run's samples: whole prompts wrapped (never cut), a few prompts per row, images
where the layout says."""

import pytest
import torch

from flowrl.grid import _font, _wrap, prompt_grid


def test_wrap_keeps_every_word_and_fits_the_width():
    font = _font(12)
    text = "a yellow square above a purple circle and two cyan triangles on a white background"
    lines = _wrap(text, font, 150)
    assert " ".join(lines) == text and len(lines) >= 3
    assert all(font.getlength(line) <= 150 for line in lines)
    long = "x" * 80  # one word wider than a line is broken, not dropped
    assert "".join(_wrap(long, font, 100)) == long


def test_prompt_grid_places_each_image_under_its_prompt():
    colours = torch.linspace(0, 1, 6)
    base = colours[:, None, None, None].expand(6, 3, 32, 32).clone()
    current = 1 - base
    boxes: dict = {}
    grid = prompt_grid([f"prompt {i}" for i in range(6)], {"base": base, "now": current}, per_row=4, boxes=boxes)
    assert len(boxes) == 12
    # Two rows: four prompts, then two; within a prompt, base left of now, side by side.
    assert boxes[(0, "base")][1] == boxes[(3, "now")][1] < boxes[(4, "base")][1]
    assert boxes[(0, "base")][2] < boxes[(0, "now")][0]
    for (i, label), (left, top, right, bottom) in boxes.items():
        value = float((base if label == "base" else current)[i, 0, 0, 0])
        pixel = grid.getpixel(((left + right) // 2, (top + bottom) // 2))
        assert abs(pixel[0] - round(value * 255)) <= 1, (i, label)
    with pytest.raises(ValueError, match="has 5 images for 6 prompts"):
        prompt_grid(["p"] * 6, {"base": base[:5]})
