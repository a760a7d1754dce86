"""The adversarial reward: hinge losses and the reward against hand-derived values, the discriminator learning
to separate real from colour-shifted shapes images, exact state round trips, references, the schedule, and
two processes taking the same discriminator step as one."""

import colorsys
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import rewards
from flowrl.data.shapes import prompt_rows
from rewards.adversarial import (AdversarialReward, DiscriminatorSchedule, clipped_linear, discriminator_loss,
                                 head_reward, hinge_loss, trainable_rewards)
from rewards.adversarial_refs import ImageReferences, ShapesReferences, load_references
from rewards.backbones import BackboneFeatures
from rewards.base import RewardError
from rewards.shapes_synth import colour_cast

ROOT = Path(__file__).resolve().parents[2]


def first_coordinate(tokens: torch.Tensor) -> torch.Tensor:
    """A stand-in head: D(token) = token[0]."""
    return tokens[..., 0]


def shapes_batch(prompts, seeds, tint=None) -> torch.Tensor:
    """Rendered scenes of ``prompts`` (``[B, 3, 32, 32]``), optionally with a colour cast per image ``[B, 3]``."""
    images, _ = ShapesReferences().draw(prompts, torch.as_tensor(seeds), True, lambda x: x)
    if tint is None:
        return images
    array = colour_cast(images.permute(0, 2, 3, 1).numpy(), np.asarray(tint, dtype=np.float32)[:, None, None, :])
    return torch.from_numpy(array).permute(0, 3, 1, 2).contiguous()


# ------------------------------------------------------------------------------------------- the formulas


def test_hinge_loss_hand_values():
    real = torch.tensor([2.0, 0.5, -1.0])  # relu(1 - real) = 0, 0.5, 2     -> mean 5/6
    fake = torch.tensor([-2.0, 0.0, 0.5])  # relu(1 + fake) = 0, 1, 1.5     -> mean 5/6
    assert hinge_loss(real, fake).item() == pytest.approx(5 / 3, abs=1e-6)
    assert hinge_loss(torch.tensor([1.0, 3.0]), torch.tensor([-1.0, -4.0])).item() == 0.0  # margins met


def test_discriminator_loss_hand_values():
    real = BackboneFeatures(torch.tensor([[2.0, 9.0], [0.5, 9.0]]),
                            torch.tensor([[[0.0, 0], [3.0, 0], [1.5, 0]], [[-1.0, 0], [2.0, 0], [0.0, 0]]]))
    fake = BackboneFeatures(torch.tensor([[-2.0, 9.0], [0.0, 9.0]]),
                            torch.tensor([[[-3.0, 0], [0.5, 0], [-0.5, 0]], [[1.0, 0], [-1.0, 0], [0.0, 0]]]))
    real_index = torch.tensor([[1, 2], [0, 2]])  # real patches 3.0, 1.5 | -1.0, 0.0
    fake_index = torch.tensor([[0, 1], [0, 1]])  # fake patches -3.0, 0.5 | 1.0, -1.0
    loss, parts = discriminator_loss(first_coordinate, real, fake, real_index, fake_index, patch_weight=0.3)
    global_term = (0 + 0.5) / 2 + (0 + 1) / 2  # relu(1 - [2, 0.5]) and relu(1 + [-2, 0])
    patch_term = (0 + 0 + 2 + 1) / 4 + (0 + 1.5 + 2 + 0) / 4
    assert parts["global"].item() == pytest.approx(global_term)
    assert parts["patch"].item() == pytest.approx(patch_term)
    assert loss.item() == pytest.approx(global_term + 0.3 * patch_term)
    assert parts["real"].item() == pytest.approx(1.25) and parts["fake"].item() == pytest.approx(-1.0)
    assert parts["acc"].item() == pytest.approx(0.75)  # both reals > 0; one of the fakes < 0


