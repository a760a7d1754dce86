"""A headless Chromium (Selenium + Debian's chromium-driver) uses the running app as a person would: types two
prompts and three seeds into Compare, clicks Generate, and screenshots the page. The test then checks what
the user sees: the grid image shown at its place in the screenshot, every one of its 18 cells holding a
generated image with its reward caption under it (read back with OCR), the row labels, and the table of
mean rewards naming every model.

Without Chromium this test FAILS: `make install` (run by `make test`) installs chromium and chromium-driver."""

import inspect
import io

import numpy as np
import pytest
from PIL import Image

from flowrl.demo.headless import capture_compare, find_chromedriver, find_chromium
from flowrl.demo.render import grid_image
from flowrl.grid import HEADER, LINE_HEIGHT, PAD  # grid_image's geometry (HEADER: the column labels on top)


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
    for word in ("extra_object_rate", "bg_shift", "accuracy_strict", "drift_pixel", "flow_grpo", "lora"):
        assert word in info["hacking_text"], info["hacking_text"]
