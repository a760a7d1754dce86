"""`flowrl export` for the newer model families (flowrl.models.families): a LoRA run of the tiny pipeline, exported
as a diffusers LoRA folder, a PEFT adapter and a merged pipeline, loaded by plain diffusers / peft, generates the
images flowrl's own model gives at that checkpoint (1e-5), for the same prompts and noise. The run uses alpha = 2 r,
so an export that forgot the alpha / r factor (or loaded nothing) is far off.

Wan (``wan``: Wan 2.1; ``wan22``: Wan 2.2 A14B's two experts, both with LoRA) exports videos: plain
``WanPipeline`` frames ``[B, F, 3, H, W]`` are compared. Wan 2.2's diffusers folder holds the high-noise expert's
LoRA as ``pytorch_lora_weights.safetensors`` and the low-noise expert's as
``pytorch_lora_weights_transformer_2.safetensors`` (``load_lora_weights(..., load_into_transformer_2=True)``); its
PEFT adapter is of flowrl's two-expert module (keys ``high.`` / ``low.``), loaded here into that module built from
the plain pipeline's two transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["a red cat", "a blue square"]
SEEDS = [3, 11]
STEPS = 3
ATOL = 1e-5
# flowrl units (Z-Image: its guidance_scale 2; FLUX.2 [dev]: the guidance embedding's value)
GUIDANCE = {"qwen_image": 4.0, "z_image": 3.0, "flux2_klein": 4.0, "flux2": 4.0, "wan": 5.0, "wan22": 4.0}
#: flowrl's latent shape of each tiny pipeline (FLUX.2: the transformer's patchified 128 channels; Wan: 2 latent
#: frames of the 5-frame clip).
LATENT = {"qwen_image": (16, 8, 8), "z_image": (16, 8, 8), "flux2_klein": (128, 4, 4), "flux2": (128, 4, 4),
          "wan": (16, 2, 8, 8), "wan22": (16, 2, 8, 8)}
FAMILIES = list(GUIDANCE)
IMAGE_FAMILIES = [f for f in FAMILIES if not f.startswith("wan")]
NEGATIVE = "blurred, static"  # Wan's negative prompt in these runs
NUM_FRAMES = 5  # flowrl.testing.tiny_wan.TINY_WAN_NUM_FRAMES


def model_name(family: str) -> str:
    """The ``model.name`` of a tiny pipeline kind (``wan22`` is a Wan pipeline)."""
    return "wan" if family.startswith("wan") else family


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def train_lora_run(family: str, path: Path, out: Path, prompt_file: Path) -> Path:
    """One Flow-GRPO epoch of the tiny ``family`` pipeline at ``path`` with LoRA r 4, alpha 8 at a high learning
    rate, so the adapter moves the images."""
    from flowrl.commands.train import load_recipe_config

    settings = {
        "model.name": model_name(family), "model.path": str(path), "model.resolution": TINY_RESOLUTION,
        "model.max_sequence_length": TINY_MAX_SEQUENCE_LENGTH, "model.lora": "{rank: 4, alpha: 8}",
        "run.output_dir": str(out), "run.max_epochs": 1, "run.max_minutes": "null",
        "data.train_prompts": str(prompt_file), "data.eval_prompts": str(prompt_file), "data.num_eval_prompts": 2,
        "sampling.num_steps": 3, "sampling.eval_num_steps": 2, "sampling.window": "{mode: fixed, start: 0, size: null}",
        "sampling.group_size": 2, "sampling.groups_per_epoch": 2, "sampling.batch_size": 4,
        "sampling.guidance": GUIDANCE[family], "train.micro_batch_size": 4, "train.clip_range": 0.5, "optim.lr": 0.05,
        "reward.train": "{jpeg_incompressibility: 1.0}", "reward.eval": "[jpeg_incompressibility]",
        "eval.at_start": "false", "eval.every_epochs": 10, "eval.every_minutes": "null", "eval.grid_size": 0,
        "checkpoint.every_epochs": 1,
    }
    if family.startswith("wan"):
        settings.update({"model.num_frames": NUM_FRAMES, "model.negative_prompt": NEGATIVE})
    recipe, cfg = load_recipe_config(str(ROOT / "configs/shapes/flow_grpo.yaml"),
                                     [f"{k}={v}" for k, v in settings.items()])
    assert recipe.main(cfg) == 0
    return out


class _Lazy(dict):
    """``{family: make(family)}``, each made when first looked up (a -k selection trains only its families)."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, family):
        self[family] = self.make(family)
        return self[family]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_dir):
    root = tmp_path_factory.mktemp("export_family_runs")
    prompts = root / "prompts.txt"
    prompts.write_text("a red apple\na blue car\na cat on a mat\na bowl of soup\n")
    # each trained when first asked for
    return _Lazy(lambda family: train_lora_run(family, tiny_dir(family), root / family, prompts))