def test_head_reward_is_07_global_plus_03_mean_of_all_patches():
    features = BackboneFeatures(torch.tensor([[1.0, 5.0], [-2.0, 5.0]]),
                                torch.tensor([[[1.0, 0], [2.0, 0], [6.0, 0]], [[0.0, 0], [0.0, 0], [-3.0, 0]]]))
    reward, global_score, patch_score = head_reward(first_coordinate, features)
    assert global_score.tolist() == [1.0, -2.0]
    assert patch_score.tolist() == [3.0, -1.0]
    assert reward.tolist() == pytest.approx([0.7 * 1 + 0.3 * 3, 0.7 * -2 + 0.3 * -1])


def set_head_to_first_coordinate(reward: AdversarialReward) -> None:
    """Weights that make the real MLP compute D(t) = t[0]: GELU(t[0] + 30) = t[0] + 30 exactly in float32 for
    |t[0]| <= sqrt(D) (RMS-normalised tokens), every other hidden unit GELU(-30) = 0."""
    first, last = reward.head.net[0], reward.head.net[2]
    with torch.no_grad():
        first.weight.zero_()
        first.weight[0, 0] = 1.0
        first.bias.fill_(-30.0)
        first.bias[0] = 30.0
        last.weight.zero_()
        last.weight[0, 0] = 1.0
        last.bias.fill_(-30.0)


def test_reward_scores_the_backbone_tokens_the_head_trains_on():
    reward = rewards.load("adversarial")
    set_head_to_first_coordinate(reward)
    images = shapes_batch(["a red circle", "three blue squares"], [1, 2])
    out = reward(images, ["a red circle", "three blue squares"])
    features = reward.backbone(images)
    g, p = features.global_token[:, 0], features.patch_tokens[:, :, 0]
    assert features.patch_tokens.shape == (2, 256, 64)
    assert torch.allclose(out.details["adversarial/global"], g, atol=1e-5)
    assert torch.allclose(out.details["adversarial/patch"], p.mean(1), atol=1e-5)
    assert torch.allclose(out.scores, 0.7 * g + 0.3 * p.mean(1), atol=1e-5)
    # larger images reach the encoder through its box filter: a 2x nearest upscale of a 32 px render is
    # averaged back to it exactly
    big = images.repeat_interleave(2, dim=-1).repeat_interleave(2, dim=-2)
    assert torch.allclose(reward(big, ["a red circle", "three blue squares"]).scores, out.scores, atol=1e-4)
    # differentiable: the score has gradients with respect to the image
    x = images.clone().requires_grad_(True)
    reward(x, ["a red circle", "three blue squares"]).scores.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_clipped_linear_reward_pays_nothing_past_the_margin():
    """IRRL's clipped-linear form: below the margin the reward and its gradient are the raw head's, above it
    the reward is the margin and the gradient is zero (fooling the discriminator further earns nothing)."""
    assert clipped_linear(torch.tensor([-2.0, 0.0, 0.3, 5.0]), 0.3).tolist() == pytest.approx([-2.0, 0.0, 0.3, 0.3])
    raw = rewards.load("adversarial")
    clipped = rewards.load("adversarial", clip_margin=0.87)
    for r in (raw, clipped):
        set_head_to_first_coordinate(r)
    prompts = ["a red circle", "three blue squares", "a green triangle", "two red squares"]
    images = shapes_batch(prompts, [1, 2, 3, 4])
    x = images.clone().requires_grad_(True)
    y = images.clone().requires_grad_(True)
    r_raw, r_clip = raw(x, prompts), clipped(y, prompts)
    above = r_raw.scores > 0.87
    assert above.any() and (~above).any(), r_raw.scores  # the constructed batch straddles the margin
    assert torch.allclose(r_clip.scores, torch.minimum(r_raw.scores, torch.tensor(0.87)), atol=1e-6)
    assert r_clip.details["adversarial/clipped"].tolist() == above.float().tolist()
    r_raw.scores.sum().backward()
    r_clip.scores.sum().backward()
    for i in range(len(prompts)):
        if above[i]:
            assert float(y.grad[i].abs().max()) == 0.0  # no gradient past the margin
        else:
            assert torch.allclose(y.grad[i], x.grad[i], atol=1e-6)
    with pytest.raises(RewardError, match="clip_margin must be a number"):
        rewards.load("adversarial", clip_margin="high")


