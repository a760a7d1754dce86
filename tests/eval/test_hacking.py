"""The hacking panel on hand-built images whose values are known."""

import math

import pytest
import torch

from flowrl.data.shapes import Scene, SceneObject, render
from flowrl.eval.hacking import (background_stats, feature_drift, group_diversity, hacking_panel, pixel_drift,
                            judge_shapes_image, shapes_metrics)


def image(rgb, size=4) -> torch.Tensor:
    return torch.tensor(rgb, dtype=torch.float32).view(3, 1, 1).expand(3, size, size) / 255.0


def scene_image(*objects, background=None) -> torch.Tensor:
    """A rendered 32 x 32 scene ``[3, 32, 32]``; ``background`` multiplies it per channel (white -> that colour)."""
    array = torch.from_numpy(render(Scene(tuple(SceneObject(*o) for o in objects))).copy()).float()
    out = array.permute(2, 0, 1) / 255.0
    if background is not None:
        out = out * torch.tensor(background, dtype=torch.float32).view(3, 1, 1) / 255.0
    return out


def test_pixel_drift_is_the_mean_rgb_distance_in_0_255_units():
    base = torch.stack([image((0, 0, 0)), image((0, 0, 0))])
    tuned = base.clone()
    tuned[0, :, 0, 0] = torch.tensor([1.0, 0.0, 0.0])  # one pixel of 16 differs by 255 in red
    tuned[1] = image((3, 4, 0))  # every pixel differs by (3, 4, 0): distance 5
    assert pixel_drift(tuned, base) == pytest.approx((255 / 16 + 5) / 2, abs=1e-4)
    assert pixel_drift(base, base) == 0.0
    with pytest.raises(ValueError, match="differ in shape"):
        pixel_drift(tuned[:1], base)


def test_feature_drift_and_diversity_are_cosine_distances():
    a = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    b = torch.tensor([[3.0, 0.0], [1.0, 0.0]])
    assert feature_drift(a, b) == pytest.approx(0.5)  # (0 + 1) / 2
    features = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [5.0, 0.0], [1.0, 1.0]])
    # group x: orthogonal pair (distance 1); group y: parallel pair (0); group z: one image (ignored)
    assert group_diversity(features, ["x", "x", "y", "y", "z"]) == pytest.approx(0.5)
    three = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])  # distances 1, 2, 1 -> mean 4/3
    assert group_diversity(three, ["g"] * 3) == pytest.approx(4 / 3)
    assert math.isnan(group_diversity(features[:2], ["a", "b"]))


def test_background_shift_of_a_tinted_canvas_with_an_object():
    tinted = scene_image(("square", "red", 15.0, 15.0, 10.0), background=(250, 240, 200))
    white = scene_image(("circle", "blue", 10.0, 20.0, 11.0))
    shift, colour = background_stats(torch.stack([tinted, white]))
    # every background pixel of the first image is (250, 240, 200), up to uint8 rounding of the render
    assert shift[0].item() == pytest.approx(math.sqrt(5**2 + 15**2 + 55**2), abs=0.05)
    assert colour[0].tolist() == pytest.approx([250, 240, 200], abs=0.05)
    assert shift[1].item() == pytest.approx(0.0, abs=1e-6)
    assert colour[1].tolist() == pytest.approx([255, 255, 255], abs=1e-6)
    # an image that is all foreground has no background: NaN, left out of the panel's mean
    striped = torch.zeros(1, 3, 8, 8)
    striped[..., ::2, :] = 1.0
    assert math.isnan(background_stats(striped)[0][0].item())


def test_extra_objects_and_strict_counting():
    one = scene_image(("circle", "red", 10.0, 10.0, 10.0))
    two = scene_image(("circle", "red", 9.0, 9.0, 10.0), ("circle", "red", 23.0, 23.0, 10.0))
    counted = scene_image(("square", "blue", 8.0, 8.0, 10.0), ("square", "blue", 24.0, 8.0, 10.0),
                          ("triangle", "green", 16.0, 24.0, 10.0))
    images = torch.stack([one, two, counted])
    prompts = ["a red circle", "a red circle", "two blue squares"]
    out = shapes_metrics(images, prompts)
    # two red circles for "a red circle" and a stray triangle beside two blue squares: 2 of 3 images, 1 extra each
    assert out["hack/extra_object_rate"] == pytest.approx(2 / 3)
    assert out["hack/extra_objects"] == pytest.approx(2 / 3)
    assert out["hack/lenient_accuracy"] == 1.0  # the lenient rule passes all three
    assert out["hack/accuracy"] == pytest.approx(1 / 3)  # the gold (strict) passes one
    assert out["hack/accuracy/colors"] == 0.5
    assert out["hack/accuracy/counting"] == 0.0
    assert out["hack/bg_shift"] == pytest.approx(0.0, abs=1e-6)
    assert (out["hack/bg_r"], out["hack/bg_g"], out["hack/bg_b"]) == pytest.approx((255, 255, 255))


def test_one_image_judgement_names_kind_extras_and_both_accuracies():
    two = scene_image(("circle", "red", 9.0, 9.0, 10.0), ("circle", "red", 23.0, 23.0, 10.0))
    wrong = scene_image(("square", "blue", 16.0, 16.0, 10.0))
    hwc = lambda img: img.permute(1, 2, 0).numpy()  # noqa: E731
    assert tuple(judge_shapes_image("a red circle", hwc(two))) == ("colors", 1, False, True)
    assert tuple(judge_shapes_image("a red circle", hwc(wrong))) == ("colors", 0, False, False)
    assert tuple(judge_shapes_image("two red circles", hwc(two))) == ("counting", 0, True, True)


