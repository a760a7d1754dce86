"""Each tab's API, called with gradio_client on the running app (tiny shapes model, real fine-tuned runs):
images and scores come back; mistakes come back as one-line messages, never a traceback."""

import re
from pathlib import Path

import gradio_client  # a dev dependency (pyproject [dev])
import pytest
from PIL import Image


@pytest.fixture(scope="module")
def client(demo_url):
    return gradio_client.Client(demo_url, verbose=False)


def _table(value) -> tuple[list, list]:
    return value["headers"], value["data"]


def test_api_lists_the_three_tabs(client):
    endpoints = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    assert {"/compare", "/trajectory", "/score"} <= set(endpoints)


def test_compare_returns_a_grid_and_scores(client):
    grid, means, per_image, status, hacking, clips = client.predict(
        ["base", "flow_grpo", "lora"], "a red circle\ntwo blue squares", "0-2", 3, 1.0, "flow_sde", 0.7,
        ["shapes", "jpeg_compressibility"], api_name="/compare")
    with Image.open(grid) as image:
        width, height = image.size
        assert image.getextrema() != ((255, 255), (255, 255), (255, 255))  # not blank
    assert width > 3 * 128 and height > 3 * 2 * 128  # 3 seeds x (3 models x 2 prompts)
    headers, rows = _table(means)
    assert headers == ["model", "mean shapes", "mean shapes correct", "mean jpeg_compressibility"]
    assert [r[0] for r in rows] == ["base", "flow_grpo", "lora"]
    assert all(isinstance(v, (int, float)) for r in rows for v in r[1:])
    headers, rows = _table(per_image)
    assert headers == ["model", "prompt", "seed", "shapes", "shapes correct", "jpeg_compressibility"]
    assert len(rows) == 3 * 2 * 3
    assert "18 images" in status and not clips  # an image model has no clips
    headers, rows = _table(hacking)
    assert headers[0] == "model" and {"drift_pixel", "extra_object_rate", "bg_shift", "accuracy", "lenient_accuracy",
                                      "diversity", "color_entropy", "color_hist_shift", "dark_frac",
                                      "saturated_frac", "hf_energy"} <= set(headers)
    assert [r[0] for r in rows] == ["base", "flow_grpo", "lora"]
    drift = headers.index("drift_pixel")
    assert rows[0][drift] is None or rows[0][drift] != rows[0][drift]  # the first model is the reference: no drift
    assert rows[1][drift] > 0  # the tuned model's images differ from the base model's of the same noise


def test_trajectory_returns_the_strip_the_curve_and_the_steps(client):
    strip, plot, table, summary = client.predict(
        "lora", "a red circle", 1, 4, 1.0, "flow_sde", 0.7, "jpeg_compressibility", 1, api_name="/trajectory")
    for path in (strip, plot):
        with Image.open(path) as image:
            assert image.size[0] > 300
    headers, rows = _table(table)
    assert headers[:5] == ["step", "sigma", "sigma_next", "sde", "R_t (ODE-completed)"]
    assert len(rows) == 4 and [r[3] for r in rows] == [True, True, True, False]
    assert all(isinstance(r[4], float) for r in rows[:3])
    assert rows[0][9] == pytest.approx(1.0)  # rho_1 = 1
    assert "Turning points:" in summary and "ODE completions:" in summary


def test_score_returns_the_reward_table(client, tmp_path):
    paths = []
    for i, color in enumerate([(220, 30, 30), (30, 30, 220)]):
        image = Image.new("RGB", (32, 32), (255, 255, 255))
        image.paste(color, (8, 8, 24, 24))
        paths.append(tmp_path / f"img{i}.png")
        image.save(paths[-1])
    table, status = client.predict([gradio_client.handle_file(str(p)) for p in paths], "a red square",
                                   ["shapes", "jpeg_compressibility"], True, api_name="/score")
    headers, rows = _table(table)
    assert headers == ["image", "size", "prompt", "shapes", "shapes correct", "jpeg_compressibility"]
    assert [r[0] for r in rows] == ["img0.png", "img1.png"]
    assert all(isinstance(v, float) for r in rows for v in r[3:])
    assert "2 image(s) scored" in status


