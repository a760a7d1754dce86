"""What a user looks at after a run: the sample grid (base vs current model, same prompts and noise, captioned
with the eval rewards) and the plots that say whether training works, one unit per axis."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_sample_grid_shows_base_and_current_and_the_plots_exist(tiny_shapes_dir, tmp_path):
    from flowrl.commands.train import main

    out = tmp_path / "run"
    args = [str(ROOT / "configs/shapes/flow_grpo.yaml"), f"model.path={tiny_shapes_dir}", f"run.output_dir={out}",
            "run.max_minutes=null", "run.max_epochs=2", "eval.at_start=false", "eval.every_minutes=null",
            "eval.every_epochs=2", "eval.grid_size=3", "sampling.num_steps=3", "sampling.eval_num_steps=2",
            "sampling.window.max_start=null", "sampling.groups_per_epoch=2", "sampling.group_size=2",
            "sampling.batch_size=4", "train.micro_batch_size=4", "data.num_eval_prompts=4", "optim.lr=1e-2",
            "reward.train={jpeg_incompressibility: 1.0}", "reward.eval=[jpeg_incompressibility, shapes]"]
    assert main(args) == 0
    grid = np.asarray(Image.open(out / "samples" / "epoch_0002.png").convert("RGB")).astype(np.float32)
    # Where prompt_grid puts each tile for these prompts (the same layout code drew the file).
    from flowrl.data.prompts import load_prompts
    from flowrl.eval.grid import prompt_grid

    prompts = list(load_prompts("shapes:eval", 4).prompts)[:3]
    boxes: dict = {}
    blank = torch.zeros(3, 3, 32, 32)
    layout = prompt_grid(prompts, {"base": blank, "epoch 2": blank}, {"base": ["a\nb"] * 3, "epoch 2": ["a\nb"] * 3},
                         notes=["seed"] * 3, boxes=boxes)
    assert grid.shape[:2] == (layout.size[1], layout.size[0])
    assert layout.size[0] < 4 * 260 and layout.size[1] < 300  # three prompts in one row, not a tall strip
    for i in range(3):
        (l0, t0, r0, b0), (l1, t1, r1, b1) = boxes[(i, "base")], boxes[(i, "epoch 2")]
        left_tile, right_tile = grid[t0:b0, l0:r0], grid[t1:b1, l1:r1]
        assert left_tile.shape == (96, 96, 3)  # 32 px images at 3x
        assert left_tile.std() > 1 and right_tile.std() > 1  # drawn images, not blank cells
        assert np.abs(left_tile - right_tile).mean() > 0.5  # lr 1e-2 for 2 epochs moved the model: base != current
    for plot in ("reward", "grad_norm", "signal", "policy", "time_per_epoch", "time_total", "eval"):
        assert (out / "plots" / f"{plot}.png").is_file(), plot