def test_measure_reports_the_fresh_accuracy_without_a_step():
    """``measure`` gives the accuracy on new fakes without touching the head; ``update``'s ``d_acc_fresh`` is
    the first step's accuracy, before the head has learned from those fakes (so a head that only memorised
    last epoch's samples shows it)."""
    prompts = ["a red circle", "two green squares", "a circle and a square", "a blue triangle"]
    fakes = shapes_batch(prompts, [0, 1, 2, 3], np.full((4, 3), 0.8))
    reward = rewards.load("adversarial", d_steps=4, lr=1e-3, patch_samples=16)
    head = {k: v.clone() for k, v in reward.head.state_dict().items()}
    measured = reward.measure(fakes, prompts)
    assert reward.updates == 0 and not reward.optimizer.state  # no step, no Adam state
    assert all(torch.equal(v, reward.head.state_dict()[k]) for k, v in head.items())
    assert measured["adv/d_acc_fresh"] == measured["adv/d_acc"]  # one draw, nothing averaged
    trained = [reward.update(fakes, prompts) for _ in range(20)]
    assert trained[-1]["adv/d_updates"] == 20
    # After steps on this (colour-cast) batch the head separates it; the first step's accuracy lags the
    # average over the steps on the first update (it is measured before any of them).
    assert trained[-1]["adv/d_acc_fresh"] == 1.0
    assert trained[0]["adv/d_acc_fresh"] <= trained[0]["adv/d_acc"]


# ------------------------------------------------------------------------------------------- training


@pytest.mark.slow
def test_discriminator_separates_real_from_colour_shifted_images():
    """After 200 updates of 32 images with the default settings (lr 1e-4, Adam 0.5/0.999) on train prompts,
    held-out eval-split images are told apart by the sign of the reward."""
    reward = rewards.load("adversarial", seed=0)
    rng = np.random.default_rng(0)

    def tints(n):  # a colour cast of a random saturated hue, strength 0.15-0.3: white -> a pale tint
        hue = np.array([colorsys.hsv_to_rgb(h, 1.0, 1.0) for h in rng.uniform(0, 1, size=n)])
        return 1.0 - rng.uniform(0.15, 0.3, size=(n, 1)) * (1.0 - hue)

    steps = 200
    train_prompts = [row[0] for row in prompt_rows("train", steps * 32, seed=11)]
    for step in range(steps):
        prompts = train_prompts[step * 32:(step + 1) * 32]
        fakes = shapes_batch(prompts, np.arange(32) + 10_000 * step, tints(32))
        metrics = reward.update(fakes, prompts)
    assert metrics["adv/d_updates"] == steps and metrics["adv/matched_frac"] == 1.0
    held = [row[0] for row in prompt_rows("eval", 200, seed=5)]
    real = shapes_batch(held, np.arange(200) + 900_000)
    fake = shapes_batch(held, np.arange(200) + 900_000, tints(200))
    real_scores, fake_scores = reward(real, held).scores, reward(fake, held).scores
    accuracy = 0.5 * ((real_scores > 0).float().mean() + (fake_scores < 0).float().mean()).item()
    assert accuracy >= 0.9, (accuracy, real_scores.mean().item(), fake_scores.mean().item())