def base_pipeline(family: str, tiny_dir):
    from flowrl.models.families import pipeline_class

    pipe = pipeline_class(model_name(family)).from_pretrained(tiny_dir(family))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_images(pipe, family: str) -> torch.Tensor:
    """Plain diffusers generation from flowrl's initial noise of the same seeds."""
    from samplers import initial_noise

    noise = initial_noise(LATENT[family], torch.tensor(SEEDS))
    if family.startswith("wan"):  # videos: standard CFG on the negative prompt, frames [B, F, 3, H, W]
        with torch.no_grad():
            return pipe(prompt=list(PROMPTS), negative_prompt=[NEGATIVE] * len(PROMPTS),
                        guidance_scale=GUIDANCE[family], latents=noise, num_frames=NUM_FRAMES,
                        num_inference_steps=STEPS, height=TINY_RESOLUTION, width=TINY_RESOLUTION,
                        max_sequence_length=TINY_MAX_SEQUENCE_LENGTH,
                        output_type="pt").frames.cpu()
    if family == "qwen_image":
        kwargs = {"negative_prompt": [" "] * len(PROMPTS), "true_cfg_scale": GUIDANCE[family],
                  "latents": pipe._pack_latents(noise, *noise.shape)}
    elif family == "z_image":  # unpacked latents, its guidance_scale is flowrl's minus 1
        kwargs = {"guidance_scale": GUIDANCE[family] - 1.0, "latents": noise}
    else:  # flux2_klein: the patchified latents, standard CFG; flux2: the same latents, the guidance embedding
        kwargs = {"guidance_scale": GUIDANCE[family], "latents": noise}
    with torch.no_grad():
        # a copy: ZImagePipeline writes the chat-templated text back into the caller's prompt list
        return pipe(prompt=list(PROMPTS), num_inference_steps=STEPS,
                    height=TINY_RESOLUTION, width=TINY_RESOLUTION, max_sequence_length=TINY_MAX_SEQUENCE_LENGTH,
                    output_type="pt", **kwargs).images.cpu()


