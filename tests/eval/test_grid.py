"""The compact prompt grid of a run's samples: whole prompts wrapped (never cut), a few prompts per row, images
where the layout says."""

import pytest
import torch

from flowrl.eval.grid import _font, _wrap, prompt_grid


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


def test_a_video_is_drawn_as_its_frame_strip_and_saved_as_a_gif(tmp_path):
    """Frames side by side, left to right, each at the cell size, 2 px apart; the GIF holds every frame."""
    from PIL import Image

    from flowrl.eval.grid import FRAME_GAP, frame_strip, image_grid, save_gif

    video = torch.linspace(0, 1, 4)[:, None, None, None].expand(4, 3, 16, 16).clone()  # frame k: grey level k / 3
    video[:, 0] = 0  # no red: frames are distinct, not white like the gaps
    strip = frame_strip(video, cell=32)
    assert strip.size == (4 * 32 + 3 * FRAME_GAP, 32)
    lefts = [k * (32 + FRAME_GAP) for k in range(4)]
    assert [strip.getpixel((x + 16, 16))[1] for x in lefts] == [0, 85, 170, 255]
    assert strip.getpixel((32, 16)) == (255, 255, 255)  # the gap
    grid = image_grid(torch.stack([video, video.flip(0)]), ["a prompt"], ["seed 0", "seed 1"], cell=32)
    assert grid.size[0] > 2 * strip.size[0] and grid.size[1] < 2 * strip.size[0]
    with pytest.raises(ValueError, match=r"\[F, 3, H, W\]"):
        frame_strip(video[:, :2])
    save_gif(video, tmp_path / "v.gif", fps=16)
    with Image.open(tmp_path / "v.gif") as gif:
        assert gif.n_frames == 4 and gif.size == (16, 16)
        greens = []
        for k in range(4):
            gif.seek(k)
            greens.append(gif.convert("RGB").getpixel((8, 8))[1])
    assert greens == [0, 85, 170, 255]


def test_prompt_grid_of_videos_keeps_the_strips_whole():
    videos = torch.rand(2, 3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    boxes: dict = {}
    prompt_grid(["one", "two"], {"base": videos, "now": videos}, cell=16, boxes=boxes)
    left, top, right, bottom = boxes[(0, "base")]
    assert (right - left, bottom - top) == (3 * 16 + 2 * 2, 16)
    assert boxes[(0, "base")][2] < boxes[(0, "now")][0]
