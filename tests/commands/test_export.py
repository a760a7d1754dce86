"""`flowrl export`: a LoRA run of the tiny SD3 / FLUX pipelines, exported as a diffusers LoRA folder, a PEFT adapter
and a merged pipeline, loaded by plain diffusers / peft, generates the same images (1e-5) as flowrl's own model at
that checkpoint, for the same prompts and noise. The runs use alpha = 2 r, so an export that forgot the alpha / r
factor (or loaded nothing) is far off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["a red cat", "a blue square"]
SEEDS = [3, 11]
STEPS = 3
GUIDANCE = {"sd3": 4.5, "flux": 3.5}
ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def train_lora_run(kind: str, path: Path, out: Path, prompt_file: Path, **extra) -> Path:
    """One Flow-GRPO epoch of the tiny ``kind`` pipeline at ``path`` with LoRA r 4, alpha 8 at a high learning rate,
    so the adapter moves the images."""
    from flowrl.commands.train import load_recipe_config

    settings = {
        "model.name": kind, "model.path": str(path), "model.max_sequence_length": TINY_MAX_SEQUENCE_LENGTH,
        "model.lora": "{rank: 4, alpha: 8}", "run.output_dir": str(out), "run.max_epochs": 1,
        "run.max_minutes": "null", "data.train_prompts": str(prompt_file), "data.eval_prompts": str(prompt_file),
        "data.num_eval_prompts": 2, "sampling.num_steps": 3, "sampling.eval_num_steps": 2,
        "sampling.window.max_start": "null", "sampling.group_size": 2, "sampling.groups_per_epoch": 2,
        "sampling.batch_size": 4, "sampling.guidance": GUIDANCE[kind], "train.micro_batch_size": 4,
        "train.clip_range": 0.5, "optim.lr": 0.05, "reward.train": "{jpeg_incompressibility: 1.0}",
        "reward.eval": "[jpeg_incompressibility]", "eval.at_start": "false", "eval.every_epochs": 10,
        "eval.every_minutes": "null", "eval.grid_size": 0, "checkpoint.every_epochs": 1,
    }
    settings.update(extra)
    recipe, cfg = load_recipe_config(str(ROOT / "configs/shapes/flow_grpo.yaml"),
                                     [f"{k}={v}" for k, v in settings.items()])
    assert recipe.main(cfg) == 0
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_dir):
    root = tmp_path_factory.mktemp("export_runs")
    prompts = root / "prompts.txt"
    prompts.write_text("a red apple\na blue car\na cat on a mat\na bowl of soup\n")
    # SD3 keeps an EMA (two optimizer steps, so it differs from the raw weights); FLUX does not.
    return {"sd3": train_lora_run("sd3", tiny_dir("sd3"), root / "sd3", prompts,
                                  **{"train.ema_decay": 0.5, "train.minibatches": 2}),
            "flux": train_lora_run("flux", tiny_dir("flux"), root / "flux", prompts)}


def pipeline_class(kind):
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    return StableDiffusion3Pipeline if kind == "sd3" else FluxPipeline


def flowrl_images(run: Path, **kwargs) -> torch.Tensor:
    """Images of flowrl's own model at the run's checkpoint (``load_finetuned``, EMA when kept)."""
    from flowrl.models.resolve import load_finetuned
    from flowrl.eval.generate import generate

    model = load_finetuned(run, **kwargs)
    return generate(model, PROMPTS, SEEDS, steps=STEPS, guidance=GUIDANCE[_kind(run)])


def _kind(run: Path) -> str:
    return "sd3" if run.name == "sd3" else "flux"


def diffusers_images(pipe, kind: str) -> torch.Tensor:
    """Plain diffusers generation from flowrl's initial noise of the same seeds."""
    from samplers import initial_noise

    noise = initial_noise((16, TINY_RESOLUTION // 8, TINY_RESOLUTION // 8), torch.tensor(SEEDS))
    if kind == "flux":
        noise = pipe._pack_latents(noise, *noise.shape)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        return pipe(PROMPTS, num_inference_steps=STEPS, guidance_scale=GUIDANCE[kind], latents=noise,
                    height=TINY_RESOLUTION, width=TINY_RESOLUTION, max_sequence_length=TINY_MAX_SEQUENCE_LENGTH,
                    output_type="pt").images.cpu()


def base_pipeline(kind: str, tiny_dir):
    return pipeline_class(kind).from_pretrained(tiny_dir(kind))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_exports_load_in_plain_diffusers_and_peft_and_match_flowrl(runs, kind, tmp_path, tiny_dir):
    from peft import PeftModel

    from flowrl.commands.export import main as export_main

    run = runs[kind]
    ours = flowrl_images(run)
    base = diffusers_images(base_pipeline(kind, tiny_dir), kind)
    assert (ours - base).abs().max() > 1e-3, "the LoRA must change the images for this test to mean anything"

    # The diffusers LoRA folder of `flowrl export` and the one every checkpoint holds.
    assert export_main([str(run), "--format", "diffusers", "--out", str(tmp_path / "diffusers")]) == 0
    for folder in (tmp_path / "diffusers", run / "checkpoints" / "epoch_0000001" / "lora"):
        pipe = base_pipeline(kind, tiny_dir)
        pipe.load_lora_weights(str(folder))
        torch.testing.assert_close(diffusers_images(pipe, kind), ours, rtol=0, atol=ATOL)

    # The PEFT adapter, loaded into the plain transformer with peft.
    assert export_main([str(run), "--format", "peft", "--out", str(tmp_path / "peft")]) == 0
    pipe = base_pipeline(kind, tiny_dir)
    PeftModel.from_pretrained(pipe.transformer, str(tmp_path / "peft"))  # injects the adapter in place
    torch.testing.assert_close(diffusers_images(pipe, kind), ours, rtol=0, atol=ATOL)

    # The merged pipeline: plain from_pretrained, no LoRA machinery at all.
    assert export_main([str(run), "--checkpoint", "1", "--format", "merged", "--out", str(tmp_path / "merged")]) == 0
    merged = pipeline_class(kind).from_pretrained(str(tmp_path / "merged"))
    assert not any("lora" in name for name, _ in merged.transformer.named_parameters())
    torch.testing.assert_close(diffusers_images(merged, kind), ours, rtol=0, atol=ATOL)


@pytest.mark.slow
def test_ema_and_raw_weights_are_exported_as_asked(runs, tmp_path, tiny_dir):
    """The SD3 run kept an EMA: the default export is the EMA (as load_finetuned), --no-ema the raw weights."""
    from flowrl.commands.export import main as export_main

    run = runs["sd3"]
    raw = flowrl_images(run, use_ema=False)
    ema = flowrl_images(run)
    assert (raw - ema).abs().max() > 1e-4
    assert export_main([str(run), "--format", "diffusers", "--no-ema", "--out", str(tmp_path / "raw")]) == 0
    pipe = base_pipeline("sd3", tiny_dir)
    pipe.load_lora_weights(str(tmp_path / "raw"))
    torch.testing.assert_close(diffusers_images(pipe, "sd3"), raw, rtol=0, atol=ATOL)


def test_lora_layers_bake_alpha_over_rank_into_b_only():
    from flowrl.models.lora_files import lora_layers

    a, b = torch.randn(4, 8), torch.randn(8, 4)
    layers = lora_layers({"blocks.0.attn.to_q.lora_A.default.weight": a, "blocks.0.attn.to_q.lora_B.default.weight": b},
                         scale=2.0)
    assert set(layers) == {"blocks.0.attn.to_q.lora_A.weight", "blocks.0.attn.to_q.lora_B.weight"}
    assert torch.equal(layers["blocks.0.attn.to_q.lora_A.weight"], a)
    assert torch.equal(layers["blocks.0.attn.to_q.lora_B.weight"], 2.0 * b)


def shapes_run(model_dir: Path, out: Path, **extra) -> Path:
    """One epoch of Flow-GRPO on the tiny shapes model (tests/conftest.py)."""
    from flowrl.commands.train import load_recipe_config

    settings = {"model.path": str(model_dir), "run.output_dir": str(out), "run.max_minutes": "null",
                "run.max_epochs": 1, "data.num_eval_prompts": 2, "sampling.num_steps": 3,
                "sampling.window.max_start": "null", "sampling.eval_num_steps": 2, "sampling.groups_per_epoch": 1,
                "sampling.group_size": 4, "sampling.batch_size": 4, "train.micro_batch_size": 4, "optim.lr": 0.05,
                "eval.at_start": "false", "eval.every_epochs": 10, "eval.grid_size": 0, "checkpoint.every_epochs": 1,
                "reward.train": "{jpeg_compressibility: 1.0}", "reward.eval": "[jpeg_compressibility]", **extra}
    recipe, cfg = load_recipe_config(str(ROOT / "configs/shapes/flow_grpo.yaml"),
                                     [f"{k}={v}" for k, v in settings.items()])
    assert recipe.main(cfg) == 0
    return out


@pytest.mark.slow
def test_bad_exports_are_one_line_errors(tiny_shapes_dir, tmp_path, capsys):
    from flowrl.commands.export import main as export_main

    assert export_main([str(tmp_path / "nowhere"), "--format", "peft", "--out", str(tmp_path / "o")]) == 2
    assert "no run at" in capsys.readouterr().err
    # A full fine-tuning run of the shapes model: only `merged` applies; the shapes model has no diffusers pipeline.
    full = shapes_run(tiny_shapes_dir, tmp_path / "full")
    capsys.readouterr()  # the run's own output
    assert export_main([str(full), "--format", "diffusers", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("flowrl export: error:")
    assert "fine-tunes the whole model" in err and "--format merged" in err
    assert export_main([str(full), "--checkpoint", "7", "--format", "merged", "--out", str(tmp_path / "m")]) == 2
    assert "has no checkpoint 7; it has 1" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("mine")
    assert export_main([str(full), "--format", "merged", "--out", str(tmp_path / "busy")]) == 2
    assert "is not an empty directory" in capsys.readouterr().err
    assert export_main([str(full), "--format", "merged", "--out", str(tmp_path / "merged")]) == 0
    from flowrl.models.resolve import load_finetuned
    from flowrl.models.shapes import ShapesModel

    merged, tuned = ShapesModel.from_pretrained(tmp_path / "merged"), load_finetuned(full)
    for key, value in tuned.denoiser.state_dict().items():
        assert torch.equal(value, merged.denoiser.state_dict()[key]), key
    lora = shapes_run(tiny_shapes_dir, tmp_path / "lora", **{"model.lora": "{rank: 4, alpha: 8.0}"})
    capsys.readouterr()
    assert export_main([str(lora), "--format", "diffusers", "--out", str(tmp_path / "d2")]) == 2
    assert "the shapes model has no diffusers pipeline" in capsys.readouterr().err
    assert export_main([str(lora), "--format", "peft", "--out", str(tmp_path / "p")]) == 0
    assert (tmp_path / "p" / "adapter_config.json").is_file()