def flowrl_images(run: Path, family: str) -> torch.Tensor:
    from flowrl.models.resolve import load_finetuned
    from flowrl.eval.generate import generate

    return generate(load_finetuned(run), PROMPTS, SEEDS, steps=STEPS, guidance=GUIDANCE[family])


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_exports_load_in_plain_diffusers_and_peft_and_match_flowrl(runs, family, tmp_path, tiny_dir):
    from peft import PeftModel

    from flowrl.commands.export import main as export_main
    from flowrl.models.families import pipeline_class

    run = runs[family]
    ours = flowrl_images(run, family)
    base = diffusers_images(base_pipeline(family, tiny_dir), family)
    torch.testing.assert_close(flowrl_images(run, family), ours, rtol=0, atol=0)
    assert (ours - base).abs().max() > 1e-3, "the LoRA must change the images for this test to mean anything"

    assert export_main([str(run), "--format", "diffusers", "--out", str(tmp_path / "diffusers")]) == 0
    for folder in (tmp_path / "diffusers", run / "checkpoints" / "epoch_0000001" / "lora"):
        pipe = base_pipeline(family, tiny_dir)
        pipe.load_lora_weights(str(folder))
        if family == "wan22":  # the low-noise expert's LoRA, into transformer_2
            from flowrl.models.lora_files import EXPERT_2_WEIGHTS

            one_expert = diffusers_images(pipe, family)
            assert (one_expert - ours).abs().max() > 1e-3, "transformer_2's LoRA must matter for this test"
            pipe.load_lora_weights(str(folder), weight_name=EXPERT_2_WEIGHTS, load_into_transformer_2=True)
        torch.testing.assert_close(diffusers_images(pipe, family), ours, rtol=0, atol=ATOL)

    assert export_main([str(run), "--format", "peft", "--out", str(tmp_path / "peft")]) == 0
    pipe = base_pipeline(family, tiny_dir)
    if family == "wan22":
        from flowrl.models.wan import WanExperts

        experts = WanExperts(pipe.transformer, pipe.transformer_2, pipe.config.boundary_ratio * 1000)
        PeftModel.from_pretrained(experts, str(tmp_path / "peft"))  # injects into both transformers in place
    else:
        PeftModel.from_pretrained(pipe.transformer, str(tmp_path / "peft"))
    torch.testing.assert_close(diffusers_images(pipe, family), ours, rtol=0, atol=ATOL)

    assert export_main([str(run), "--format", "merged", "--out", str(tmp_path / "merged")]) == 0
    merged = pipeline_class(model_name(family)).from_pretrained(str(tmp_path / "merged"))
    merged.set_progress_bar_config(disable=True)
    assert not any("lora" in name for name, _ in merged.transformer.named_parameters())
    if family == "wan22":
        assert not any("lora" in name for name, _ in merged.transformer_2.named_parameters())
    torch.testing.assert_close(diffusers_images(merged, family), ours, rtol=0, atol=ATOL)


@pytest.fixture(scope="module")
def exported(runs, tmp_path_factory):
    from flowrl.commands.export import main as export_main

    def export(family: str) -> dict[str, Path]:
        run, root = runs[family], tmp_path_factory.mktemp(f"{family}_exports")
        assert export_main([str(run), "--format", "diffusers", "--out", str(root / "lora")]) == 0
        assert export_main([str(run), "--format", "merged", "--out", str(root / "merged")]) == 0
        return {"lora": root / "lora", "merged": root / "merged"}

    return _Lazy(export)


def _grid(path: Path):
    import numpy as np
    from PIL import Image

    with Image.open(path, formats=["PNG"]) as image:
        return np.asarray(image.convert("RGB")).astype(np.int16)


