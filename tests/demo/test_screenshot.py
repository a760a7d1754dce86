"""A headless Chromium (Selenium + Debian's chromium-driver) uses the running app as a person would: types two
prompts and three seeds into Compare, clicks Generate, and screenshots the page. The test then checks what
the user sees: the grid image shown at its place in the screenshot, every one of its 18 cells holding a
generated image with its reward caption under it (read back with OCR), the row labels, and the table of
mean rewards naming every model. A second app of a tiny video model (Wan) and a tiny editing model (FLUX.1-Kontext)
is driven the same way: the video's clips play under the grid as GIFs of every frame, and the uploaded source is
the first column of the edits' grid.

Without Chromium this test FAILS: `make install` (run by `make test`) installs chromium and chromium-driver."""

import inspect
import io

import numpy as np
import pytest
from PIL import Image

from flowrl.demo.headless import capture_compare, compare_in, find_chromedriver, find_chromium, open_page
from flowrl.demo.render import grid_image
# grid_image's geometry (HEADER: the column labels on top)
from flowrl.eval.grid import FRAME_GAP, HEADER, LINE_HEIGHT, PAD


@pytest.fixture(scope="session")
def browser_binaries() -> tuple[str, str]:
    """The browser and its driver, checked before the app is started (missing ones fail at once, never skip)."""
    binary, driver = find_chromium(), find_chromedriver()
    if binary is None or driver is None:
        pytest.fail("Chromium or chromedriver is not installed, so the demo's browser test cannot run: run "
                    "`make install` (it installs Debian's chromium and chromium-driver) or "
                    "`apt-get install -y chromium chromium-driver`")
    return binary, driver


def ink(region: np.ndarray) -> float:
    """Fraction of dark pixels (text strokes) in an RGB region."""
    return float((region.mean(axis=-1) < 140).mean())


@pytest.mark.slow
def test_compare_tab_shows_the_grid_with_images_and_captions(browser_binaries, demo_url, tmp_path):
    binary, driver = browser_binaries
    out = tmp_path / "compare.png"
    info = capture_compare(demo_url, out, prompts="a red circle\ntwo blue squares", seeds="0-2", timeout=240,
                           binary=binary, driver=driver)
    assert out.read_bytes() == info["png"]
    page = np.asarray(Image.open(io.BytesIO(info["png"])).convert("RGB")).astype(np.float32)
    assert page.shape[1] == 1280 and page.shape[0] >= 600

    # 1. The grid image the server drew is what the user sees, at its place in the screenshot.
    grid = np.asarray(Image.open(io.BytesIO(info["grid_png"])).convert("RGB")).astype(np.float32)
    natural_w, natural_h = info["grid_natural"]
    assert grid.shape[:2] == (natural_h, natural_w)
    x, y, w, h = info["grid_rect"]
    assert w > 300 and h > 600, f"the grid is displayed at {w}x{h} px"
    shown = page[y:y + h, x:x + w]
    as_shown = np.asarray(Image.fromarray(grid.astype(np.uint8)).resize((w, h), Image.Resampling.BILINEAR),
                          dtype=np.float32)
    assert np.abs(shown - as_shown).mean() < 12, "the screenshot's grid area does not show the grid image"

    # 2. Its layout: 6 rows (3 models x 2 prompts) of 3 seeds, each cell an image and a caption of
    #    `lines` lines (grid_image's geometry: cell 128 px, PAD between cells, HEADER on top).
    defaults = inspect.signature(grid_image).parameters
    cell, label_w = defaults["cell"].default, defaults["row_label_width"].default
    rows, cols = 6, 3
    assert natural_w == label_w + cols * (cell + PAD) + PAD
    cell_h = (natural_h - HEADER - PAD) // rows - PAD
    lines = (cell_h - cell - 4) // LINE_HEIGHT
    assert lines >= 2 and HEADER + rows * (cell_h + PAD) + PAD == natural_h
    scale = w / natural_w
    at = lambda x0, y0, x1, y1: shown[round(y0 * scale):round(y1 * scale), round(x0 * scale):round(x1 * scale)]  # noqa: E731
    assert ink(at(label_w, 0, natural_w, HEADER)) > 0.01  # the "seed k" column labels
    captions = []
    for r in range(rows):
        top = HEADER + r * (cell_h + PAD)
        assert ink(at(PAD, top, label_w - PAD, top + cell)) > 0.002, f"row {r} has no label"
        for c in range(cols):
            left = label_w + c * (cell + PAD)
            tile = at(left + 2, top + 2, left + cell - 2, top + cell - 2)
            assert tile.std() > 10, f"cell ({r}, {c}) shows no image"
            gap = at(left + cell + 1, top, left + cell + PAD - 1, top + cell)  # between two cells: background
            assert gap.size == 0 or gap.min() > 200
            for k in range(lines):
                band = at(left, top + cell + 4 + k * LINE_HEIGHT, left + cell, top + cell + 4 + (k + 1) * LINE_HEIGHT)
                assert ink(band) > 0.01, f"cell ({r}, {c}) has no caption line {k + 1}"
        captions.append(grid[top + cell + 2:top + cell + 4 + lines * LINE_HEIGHT + 2, label_w:natural_w - PAD])

    # 3. The captions say which reward scored what: read them back (OCR on the grid's caption strips).
    import rewards

    reader = rewards.load("ocr").reader
    upscaled = [np.asarray(Image.fromarray(strip.astype(np.uint8)).resize((strip.shape[1] * 3, strip.shape[0] * 3),
                                                                          Image.Resampling.LANCZOS))
                for strip in captions[:2]]
    text = " ".join(" ".join(reader.readtext(strip, detail=0)) for strip in upscaled).lower()
    assert "shapes" in text and ("wrong" in text or "correct" in text), text
    assert any(ch.isdigit() for ch in text), text

    # 4. The table a user reads under the grid names every model, and the status line counts the images.
    for name in ("base", "flow_grpo", "lora"):
        assert name in info["means_text"]
    assert "mean shapes" in info["means_text"]
    assert "18 images" in info["status_text"]
    # 5. The reward-hacking panel under it: one row per model, the shapes world's metrics as columns.
    for word in ("extra_object_rate", "bg_shift", "lenient_accuracy", "drift_pixel", "flow_grpo", "lora"):
        assert word in info["hacking_text"], info["hacking_text"]


