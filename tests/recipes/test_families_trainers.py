"""Every trainer (Flow-GRPO, CRD, DiffusionNFT, AWM, DGPO, Diffusion-DPO, D3PO) runs a tiny epoch on the tiny
pipeline of each newer model family (flowrl.models.families; SD3 / FLUX have their own tests), through the
trainer's shipped shapes config with the model swapped: it trains (finite loss, a gradient), logs, evaluates and
checkpoints. Wan (text-to-video) runs on 5-frame clips (2 latent frames); its Diffusion-DPO pairs are the same
image pairs as the image families', which the Wan adapter encodes as still clips (each image repeated over every
frame: flowrl has no video pair shards). Flow-GRPO's first pass re-scores its own rollout, so its logged ratio is 1
and the LoRA (B = 0 at init) equals the reference."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from flowrl.run.checkpoint_files import latest_checkpoint, load_state
from flowrl.run.metrics import read_metrics
from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION, build_tiny
from flowrl.commands.train import load_recipe_config

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ["qwen_image", "z_image", "flux2_klein", "flux2", "wan"]
TRAINERS = ["flow_grpo", "crd", "nft", "awm", "dgpo", "dpo", "d3po"]
# with CFG, so the unconditional branch trains too (FLUX.2 [dev]: the guidance embedding's value, no CFG)
GUIDANCE = {"qwen_image": 4.0, "z_image": 3.0, "flux2_klein": 4.0, "flux2": 4.0, "wan": 5.0}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("a red apple\na blue car\na cat on a mat\na bowl of soup\n")
    return path


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    """Four preference pairs of random images at the tiny pipelines' resolution."""
    from flowrl.data.webdataset_io import write_pair_shards

    path = tmp_path_factory.mktemp("pairs")
    rng = np.random.default_rng(0)
    image = lambda: rng.integers(0, 256, (TINY_RESOLUTION, TINY_RESOLUTION, 3), dtype=np.uint8)  # noqa: E731
    write_pair_shards(((image(), image(), p, None) for p in ["a red apple", "a blue car"] * 2), path)
    return path


def overrides(family: str, trainer: str, out: Path, prompts: Path, pairs: Path) -> list[str]:
    settings = {
        "model.name": family, "model.path": str(build_tiny(family)), "model.resolution": TINY_RESOLUTION,
        "model.max_sequence_length": TINY_MAX_SEQUENCE_LENGTH, "model.lora": "{rank: 4, alpha: 8}",
        "model.dtype": "float32", "run.output_dir": str(out), "run.max_epochs": 1, "run.max_minutes": "null",
        "data.train_prompts": str(prompts), "data.eval_prompts": str(prompts), "data.num_eval_prompts": 2,
        "sampling.num_steps": 3, "sampling.eval_num_steps": 2, "sampling.group_size": 2,
        "sampling.groups_per_epoch": 2, "sampling.batch_size": 4, "sampling.guidance": GUIDANCE[family],
        "train.micro_batch_size": 4, "reward.train": "{jpeg_incompressibility: 1.0}",
        "reward.eval": "[jpeg_incompressibility]", "eval.at_start": "false", "eval.every_epochs": 1,
        "eval.every_minutes": "null", "eval.grid_size": 2, "checkpoint.every_epochs": 1,
    }
    if family == "wan":
        from flowrl.testing.tiny_wan import TINY_WAN_NUM_FRAMES

        settings.update({"model.num_frames": TINY_WAN_NUM_FRAMES, "model.negative_prompt": "blurred, static"})
    if trainer in ("flow_grpo", "d3po"):
        settings["sampling.window"] = "{mode: fixed, start: 0, size: null}"
    if trainer == "d3po":
        settings["train.micro_batch_size"] = 1
    if trainer == "dpo":
        for key in [k for k in settings if k.startswith(("sampling.", "data.train_prompts", "reward.train"))]:
            del settings[key]
        settings.update({"pairs.path": str(pairs), "pairs.pairs_per_epoch": 2, "sampling.eval_num_steps": 2,
                         "sampling.guidance": GUIDANCE[family]})
    return [f"{k}={v}" for k, v in settings.items()]


@pytest.mark.slow
@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_tiny_epoch_of_every_trainer(family, trainer, prompts, pairs, tmp_path):
    out = tmp_path / "run"
    recipe, cfg = load_recipe_config(str(ROOT / "configs" / "shapes" / f"{trainer}.yaml"),
                                     overrides(family, trainer, out, prompts, pairs))
    assert recipe.main(cfg) == 0
    rows = read_metrics(out / "metrics.jsonl")
    row = rows[-1]
    losses = [v for k, v in row.items() if k.startswith("train/") and "loss" in k and isinstance(v, float)]
    assert losses and all(math.isfinite(v) for v in losses), row
    assert row["train/grad_norm"] > 0, row
    assert "eval/jpeg_incompressibility/mean" in row
    state = load_state(latest_checkpoint(out))
    assert state["model"] and all("lora_" in k for k in state["model"])
    assert (out / "checkpoints" / latest_checkpoint(out).name / "lora" / "pytorch_lora_weights.safetensors").is_file()
    if trainer == "flow_grpo":
        assert abs(row["train/ratio_mean"] - 1.0) < 1e-6 and row["train/clip_frac"] == 0.0
        assert row["train/kl_ref"] == pytest.approx(0.0, abs=1e-10)
    if family == "wan":  # the eval grid draws each video as its strip of 5 frames of 64 px (base and current)
        from PIL import Image

        with Image.open(out / "samples" / "epoch_0001.png") as grid:
            assert grid.size[0] > 2 * (5 * 64)


@pytest.mark.slow
def test_wan22_trains_both_experts(prompts, pairs, tmp_path):
    """Flow-GRPO on the tiny Wan 2.2 pipeline (3 steps: t = 1000 on the high-noise expert, the rest below the
    875 boundary on the low-noise one): both experts' LoRA weights are trained and checkpointed."""
    out = tmp_path / "run"
    settings = overrides("wan", "flow_grpo", out, prompts, pairs)
    settings = [s for s in settings if not s.startswith("model.path=")] + [f"model.path={build_tiny('wan22')}",
                                                                         "optim.lr=0.05", "train.clip_range=0.5"]
    recipe, cfg = load_recipe_config(str(ROOT / "configs" / "shapes" / "flow_grpo.yaml"), settings)
    assert recipe.main(cfg) == 0
    state = load_state(latest_checkpoint(out))
    assert {k.split(".")[0] for k in state["model"]} == {"high", "low"}
    for expert in ("high", "low"):  # lora_B starts at 0: a trained expert has moved it
        moved = [v.abs().max() for k, v in state["model"].items() if k.startswith(expert) and "lora_B" in k]
        assert moved and max(moved) > 0, expert