@pytest.mark.parametrize("api_name, args, message", [
    ("/compare", (["base"], "a red circle", "0-50", 3, 1.0, "ode", 0.7, ["shapes"]), "more than 8 seeds"),
    ("/compare", (["base"], "", "0", 3, 1.0, "ode", 0.7, ["shapes"]), "enter a prompt"),
    # Gradio's own slider check answers first here; the handler checks again for any other caller.
    ("/compare", (["base"], "a red circle", "0", 1000, 1.0, "ode", 0.7, ["shapes"]),
     r"greater than maximum value 100|steps must be a whole number in \[1, 100\]"),
    # Values outside a checkbox group's choices: Gradio's own check, or the handler's.
    ("/compare", (["nope"], "a red circle", "0", 3, 1.0, "ode", 0.7, ["shapes"]),
     r"nope.*not in the list of choices|unknown model 'nope'"),
    ("/compare", (["base"], "a red circle", "0", 3, 1.0, "ode", 0.7, ["aesthetic"]),
     r"aesthetic.*not in the list of choices|reward 'aesthetic' is not loaded"),
    ("/trajectory", ("base", "a red circle", 0, 80, 1.0, "flow_sde", 0.7, "shapes", 1),
     r"greater than maximum value 50|steps must be a whole number in \[2, 50\]"),
    ("/trajectory", ("base", "a red circle\na blue square", 0, 4, 1.0, "flow_sde", 0.7, "shapes", 1),
     "takes one prompt"),
    ("/trajectory", ("base", "a red circle", 0, 4, 1.0, "euler", 0.7, "shapes", 1), "euler"),
])
def test_mistakes_are_one_line_messages(client, api_name, args, message):
    with pytest.raises(Exception) as info:
        client.predict(*args, api_name=api_name)
    text = str(info.value)
    assert "Traceback" not in text and "File \"" not in text
    assert re.search(message, text), text


def test_a_file_that_is_not_an_image_is_a_message(client, tmp_path):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG but not really")
    with pytest.raises(Exception, match="broken.png is not a readable image") as info:
        client.predict([gradio_client.handle_file(str(bad))], "a red circle", ["shapes"], False, api_name="/score")
    assert "Traceback" not in str(info.value)


# --------------------------------------------------------------------------------------------- what a visitor can reach


def test_file_data_naming_a_url_is_never_fetched_by_the_server(client, monkeypatch, tmp_path):
    """An API client may send file data that names a URL; Gradio would download it on the server (main did).
    Gradio's downloader is replaced by a recorder: the Score tab must never call it."""
    fetched = []

    async def download(url, cache_dir):
        fetched.append(url)
        path = tmp_path / "fetched.png"
        Image.new("RGB", (32, 32), "red").save(path)
        return str(path)

    monkeypatch.setattr("gradio.processing_utils.async_ssrf_protected_download", download)
    try:
        client.predict([gradio_client.handle_file("https://images.example.com/x.png")], "a red circle", ["shapes"],
                       False, api_name="/score")
        outcome = "scored"
    except Exception as err:  # noqa: BLE001 - gradio_client raises AppError
        outcome = str(err)
    assert fetched == []
    assert "does not fetch URLs" in outcome


def test_no_server_path_reaches_the_page(demo_state):
    import gradio as gr

    from flowrl.demo.handlers import guarded
    from flowrl.demo.ui import _models_markdown
    from flowrl.models.base import ModelLoadError

    page = _models_markdown(demo_state)
    assert "flow_grpo" in page and "lora" in page
    assert not re.search(r"(?<![\w.:/])/(tmp|root|home|work|srv)\b", page), page  # main: a `source` column of paths

    @guarded
    def fails():
        raise ModelLoadError("model 'x' (/srv/models/secret-run): no checkpoint at '/srv/models/secret-run/ckpt'")

    with pytest.raises(gr.Error) as info:
        fails()
    assert "/srv" not in info.value.message and ".../secret-run" in info.value.message

    @guarded
    def bug():
        raise RuntimeError("cannot open /srv/models/secret-run/state.pt")

    with pytest.raises(gr.Error) as info:
        bug()
    assert info.value.message == "internal error (RuntimeError); the server's console has the details"


def test_uploads_leave_the_cache(demo_state, tmp_path):
    """With ``Limits.cache_seconds`` = 1 an uploaded image is gone from Gradio's cache a few seconds later
    (main kept every upload and output until the server stopped)."""
    import dataclasses
    import time
    import uuid

    from gradio.utils import get_upload_folder

    from flowrl.demo.cli import launch
    from flowrl.demo.limits import Limits

    state = dataclasses.replace(demo_state, limits=Limits(cache_seconds=1))
    demo, url = launch(state, host="127.0.0.1", port=None, block=False, quiet=True)
    try:
        name = f"probe-{uuid.uuid4().hex}.png"
        Image.new("RGB", (32, 32), "red").save(tmp_path / name)
        gradio_client.Client(url, verbose=False).predict([gradio_client.handle_file(str(tmp_path / name))],
                                                         "a red circle", ["shapes"], False, api_name="/score")
        cached = lambda: list(Path(get_upload_folder()).rglob(name))  # noqa: E731
        assert cached()  # the upload was stored ...
        deadline = time.monotonic() + 8
        while cached() and time.monotonic() < deadline:
            time.sleep(0.25)
        assert not cached()  # ... and removed
    finally:
        demo.close()
