"""Data-parallel invariance: `accelerate launch` with 2 CPU processes (gloo) takes the same update as one
process with twice the gradient accumulation (same samples through per-sample seeds)."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from flowrl.checkpoint import latest_checkpoint, load_state
from flowrl.logging import read_metrics

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/shapes/flow_grpo.yaml"


def overrides(model_dir, out) -> list[str]:
    return [f"model.path={model_dir}", f"run.output_dir={out}", "run.max_epochs=1", "run.max_minutes=null",
            "run.deterministic=true", "data.num_eval_prompts=6", "sampling.num_steps=4", "sampling.window.max_start=null", "sampling.eval_num_steps=2",
            "sampling.groups_per_epoch=2", "sampling.group_size=4", "sampling.batch_size=4",
            "train.micro_batch_size=4", "train.clip_range=0.2", "optim.lr=1e-3", "eval.at_start=false",
            "eval.every_minutes=null", "eval.grid_size=0",
            # The random tiny model draws no shapes; JPEG size varies per image, so advantages are non-zero.
            "reward.train={jpeg_incompressibility: 1.0}"]


def run(command, env_extra=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env_extra or {})}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_two_processes_equal_one_process_with_double_accumulation(tiny_shapes_dir, tmp_path):
    single, double = tmp_path / "one_process", tmp_path / "two_processes"
    # 8 samples per epoch: one process runs two micro-batches of 4 (accumulation 2) ...
    run([sys.executable, "-m", "flowrl", "train", CONFIG, *overrides(tiny_shapes_dir, single)])
    # ... two processes run one micro-batch of 4 each (accumulation 1).
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu_2proc.yaml",
              "-m", "flowrl", "train", CONFIG, *overrides(tiny_shapes_dir, double)]
    result = run(launch, {"ACCELERATE_USE_CPU": "1"})
    assert result.stdout.count("flowrl: flow_grpo stopped at epoch 1/1") == 1  # printed by rank 0 only
    a, b = load_state(latest_checkpoint(single)), load_state(latest_checkpoint(double))
    for key, value in a["model"].items():
        assert torch.allclose(value, b["model"][key], atol=1e-5, rtol=0), key
    ra, rb = read_metrics(single / "metrics.jsonl")[-1], read_metrics(double / "metrics.jsonl")[-1]
    assert ra["train/reward_mean"] == rb["train/reward_mean"]
    assert abs(ra["train/grad_norm"] - rb["train/grad_norm"]) < 1e-5 * max(1.0, ra["train/grad_norm"])
    assert ra["train/grad_norm"] > 0  # a real update happened
    assert ra["eval/shapes/accuracy"] == rb["eval/shapes/accuracy"]
