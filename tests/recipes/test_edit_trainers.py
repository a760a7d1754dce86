"""Editing models train on editing prompts: a tiny epoch of Flow-GRPO and of DiffusionNFT (a forward-process
trainer) on FLUX.1-Kontext's tiny pipeline with prompts and source images from a tiny webdataset shard, and the
Flow-GRPO run's LoRA exported to diffusers gives, in plain ``FluxKontextPipeline`` with the same source image and
noise, the images flowrl's own model draws (1e-5)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from flowrl.logging import read_metrics
from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION, build_tiny
from flowrl.train import load_recipe_config

ROOT = Path(__file__).resolve().parents[2]
FAMILY = "flux_kontext"
GUIDANCE = 2.5
STEPS = 3


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def edits(tmp_path_factory) -> Path:
    """Four editing prompts, each a random 48 px source (resized to the model's 64 px on loading)."""
    from flowrl.data.edit_prompts import write_edit_shards

    path = tmp_path_factory.mktemp("edits")
    rng = np.random.default_rng(0)
    samples = [(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8), text, None, None)
               for text in ["make the apple blue", "turn the car red", "add a cat", "make it small"]]
    write_edit_shards(samples, path)
    return path


def run_epoch(trainer: str, out: Path, edits: Path, **extra) -> Path:
    settings = {
        "model.name": FAMILY, "model.path": str(build_tiny(FAMILY)), "model.resolution": TINY_RESOLUTION,
        "model.max_sequence_length": TINY_MAX_SEQUENCE_LENGTH, "model.lora": "{rank: 4, alpha: 8}",
        "model.dtype": "float32", "run.output_dir": str(out), "run.max_epochs": 1, "run.max_minutes": "null",
        "data.train_prompts": str(edits), "data.eval_prompts": str(edits), "data.num_eval_prompts": 2,
        "sampling.num_steps": STEPS, "sampling.eval_num_steps": 2, "sampling.group_size": 2,
        "sampling.groups_per_epoch": 2, "sampling.batch_size": 4, "sampling.guidance": GUIDANCE,
        "train.micro_batch_size": 4, "reward.train": "{jpeg_incompressibility: 1.0}",
        "reward.eval": "[jpeg_incompressibility]", "eval.at_start": "false", "eval.every_epochs": 1,
        "eval.every_minutes": "null", "eval.grid_size": 2, "checkpoint.every_epochs": 1, **extra,
    }
    if trainer == "flow_grpo":
        settings["sampling.window"] = "{mode: fixed, start: 0, size: null}"
    recipe, cfg = load_recipe_config(str(ROOT / "configs" / "shapes" / f"{trainer}.yaml"),
                                     [f"{k}={v}" for k, v in settings.items()])
    assert recipe.main(cfg) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["flow_grpo", "nft"])
def test_a_tiny_epoch_on_editing_prompts(trainer, edits, tmp_path):
    out = run_epoch(trainer, tmp_path / "run", edits)
    row = read_metrics(out / "metrics.jsonl")[-1]
    losses = [v for k, v in row.items() if k.startswith("train/") and "loss" in k and isinstance(v, float)]
    assert losses and all(math.isfinite(v) for v in losses), row
    assert row["train/grad_norm"] > 0, row
    assert "eval/jpeg_incompressibility/mean" in row
    if trainer == "flow_grpo":  # re-scoring its own rollout: the stored Cond (with the source) was used
        assert abs(row["train/ratio_mean"] - 1.0) < 1e-6 and row["train/kl_ref"] == pytest.approx(0.0, abs=1e-10)


@pytest.mark.slow
def test_the_exported_lora_edits_like_flowrl_in_plain_diffusers(edits, tmp_path):
    from diffusers import FluxKontextPipeline

    from flowrl.data.prompts import load_prompts
    from flowrl.export import main as export_main
    from flowrl.generate import generate
    from flowrl.models.resolve import load_finetuned
    from samplers import initial_noise

    run = run_epoch("flow_grpo", tmp_path / "run", edits, **{"optim.lr": 0.05, "train.clip_range": 0.5,
                                                             "eval.every_epochs": 10, "eval.grid_size": 0})
    prompt_set = load_prompts(str(edits), resolution=TINY_RESOLUTION)
    prompts, rows, seeds = prompt_set.prompts[:2], prompt_set.metadata[:2], [3, 11]
    assert rows[0]["source_image"].shape == (3, TINY_RESOLUTION, TINY_RESOLUTION)
    ours = generate(load_finetuned(run), prompts, seeds, steps=STEPS, guidance=GUIDANCE, metadata=rows)

    def diffusers_images(pipe):
        noise = initial_noise((16, 8, 8), torch.tensor(seeds))
        source = torch.stack([r["source_image"] for r in rows])
        with torch.no_grad():
            return pipe(image=source, prompt=prompts, latents=pipe._pack_latents(noise, *noise.shape),
                        num_inference_steps=STEPS, guidance_scale=GUIDANCE, height=TINY_RESOLUTION,
                        width=TINY_RESOLUTION, max_sequence_length=TINY_MAX_SEQUENCE_LENGTH, output_type="pt",
                        max_area=TINY_RESOLUTION ** 2, _auto_resize=False).images.cpu()

    def base():
        pipe = FluxKontextPipeline.from_pretrained(build_tiny(FAMILY))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    assert (ours - diffusers_images(base())).abs().max() > 1e-3, "the LoRA must change the images"
    assert export_main([str(run), "--format", "diffusers", "--out", str(tmp_path / "lora")]) == 0
    pipe = base()
    pipe.load_lora_weights(str(tmp_path / "lora"))
    torch.testing.assert_close(diffusers_images(pipe), ours, rtol=0, atol=1e-5)
