"""Parameter snapshots under FSDP2 on two CPU processes (gloo): FSDP2 gathers a module's shards in its forward
pre-hook and overwrites the tensors ``functional_call`` swaps in, so before 2026-12-07 a "snapshot" predicted with the
live weights (DGPO's clip and EMA sampling, NFT's and CRD's old policy, AWM's EMA KL silently used the live model).
Snapshots now swap the shards themselves; a DGPO run that uses its snapshot trains, checkpoints and resumes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_processes(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), *args]
    result = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=600)
    errors = [line for line in result.stderr.splitlines() if "Error" in line][:10]
    assert result.returncode == 0, "\n".join(errors) + result.stdout[-2000:] + result.stderr[-2000:]
    return result


@pytest.mark.slow
def test_a_snapshot_predicts_with_its_own_weights_under_fsdp2(tiny_shapes_dir, tmp_path):
    out = tmp_path / "snapshot.json"
    two_processes("tests/recipes/fsdp_snapshot_worker.py", str(tiny_shapes_dir), str(out))
    sharded = json.loads(out.read_text())
    single = sharded["reference"]  # the same model on one process, no FSDP
    assert sharded["snapshot"] == pytest.approx(single["snapshot"], abs=1e-5)
    assert sharded["snapshot"] != pytest.approx(sharded["live_before"], abs=1e-3)  # the bug: these were equal
    assert sharded["live_after"] == sharded["live_before"]  # the live shards are restored exactly
    assert sharded["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)  # a snapshot forward mid-backward
    assert sharded["state_whole"]  # the checkpoint's copy is whole tensors


@pytest.mark.slow
def test_dgpo_with_its_snapshot_trains_checkpoints_and_resumes_under_fsdp2(tiny_shapes_dir, tmp_path):
    """Also the hangs a review found: an evaluation split giving the processes different numbers of batches, and the
    grid's base images drawn by the main process alone (each a forward the other process never joins)."""
    out = tmp_path / "dgpo"
    settings = {
        "model.path": tiny_shapes_dir, "run.output_dir": out, "run.max_minutes": "null",
        "data.num_eval_prompts": 5,  # 3 + 2 rows: the processes must still run the same forwards
        "sampling.num_steps": 4, "sampling.eval_num_steps": 2, "sampling.groups_per_epoch": 2,
        "sampling.group_size": 4, "sampling.batch_size": 4, "train.micro_batch_size": 4,
        "train.clip_range": 0.01, "train.sample_from_ema_after": 1,  # the snapshot clips and samples
        "optim.lr": 1e-3, "eval.at_start": "true", "eval.every_epochs": 1, "eval.every_minutes": "null",
        "eval.grid_size": 4, "checkpoint.every_epochs": 1, "reward.train": "{jpeg_incompressibility: 1.0}",
    }
    args = ["tests/recipes/fsdp_cpu_worker.py", "configs/shapes/dgpo.yaml"] + [f"{k}={v}" for k, v in settings.items()]
    first = two_processes(*args, "run.max_epochs=2")
    assert "flowrl: dgpo on fsdp2, 2 process(es)" in first.stdout
    # Resumed without the panel: the evaluation grid's base images are drawn again, by every process.
    second = two_processes(*args, "run.max_epochs=3", "run.resume=true", "eval.hacking.enabled=false")
    assert "resumed from" in second.stdout
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["epoch"] for r in rows] == [0, 1, 2, 3]
    assert [r.get("train/sampled_from_ema") for r in rows[1:]] == [0, 1, 1]
    assert all(r["train/grad_norm"] > 0 for r in rows[1:])
