"""The GPU launch configs, end to end: FSDP2 (`configs/accelerate/fsdp.yaml`) and DeepSpeed ZeRO-2
(`configs/accelerate/zero2.yaml`) each run two epochs of Flow-GRPO on the tiny SD3 pipeline with 2 GPUs (bf16 mixed
precision from the launch config), and a run stopped after epoch 1 and resumed ends equal to the straight run.

NOT RUN YET: this file needs 2 CUDA GPUs (and `pip install deepspeed` for ZeRO-2); without them every test is
skipped. On a GPU machine:

    pytest tests/recipes/test_flow_grpo_distributed_gpu.py -v

The CPU suite covers the same code paths where it can: 2-process DDP, two machines on loopback, and FSDP2 on CPU
processes with gloo (tests/recipes/test_flow_grpo_distributed.py).
"""

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowrl.run.checkpoint_files import latest_checkpoint, load_state
from flowrl.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs (run on a GPU machine)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config: str, out: Path, extra: list[str]) -> subprocess.CompletedProcess:
    from flowrl.testing import build_tiny_sd3

    args = ["model.name=sd3", f"model.path={build_tiny_sd3()}", "model.max_sequence_length=16",
            f"run.output_dir={out}", "run.max_minutes=null", "run.deterministic=true",
            "data.train_prompts=shapes:train", "data.eval_prompts=shapes:eval", "data.num_eval_prompts=4",
            "sampling.num_steps=4", "sampling.window.max_start=null", "sampling.eval_num_steps=2",
            "sampling.group_size=4", "sampling.groups_per_epoch=2", "sampling.batch_size=4", "sampling.guidance=4.5",
            "train.micro_batch_size=2", "train.minibatches=2", "train.ema_decay=0.5", "train.kl_coef=0.01",
            "optim.lr=1e-3", "eval.at_start=false", "eval.every_epochs=2", "eval.every_minutes=null",
            "eval.grid_size=0", "checkpoint.every_epochs=1",
            "reward.train={jpeg_incompressibility: 1.0}", "reward.eval=[jpeg_incompressibility]", *extra]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--num_processes", "2",
               "--main_process_port", str(free_port()), "-m", "flowrl", "train", "configs/shapes/flow_grpo.yaml", *args]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


CASES = [("configs/accelerate/fsdp.yaml", "fsdp2", ["model.lora={rank: 4, alpha: 8}"]),
         ("configs/accelerate/fsdp.yaml", "fsdp2", ["model.lora=null", "optim.lr=1e-4"]),
         ("configs/accelerate/zero2.yaml", "deepspeed", ["model.lora={rank: 4, alpha: 8}"])]


@pytest.mark.slow
@pytest.mark.parametrize("config,backend,extra", CASES, ids=["fsdp2-lora", "fsdp2-full", "zero2-lora"])
def test_two_epochs_and_an_exact_resume(config, backend, extra, tmp_path):
    if backend == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("pip install deepspeed")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    first = launch(config, straight, extra + ["run.max_epochs=2"])
    assert f"on {backend}, 2 process(es), mixed precision bf16" in first.stdout
    launch(config, resumed, extra + ["run.max_epochs=1"])
    second = launch(config, resumed, extra + ["run.max_epochs=2", "run.resume=true"])
    assert "resumed from" in second.stdout
    a, b = load_state(latest_checkpoint(straight)), load_state(latest_checkpoint(resumed))
    assert a["epoch"] == b["epoch"] == 2
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    for x, y in zip(a["ema"]["shadow_params"], b["ema"]["shadow_params"], strict=True):
        assert torch.equal(x, y)
    rows_a, rows_b = read_metrics(straight / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl")
    strip = [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))} for r in rows_a]
    assert strip == [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))} for r in rows_b]
    assert rows_a[-1]["train/grad_norm"] > 0
    if "lora" in extra[0] and "null" not in extra[0]:
        assert (latest_checkpoint(straight) / "lora" / "pytorch_lora_weights.safetensors").is_file()
