"""Diffusion-DPO (flowrl/recipes/dpo.py): updates on toy pairs raise the toy flow's known reward, swapped
pairs lower it; pairs are read from webdataset shards, each used once per pass over the set, with clear errors
for bad shards. Runs, resume and 2-process equivalence: test_trainers_*.py."""

import numpy as np
import pytest
import torch

from flowrl.config import ConfigError, from_dict
from flowrl.data.webdataset_io import ShardError, read_pairs, write_pair_shards
from flowrl.dist import Dist
from flowrl.recipes import dpo
from flowrl.rl.forward import ForwardData
from flowrl.eval.generate import generate

from toy import ToyFlow, expected_reward


def toy_pairs(swap: bool, n: int = 512, rejected_first: bool = False) -> ForwardData:
    """Pairs of base-model samples of the toy flow; the one further right is preferred (or, swapped, the other).
    Labelled rows 2j, 2j + 1 of pair j: the chosen image first, or with ``rejected_first`` the rejected one."""
    x = generate(ToyFlow(), ["p"] * 2 * n, list(range(2 * n)), steps=10, guidance=1.0, batch_size=2 * n)
    a, b = x[:n], x[n:]
    right = (a[:, 0, 0, 0] > b[:, 0, 0, 0])[:, None, None, None]
    chosen, rejected = torch.where(right, a, b), torch.where(right, b, a)
    if swap:
        chosen, rejected = rejected, chosen
    rows = [rejected, chosen] if rejected_first else [chosen, rejected]
    x0 = torch.stack(rows, dim=1).flatten(0, 1)  # rows 2j, 2j + 1: pair j
    labels = torch.tensor([False, True] if rejected_first else [True, False]).repeat(n)
    return ForwardData(x0=x0, cond={"embedding": torch.zeros(2 * n, 1)}, advantages=None,
                       group_ids=torch.arange(n).repeat_interleave(2), sample_ids=torch.arange(2 * n),
                       valid=torch.ones(2 * n, dtype=torch.bool), chosen=labels)


def run_updates(swap: bool, epochs: int = 8, rejected_first: bool = False) -> tuple[float, float]:
    cfg = from_dict(dpo.Config, {"pairs": {"path": "unused"}, "optim": {"lr": 3e-3},
                                 "train": {"beta": 20.0, "micro_batch_size": 256}})
    model, dist = ToyFlow(), Dist(cpu=True)
    model.freeze_reference()
    optimizer = torch.optim.Adam(model.trainable_parameters(), lr=cfg.optim.lr)
    data = toy_pairs(swap, rejected_first=rejected_first)
    before = expected_reward(model)
    for epoch in range(epochs):
        metrics = dpo.train_epoch(model, optimizer, data, model.sigmas(10), cfg, dist, epoch)
        assert metrics["train/optimizer_steps"] == 1 and metrics["train/grad_norm"] > 0
    assert metrics["train/implicit_acc"] > 0.5  # the policy now prefers the chosen images more than the reference
    return before, expected_reward(model)


def test_updates_climb_the_reward_and_swapped_pairs_descend():
    before, after = run_updates(swap=False)
    assert before == pytest.approx(0.0, abs=0.05)
    assert after > before + 0.1, (before, after)
    before_swapped, after_swapped = run_updates(swap=True)
    assert after_swapped < before_swapped - 0.1, (before_swapped, after_swapped)


def test_the_labels_say_which_image_is_chosen_not_the_row_order():
    """Diffusion-DPO reads each row's label (``ForwardData.chosen``), not the sign of an advantage or the row's place
    in its pair: with the rejected image first in every pair, the same pairs train the same way."""
    chosen_first = run_updates(swap=False, epochs=2)
    rejected_first = run_updates(swap=False, epochs=2, rejected_first=True)
    assert rejected_first[1] == pytest.approx(chosen_first[1], rel=1e-4, abs=1e-6)
    assert rejected_first[1] > rejected_first[0]


class PixelModel:
    """What PairSet reads of a model: encode_images (pixels to [-1, 1]), the latent shape, prompts."""

    latent_shape = (3, 4, 4)
    device = torch.device("cpu")

    def encode_images(self, images):
        return images * 2 - 1

    def encode_prompts(self, prompts):
        return {"ids": torch.tensor([[len(p)] for p in prompts])}


def write_toy_pairs(path, n: int, size: int = 4) -> None:
    image = lambda value: np.full((size, size, 3), value, dtype=np.uint8)  # noqa: E731
    write_pair_shards(((image(2 * i), image(2 * i + 1), f"prompt {i}", {"i": i}) for i in range(n)), path, shard_size=3)


def test_pair_set_uses_every_pair_once_per_pass_and_encodes_both_images(tmp_path):
    write_toy_pairs(tmp_path, 5)
    assert [p.prompt for p in read_pairs(tmp_path)] == [f"prompt {i}" for i in range(5)]  # 2 shards, in order
    pairs = dpo.PairSet(str(tmp_path), pairs_per_epoch=2, seed=0)
    order = pairs.indices(0) + pairs.indices(1) + pairs.indices(2)[:1]  # positions 0-4: the first pass
    assert sorted(order) == [0, 1, 2, 3, 4]
    assert sorted(pairs.indices(2)[1:] + pairs.indices(3) + pairs.indices(4)) == [0, 1, 2, 3, 4]  # the second pass
    data = pairs.epoch(PixelModel(), 1, Dist(cpu=True))
    j = pairs.indices(1)
    # Row 2k is pair k's chosen image (value 2i / 255 -> [-1, 1]), row 2k + 1 its rejected one.
    expected = torch.tensor([[2 * i, 2 * i + 1] for i in j], dtype=torch.float32).flatten() / 255 * 2 - 1
    assert torch.allclose(data.x0[:, 0, 0, 0], expected)
    assert data.chosen.tolist() == [True, False, True, False] and data.advantages is None
    assert data.group_ids.tolist() == [0, 0, 1, 1] and data.sample_ids.tolist() == [0, 1, 2, 3]
    assert data.cond["ids"].flatten().tolist() == [len(f"prompt {i}") for i in j for _ in range(2)]


def test_bad_pairs_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"pairs\.path: name the preference-pair shards"):
        from_dict(dpo.Config, {})
    import webdataset as wds

    with wds.ShardWriter(str(tmp_path / "bad-%06d.tar"), maxcount=10, verbose=0) as sink:
        sink.write({"__key__": "k0", "chosen.png": b"x", "txt": "a circle"})
    with pytest.raises(ShardError, match=r"sample 'k0' of .* has no rejected image \(expected rejected\.png\)"):
        read_pairs(tmp_path)
    good = tmp_path / "good"
    write_toy_pairs(good, 2, size=8)
    pairs = dpo.PairSet(str(good), pairs_per_epoch=2, seed=0)
    with pytest.raises(ShardError, match=r"encode to latents of shape \(3, 8, 8\), but the model samples \(3, 4, 4\)"):
        pairs.epoch(PixelModel(), 0, Dist(cpu=True))
