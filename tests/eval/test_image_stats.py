"""The image statistics of the hacking panel (flowrl/eval/image_stats.py) on constructed images: a flat colour, a
checkerboard, a two-colour split, dark and saturated patches; and their entries in the panel."""

import math

import pytest
import torch

from flowrl.eval.hacking import hacking_panel
from flowrl.eval.image_stats import (color_entropy, dark_fraction, high_frequency_energy, histogram_shift, image_stats,
                                saturated_fraction)


def flat(rgb, size=16) -> torch.Tensor:
    return torch.tensor(rgb, dtype=torch.float32).view(1, 3, 1, 1).expand(1, 3, size, size).clone()


def checkerboard(size=16) -> torch.Tensor:
    y, x = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    return ((x + y) % 2).float().expand(1, 3, size, size).clone()


def test_colour_entropy_counts_the_colours():
    assert color_entropy(flat([0.5, 0.5, 0.5])).item() == 0.0  # one colour: no uncertainty
    assert color_entropy(checkerboard()).item() == pytest.approx(1.0)  # black and white, half each
    four = torch.zeros(1, 3, 2, 2)
    four[0, 0, 0, 0], four[0, 1, 0, 1], four[0, 2, 1, 0] = 1.0, 1.0, 1.0  # red, green, blue, black
    assert color_entropy(four).item() == pytest.approx(2.0)
    # Colours within one histogram level (1/8) share a cell.
    near = torch.cat([flat([0.51, 0.5, 0.5])[..., :8], flat([0.5, 0.5, 0.5])[..., 8:]], dim=-1)
    assert color_entropy(near).item() == 0.0


def test_histogram_shift_is_total_variation_of_the_colours():
    white, black = flat([1.0, 1.0, 1.0]), flat([0.0, 0.0, 0.0])
    assert histogram_shift(white, white) == 0.0
    assert histogram_shift(white, black) == pytest.approx(1.0)  # disjoint colours
    half = torch.cat([white[..., :8], black[..., 8:]], dim=-1)  # half white, half black
    assert histogram_shift(half, white) == pytest.approx(0.5)


def test_dark_and_saturated_fractions():
    image = flat([1.0, 1.0, 1.0])
    image[..., :4, :] = 0.02  # a quarter dark (luma 0.02)
    image[0, :, 4:8, :] = torch.tensor([1.0, 0.05, 0.0]).view(3, 1, 1)  # a quarter pure red
    image[0, :, 8:12, :] = torch.tensor([1.0, 0.6, 0.6]).view(3, 1, 1)  # a quarter pale red: not saturated
    assert dark_fraction(image).item() == pytest.approx(0.25)
    assert saturated_fraction(image).item() == pytest.approx(0.25)  # dark pixels have no value, white no colour


def test_high_frequency_energy_sees_grid_textures_not_smooth_images():
    assert high_frequency_energy(checkerboard()).item() == pytest.approx(1.0)  # all energy at Nyquist
    assert high_frequency_energy(flat([0.3, 0.6, 0.9])).item() == 0.0  # no energy at all
    x = torch.linspace(0, 2 * math.pi, 33)[:-1]
    smooth = (0.5 + 0.4 * torch.sin(x)).view(1, 1, 1, 32).expand(1, 3, 32, 32).clone()  # one cycle per image
    assert high_frequency_energy(smooth).item() < 1e-6
    mixed = 0.5 * smooth + 0.5 * checkerboard(32)
    assert 0.0 < high_frequency_energy(mixed).item() < 1.0


def test_image_stats_in_the_panel():
    images = torch.cat([checkerboard(), flat([0.5, 0.5, 0.5])])
    stats = image_stats(images, base_images=torch.cat([flat([0.5, 0.5, 0.5])] * 2))
    assert stats["hack/color_entropy"] == pytest.approx(0.5)  # mean of 1 bit and 0 bits
    assert stats["hack/hf_energy"] == pytest.approx(0.5)
    assert stats["hack/color_hist_shift"] == pytest.approx(0.5)  # the checkerboard's colours are all new
    panel = hacking_panel(images, ["a photo of a cat", "a photo of a cat"], base_images=images, shapes=False)
    assert panel["hack/color_hist_shift"] == 0.0 and panel["hack/color_entropy"] == pytest.approx(0.5)
    assert "hack/color_hist_shift" not in hacking_panel(images, ["x", "y"], shapes=False)  # no base: no shift
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        image_stats(torch.zeros(3, 8, 8))
