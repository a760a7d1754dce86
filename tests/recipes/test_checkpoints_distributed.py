"""The checkpoint layout of an online run (docs/distributed.md, "Checkpoints"): flowrl's state.pt plus accelerate's
save_state, a checkpoint of the layout before accelerate/ existed still resumes exactly, and a corrupt accelerate/
part of the newest checkpoint falls back to the one before it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.run.checkpoint_files import checkpoints, latest_checkpoint, load_state
from flowrl.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "shapes" / "flow_grpo.yaml"


def run(model_dir, out, capsys=None, **extra) -> str:
    from flowrl.commands.train import main

    settings = {
        "model.path": model_dir, "run.output_dir": out, "run.max_minutes": "null", "run.deterministic": "true",
        "data.num_eval_prompts": 2, "sampling.num_steps": 3, "sampling.window.max_start": "null",
        "sampling.eval_num_steps": 2, "sampling.groups_per_epoch": 2, "sampling.group_size": 2,
        "sampling.batch_size": 4, "train.micro_batch_size": 4, "train.minibatches": 2, "train.ema_decay": 0.5,
        "optim.lr": 1e-3, "eval.at_start": "false", "eval.every_epochs": 1, "eval.grid_size": 0,
        "checkpoint.every_epochs": 1, "checkpoint.keep": 3, "reward.train": "{jpeg_incompressibility: 1.0}",
        "reward.eval": "[jpeg_incompressibility]", **extra}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main([str(CONFIG)] + [f"{k}={v}" for k, v in settings.items()]) == 0
    finally:
        torch.set_num_threads(threads)
    return capsys.readouterr().err if capsys is not None else ""


def comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))} for r in rows]


@pytest.mark.slow
def test_layout_old_checkpoints_and_a_corrupt_accelerate_part(tiny_shapes_dir, tmp_path, capsys):
    straight, old, corrupt = tmp_path / "straight", tmp_path / "old", tmp_path / "corrupt"
    run(tiny_shapes_dir, straight, **{"run.max_epochs": 2})
    newest = latest_checkpoint(straight)
    assert {p.name for p in newest.iterdir()} == {"state.pt", "accelerate"}  # no lora/: a full fine-tuning run
    state = load_state(newest)
    assert {"model", "ema", "scheduler", "tracker", "rng", "epoch"} <= set(state) and "optimizer" not in state
    assert (newest / "accelerate" / "optimizer.bin").is_file()

    # The layout before accelerate/: the optimizer inside state.pt. It resumes exactly.
    run(tiny_shapes_dir, old, **{"run.max_epochs": 1})
    first = latest_checkpoint(old)
    state = load_state(first)
    state["optimizer"] = torch.load(first / "accelerate" / "optimizer.bin", weights_only=True)
    torch.save(state, first / "state.pt")
    for part in (first / "accelerate").iterdir():
        part.unlink()
    (first / "accelerate").rmdir()
    run(tiny_shapes_dir, old, **{"run.max_epochs": 2, "run.resume": "true"})
    a, b = load_state(latest_checkpoint(straight)), load_state(latest_checkpoint(old))
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    assert comparable(read_metrics(old / "metrics.jsonl")) == comparable(read_metrics(straight / "metrics.jsonl"))

    # A corrupt optimizer file in the newest checkpoint: resume from the one before it, with a warning.
    run(tiny_shapes_dir, corrupt, **{"run.max_epochs": 2})
    capsys.readouterr()
    bad = latest_checkpoint(corrupt)
    (bad / "accelerate" / "optimizer.bin").write_bytes(b"not a checkpoint")
    err = run(tiny_shapes_dir, corrupt, capsys, **{"run.max_epochs": 3, "run.resume": "true"})
    assert f"warning: cannot restore checkpoint {bad}" in err and "resuming from" in err and "epoch_0000001" in err
    assert [r["epoch"] for r in read_metrics(corrupt / "metrics.jsonl")] == [1, 2, 3]
    assert [p.name for p in checkpoints(corrupt)][0] == "epoch_0000003"