def test_state_round_trip_is_exact(tmp_path):
    prompts = [row[0] for row in prompt_rows("train", 8, seed=3)]
    fakes = shapes_batch(prompts, np.arange(8), np.tile([1.0, 0.9, 0.8], (8, 1)))
    first = rewards.load("adversarial", seed=1, d_steps=2)
    for _ in range(2):
        first.update(fakes, prompts)
    torch.save(first.state_dict(), tmp_path / "state.pt")
    second = rewards.load("adversarial", seed=99, d_steps=2)  # other initial weights and draws
    second.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert second.updates == 2
    a, b = first.update(fakes, prompts), second.update(fakes, prompts)
    assert a == b  # same references drawn, same patches, same step
    for (name, p), q in zip(first.head.named_parameters(), second.head.parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(first(fakes, prompts).scores, second(fakes, prompts).scores)
    # a trained head alone starts another run's discriminator (head_path)
    from safetensors.torch import save_file

    save_file(first.state_dict()["head"], str(tmp_path / "head.safetensors"))
    third = rewards.load("adversarial", head_path=str(tmp_path / "head.safetensors"))
    assert torch.equal(first(fakes, prompts).scores, third(fakes, prompts).scores)
    with pytest.raises(RewardError, match="does not fit a 64-wide backbone with hidden=256"):
        rewards.load("adversarial", head_path=str(tmp_path / "head.safetensors"), hidden=256)
    # a discriminator of another backbone width is refused with a clear message
    state = first.state_dict()
    state["dim"] = 768
    with pytest.raises(RewardError, match="width 768"):
        second.load_state_dict(state)


def test_update_metrics_and_steps():
    prompts = ["a red circle", "two green squares", "a circle and a square", "a blue triangle"]
    reward = rewards.load("adversarial", d_steps=3, patch_samples=16)
    before = [p.clone() for p in reward.head.parameters()]
    metrics = reward.update(shapes_batch(prompts, [0, 1, 2, 3], np.full((4, 3), 0.8)), prompts)
    assert set(metrics) == {"adv/d_loss", "adv/d_loss_global", "adv/d_loss_patch", "adv/d_real", "adv/d_fake",
                            "adv/d_acc", "adv/d_acc_fresh", "adv/matched_frac", "adv/d_updates"}
    assert metrics["adv/d_loss"] == pytest.approx(metrics["adv/d_loss_global"] + 0.3 * metrics["adv/d_loss_patch"])
    assert reward.optimizer.state_dict()["state"][0]["step"].item() == 3  # three Adam steps
    assert any(not torch.equal(a, b) for a, b in zip(before, reward.head.parameters()))
    with pytest.raises(RewardError, match="2 images but 1 prompts"):
        reward.update(torch.rand(2, 3, 32, 32), ["a circle"])
    state = reward.state_dict()
    with pytest.raises(RewardError, match="NaN or infinite pixels"):
        reward.update(torch.full((1, 3, 32, 32), float("nan")), ["a circle"])
    assert torch.equal(reward.state_dict()["head"]["net.0.weight"], state["head"]["net.0.weight"])


@pytest.mark.slow
def test_two_processes_take_the_same_discriminator_steps_as_one(tmp_path):
    worker = "tests/rewards/adversarial_dist_worker.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "ACCELERATE_USE_CPU": "1"}
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    for command, out in (([sys.executable, worker, str(one)], one),
                         ([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           "configs/accelerate/cpu_2proc.yaml", worker, str(two)], two)):
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    a, b = torch.load(one, weights_only=True), torch.load(two, weights_only=True)
    assert (a["world_size"], b["world_size"]) == (1, 2)
    assert a["state"]["updates"] == b["state"]["updates"] == 3
    assert torch.equal(a["state"]["generator"], b["state"]["generator"])
    initial = rewards.load("adversarial", seed=3).head.state_dict()
    for key, value in a["state"]["head"].items():
        assert torch.allclose(value, b["state"]["head"][key], atol=1e-6, rtol=0), key
    assert not torch.equal(a["state"]["head"]["net.0.weight"], initial["net.0.weight"])  # the head moved


# ------------------------------------------------------------------------------------------- inputs


def png(rgb) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), rgb).save(buffer, format="PNG")
    return buffer.getvalue()


