"""Fixtures of the demo tests: real fine-tuned checkpoints of the tiny shapes model (the Flow-GRPO recipe run
for one epoch, full fine-tuning and LoRA), the demo state built from them, and one running app."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "shapes" / "flow_grpo.yaml"


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads; on a shared 2-core machine they only thrash.
    (Module scope: the setting is restored before other directories' tests run.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_flow_grpo(model_dir: Path, out: Path, **extra) -> Path:
    """One epoch of the real recipe on the tiny model. The training reward is JPEG compressibility, which
    varies between random images (the shapes reward is 0 for all of them), so the weights really move."""
    from flowrl.train import load_recipe_config

    settings = {
        "model.path": str(model_dir), "run.output_dir": str(out), "run.max_minutes": "null", "run.max_epochs": 1,
        "data.num_eval_prompts": 2, "sampling.num_steps": 3, "sampling.window.max_start": "null", "sampling.eval_num_steps": 2,
        "sampling.groups_per_epoch": 1, "sampling.group_size": 4, "sampling.batch_size": 4,
        "train.micro_batch_size": 4, "train.clip_range": 0.2, "optim.lr": 0.05, "eval.at_start": "false",
        "eval.every_epochs": 1, "eval.grid_size": 0, "checkpoint.every_epochs": 1,
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