@pytest.mark.slow
def test_video_clips_and_the_editing_source_show_in_the_page(browser_binaries, media_url, source_png):
    from .conftest import MEDIA_FRAMES

    binary, driver = browser_binaries
    browser = open_page(media_url, timeout=240, binary=binary, driver=driver)
    try:
        video = compare_in(browser, prompts="a red cat", seeds="0-1", models=["base"], steps=2, clips=2,
                           screenshot=False, timeout=240)
        edit = compare_in(browser, prompts="a red cat", seeds="0", models=["kontext"], source=source_png,
                          steps=2, timeout=240)
    finally:
        browser.quit()
    defaults = inspect.signature(grid_image).parameters
    cell, label_w = defaults["cell"].default, defaults["row_label_width"].default

    # The video model: its grid cells are frame strips, and each clip plays under the grid as a GIF of every frame.
    strip_w = MEDIA_FRAMES * cell + (MEDIA_FRAMES - 1) * FRAME_GAP
    assert video["grid_natural"][0] == label_w + 2 * (strip_w + PAD) + PAD
    assert "2 videos" in video["status_text"] and "2 ode steps" in video["status_text"]
    assert len(video["clips"]) == 2, video["clips"]
    gifs = []
    for clip in video["clips"]:
        x, y, w, h = clip["rect"]
        assert w > 32 and h > 32, f"a clip is displayed at {w}x{h} px"
        with Image.open(io.BytesIO(clip["gif"])) as gif:
            assert gif.format == "GIF" and gif.n_frames == MEDIA_FRAMES and gif.info.get("loop") == 0
            assert gif.size == (64, 64) == tuple(clip["natural"])
            gifs.append(np.asarray(gif.convert("RGB"), dtype=np.float32))
    assert np.abs(gifs[0] - gifs[1]).mean() > 1  # seeds 0 and 1: two different clips

    # The editing model: the source was uploaded (its preview shows), and it is the first column of the grid,
    # resized to the model's 64 px (drawn 2x), as the user sees it in the screenshot.
    assert edit["source_shown"] and edit["clips"] == []
    assert "1 edits" in edit["status_text"] and "first column is the source" in edit["status_text"]
    grid = np.asarray(Image.open(io.BytesIO(edit["grid_png"])).convert("RGB"))
    assert grid.shape[1] == label_w + 2 * (cell + PAD) + PAD  # source, seed 0
    resized = np.asarray(Image.open(source_png).convert("RGB").resize((64, 64), Image.Resampling.BICUBIC))
    first = grid[HEADER:HEADER + cell, label_w:label_w + cell]
    assert np.array_equal(first[::2, ::2], resized)
    page = np.asarray(Image.open(io.BytesIO(edit["png"])).convert("RGB")).astype(np.float32)
    x, y, w, h = edit["grid_rect"]
    shown = page[y:y + h, x:x + w]
    as_shown = np.asarray(Image.fromarray(grid).resize((w, h), Image.Resampling.BILINEAR), dtype=np.float32)
    assert np.abs(shown - as_shown).mean() < 12, "the screenshot's grid area does not show the edits' grid"