def test_image_references_pair_by_prompt_and_fall_back_unpaired(tmp_path):
    for name, rgb, prompt in (("a", (255, 0, 0), "A red  Thing"), ("b", (0, 0, 255), "a blue thing"),
                              ("c", (0, 255, 0), "a blue thing")):
        (tmp_path / f"{name}.png").write_bytes(png(rgb))
        (tmp_path / f"{name}.txt").write_text(prompt)
    refs = load_references(str(tmp_path))
    assert isinstance(refs, ImageReferences) and len(refs) == 3
    images, matched = refs.draw(["a red thing", "a blue thing", "a blue thing", "a cow"],
                                torch.tensor([5, 0, 1, 2]), True, lambda x: x)
    colours = [tuple((images[i, :, 0, 0] * 255).round().int().tolist()) for i in range(4)]
    assert colours[:3] == [(255, 0, 0), (0, 0, 255), (0, 255, 0)]  # the blue prompt's two refs by seed
    assert colours[3] == (0, 255, 0)  # no reference for "a cow": any image (seed 2 of 3)
    assert matched.tolist() == [True, True, True, False]
    unpaired, matched = refs.draw(["a cow"], torch.tensor([4]), False, lambda x: x)
    assert tuple((unpaired[0, :, 0, 0] * 255).round().int().tolist()) == (0, 0, 255) and matched.all()
    # images without prompts serve the unpaired mode only
    bare = ImageReferences([png((1, 2, 3))], None, "bare")
    with pytest.raises(RewardError, match="pairing='unpaired'"):
        bare.draw(["x"], torch.tensor([0]), True, lambda x: x)


def test_references_from_shards_and_the_reward_in_unpaired_mode(tmp_path):
    from flowrl.data.webdataset_io import write_shapes_shards

    write_shapes_shards("train", 12, tmp_path / "shards", shard_size=5)
    refs = load_references(str(tmp_path / "shards"))
    assert len(refs) == 12 and refs.prompts[0]
    prompt = refs.prompts[3]
    images, matched = refs.draw([prompt], torch.tensor([0]), True, lambda x: x)
    assert matched.all() and images.shape == (1, 3, 32, 32)
    reward = rewards.load("adversarial", references=str(tmp_path / "shards"), pairing="unpaired")
    metrics = reward.update(shapes_batch(["a red circle"] * 2, [0, 1]), ["a red circle"] * 2)
    assert metrics["adv/matched_frac"] == 1.0


def test_bad_arguments_are_one_clear_error(tmp_path):
    with pytest.raises(RewardError, match="pairing must be 'prompt' or 'unpaired'"):
        rewards.load("adversarial", pairing="paired")
    with pytest.raises(RewardError, match="lr must be a positive float"):
        rewards.load("adversarial", lr=-1.0)
    with pytest.raises(RewardError, match="neither 'shapes', a folder of images nor webdataset"):
        rewards.load("adversarial", references=str(tmp_path / "nothing"))
    with pytest.raises(RewardError, match="unknown backbone 'dino'"):
        rewards.load("adversarial", backbone="dino")
    reward = rewards.load("adversarial")
    with pytest.raises(RewardError, match="shapes-world prompts"):
        reward.update(torch.rand(1, 3, 32, 32), ["a photo of a cat"])


# ------------------------------------------------------------------------------------------- DINOv2


def tiny_dinov2(folder: Path) -> Path:
    from transformers import Dinov2Config, Dinov2Model

    config = Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                          image_size=32, patch_size=8)
    torch.manual_seed(0)
    Dinov2Model(config).save_pretrained(folder)
    return folder


def test_missing_dinov2_weights_give_one_error_naming_the_files(tmp_path):
    with pytest.raises(RewardError) as missing:
        rewards.load("adversarial", backbone="dinov2", backbone_path=str(tmp_path / "dinov2-base"))
    message = str(missing.value)
    assert "\n" not in message
    for needed in ("config.json", "model.safetensors", "huggingface-cli download facebook/dinov2-base",
                   "backbone_path=DIR", str(tmp_path / "dinov2-base")):
        assert needed in message
    with pytest.raises(RewardError, match="needs backbone_path=<folder with config.json and model.safetensors>"):
        rewards.load("adversarial", backbone="dinov2")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(RewardError, match=r"lacks model.safetensors \(expected config.json and model.safetensors\)"):
        rewards.load("adversarial", backbone="dinov2", backbone_path=str(tmp_path / "half"))


