"""Distributed training on CPU processes (gloo), through the real launchers (docs/distributed.md).

- DDP: `accelerate launch` with 2 CPU processes takes the same update as one process with twice the gradient
  accumulation (same samples through per-sample seeds).
- Two "machines" on loopback (`--num_machines 2`, one process each, two `accelerate launch` commands with
  `--machine_rank 0/1`): a run stopped after epoch 1 and resumed ends bitwise equal to the run that went straight
  through (weights, EMA, every logged metric), and equal to one process with double accumulation.
- FSDP2 (torch's `fully_shard`, DTensor parameters, sharded `save_state`) on 2 CPU processes: accelerate itself
  refuses FSDP on CPU, so `fsdp_cpu_worker.py` bypasses only that check; stopped and resumed, the run equals one
  process with double accumulation.
- The launch config's mixed precision reaches the run, and a `model.dtype` that contradicts it is one line.
"""

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
CONFIG = "configs/shapes/flow_grpo.yaml"
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]


def overrides(model_dir, out, **extra) -> list[str]:
    settings = {
        "model.path": model_dir, "run.output_dir": out, "run.max_epochs": 1, "run.max_minutes": "null",
        "run.deterministic": "true", "data.num_eval_prompts": 6, "sampling.num_steps": 4,
        "sampling.window.max_start": "null", "sampling.eval_num_steps": 2, "sampling.groups_per_epoch": 2,
        "sampling.group_size": 4, "sampling.batch_size": 4, "train.micro_batch_size": 4, "train.clip_range": 0.2,
        "optim.lr": 1e-3, "eval.at_start": "false", "eval.every_minutes": "null", "eval.grid_size": 0,
        # The random tiny model draws no shapes; JPEG size varies per image, so advantages are non-zero.
        "reward.train": "{jpeg_incompressibility: 1.0}",
    }
    settings.update(extra)
    return [f"{k}={v}" for k, v in settings.items()]


# Two epochs, two optimizer steps per epoch, an EMA and a checkpoint every epoch: resume must restore the
# optimizer's moments, the EMA, the advantage tracker and the RNG to continue exactly. Adam's epsilon is raised so
# that weights whose gradient is zero up to rounding (a bias before a GroupNorm) do not turn reduction-order
# noise into full-size steps when two topologies are compared.
RESUMABLE = {"train.minibatches": 2, "train.ema_decay": 0.5, "checkpoint.every_epochs": 1, "optim.adam_eps": 1e-4,
             "eval.every_epochs": 1}  # a run stopped at epoch 1 evaluates there: so does the straight one


def env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


def run(command, env_extra=None):
    result = subprocess.run(command, cwd=ROOT, env=env(**(env_extra or {})), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_machines(args: list[str]) -> subprocess.CompletedProcess:
    """The same command on two 'machines' of one process each, meeting on loopback."""
    port = free_port()
    commands = [LAUNCH + ["--config_file", "configs/accelerate/cpu_2proc.yaml", "--num_machines", "2",
                          "--num_processes", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
                          "--main_process_port", str(port), "-m", "flowrl", "train", CONFIG, *args]
                for rank in (0, 1)]
    nodes = [subprocess.Popen(c, cwd=ROOT, env=env(ACCELERATE_USE_CPU="1"), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for c in commands]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-4000:]
    return subprocess.CompletedProcess(commands[0], 0, outputs[0], outputs[1])


def in_process(model_dir, out, **extra) -> None:
    from flowrl.commands.train import load_recipe_config

    recipe, cfg = load_recipe_config(CONFIG, overrides(model_dir, out, **extra))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert recipe.main(cfg) == 0
    finally:
        torch.set_num_threads(threads)


def comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))} for r in rows]


def assert_same_weights(a_dir, b_dir, *, atol=0.0):
    a, b = load_state(latest_checkpoint(a_dir)), load_state(latest_checkpoint(b_dir))
    assert a["epoch"] == b["epoch"] and set(a["model"]) == set(b["model"])
    for key, value in a["model"].items():
        gap = float((value - b["model"][key]).abs().max())
        assert torch.allclose(value, b["model"][key], atol=atol, rtol=0), (key, gap)
    if "ema" in a:
        for x, y in zip(a["ema"]["shadow_params"], b["ema"]["shadow_params"], strict=True):
            assert torch.allclose(x, y, atol=atol, rtol=0)
    return a, b