def test_strict_counting_accepts_exact_scenes_and_names_colourless_objects_by_shape():
    both = scene_image(("circle", "red", 9.0, 16.0, 10.0), ("square", "green", 24.0, 16.0, 10.0))
    out = shapes_metrics(both[None], ["a circle and a square"])
    assert out["hack/accuracy"] == 1.0 and out["hack/extra_object_rate"] == 0.0


def test_panel_combines_drift_diversity_and_shapes_metrics():
    base = torch.stack([scene_image(("circle", "red", 10.0, 10.0, 10.0)),
                        scene_image(("circle", "red", 20.0, 20.0, 10.0))])
    tuned = torch.stack([scene_image(("circle", "red", 10.0, 10.0, 10.0), background=(255, 250, 230)),
                         scene_image(("circle", "red", 20.0, 20.0, 10.0), background=(255, 250, 230))])
    prompts = ["a red circle", "a red circle"]
    flat = lambda x: x.flatten(1)  # noqa: E731  (pixels as features)
    out = hacking_panel(tuned, prompts, base_images=base, features=flat)
    assert out["hack/drift_pixel"] == pytest.approx(pixel_drift(tuned, base))
    assert out["hack/drift_feature"] == pytest.approx(feature_drift(flat(tuned), flat(base)))
    assert out["hack/diversity"] == pytest.approx(group_diversity(flat(tuned), prompts))
    assert out["hack/bg_shift"] == pytest.approx(math.sqrt(5**2 + 25**2), abs=0.05)
    assert all(k.startswith("hack/") and isinstance(v, float) for k, v in out.items())
    # prompts outside the shapes grammar: the shapes metrics are left out, the rest stays
    other = hacking_panel(tuned, ["a cat", "a dog"], features=flat)
    assert set(other) == {"hack/diversity", "hack/color_entropy", "hack/dark_frac", "hack/saturated_frac",
                          "hack/hf_energy"}  # the image statistics need no grammar (and no base: no shift)


def test_panel_measures_videos_frame_by_frame():
    """Videos [B, F, 3, H, W]: drift and image statistics over every frame, features averaged over each video."""
    g = torch.Generator().manual_seed(0)
    tuned, base = torch.rand(2, 3, 3, 16, 16, generator=g), torch.rand(2, 3, 3, 16, 16, generator=g)
    flat = lambda x: x.flatten(1)  # noqa: E731  (pixels as features)
    out = hacking_panel(tuned, ["a cat", "a cat"], base_images=base, features=flat)
    frames, base_frames = tuned.flatten(0, 1), base.flatten(0, 1)
    assert out["hack/drift_pixel"] == pytest.approx(pixel_drift(frames, base_frames))
    video_features = lambda x: flat(x.flatten(0, 1)).reshape(2, 3, -1).mean(dim=1)  # noqa: E731
    assert out["hack/drift_feature"] == pytest.approx(feature_drift(video_features(tuned), video_features(base)))
    assert out["hack/diversity"] == pytest.approx(group_diversity(video_features(tuned), ["a cat", "a cat"]))
    assert out["hack/dark_frac"] == pytest.approx(hacking_panel(frames, ["a cat"] * 6)["hack/dark_frac"])
    with pytest.raises(ValueError, match="videos differ in shape"):
        hacking_panel(tuned, ["a cat", "a cat"], base_images=base[:, :2])


def test_panel_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        hacking_panel(torch.zeros(2, 32, 32), ["a circle", "a circle"])
    with pytest.raises(ValueError, match="2 images but 1 prompts"):
        hacking_panel(torch.zeros(2, 3, 32, 32), ["a circle"])


def test_shapes_feature_fn_gives_encoder_global_tokens():
    from flowrl.eval.hacking import shapes_feature_fn

    images = torch.stack([scene_image(("circle", "red", 10.0, 10.0, 10.0)), scene_image()])
    features = shapes_feature_fn()(images)
    assert features.shape == (2, 64)
    assert torch.allclose(features.pow(2).mean(-1), torch.ones(2), atol=1e-4)  # RMS-normalised tokens


def test_panel_benchmark_compares_two_models(tiny_shapes_dir, tmp_path):
    """``flowrl panel`` on the tiny model against itself: zero drift, identical panels."""
    import json

    from flowrl.commands import panel

    result = panel.panel_report(["--tuned", str(tiny_shapes_dir), "--base", str(tiny_shapes_dir), "--n", "6",
                                 "--steps", "2", "--group-prompts", "2", "--group-seeds", "2",
                                 "--adversarial-updates", "2", "--adversarial-pool", "8",
                                 "--out", str(tmp_path / "panel")])
    base, tuned = result["panel"]["base"], result["panel"]["tuned"]
    assert tuned["hack/drift_pixel"] == 0.0 and tuned["hack/drift_feature"] == pytest.approx(0.0, abs=1e-6)
    assert tuned["hack/color_hist_shift"] == pytest.approx(0.0, abs=1e-6)  # against the base: a drift too
    drifts = ("hack/drift", "hack/color_hist_shift")
    assert {k: v for k, v in tuned.items() if not k.startswith(drifts)} == pytest.approx(base, nan_ok=True)
    assert json.loads((tmp_path / "panel.json").read_text())["n"] == 6
    assert "| `hack/bg_shift` |" in (tmp_path / "panel.md").read_text()
    probe = result["adversarial_probe"]
    assert probe["updates"] == 2 and probe["reward_base_mean"] == pytest.approx(probe["reward_tuned_mean"])
