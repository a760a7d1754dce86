"""What a user looks at after a run: the sample grid (base vs current model, same prompts and noise, captioned
with the eval rewards) and the plots that say whether training works, one unit per axis."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from flowrl.grid import HEADER, LINE_HEIGHT, PAD

ROOT = Path(__file__).resolve().parents[2]


def test_sample_grid_shows_base_and_current_and_the_plots_exist(tiny_shapes_dir, tmp_path):
    from flowrl.train import main

    out = tmp_path / "run"
    args = [str(ROOT / "configs/shapes/flow_grpo.yaml"), f"model.path={tiny_shapes_dir}", f"run.output_dir={out}",
            "run.max_minutes=null", "run.max_epochs=2", "eval.at_start=false", "eval.every_minutes=null",
            "eval.every_epochs=2", "eval.grid_size=3", "sampling.num_steps=3", "sampling.eval_num_steps=2",
            "sampling.window.max_start=null", "sampling.groups_per_epoch=2", "sampling.group_size=2",
            "sampling.batch_size=4", "train.micro_batch_size=4", "data.num_eval_prompts=4", "optim.lr=1e-2",
            "reward.train={jpeg_incompressibility: 1.0}", "reward.eval=[jpeg_incompressibility, shapes]"]
    assert main(args) == 0
    grid = np.asarray(Image.open(out / "samples" / "epoch_0002.png").convert("RGB")).astype(np.float32)
    cell, caption_lines = 128, 2  # 32 px images at 4x; one caption line per eval reward
    assert grid.shape[0] == HEADER + 3 * (cell + caption_lines * LINE_HEIGHT + 4 + PAD) + PAD
    assert grid.shape[1] == 170 + 2 * (cell + PAD) + PAD  # two columns: base, epoch 2
    top = HEADER
    left_tile = grid[top:top + cell, 170:170 + cell]
    right_tile = grid[top:top + cell, 170 + cell + PAD:170 + 2 * cell + PAD]
    assert left_tile.std() > 1 and right_tile.std() > 1  # drawn images, not blank cells
    assert np.abs(left_tile - right_tile).mean() > 0.5  # lr 1e-2 for 2 epochs moved the model: base != current
    for plot in ("reward", "grad_norm", "signal", "policy", "time_per_epoch", "time_total", "eval"):
        assert (out / "plots" / f"{plot}.png").is_file(), plot