@pytest.mark.slow
def test_two_processes_equal_one_process_with_double_accumulation(tiny_shapes_dir, tmp_path):
    single, double = tmp_path / "one_process", tmp_path / "two_processes"
    # 8 samples per epoch: one process runs two micro-batches of 4 (accumulation 2) ...
    run([sys.executable, "-m", "flowrl", "train", CONFIG, *overrides(tiny_shapes_dir, single)])
    # ... two processes run one micro-batch of 4 each (accumulation 1).
    launch = LAUNCH + ["--config_file", "configs/accelerate/cpu_2proc.yaml", "-m", "flowrl", "train", CONFIG,
                       *overrides(tiny_shapes_dir, double)]
    result = run(launch, {"ACCELERATE_USE_CPU": "1"})
    assert result.stdout.count("flowrl: flow_grpo stopped at epoch 1/1") == 1  # printed by rank 0 only
    assert "flowrl: flow_grpo on ddp, 2 process(es), mixed precision no" in result.stdout
    a, b = assert_same_weights(single, double, atol=1e-5)
    ra, rb = read_metrics(single / "metrics.jsonl")[-1], read_metrics(double / "metrics.jsonl")[-1]
    assert ra["train/reward_mean"] == rb["train/reward_mean"]
    assert abs(ra["train/grad_norm"] - rb["train/grad_norm"]) < 1e-5 * max(1.0, ra["train/grad_norm"])
    assert ra["train/grad_norm"] > 0  # a real update happened
    assert ra["eval/shapes/accuracy"] == rb["eval/shapes/accuracy"]
    # The checkpoint: flowrl's state.pt, and accelerate's state with the optimizer and each process's RNG.
    files = {p.name for p in (latest_checkpoint(double) / "accelerate").iterdir()}
    assert {"optimizer.bin", "random_states_0.pkl", "random_states_1.pkl"} <= files
    assert not any(name.startswith(("model", "pytorch_model")) for name in files)  # the weights are in state.pt


@pytest.mark.slow
def test_two_machines_on_loopback_train_stop_and_resume_exactly(tiny_shapes_dir, tmp_path):
    straight, resumed, single = tmp_path / "straight", tmp_path / "resumed", tmp_path / "single"
    two_machines(overrides(tiny_shapes_dir, straight, **RESUMABLE, **{"run.max_epochs": 2}))
    first = two_machines(overrides(tiny_shapes_dir, resumed, **RESUMABLE))
    assert "flowrl: flow_grpo on ddp, 2 process(es)" in first.stdout and "2 machines" in first.stdout
    second = two_machines(overrides(tiny_shapes_dir, resumed, **RESUMABLE, **{"run.max_epochs": 2,
                                                                               "run.resume": "true"}))
    assert f"flowrl: resumed from {resumed}/checkpoints/epoch_0000001 at epoch 1" in second.stdout
    assert_same_weights(straight, resumed)  # bitwise: weights and EMA
    rows_straight, rows_resumed = read_metrics(straight / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl")
    assert [r["epoch"] for r in rows_resumed] == [1, 2]
    assert comparable(rows_resumed) == comparable(rows_straight)
    assert rows_straight[1]["train/optimizer_steps"] == 2 and rows_straight[1]["train/grad_norm"] > 0
    # Two machines of one process take the update of one process with double accumulation.
    in_process(tiny_shapes_dir, single, **RESUMABLE, **{"run.max_epochs": 2})
    assert_same_weights(single, straight, atol=1e-5)


@pytest.mark.slow
def test_fsdp2_on_two_cpu_processes_resumes_and_equals_one_process(tiny_shapes_dir, tmp_path):
    out, single = tmp_path / "fsdp2", tmp_path / "single"
    def worker():
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(free_port()), "tests/recipes/fsdp_cpu_worker.py", CONFIG]

    first = run(worker() + overrides(tiny_shapes_dir, out, **RESUMABLE))
    assert "fsdp_cpu_worker: backend fsdp2" in first.stdout
    assert "flowrl: flow_grpo on fsdp2, 2 process(es)" in first.stdout
    shards = latest_checkpoint(out) / "accelerate"
    # accelerate's sharded checkpoint: model and optimizer written by both processes (torch.distributed.checkpoint)
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in (shards / folder).iterdir()}, folder
    state = load_state(latest_checkpoint(out))  # flowrl's state.pt: whole tensors, loadable anywhere
    assert all(type(v) is torch.Tensor for v in state["model"].values())
    assert all(type(v) is torch.Tensor for v in state["ema"]["shadow_params"])
    second = run(worker() + overrides(tiny_shapes_dir, out, **RESUMABLE, **{"run.max_epochs": 2, "run.resume": "true"}))
    assert "resumed from" in second.stdout
    in_process(tiny_shapes_dir, single, **RESUMABLE, **{"run.max_epochs": 2})
    assert_same_weights(single, out, atol=1e-5)
    rows_single, rows_fsdp = read_metrics(single / "metrics.jsonl"), read_metrics(out / "metrics.jsonl")
    for a, b in zip(rows_single, rows_fsdp, strict=True):
        assert a["train/reward_mean"] == b["train/reward_mean"]
        assert abs(a["train/grad_norm"] - b["train/grad_norm"]) < 1e-5 * max(1.0, a["train/grad_norm"])


