"""Editing models train on editing prompts: a tiny epoch of every trainer (Flow-GRPO, CRD, DiffusionNFT, AWM, DGPO,
D3PO on prompts and source images from a tiny webdataset shard; Diffusion-DPO on editing pairs, each with the
source both images were edited from) on the tiny pipelines of FLUX.1-Kontext and Qwen-Image-Edit, and the
Flow-GRPO run's LoRA exported to diffusers (and as a PEFT adapter, and merged) gives, in plain ``FluxKontextPipeline`` /
``QwenImageEditPipeline`` with the same source image and noise, the images flowrl's own model draws (1e-5).

``QwenImageEditPipeline`` sizes the source to a 1024 x 1024 area; flowrl conditions at the model's resolution, so the
plain pipeline here runs with that area set to the tiny model's 64 x 64 (tests/models/test_qwen_image_edit.py)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from flowrl.run.metrics import read_metrics
from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION, build_tiny
from flowrl.commands.train import load_recipe_config

ROOT = Path(__file__).resolve().parents[2]
#: The editing families and their guidance (Kontext: the guidance embedding; Qwen-Image-Edit: true CFG on " ").
GUIDANCE = {"flux_kontext": 2.5, "qwen_image_edit": 4.0}
FAMILIES = list(GUIDANCE)
STEPS = 3
TRAINERS = ["flow_grpo", "crd", "nft", "awm", "dgpo", "dpo", "d3po"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


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


@pytest.fixture(scope="module")
def edit_pairs(tmp_path_factory) -> Path:
    """Two editing preference pairs: random chosen / rejected images at the tiny resolution, each with a random
    48 px source."""
    from flowrl.data.webdataset_io import write_pair_shards

    path = tmp_path_factory.mktemp("edit_pairs")
    rng = np.random.default_rng(1)
    image = lambda side: rng.integers(0, 256, (side, side, 3), dtype=np.uint8)  # noqa: E731
    write_pair_shards([(image(TINY_RESOLUTION), image(TINY_RESOLUTION), text, None, image(48))
                       for text in ["make the apple blue", "add a cat"]], path)
    return path


def run_epoch(trainer: str, out: Path, edits: Path, pairs: Path | None = None, family: str = "flux_kontext",
              **extra) -> Path:
    settings = {
        "model.name": family, "model.path": str(build_tiny(family)), "model.resolution": TINY_RESOLUTION,
        "model.max_sequence_length": TINY_MAX_SEQUENCE_LENGTH, "model.lora": "{rank: 4, alpha: 8}",
        "model.dtype": "float32", "run.output_dir": str(out), "run.max_epochs": 1, "run.max_minutes": "null",
        "data.train_prompts": str(edits), "data.eval_prompts": str(edits), "data.num_eval_prompts": 2,
        "sampling.num_steps": STEPS, "sampling.eval_num_steps": 2, "sampling.group_size": 2,
        "sampling.groups_per_epoch": 2, "sampling.batch_size": 4, "sampling.guidance": GUIDANCE[family],
        "train.micro_batch_size": 4, "reward.train": "{jpeg_incompressibility: 1.0}",
        "reward.eval": "[jpeg_incompressibility]", "eval.at_start": "false", "eval.every_epochs": 1,
        "eval.every_minutes": "null", "eval.grid_size": 2, "checkpoint.every_epochs": 1, **extra,
    }
    if trainer in ("flow_grpo", "d3po"):
        settings["sampling.window"] = "{mode: fixed, start: 0, size: null}"
    if trainer == "d3po":
        settings["train.micro_batch_size"] = 1
    if trainer == "dpo":
        for key in [k for k in settings if k.startswith(("sampling.", "data.train_prompts", "reward.train"))]:
            del settings[key]
        settings.update({"pairs.path": str(pairs), "pairs.pairs_per_epoch": 2, "sampling.eval_num_steps": 2,
                         "sampling.guidance": GUIDANCE[family]})
    recipe, cfg = load_recipe_config(str(ROOT / "configs" / "shapes" / f"{trainer}.yaml"),
                                     [f"{k}={v}" for k, v in settings.items()])
    assert recipe.main(cfg) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("trainer", TRAINERS)
def test_a_tiny_epoch_on_editing_prompts(trainer, family, edits, edit_pairs, tmp_path):
    out = run_epoch(trainer, tmp_path / "run", edits, edit_pairs, family=family)
    row = read_metrics(out / "metrics.jsonl")[-1]
    losses = [v for k, v in row.items() if k.startswith("train/") and "loss" in k and isinstance(v, float)]
    assert losses and all(math.isfinite(v) for v in losses), row
    assert row["train/grad_norm"] > 0, row
    assert "eval/jpeg_incompressibility/mean" in row
    if trainer == "flow_grpo":  # re-scoring its own rollout: the stored Cond (with the source) was used
        assert abs(row["train/ratio_mean"] - 1.0) < 1e-6 and row["train/kl_ref"] == pytest.approx(0.0, abs=1e-10)


def _plain_edits(pipe, family: str, prompts: list[str], sources: torch.Tensor, seeds: list[int]) -> torch.Tensor:
    """Plain diffusers' edits of ``sources`` ``[B, 3, H, W]`` from flowrl's initial noise of ``seeds``."""
    from samplers import initial_noise

    noise = initial_noise((16, 8, 8), torch.tensor(seeds))
    size = {"height": TINY_RESOLUTION, "width": TINY_RESOLUTION, "num_inference_steps": STEPS, "output_type": "pt"}
    with torch.no_grad():
        if family == "flux_kontext":
            return pipe(image=sources, prompt=prompts, latents=pipe._pack_latents(noise, *noise.shape),
                        guidance_scale=GUIDANCE[family], max_sequence_length=TINY_MAX_SEQUENCE_LENGTH,
                        max_area=TINY_RESOLUTION ** 2, _auto_resize=False, **size).images.cpu()
        from PIL import Image

        images = [Image.fromarray((s.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)) for s in sources]
        return pipe(image=images, prompt=prompts, negative_prompt=[" "] * len(prompts),
                    true_cfg_scale=GUIDANCE[family], latents=pipe._pack_latents(noise, *noise.shape),
                    **size).images.cpu()


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_the_exported_lora_edits_like_flowrl_in_plain_diffusers(family, edits, tmp_path, monkeypatch):
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

    from flowrl.data.prompts import load_prompts
    from flowrl.commands.export import main as export_main
    from flowrl.eval.generate import generate
    from flowrl.models.families import pipeline_class
    from flowrl.models.resolve import load_finetuned

    area = pipeline_qwenimage_edit.calculate_dimensions  # the tiny model's area instead of 1024 x 1024
    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions",
                        lambda target, ratio: area(TINY_RESOLUTION ** 2, ratio))
    run = run_epoch("flow_grpo", tmp_path / "run", edits, family=family,
                    **{"optim.lr": 0.05, "train.clip_range": 0.5, "eval.every_epochs": 10, "eval.grid_size": 0})
    prompt_set = load_prompts(str(edits), resolution=TINY_RESOLUTION)
    prompts, rows, seeds = prompt_set.prompts[:2], prompt_set.metadata[:2], [3, 11]
    assert rows[0]["source_image"].shape == (3, TINY_RESOLUTION, TINY_RESOLUTION)
    ours = generate(load_finetuned(run), prompts, seeds, steps=STEPS, guidance=GUIDANCE[family], metadata=rows)
    sources = torch.stack([r["source_image"] for r in rows])

    def base():
        pipe = pipeline_class(family).from_pretrained(build_tiny(family))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    assert (ours - _plain_edits(base(), family, prompts, sources, seeds)).abs().max() > 1e-3, \
        "the LoRA must change the images"
    assert export_main([str(run), "--format", "diffusers", "--out", str(tmp_path / "lora")]) == 0
    pipe = base()
    pipe.load_lora_weights(str(tmp_path / "lora"))
    torch.testing.assert_close(_plain_edits(pipe, family, prompts, sources, seeds), ours, rtol=0, atol=1e-5)
    # another source, the same prompts and noise: other edits (the source reaches the exported model too)
    other = _plain_edits(pipe, family, prompts, sources.flip(0), seeds)
    assert (other - ours).abs().max() > 1e-3
    # a PEFT adapter on the plain transformer, and the merged pipeline, edit alike
    from peft import PeftModel

    assert export_main([str(run), "--format", "peft", "--out", str(tmp_path / "peft")]) == 0
    pipe = base()
    PeftModel.from_pretrained(pipe.transformer, str(tmp_path / "peft"))
    torch.testing.assert_close(_plain_edits(pipe, family, prompts, sources, seeds), ours, rtol=0, atol=1e-5)
    assert export_main([str(run), "--format", "merged", "--out", str(tmp_path / "merged")]) == 0
    merged = pipeline_class(family).from_pretrained(str(tmp_path / "merged"))
    merged.set_progress_bar_config(disable=True)
    assert not any("lora" in name for name, _ in merged.transformer.named_parameters())
    torch.testing.assert_close(_plain_edits(merged, family, prompts, sources, seeds), ours, rtol=0, atol=1e-5)


def test_editing_pairs_carry_their_source_and_plain_pairs_do_not(edit_pairs, tmp_path):
    from flowrl.data.webdataset_io import decode_image, read_pairs, write_pair_shards

    pairs = read_pairs(edit_pairs)
    assert [p.prompt for p in pairs] == ["make the apple blue", "add a cat"]
    assert all(decode_image(p.source).size == (48, 48) for p in pairs)
    blank = np.zeros((8, 8, 3), dtype=np.uint8)
    write_pair_shards([(blank, blank, "a cat", None)], tmp_path / "plain")
    assert read_pairs(tmp_path / "plain")[0].source is None


@pytest.mark.slow
def test_dpo_refuses_pairs_without_sources_on_an_editing_model(tmp_path, edits):
    from flowrl.data.webdataset_io import ShardError, write_pair_shards

    image = np.zeros((TINY_RESOLUTION, TINY_RESOLUTION, 3), dtype=np.uint8)
    write_pair_shards([(image, image, "add a cat", None)] * 2, tmp_path / "plain")
    with pytest.raises(ShardError, match="has no source image"):
        run_epoch("dpo", tmp_path / "run", edits, tmp_path / "plain")


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_sample_draws_the_source_beside_the_edits_and_eval_reads_editing_shards(family, edits, tmp_path, capsys):
    """`flowrl sample --source` edits that image (the grid's first column is the source, the edits are the model's
    images for it, which a different source changes); `flowrl eval --prompts SHARDS` scores the editing prompts;
    sources go to editing models only."""
    import json

    from PIL import Image

    from flowrl.commands.sample import eval_main, sample_main

    tiny = str(build_tiny(family))
    rng = np.random.default_rng(5)
    sources = []
    for i in range(2):
        sources.append(tmp_path / f"src{i}.png")
        Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(sources[-1])
    common = ["--model", tiny, "--resolution", str(TINY_RESOLUTION), "--seeds", "0-1", "--steps", "2", "--guidance",
              str(GUIDANCE[family]), "--scale", "1", "--no-progress", "--prompt", "make it blue"]

    def grid(source: Path, name: str) -> np.ndarray:
        out = tmp_path / f"{name}.png"
        assert sample_main([*common, "--source", str(source), "--out", str(out)]) == 0, capsys.readouterr().err
        return np.asarray(Image.open(out).convert("RGB"), dtype=np.int16)

    first, second, again = grid(sources[0], "a"), grid(sources[1], "b"), grid(sources[0], "c")
    assert (first == again).all()
    assert first.shape == second.shape and first.shape[1] >= 3 * TINY_RESOLUTION  # source + two seeds
    # The source column shows the source (resized to the model's 64 px): its pixels differ between the two grids,
    # and so do the edits.
    assert np.abs(first - second).mean() > 5
    assert sample_main([*common, "--out", str(tmp_path / "x.png")]) == 2
    assert "edits a source image: give it with --source" in capsys.readouterr().err
    assert sample_main([*common, "--source", str(sources[0]), "--source", str(sources[1]), "--source",
                        str(sources[0]), "--out", str(tmp_path / "x.png")]) == 2
    assert "3 --source images for 1 prompts" in capsys.readouterr().err
    (tmp_path / "bad.png").write_bytes(b"not an image")
    assert sample_main([*common, "--source", str(tmp_path / "bad.png"), "--out", str(tmp_path / "x.png")]) == 2
    assert "give a PNG, JPEG or WebP image" in capsys.readouterr().err
    assert sample_main(["--model", "shapes", "--prompt", "a red circle", "--seeds", "0", "--steps", "2",
                        "--no-progress", "--source", str(sources[0]), "--out", str(tmp_path / "x.png")]) == 2
    assert "--source is for editing models" in capsys.readouterr().err
    summary = tmp_path / "eval.json"
    assert eval_main(["--model", tiny, "--resolution", str(TINY_RESOLUTION), "--reward", "jpeg_incompressibility",
                      "--prompts", str(edits), "--steps", "2", "--guidance", str(GUIDANCE[family]),
                      "--out", str(summary), "--no-progress"]) == 0, capsys.readouterr().err[-2000:]
    assert json.loads(summary.read_text())["settings"]["n"] == 4
