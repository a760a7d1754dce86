"""Fixtures of the demo tests: real fine-tuned checkpoints of the tiny shapes model (the Flow-GRPO recipe run
for one epoch, full fine-tuning and LoRA), the demo state built from them, and one running app."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "shapes" / "flow_grpo.yaml"


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs on one torch thread (tests/conftest.py's ``one_thread``)."""


def run_flow_grpo(model_dir: Path, out: Path, **extra) -> Path:
    """One epoch of the real recipe on the tiny model. The training reward is JPEG compressibility, which
    varies between random images (the shapes reward is 0 for all of them), so the weights really move."""
    from flowrl.commands.train import load_recipe_config

    settings = {
        "model.path": str(model_dir), "run.output_dir": str(out), "run.max_minutes": "null", "run.max_epochs": 1,
        "data.num_eval_prompts": 2, "sampling.num_steps": 3, "sampling.window.max_start": "null",
        "sampling.eval_num_steps": 2, "sampling.groups_per_epoch": 1, "sampling.group_size": 4,
        "sampling.batch_size": 4, "train.micro_batch_size": 4, "train.clip_range": 0.2, "optim.lr": 0.05,
        "eval.at_start": "false", "eval.every_epochs": 1, "eval.grid_size": 0, "checkpoint.every_epochs": 1,
        "reward.train": "{jpeg_compressibility: 1.0}", "reward.eval": "[shapes]",
    }
    settings.update(extra)
    recipe, cfg = load_recipe_config(str(CONFIG), [f"{k}={v}" for k, v in settings.items()])
    assert recipe.main(cfg) == 0
    return out


@pytest.fixture(scope="session")
def finetuned_runs(tiny_shapes_dir, tmp_path_factory) -> dict[str, Path]:
    """``{"full": run dir, "lora": run dir}``: real Flow-GRPO runs (one epoch each) on the tiny model."""
    root = tmp_path_factory.mktemp("demo_runs")
    # Two optimizer steps: diffusers' EMA copies the weights at its first step and averages from the second.
    full = run_flow_grpo(tiny_shapes_dir, root / "flow_grpo_full", **{"train.ema_decay": 0.5, "train.minibatches": 2})
    lora = run_flow_grpo(tiny_shapes_dir, root / "flow_grpo_lora", **{"model.lora": "{rank: 4, alpha: 8.0}"})
    return {"full": full, "lora": lora, "root": root}


@pytest.fixture(scope="session")
def demo_state(tiny_shapes_dir, finetuned_runs):
    """The demo's state as ``python app.py`` builds it: base = the tiny model, two named checkpoints, the
    runs directory scanned, the shapes and JPEG rewards plus one whose weights are missing (aesthetic)."""
    from flowrl.demo.cli import make_state

    notes = []
    state = make_state(model=str(tiny_shapes_dir),
                       checkpoints=[f"flow_grpo={finetuned_runs['full']}", f"lora={finetuned_runs['lora']}"],
                       rewards=["shapes", "jpeg_compressibility", "aesthetic"], runs_dir=str(finetuned_runs["root"]),
                       device="cpu", log=notes.append)
    state.notes = notes
    return state


@pytest.fixture(scope="session")
def demo_url(demo_state):
    """One running app (in this process, on a free port of 127.0.0.1) shared by the API and browser tests."""
    from flowrl.demo.cli import launch

    demo, url = launch(demo_state, host="127.0.0.1", port=None, block=False, quiet=True)
    yield url
    demo.close()


# ---------------------------------------------------------------------------- video and editing models

MEDIA_FRAMES = 5  # the tiny Wan's clips: (5 - 1) / 4 + 1 = 2 latent frames


def fake_run(root: Path, name: str, model: dict, *, seed: int) -> Path:
    """A fine-tuning run folder as ``flowrl train`` leaves it (``config.yaml`` with the ``model`` section,
    ``checkpoints/epoch_1/state.pt`` with the trainable tensors), written without training: its LoRA weights are
    the freshly built adapter's, moved by seeded noise so that the run differs from its base (the demo only loads
    runs; training them is the recipes' tests' job)."""
    import yaml

    from flowrl.run.checkpoint_files import save_checkpoint
    from flowrl.config import from_dict
    from flowrl.models.config import ModelConfig, build_model

    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"recipe": "flow_grpo", "model": model}))
    built = build_model(from_dict(ModelConfig, model), "cpu")
    generator = torch.Generator().manual_seed(seed)
    state = {k: v + 0.3 * torch.randn(v.shape, generator=generator) for k, v in built.trainable_state_dict().items()}
    save_checkpoint(run, 1, {"model": state, "epoch": 1})
    return run


@pytest.fixture(scope="session")
def media_dirs(tmp_path_factory, tiny_dir) -> dict[str, Path]:
    """The tiny Wan (text-to-video) and FLUX.1-Kontext (editing) pipelines, and a runs folder holding one LoRA run
    of each (:func:`fake_run`)."""
    from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        wan, kontext = tiny_dir("wan"), tiny_dir("flux_kontext")
        runs = tmp_path_factory.mktemp("media_runs")
        common = {"resolution": TINY_RESOLUTION, "max_sequence_length": TINY_MAX_SEQUENCE_LENGTH,
                  "dtype": "float32", "lora": {"rank": 4, "alpha": 8.0}}
        fake_run(runs, "wan_lora", {"name": "wan", "path": str(wan), "num_frames": MEDIA_FRAMES, **common}, seed=1)
        fake_run(runs, "kontext_lora", {"name": "flux_kontext", "path": str(kontext), **common}, seed=2)
    finally:
        torch.set_num_threads(threads)
    return {"wan": wan, "kontext": kontext, "runs": runs}


@pytest.fixture(scope="session")
def media_state(media_dirs):
    """A demo of video and editing models as ``python app.py --model <tiny wan> --resolution 64 --num-frames 5
    --checkpoint kontext=<tiny kontext> --runs-dir <runs>`` builds it, scoring with JPEG compressibility."""
    from flowrl.demo.cli import make_state

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return make_state(model=str(media_dirs["wan"]), resolution=64, num_frames=MEDIA_FRAMES,
                          checkpoints=[f"kontext={media_dirs['kontext']}"], rewards=["jpeg_compressibility"],
                          runs_dir=str(media_dirs["runs"]), device="cpu", log=lambda _: None)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def media_url(media_state):
    """The app of :func:`media_state`, running in this process on a free port of 127.0.0.1."""
    from flowrl.demo.cli import launch

    demo, url = launch(media_state, host="127.0.0.1", port=None, block=False, quiet=True)
    yield url
    demo.close()


@pytest.fixture(scope="session")
def source_png(tmp_path_factory) -> Path:
    """A 48 x 40 source photo (a colour ramp and a square): not the model's size, so the demo must resize it."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:40, 0:48]
    pixels = np.stack([x * 5, y * 6, np.full_like(x, 90)], axis=-1).astype(np.uint8)
    pixels[10:25, 12:30] = (250, 250, 20)
    path = tmp_path_factory.mktemp("source") / "source.png"
    Image.fromarray(pixels).save(path)
    return path