@pytest.mark.slow
def test_the_launch_configs_mixed_precision_reaches_the_run_and_must_agree_with_model_dtype(tiny_shapes_dir, tmp_path):
    launch = LAUNCH + ["--config_file", "configs/accelerate/cpu_2proc.yaml", "--num_processes", "1",
                       "--mixed_precision", "bf16", "-m", "flowrl", "train", CONFIG]
    bad = subprocess.run(launch + overrides(tiny_shapes_dir, tmp_path / "bad", **{"model.dtype": "float16"}), cwd=ROOT,
                         env=env(ACCELERATE_USE_CPU="1"), capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0
    assert ("flowrl train: error: model.dtype: float16 disagrees with the launch config's mixed_precision bf16; "
            "set model.dtype to float32 or bfloat16, or launch with mixed_precision fp16") in bad.stderr
    assert "Traceback" not in bad.stderr.split("flowrl train: error")[0][-2000:]
    good = run(launch + overrides(tiny_shapes_dir, tmp_path / "good", **{"run.max_epochs": 0}),
               {"ACCELERATE_USE_CPU": "1"})
    assert "flowrl: flow_grpo on single, 1 process(es), mixed precision bf16" in good.stdout


def test_dtype_agreement_rules():
    from flowrl.config import ConfigError
    from flowrl.dist import check_dtype_agrees

    for precision, dtype in [("no", "float32"), ("no", "bfloat16"), ("no", "float16"), ("bf16", "float32"),
                             ("bf16", "bfloat16"), ("fp16", "float32"), ("fp16", "float16")]:
        check_dtype_agrees(precision, dtype)
    for precision, dtype in [("bf16", "float16"), ("fp16", "bfloat16"), ("fp8", "float32")]:
        with pytest.raises(ConfigError, match=r"^model.dtype: "):
            check_dtype_agrees(precision, dtype)


def test_an_fsdp_launch_that_accelerate_runs_as_ddp_on_cpu_says_so(monkeypatch):
    from flowrl.dist import Dist

    dist = Dist(cpu=True)
    assert dist.notes() == []
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert dist.notes() == ["the launch config asks for FSDP but accelerate runs it as single on cpu (FSDP needs "
                            "GPUs); the weights are not sharded"]


@pytest.mark.slow
def test_a_failure_in_a_two_process_run_saves_from_the_main_process_and_resumes(tiny_shapes_dir, tmp_path):
    """Every process fails (the reward server is down): the main process saves alone, without collectives (the
    others may be anywhere), in the layout with the optimizer inside state.pt; the run then resumes under two
    processes and equals one process with double accumulation."""
    out, single = tmp_path / "failed", tmp_path / "single"
    launch = LAUNCH + ["--config_file", "configs/accelerate/cpu_2proc.yaml", "-m", "flowrl", "train", CONFIG]
    down = f"reward.train={{remote: {{weight: 1.0, kwargs: {{url: 'http://127.0.0.1:{free_port()}'}}}}}}"
    failed = subprocess.run(launch + overrides(tiny_shapes_dir, out, **{"eval.at_start": "true"}) + [down], cwd=ROOT,
                            env=env(ACCELERATE_USE_CPU="1"), capture_output=True, text=True, timeout=600)
    assert failed.returncode != 0 and "checkpoint of epoch 0 saved" in failed.stderr, failed.stderr[-3000:]
    saved = latest_checkpoint(out)
    assert "optimizer" in load_state(saved) and not (saved / "accelerate").exists()
    resumed = run(launch + overrides(tiny_shapes_dir, out, **{"run.resume": "true"}), {"ACCELERATE_USE_CPU": "1"})
    assert "resumed from" in resumed.stdout
    in_process(tiny_shapes_dir, single)
    assert_same_weights(single, out, atol=1e-5)