@pytest.mark.slow
@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_sample_eval_and_demo_see_the_run_its_lora_and_its_merged_pipeline_alike(runs, exported, family, tmp_path,
                                                                                 capsys, tiny_dir):
    """`flowrl sample` of the run, of base + exported LoRA and of the merged pipeline draw the same grid (to a pixel
    level); `flowrl eval` scores the run; the demo shows the run and the merged pipeline with the same images."""
    import json

    from flowrl.demo import engine
    from flowrl.demo.cli import make_state
    from flowrl.commands.sample import eval_main, sample_main

    run, tiny = runs[family], tiny_dir(family)
    grids = {}
    for name, args in {"run": ["--run", str(run)],
                       "lora": ["--model", family, "--path", str(tiny), "--lora", str(exported[family]["lora"]),
                                "--resolution", str(TINY_RESOLUTION)],
                       "merged": ["--model", str(exported[family]["merged"])]}.items():
        out = tmp_path / f"{name}.png"
        code = sample_main([*args, "--prompt", "a red cat", "--seeds", "0-1", "--steps", "3", "--guidance",
                            str(GUIDANCE[family]), "--out", str(out), "--no-progress"])
        assert code == 0, capsys.readouterr().err[-2000:]
        grids[name] = _grid(out)
    assert abs(grids["run"] - grids["merged"]).max() <= 1  # the merged export keeps the run's sampling settings
    # The LoRA folder runs with the pipeline's own max_sequence_length (512) instead of the run's 16. With masked
    # text (Qwen-Image, Z-Image) that is the same conditioning; FLUX.2 attends to its padding, so it differs there.
    if family in ("qwen_image", "z_image"):
        assert abs(grids["run"] - grids["lora"]).max() <= 1

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "tag": "t"}) + "\n" for p in ["a red cat", "a blue car"]))
    summary = tmp_path / "eval.json"
    assert eval_main(["--run", str(run), "--reward", "jpeg_incompressibility", "--prompts", str(prompts), "--steps",
                      "3", "--out", str(summary), "--no-progress"]) == 0, capsys.readouterr().err[-2000:]
    assert json.loads(summary.read_text())["settings"]["model"] == f"run {run}"

    state = make_state(model=str(tiny), checkpoints=[f"tuned={run}", f"merged={exported[family]['merged']}"],
                       rewards=["jpeg_incompressibility"], runs_dir=str(run.parent), device="cpu")
    rows = {r["name"]: r for r in state.bank.describe()}
    assert rows["tuned"]["state"].startswith("loaded (epoch 1, LoRA") and rows["merged"]["state"] == "loaded"
    models = {n: state.bank.get(n) for n in ("tuned", "merged")}
    result = engine.compare(models, ["a red cat"], [0, 1], steps=3, guidance=GUIDANCE[family], sampler="ode",
                            noise_level=None, rewards=state.rewards, reward_names=["jpeg_incompressibility"])
    torch.testing.assert_close(result.images["tuned"], result.images["merged"], rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["wan", "wan22"])
def test_sample_draws_the_run_its_lora_and_its_merged_pipeline_as_the_same_frame_strips_and_gifs(runs, exported,
                                                                                                 family, tmp_path,
                                                                                                 capsys, tiny_dir):
    """`flowrl sample` of a Wan run, of base + exported LoRA and of the merged pipeline: the same grid of frame
    strips (to a pixel level) and one animated GIF per video with the video's frames."""
    import numpy as np
    from PIL import Image

    from flowrl.commands.sample import sample_main

    run, tiny = runs[family], tiny_dir(family)
    grids = {}
    for name, args in {"run": ["--run", str(run)],
                       "lora": ["--model", "wan", "--path", str(tiny), "--lora", str(exported[family]["lora"]),
                                "--resolution", str(TINY_RESOLUTION), "--num-frames", str(NUM_FRAMES)],
                       "merged": ["--model", str(exported[family]["merged"])]}.items():
        out = tmp_path / name / "grid.png"
        code = sample_main([*args, "--prompt", "a red cat", "--seeds", "0-1", "--steps", "3", "--guidance",
                            str(GUIDANCE[family]), "--scale", "1", "--out", str(out), "--no-progress"])
        assert code == 0, capsys.readouterr().err[-2000:]
        grids[name] = _grid(out)
        gifs = sorted(out.parent.glob("grid_p0_s*.gif"))
        assert [g.name for g in gifs] == ["grid_p0_s0.gif", "grid_p0_s1.gif"]
        with Image.open(gifs[0]) as gif:
            assert gif.n_frames == NUM_FRAMES and gif.size == (TINY_RESOLUTION, TINY_RESOLUTION)
    # a strip of 5 frames of 64 px with 2 px gaps per cell: the grid is wider than for one image per cell
    assert grids["run"].shape[1] > 2 * NUM_FRAMES * TINY_RESOLUTION
    assert abs(grids["run"] - grids["merged"]).max() <= 1  # the merged export keeps frames and negative prompt
    # The LoRA folder runs with the pipeline's defaults for the negative prompt ("") and text length (226 tokens,
    # zero padded: Wan attends to the padding), so it differs from the run; it must still draw a real grid.
    assert grids["lora"].shape == grids["run"].shape and np.ptp(grids["lora"]) > 0
