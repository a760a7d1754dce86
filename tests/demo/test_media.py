"""Video and editing models in the demo (tiny real Wan and FLUX.1-Kontext pipelines, LoRA run folders of each):
a video model's clips are the grid's frame strips and one looping GIF each, scored per frame; an editing model
edits the uploaded source (resized to its image size), which the grid draws as its first column; mixes that cannot
share a grid, and the Trajectory tab, say why in one line; the runs and pipelines load from the command line."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl.demo.engine import compare, open_source, trajectory
from flowrl.demo.limits import DemoInputError, Limits
from flowrl.demo.render import grid_image
from flowrl.demo.ui import handle_compare, handle_trajectory
from flowrl.eval.generate import generate
from flowrl.eval.grid import FRAME_GAP, HEADER, PAD

from .conftest import MEDIA_FRAMES

PROMPT = "a red cat"


@pytest.fixture(scope="module")
def bank(media_state):
    return media_state.bank


def _cell_geometry():
    defaults = inspect.signature(grid_image).parameters
    return defaults["cell"].default, defaults["row_label_width"].default


def test_video_models_give_frame_strips_and_one_gif_per_clip(media_state, bank):
    wan, tuned = bank.get("base"), bank.get("wan_lora")
    assert wan.num_frames == MEDIA_FRAMES and tuned.num_frames == MEDIA_FRAMES
    result = compare({"base": wan, "wan_lora": tuned}, [PROMPT], [0, 1], steps=2, guidance=5.0, sampler="ode",
                     noise_level=None, rewards=media_state.rewards, reward_names=["jpeg_compressibility"])
    video = result.images["base"]
    assert result.videos and video.shape == (2, MEDIA_FRAMES, 3, 64, 64)
    # like for like: the ODE sampler is `flowrl sample`'s generation, clip for clip
    torch.testing.assert_close(video, generate(wan, [PROMPT] * 2, [0, 1], steps=2, guidance=5.0), atol=1e-6, rtol=0)
    assert not torch.allclose(video, result.images["wan_lora"])  # the run's LoRA moved the clips
    # an image reward scores a clip as the mean over its frames
    jpeg = media_state.rewards.loaded["jpeg_compressibility"]
    frames = jpeg(video.flatten(0, 1), [PROMPT] * 2 * MEDIA_FRAMES).scores.reshape(2, MEDIA_FRAMES).mean(dim=1)
    torch.testing.assert_close(result.scores["base"]["jpeg_compressibility"], frames, atol=1e-5, rtol=0)

    grid, means, per_image, status, hacking, clips = handle_compare(
        media_state, ["base", "wan_lora"], PROMPT, "0-1", 2, 5.0, "ode", 0.7, ["jpeg_compressibility"])
    cell, label_w = _cell_geometry()
    strip_w = MEDIA_FRAMES * cell + (MEDIA_FRAMES - 1) * FRAME_GAP  # each 64 px frame drawn at 2x, side by side
    assert grid.size[0] == label_w + 2 * (strip_w + PAD) + PAD
    top, left = HEADER, label_w
    for k in (0, MEDIA_FRAMES - 1):  # the first and last frames of row 0, seed 0, are the clip's own pixels
        x = left + k * (cell + FRAME_GAP)
        shown = np.asarray(grid.crop((x, top, x + cell, top + cell)))[::2, ::2]
        expected = (video[0, k].permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
        assert np.array_equal(shown, expected)
    assert "4 videos" in status and f"clip's {MEDIA_FRAMES} frames" in status
    assert list(means["model"]) == ["base", "wan_lora"] and len(per_image) == 4
    assert list(hacking["model"]) == ["base", "wan_lora"] and float(hacking["drift_pixel"][1]) > 0

    # one GIF per clip, in the grid's order, with every frame, looping at 16 fps
    assert [c for _, c in clips] == ["base, seed 0", "base, seed 1", "wan_lora, seed 0", "wan_lora, seed 1"]
    firsts = []
    for (path, _), clip in zip(clips, [video[0], video[1], *result.images["wan_lora"]]):
        with Image.open(path) as gif:
            assert gif.format == "GIF" and gif.n_frames == MEDIA_FRAMES and gif.info["loop"] == 0
            assert gif.info["duration"] == 60  # 1000 / 16 ms, in GIF's 10 ms units
            gif.seek(MEDIA_FRAMES - 1)
            last = np.asarray(gif.convert("RGB"), dtype=np.float32)
        expected = clip[-1].permute(1, 2, 0).numpy() * 255
        assert np.abs(last - expected).mean() < 6  # GIF's palette rounds colours, nothing more
        firsts.append(last)
    assert np.abs(firsts[0] - firsts[1]).mean() > 1  # two seeds, two clips


def test_editing_models_edit_the_source_drawn_as_the_first_column(media_state, bank, source_png, tmp_path):
    kontext, tuned = bank.get("kontext"), bank.get("kontext_lora")
    source = open_source(source_png, media_state.limits)
    assert source.size == (48, 40)
    result = compare({"kontext": kontext, "kontext_lora": tuned}, [PROMPT, "make it blue"], [0, 3], steps=2,
                     guidance=2.5, sampler="ode", noise_level=None, rewards=media_state.rewards,
                     reward_names=["jpeg_compressibility"], source=source)
    # the source each model edits: the upload resized (bicubic) to the model's 64 px
    resized = np.asarray(Image.open(source_png).convert("RGB").resize((64, 64), Image.Resampling.BICUBIC))
    assert np.array_equal((result.sources["kontext"].permute(1, 2, 0) * 255).round().byte().numpy(), resized)
    rows = [{"source_image": result.sources["kontext"]}] * 4
    expected = generate(kontext, [PROMPT, PROMPT, "make it blue", "make it blue"], [0, 3, 0, 3], steps=2,
                        guidance=2.5, metadata=rows)
    torch.testing.assert_close(result.images["kontext"], expected, atol=1e-6, rtol=0)
    assert not torch.allclose(result.images["kontext"], result.images["kontext_lora"])

    other = tmp_path / "other.png"
    Image.fromarray(255 - np.asarray(Image.open(source_png))).save(other)
    flipped = compare({"kontext": kontext}, [PROMPT], [0], steps=2, guidance=2.5, sampler="ode", noise_level=None,
                      rewards=media_state.rewards, reward_names=["jpeg_compressibility"],
                      source=open_source(other, media_state.limits))
    # another source, another edit: the tiny random model leans on its source only a little (a mean change of
    # ~2e-4), far above float32 rounding (the same source reproduces the edit to 1e-6 or so)
    torch.testing.assert_close(compare({"kontext": kontext}, [PROMPT], [0], steps=2, guidance=2.5, sampler="ode",
                                       noise_level=None, rewards=media_state.rewards, reward_names=[],
                                       source=source).images["kontext"][0], result.images["kontext"][0],
                               atol=1e-5, rtol=0)  # alone, not in a batch of 4: rounding differs a little
    assert (flipped.images["kontext"][0] - result.images["kontext"][0]).abs().mean() > 5e-5

    grid, _, per_image, status, _, clips = handle_compare(
        media_state, ["kontext", "kontext_lora"], PROMPT, "0,3", 2, 2.5, "ode", 0.7, ["jpeg_compressibility"],
        source=str(source_png))
    assert clips == [] and "4 edits" in status and "first column is the source" in status and len(per_image) == 4
    cell, label_w = _cell_geometry()
    assert grid.size[0] == label_w + 3 * (cell + PAD) + PAD  # source, seed 0, seed 3
    cell_h = (grid.size[1] - HEADER - PAD) // 2 - PAD
    for row in range(2):  # each model's row starts with the source as it saw it, upscaled 2x nearest
        top = HEADER + row * (cell_h + PAD)
        shown = np.asarray(grid.crop((label_w, top, label_w + cell, top + cell)))
        assert np.array_equal(shown[::2, ::2], resized) and np.array_equal(shown[1::2, 1::2], resized)
        edit = np.asarray(grid.crop((label_w + cell + PAD, top, label_w + 2 * cell + PAD, top + cell)))[::2, ::2]
        assert np.abs(edit.astype(float) - resized).mean() > 5  # the next cell is an edit, not the source


def test_mixes_and_missing_sources_are_refused_by_name(media_state, source_png, tmp_path):
    args = (PROMPT, "0", 2, 2.5, "ode", 0.7, ["jpeg_compressibility"])
    with pytest.raises(DemoInputError, match="kontext edit.*upload one under 'Source image'"):
        handle_compare(media_state, ["kontext"], *args)
    with pytest.raises(DemoInputError, match="base, wan_lora do.*not edit images.*remove the source"):
        handle_compare(media_state, ["base", "wan_lora"], *args, source=str(source_png))
    with pytest.raises(DemoInputError, match="kontext edit.*and base draw.*separately"):
        handle_compare(media_state, ["kontext", "base"], *args, source=str(source_png))
    bad = tmp_path / "fake.png"
    bad.write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n")  # PostScript named .png: never handed to Ghostscript
    with pytest.raises(DemoInputError, match="fake.png is not a readable image.*PNG, JPEG or WebP"):
        handle_compare(media_state, ["kontext"], *args, source=str(bad))
    with pytest.raises(DemoInputError, match="at most 32 px per side"):
        open_source(source_png, Limits(max_image_side=32))


def test_the_trajectory_tab_says_it_is_for_image_models(media_state, bank):
    with pytest.raises(DemoInputError, match="Trajectory tab is for image models.*Compare tab"):
        trajectory(bank.get("base"), PROMPT, 0, steps=2, guidance=5.0, sampler="ode", noise_level=None)
    with pytest.raises(DemoInputError, match="editing model needs a source image.*Compare tab"):
        handle_trajectory(media_state, "kontext", PROMPT, 0, 2, 2.5, "flow_sde", 0.7, "jpeg_compressibility", 1)


def test_runs_and_pipelines_of_both_kinds_load(media_state, media_dirs):
    from flowrl.run.checkpoint_files import latest_checkpoint, load_state
    from flowrl.commands.args import UsageError
    from flowrl.demo.cli import parse_args
    from flowrl.demo.models import discover_runs, load_base, load_finetuned
    from flowrl.models.base import ModelLoadError

    found = {r.name: r for r in discover_runs(media_dirs["runs"])}
    assert {n: r.family for n, r in found.items()} == {"kontext_lora": "flux_kontext", "wan_lora": "wan"}
    for name in found:
        saved = load_state(latest_checkpoint(found[name].path))["model"]
        model = media_state.bank.get(name)  # loaded on first use, as the run trained it
        state = model.trainable_state_dict()
        assert set(state) == set(saved) and all(torch.equal(state[k], saved[k]) for k in state)
    assert media_state.bank.get("wan_lora").latent_shape == (16, 2, 8, 8)
    # Compare preselects the models of the base's kind only (a mix would be refused on the first click)
    assert media_state.default_models == ["base", "wan_lora"] and media_state.has_editing_models()
    # --model FAMILY --path DIR, as `flowrl sample` takes it, with the video model's length
    args = parse_args(["--model", "wan", "--path", str(media_dirs["wan"]), "--resolution", "64", "--num-frames", "5"])
    model = load_base(args.model, path=args.path, resolution=args.resolution, num_frames=args.num_frames)
    assert model.latent_shape == (16, 2, 8, 8) and model.num_frames == 5
    with pytest.raises(ModelLoadError, match="--num-frames is for video models"):
        load_base(str(media_dirs["kontext"]), num_frames=5)
    with pytest.raises(UsageError, match="--path goes with"):
        load_base("shapes", path=str(media_dirs["kontext"]))
    assert load_finetuned(found["kontext_lora"].path).conditions_on_source


def test_the_api_takes_an_uploaded_source_and_never_fetches_a_url(media_url, source_png, monkeypatch, tmp_path):
    """``/compare`` over the API, as gradio_client calls it: the uploaded source reaches the editing model (the
    grid's first column); a source naming a URL is refused before Gradio's downloader (replaced by a recorder)."""
    import gradio_client

    client = gradio_client.Client(media_url, verbose=False)
    grid, means, _, status, _, clips = client.predict(
        ["kontext"], PROMPT, "0", 2, 2.5, "ode", 0.7, ["jpeg_compressibility"],
        gradio_client.handle_file(str(source_png)), api_name="/compare")
    resized = np.asarray(Image.open(source_png).convert("RGB").resize((64, 64), Image.Resampling.BICUBIC))
    cell, label_w = _cell_geometry()
    with Image.open(grid) as image:
        first = np.asarray(image.convert("RGB"))[HEADER:HEADER + cell, label_w:label_w + cell]
    assert np.array_equal(first[::2, ::2], resized) and "1 edits" in status and not clips
    fetched = []

    async def download(url, cache_dir):
        fetched.append(url)
        path = tmp_path / "fetched.png"
        Image.new("RGB", (32, 32), "red").save(path)
        return str(path)

    monkeypatch.setattr("gradio.processing_utils.async_ssrf_protected_download", download)
    with pytest.raises(Exception, match="does not fetch URLs"):
        client.predict(["kontext"], PROMPT, "0", 2, 2.5, "ode", 0.7, ["jpeg_compressibility"],
                       gradio_client.handle_file("https://images.example.com/x.png"), api_name="/compare")
    assert fetched == []


def test_qwen_image_edit_edits_the_uploaded_source_too(media_state, source_png, tmp_path, tiny_dir):
    """The demo's editing path is generic: a tiny Qwen-Image-Edit pipeline loaded by folder edits the uploaded
    source (drawn first, resized to its 64 px), as plain generation with that source does."""
    from flowrl.demo.models import load_base
    from flowrl.testing import TINY_RESOLUTION

    model = load_base(str(tiny_dir("qwen_image_edit")), resolution=TINY_RESOLUTION)
    assert model.conditions_on_source
    source = open_source(source_png, media_state.limits)
    result = compare({"qwen_edit": model}, [PROMPT], [0, 3], steps=2, guidance=4.0, sampler="ode", noise_level=None,
                     rewards=media_state.rewards, reward_names=["jpeg_compressibility"], source=source)
    side = TINY_RESOLUTION
    resized = np.asarray(Image.open(source_png).convert("RGB").resize((side, side), Image.Resampling.BICUBIC))
    assert np.array_equal((result.sources["qwen_edit"].permute(1, 2, 0) * 255).round().byte().numpy(), resized)
    expected = generate(model, [PROMPT, PROMPT], [0, 3], steps=2, guidance=4.0,
                        metadata=[{"source_image": result.sources["qwen_edit"]}] * 2)
    torch.testing.assert_close(result.images["qwen_edit"], expected, atol=1e-6, rtol=0)
