"""A headless Chromium opens the running app, clicks Compare's Generate button, waits for the grid, and
screenshots the page; the screenshot must show the rendered grid.

Chromium is driven over ``--remote-debugging-pipe`` by :mod:`flowrl.demo.headless` (standard library only).
Without Chromium this test FAILS (it is part of CI, which installs it in ``.ci/run``)."""

import io

import numpy as np
import pytest
from PIL import Image

from flowrl.demo.headless import capture_compare, find_chromium


@pytest.fixture(scope="session")
def chromium() -> str:
    """The browser, checked before the app is started (a missing browser fails at once, never skips)."""
    binary = find_chromium()
    if binary is None:
        pytest.fail("Chromium is not installed, so the demo's browser test cannot run: install it with "
                    "`apt-get install -y chromium` (Debian; .ci/run does this) or set FLOWRL_CHROMIUM to a "
                    "Chromium/Chrome binary")
    return binary


def test_compare_tab_renders_the_grid_in_a_browser(chromium, demo_url, tmp_path):
    out = tmp_path / "compare.png"
    info = capture_compare(demo_url, out, prompts="a red circle\ntwo blue squares", seeds="0-2", timeout=240,
                           binary=chromium)
    assert out.read_bytes() == info["png"]
    page = np.asarray(Image.open(io.BytesIO(info["png"])).convert("RGB")).astype(np.float32)
    assert page.shape[1] == 1280 and page.shape[0] >= 600
    assert page.std() > 10, "the screenshot is blank"
    # The grid the server drew: 3 models x 2 prompts rows, 3 seed columns, shown in the page.
    natural_w, natural_h = info["grid_natural"]
    assert natural_w > 3 * 128 and natural_h > 6 * 128
    x, y, w, h = info["grid_rect"]
    assert w > 200 and h > 200, f"the grid image is displayed at {w}x{h} px"
    region = page[y:y + h, x:x + w]
    assert region.shape[0] > 100 and region.shape[1] > 100
    # Image content, not an empty placeholder: many colours and strong contrast inside the grid's box.
    colours = np.unique(region.reshape(-1, 3).astype(np.uint8), axis=0).shape[0]
    assert colours > 500 and region.std() > 30, (colours, region.std())
    # Its right half holds the generated images (the left strip is row labels): not uniform either.
    assert region[:, w // 2:].std() > 30
    for name in ("base", "flow_grpo", "lora"):
        assert name in info["means_text"]
    assert "18 images" in info["status_text"]
