"""One Flow-GRPO epoch end to end on tiny SD3 and FLUX pipelines built offline, for every step type.
Before the first optimizer step every re-scored transition is on-policy, so the logged mean ratio is 1."""

import pytest
import torch

from flowrl.run.metrics import read_metrics
from flowrl.testing import build_tiny_flux, build_tiny_sd3
from flowrl.commands.train import load_recipe_config

STEPS = ["flow_sde", "dance_sde", "cps"]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("a red apple\na blue car\na cat on a mat\na bowl of soup\n")
    return path


@pytest.mark.parametrize("kind", ["sd3", "flux"])
@pytest.mark.slow
def test_one_epoch_on_tiny_pipeline_with_ratio_one(kind, prompt_file, tmp_path):
    torch.set_num_threads(1)
    path = build_tiny_sd3() if kind == "sd3" else build_tiny_flux()
    for step in STEPS:
        out = tmp_path / f"{kind}_{step}"
        overrides = [
            f"model.name={kind}", f"model.path={path}", "model.max_sequence_length=16",
            "model.lora={rank: 4, alpha: 8}", f"run.output_dir={out}", "run.max_epochs=1", "run.max_minutes=null",
            f"data.train_prompts={prompt_file}", f"data.eval_prompts={prompt_file}", "data.num_eval_prompts=2",
            f"sampling.step={step}", "sampling.noise_level=0.5", "sampling.num_steps=3", "sampling.eval_num_steps=2",
            "sampling.window.max_start=null",
            "sampling.group_size=2", "sampling.groups_per_epoch=2", "sampling.batch_size=4",
            f"sampling.guidance={4.5 if kind == 'sd3' else 3.5}", "train.micro_batch_size=4", "train.kl_coef=0.01",
            "reward.train={jpeg_incompressibility: 1.0}", "reward.eval=[jpeg_incompressibility]",
            "eval.at_start=false", "eval.every_epochs=1", "eval.every_minutes=null", "eval.grid_size=2",
        ]
        recipe, cfg = load_recipe_config("configs/shapes/flow_grpo.yaml", overrides)
        assert recipe.main(cfg) == 0
        (row,) = read_metrics(out / "metrics.jsonl")
        assert abs(row["train/ratio_mean"] - 1.0) < 1e-6, (kind, step, row["train/ratio_mean"])
        assert row["train/clip_frac"] == 0.0 and abs(row["train/approx_kl"]) < 1e-9
        # LoRA starts at zero (gaussian init, B = 0): the policy equals the reference at the first pass.
        assert row["train/kl_ref"] == pytest.approx(0.0, abs=1e-10)
        assert row["train/grad_norm"] > 0 and row["images_sampled"] == 4
        assert "eval/jpeg_incompressibility/mean" in row
