"""The per-pixel memory costs the reward server and `flowrl score` budget with: the table must be an upper
bound of what the rewards really use (measured in a fresh process), yet not a wild over-estimate."""

from __future__ import annotations

import sys

import pytest

import rewards
from rewards import Reward
from rewards.memory import (DEFAULT_BYTES_PER_PIXEL, MEASURED_BYTES_PER_PIXEL, bytes_per_pixel, format_bytes,
                            max_pixels_for, measure_bytes_per_pixel)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self peak-RSS counters")
@pytest.mark.parametrize("name", ["shapes", "jpeg_compressibility"])
@pytest.mark.slow
def test_table_bounds_the_measured_peak(name):
    measured = measure_bytes_per_pixel(name, size=512)
    table = MEASURED_BYTES_PER_PIXEL[name]
    # An upper bound (what the budget relies on), and not a wild over-estimate (the allocator can reuse freed
    # memory, so a measurement may come out below the 1024x1024 one the table was made from).
    assert measured <= table <= 2.0 * measured, (name, measured, table)


def test_composed_rewards_cost_their_most_expensive_part_and_declared_costs_win():
    shapes = rewards.load("shapes")
    assert bytes_per_pixel(shapes) == MEASURED_BYTES_PER_PIXEL["shapes"]
    mixed = rewards.build_reward("shapes,jpeg_compressibility:0.5")
    assert bytes_per_pixel(mixed) == max(MEASURED_BYTES_PER_PIXEL["shapes"],
                                         MEASURED_BYTES_PER_PIXEL["jpeg_compressibility"])
    transformed = rewards.build_reward({"jpeg_compressibility": {"transform": {"centre": 1.0}}})
    assert bytes_per_pixel(transformed) == MEASURED_BYTES_PER_PIXEL["jpeg_compressibility"]

    class Unknown(Reward):
        name = "never_measured"

    class Declared(Reward):
        name = "declared"
        bytes_per_pixel = 12.0

    assert bytes_per_pixel(Unknown()) == DEFAULT_BYTES_PER_PIXEL > max(MEASURED_BYTES_PER_PIXEL.values())
    assert bytes_per_pixel(Declared()) == 12.0
    # 1 MiB at (12 + 8 decode) bytes per pixel
    assert max_pixels_for(Declared(), 2 ** 20) == 2 ** 20 // 20 and max_pixels_for(Declared(), 2 ** 20, cap=100) == 100
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.5 KiB" and format_bytes(3 * 2 ** 30) == "3.0 GiB"