def test_dinov2_backbone_tokens_and_an_update(tmp_path):
    from transformers import Dinov2Model

    folder = tiny_dinov2(tmp_path / "dinov2")
    reward = rewards.load("adversarial", backbone="dinov2", backbone_path=str(folder), patch_samples=4)
    images = shapes_batch(["a red circle", "a blue square"], [0, 1])
    features = reward.backbone(images)
    assert features.global_token.shape == (2, 32) and features.patch_tokens.shape == (2, 16, 32)
    # by hand: ImageNet normalisation, the CLS and patch tokens of the last (layer-normed) hidden state,
    # each divided by its root mean square
    model = Dinov2Model.from_pretrained(folder).eval()
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    with torch.no_grad():
        hidden = model(pixel_values=(images - mean) / std).last_hidden_state
    rms = hidden.pow(2).mean(-1, keepdim=True).sqrt()
    assert torch.allclose(features.global_token, (hidden / rms)[:, 0], atol=1e-4)
    assert torch.allclose(features.patch_tokens, (hidden / rms)[:, 1:], atol=1e-4)
    metrics = reward.update(images, ["a red circle", "a blue square"])
    assert np.isfinite(metrics["adv/d_loss"])
    assert reward(images, ["a red circle", "a blue square"]).scores.shape == (2,)


# ------------------------------------------------------------------------------------------- loop helpers


def test_schedule_alternates_like_adv_grpo():
    schedule = DiscriminatorSchedule()  # Adv-GRPO: 9 discriminator epochs, then 1 generator epoch
    assert [schedule.trains_generator(e) for e in range(20)] == [e % 10 == 9 for e in range(20)]
    assert [schedule.trains_discriminator(e) for e in range(20)] == [e % 10 != 9 for e in range(20)]
    every = DiscriminatorSchedule(period=1, d_epochs=0, d_on_generator_epochs=True, warmup_epochs=2)
    assert [every.trains_generator(e) for e in range(4)] == [False, False, True, True]
    assert all(every.trains_discriminator(e) for e in range(4))
    frozen = DiscriminatorSchedule(period=1, d_epochs=0)
    assert not any(frozen.trains_discriminator(e) for e in range(5))
    from flowrl.config import ConfigError, from_dict

    with pytest.raises(ConfigError, match="d_epochs: 10 of every 10 epochs leaves none for the generator"):
        from_dict(DiscriminatorSchedule, {"period": 10, "d_epochs": 10})
    with pytest.raises(ConfigError, match="period: got 0; must be >= 1"):
        from_dict(DiscriminatorSchedule, {"period": 0})


def test_trainable_rewards_are_found_inside_a_composed_reward():
    composed = rewards.build_reward({"shapes": 1.0, "adversarial": {"weight": 0.5, "transform": {"clip": [-3, 3]}}})
    found = trainable_rewards(composed)
    assert len(found) == 1 and isinstance(found[0], AdversarialReward)
    out = composed(shapes_batch(["a red circle"], [0]), ["a red circle"])
    assert "adversarial" in out.details and "adversarial/global" in out.details
    assert trainable_rewards(rewards.load("shapes")) == []


def test_config_json_of_the_shipped_encoder_says_how_it_was_built():
    config = json.loads((ROOT / "rewards" / "shapes_encoder" / "config.json").read_text())
    assert config["built_by"].startswith("flowrl train-reward shapes-encoder")
    assert config["dim"] == 64 and config["image_size"] == 32


def test_shapes_encoder_build_is_reproducible_and_loadable(tmp_path, capsys):
    from rewards.train_reward import main as train_reward

    for name in ("a", "b"):
        assert train_reward(["shapes-encoder", "--out", str(tmp_path / name), "--steps", "2", "--batch-size", "4"]) == 0
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert "use backbone_path=" in capsys.readouterr().out
    reward = rewards.load("adversarial", backbone_path=str(tmp_path / "a"))
    assert reward.backbone.dim == 64 and reward(shapes_batch(["a circle"], [0]), ["a circle"]).scores.shape == (1,)
    with pytest.raises(RewardError, match="needs config.json and model.safetensors"):
        rewards.load("adversarial", backbone_path=str(tmp_path))
