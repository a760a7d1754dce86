"""Prompt groups drawn by task kind (flowrl/data/prompt_groups.py): balanced, uniform, fixed and mixed weights."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from flowrl.config import ConfigError
from flowrl.data.prompt_groups import PromptGroups
from samplers import derive_seed

# Kind "a" has one prompt, "b" nine: drawn uniformly, "a" would get a tenth of the groups.
PROMPTS = ["a0"] + [f"b{i}" for i in range(9)]
METADATA = [{"kind": "a"}] + [{"kind": "b"} for _ in range(9)]


def kinds_of(groups: PromptGroups, epoch: int) -> Counter:
    return Counter(m["kind"] for m in groups.epoch(epoch).metadata[:: groups.group_size])


def test_balanced_gives_every_kind_its_share_of_groups_every_epoch():
    groups = PromptGroups(PROMPTS, METADATA, groups=4, group_size=2, seed=0)  # balanced is the default
    for epoch in range(5):
        assert kinds_of(groups, epoch) == {"a": 2, "b": 2}
        # within a kind, without replacement while it has prompts enough; "a" repeats its one prompt
        batch = groups.epoch(epoch)
        b_prompts = [p for p in batch.prompts[::2] if p.startswith("b")]
        assert len(set(b_prompts)) == 2
    assert groups.group_kinds(3) == [m["kind"] for m in groups.epoch(3).metadata[::2]]


def test_uneven_shares_go_by_expected_counts_with_the_remainder_drawn():
    groups = PromptGroups(PROMPTS, METADATA, groups=3, group_size=1, seed=1)  # 1.5 groups each
    counts = [kinds_of(groups, e) for e in range(40)]
    assert all(sorted(c.values()) == [1, 2] for c in counts)
    assert 10 < sum(c["a"] == 2 for c in counts) < 30  # each kind gets the extra group about half the time


def test_fixed_weights_and_uniform():
    fixed = PromptGroups(PROMPTS, METADATA, groups=4, group_size=1, seed=0, kind_weights={"a": 3, "b": 1})
    assert all(kinds_of(fixed, e) == {"a": 3, "b": 1} for e in range(5))
    only_b = PromptGroups(PROMPTS, METADATA, groups=4, group_size=1, seed=0, kind_weights={"b": 1.0})
    assert all(kinds_of(only_b, e) == {"b": 4} for e in range(5))
    uniform = PromptGroups(PROMPTS, METADATA, groups=10, group_size=1, seed=0, kind_weights="uniform")
    assert uniform.weights == pytest.approx({"a": 0.1, "b": 0.9})
    assert all(kinds_of(uniform, e) == {"a": 1, "b": 9} for e in range(5))


def test_a_set_without_kinds_is_drawn_as_before_kinds_existed():
    prompts = [f"p{i}" for i in range(7)]
    groups = PromptGroups(prompts, None, groups=3, group_size=2, seed=5)
    for epoch in range(3):
        generator = torch.Generator().manual_seed(derive_seed(5, epoch, 0x9E0))
        expected = torch.randperm(7, generator=generator)[:3].repeat_interleave(2)
        assert groups.epoch(epoch).prompts == [prompts[i] for i in expected.tolist()]


def test_mixed_weights_follow_the_groups_with_a_learning_signal():
    groups = PromptGroups(PROMPTS, METADATA, groups=4, group_size=2, seed=0, kind_weights="mixed",
                          mixed_decay=0.5, mixed_floor=0.25)
    assert groups.weights == {"a": 0.5, "b": 0.5}  # start balanced
    kinds = groups.group_kinds(0)
    # "a" groups all alike (no signal), "b" groups mixed.
    rewards = torch.tensor([[1.0, 1.0] if k == "a" else [0.0, 1.0] for k in kinds]).flatten()
    logged = groups.observe(0, rewards)
    # shares a 0, b 1 -> weights 0 and 1; the floor lifts a to 0.25 x 0.5 = 0.125; normalised: 1/9 and 8/9.
    assert groups.weights == pytest.approx({"a": 1 / 9, "b": 8 / 9})
    assert logged["data/weight/a"] == pytest.approx(1 / 9) and logged["data/mixed/b"] == 1.0
    kinds = groups.group_kinds(1)
    assert Counter(kinds)["b"] >= 3  # expected 3.56 and 0.44: b gets 3, the remainder goes by the fractions
    # Next epoch every "a" group is mixed and half the "b" groups are: averages 0.5 x old + 0.5 x new.
    rows, b_seen = [], 0
    for kind in kinds:
        mixed = kind == "a" or b_seen % 2 == 0
        b_seen += kind == "b"
        rows.append([0.0, 1.0] if mixed else [1.0, 1.0])
    groups.observe(1, torch.tensor(rows).flatten())
    b_groups = kinds.count("b")
    b_share = sum(1 for i in range(b_groups) if i % 2 == 0) / b_groups
    expected = {"a": 0.5 * 0.0 + 0.5 * 1.0 if "a" in kinds else 0.0, "b": 0.5 * 1.0 + 0.5 * b_share}
    assert groups.mixed_share == pytest.approx(expected)
    raw = {k: v / sum(expected.values()) for k, v in expected.items()}
    floored = {k: max(v, 0.125) for k, v in raw.items()}
    assert groups.weights == pytest.approx({k: v / sum(floored.values()) for k, v in floored.items()})
    state = groups.state_dict()
    again = PromptGroups(PROMPTS, METADATA, groups=4, group_size=2, seed=0, kind_weights="mixed")
    again.load_state_dict(state)
    assert again.weights == groups.weights and again.group_kinds(2) == groups.group_kinds(2)
    # NaN rewards do not count as a signal.
    before = dict(groups.mixed_share)
    groups.observe(2, torch.tensor([float("nan"), 1.0] * 4))
    assert groups.mixed_share == pytest.approx({k: 0.5 * v for k, v in before.items()})


def test_bad_kind_weights_name_the_field_and_the_kinds():
    with pytest.raises(ConfigError, match=r"data.kind_weights.*unknown: c"):
        PromptGroups(PROMPTS, METADATA, groups=2, group_size=1, seed=0, kind_weights={"c": 1})
    with pytest.raises(ConfigError, match=r"data.kind_weights.*non-negative"):
        PromptGroups(PROMPTS, METADATA, groups=2, group_size=1, seed=0, kind_weights={"a": -1})
    with pytest.raises(ConfigError, match=r"expected one of balanced, uniform, mixed"):
        PromptGroups(PROMPTS, METADATA, groups=2, group_size=1, seed=0, kind_weights="equal")


def test_group_layout_that_does_not_split_over_processes_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^sampling.groups_per_epoch: groups_per_epoch x group_size = 3 x 3 = 9 "
                                          r"samples per epoch do not split evenly over 2 processes"):
        PromptGroups(["a"], None, groups=3, group_size=3, seed=0, num_processes=2, rank=0)
