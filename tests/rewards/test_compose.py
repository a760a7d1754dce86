"""Composition and transforms on hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

import rewards
from rewards import Reward, RewardError, RewardOutput
from rewards.compose import (Centre, Clip, GatedReward, Sigmoid, TransformedReward, WeightedSum, build_reward,
                             parse_reward_string, parse_transforms)


class Fixed(Reward):
    """Scores given by hand (indexed by the prompt), with one detail."""

    differentiable = True

    def __init__(self, name: str, values: dict[str, float]):
        self.name = name
        self.values = values

    def score(self, images, prompts, metadata):
        base = torch.tensor([self.values[p] for p in prompts])
        scores = base + 0.0 * images.mean(dim=(1, 2, 3))  # differentiable, value unchanged
        return RewardOutput(scores, {f"{self.name}/double": 2 * base})


PROMPTS = ["a", "b", "c"]
IMAGES = torch.zeros(3, 3, 4, 4)


@pytest.fixture
def registered():
    """Two hand rewards in the registry for the duration of a test."""
    from rewards.registry import REWARDS

    added = {"hand_a": lambda scale=1.0, device=None: Fixed("hand_a", {"a": 1 * scale, "b": 2 * scale, "c": 3 * scale}),
             "hand_b": lambda device=None: Fixed("hand_b", {"a": 10.0, "b": -4.0, "c": 0.5})}
    for name, factory in added.items():
        REWARDS.register(name, factory)
    yield
    for name in added:
        REWARDS._entries.pop(name, None)


def test_transforms_on_hand_values():
    r = torch.tensor([-2.0, 0.0, 1.0, 5.0])
    torch.testing.assert_close(Centre(1.0)(r), torch.tensor([-3.0, -1.0, 0.0, 4.0]))
    torch.testing.assert_close(Clip(-1.0, 2.0)(r), torch.tensor([-1.0, 0.0, 1.0, 2.0]))
    torch.testing.assert_close(Clip(None, 0.5)(r), torch.tensor([-2.0, 0.0, 0.5, 0.5]))
    expected = torch.tensor([1 / (1 + math.exp(-(v - 1.0) / 2.0)) for v in (-2.0, 0.0, 1.0, 5.0)])
    torch.testing.assert_close(Sigmoid(1.0, 2.0)(r), expected)
    chain = parse_transforms({"centre": 1.0, "clip": [-1, 2]})
    assert chain == [Centre(1.0), Clip(-1.0, 2.0)]
    assert parse_transforms([{"sigmoid": {"ref": 1, "temperature": 2}}]) == [Sigmoid(1.0, 2.0)]
    with pytest.raises(RewardError, match="unknown transform 'scale'; valid transforms: centre, clip, sigmoid"):
        parse_transforms({"scale": 2})
    with pytest.raises(RewardError, match="lo=3.0 is greater than hi=1.0"):
        parse_transforms({"clip": [3, 1]})


def test_weighted_sum_and_details():
    a = Fixed("a", {"a": 1.0, "b": 2.0, "c": 3.0})
    b = Fixed("b", {"a": 10.0, "b": -4.0, "c": 0.5})
    out = WeightedSum([("a", a, 1.0), ("b", b, 0.5)])(IMAGES, PROMPTS)
    torch.testing.assert_close(out.scores, torch.tensor([6.0, 0.0, 3.25]))
    torch.testing.assert_close(out.details["a"], torch.tensor([1.0, 2.0, 3.0]))
    torch.testing.assert_close(out.details["b/double"], torch.tensor([20.0, -8.0, 1.0]))
    assert set(out.details) == {"a", "b", "a/double", "b/double"}


def test_transformed_term_logs_raw():
    a = Fixed("a", {"a": 1.0, "b": 2.0, "c": 3.0})
    out = TransformedReward(a, [Centre(2.0), Clip(-0.5, 0.5)])(IMAGES, PROMPTS)
    torch.testing.assert_close(out.scores, torch.tensor([-0.5, 0.0, 0.5]))
    torch.testing.assert_close(out.details["a/raw"], torch.tensor([1.0, 2.0, 3.0]))


def test_gated_formula():
    alignment = Fixed("align", {"a": 0.0, "b": 0.5, "c": 1.0})
    quality = Fixed("qual", {"a": 9.0, "b": 5.0, "c": 3.0})
    out = GatedReward(alignment, quality, bonus=0.5, ref=5.0, temperature=2.0)(IMAGES, PROMPTS)
    gate = [1 / (1 + math.exp(-(q - 5.0) / 2.0)) for q in (9.0, 5.0, 3.0)]
    expected = torch.tensor([a * (1 + 0.5 * g) for a, g in zip((0.0, 0.5, 1.0), gate)])
    torch.testing.assert_close(out.scores, expected)
    assert out.scores[0] == 0  # quality cannot create reward where alignment is zero
    torch.testing.assert_close(out.details["gate"], torch.tensor(gate))
    assert {"alignment", "quality", "gate", "alignment/double", "quality/double"} == set(out.details)


def test_build_reward_from_mapping(registered):
    spec = {"hand_a": 1.0, "hand_b": {"weight": 0.5, "transform": {"clip": [-1, 1]}},
            "alias": {"reward": "hand_a", "kwargs": {"scale": 10.0}, "weight": -0.1}}
    reward = build_reward(spec)
    out = reward(IMAGES, PROMPTS)
    # hand_a + 0.5 * clip(hand_b, -1, 1) - 0.1 * 10 * hand_a
    expected = torch.tensor([1 + 0.5 * 1 - 1.0, 2 + 0.5 * -1 - 2.0, 3 + 0.5 * 0.5 - 3.0])
    torch.testing.assert_close(out.scores, expected)
    torch.testing.assert_close(out.details["hand_b/raw"], torch.tensor([10.0, -4.0, 0.5]))
    assert set(out.details) >= {"hand_a", "hand_b", "alias", "alias/double", "hand_b/double"}
    assert reward.differentiable


def test_build_reward_from_string_and_single(registered):
    assert parse_reward_string("hand_a, hand_b:0.25") == [("hand_a", 1.0), ("hand_b", 0.25)]
    out = build_reward("hand_a,hand_b:0.25")(IMAGES, PROMPTS)
    torch.testing.assert_close(out.scores, torch.tensor([3.5, 1.0, 3.125]))
    single = build_reward("hand_a")
    assert isinstance(single, Fixed)  # one term with weight 1: no wrapper


def test_build_gated_spec(registered):
    reward = build_reward({"gated": {"alignment": "hand_a", "quality": "hand_b", "bonus": 1.0, "ref": 0.5}})
    assert isinstance(reward, GatedReward)
    out = reward(IMAGES, PROMPTS)
    gate = torch.sigmoid(torch.tensor([10.0, -4.0, 0.5]) - 0.5)
    torch.testing.assert_close(out.scores, torch.tensor([1.0, 2.0, 3.0]) * (1 + gate))


def test_spec_mistakes_are_clear(registered):
    with pytest.raises(KeyError, match="unknown reward 'hand_c'.*valid names: .*aesthetic.*hand_a"):
        build_reward({"hand_c": 1.0})
    with pytest.raises(RewardError, match=r"reward spec reward.hand_a.wieght: unknown key \(did you mean 'weight'\?\)"):
        build_reward({"hand_a": {"wieght": 2}})
    with pytest.raises(RewardError, match="reward spec reward.hand_a.weight: got 'x'; expected a number"):
        build_reward({"hand_a": {"weight": "x"}})
    with pytest.raises(RewardError, match="bad weight 'x'"):
        build_reward("hand_a:x")
    with pytest.raises(RewardError, match="reward.hand_a.kwargs.scael: hand_a takes no argument 'scael'; valid "
                                          "arguments: scale"):
        build_reward({"hand_a": {"kwargs": {"scael": 2}}})
    with pytest.raises(RewardError, match="reward spec reward.gated: missing required key"):
        build_reward({"gated": {"alignment": "hand_a"}})
    with pytest.raises(KeyError, match="valid names"):
        rewards.load("nonexistent")


def test_gradients_flow_through_composition(registered):
    reward = build_reward({"hand_a": 1.0, "hand_b": {"weight": 2.0, "transform": {"sigmoid": 0.0}}})
    images = IMAGES.clone().requires_grad_(True)
    reward(images, PROMPTS).scores.sum().backward()
    assert images.grad is not None
