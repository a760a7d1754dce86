"""The SD3 user's path of the README ("Real models"), on the tiny SD3 pipeline: train with configs/sd3/tiny.yaml,
`flowrl export`, `flowrl sample` / `flowrl eval` with --model sd3 --path --lora, --run and a merged pipeline
directory, a GenEval-style jsonl whose metadata reaches the reward (locally and through `flowrl serve-reward`),
and the demo's models."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def walk(tmp_path_factory, tiny_dir):
    """The README's first steps: a tiny SD3 pipeline, `flowrl train configs/sd3/tiny.yaml` (shortened to two epochs
    and a higher learning rate so the LoRA moves the images), `flowrl export` as diffusers and merged."""
    from flowrl.commands.export import main as export_main
    from flowrl.commands.train import main as train_main

    root = tmp_path_factory.mktemp("walk")
    tiny = tiny_dir("sd3")
    run = root / "runs" / "sd3_tiny"
    assert train_main([str(ROOT / "configs/sd3/tiny.yaml"), f"model.path={tiny}", f"run.output_dir={run}",
                       "run.max_epochs=2", "optim.lr=0.05", "sampling.groups_per_epoch=2"]) == 0
    assert export_main([str(run), "--format", "diffusers", "--out", str(root / "lora")]) == 0
    assert export_main([str(run), "--format", "merged", "--out", str(root / "merged")]) == 0
    return {"root": root, "tiny": tiny, "run": run, "lora": root / "lora", "merged": root / "merged"}


def grid(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB")).astype(np.int16)


def sample(capsys, *args) -> str:
    from flowrl.commands.sample import sample_main

    code = sample_main([*args, "--prompt", "a red cat", "--prompt", "a blue square", "--seeds", "0-1", "--steps", "4",
                        "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    return captured.out


@pytest.mark.slow
def test_sample_a_run_its_lora_and_its_merged_pipeline_alike(walk, tmp_path, capsys):
    w = walk
    sample(capsys, "--run", str(w["run"]), "--out", str(tmp_path / "run.png"))
    sample(capsys, "--model", "sd3", "--path", str(w["tiny"]), "--lora", str(w["lora"]), "--resolution", "64",
           "--out", str(tmp_path / "export.png"))
    sample(capsys, "--model", "sd3", "--path", str(w["tiny"]), "--lora", str(w["run"]), "--out",
           str(tmp_path / "run_lora.png"))
    sample(capsys, "--model", str(w["merged"]), "--out", str(tmp_path / "merged.png"))
    sample(capsys, "--model", "sd3", "--path", str(w["tiny"]), "--out", str(tmp_path / "base.png"))
    reference = grid(tmp_path / "run.png")
    # --lora with a diffusers folder: the pipeline's own max_sequence_length (256), not the run's 16, so only the
    # run's LoRA (same settings as the run) and the merged export (which records them) match it pixel for pixel.
    for name in ("run_lora.png", "merged.png"):
        assert np.abs(grid(tmp_path / name) - reference).max() <= 1, name
    assert np.abs(grid(tmp_path / "base.png") - reference).max() > 10  # the LoRA changed the images
    assert grid(tmp_path / "export.png").shape == reference.shape


@pytest.mark.slow
def test_eval_a_geneval_style_jsonl_hands_metadata_to_the_reward(walk, tmp_path, capsys):
    from flowrl.commands.sample import eval_main
    from rewards import RewardOutput
    from rewards.base import Reward
    from rewards.registry import REWARDS

    seen: list[dict] = []

    class Recording(Reward):
        name = "recording"

        def score(self, images, prompts, metadata=None):
            seen.extend(metadata or [])
            return RewardOutput(torch.tensor([float(m["expected"]) for m in metadata]),
                                {"correct": torch.tensor([float(m["expected"]) for m in metadata])})

    if "recording" not in REWARDS:
        REWARDS.register("recording", Recording)
    rows = [{"prompt": "a red circle", "tag": "colors", "expected": 1, "include": [{"class": "circle"}]},
            {"prompt": "two blue squares", "tag": "counting", "expected": 0, "include": [{"count": 2}]},
            {"prompt": "a cat left of a dog", "tag": "position", "expected": 1}]
    prompts = tmp_path / "geneval.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "eval.json"
    code = eval_main(["--run", str(walk["run"]), "--reward", "recording", "--prompts", str(prompts), "--steps", "3",
                      "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    assert [m["tag"] for m in seen] == ["colors", "counting", "position"]
    assert seen[0]["include"] == [{"class": "circle"}]
    summary = json.loads(out.read_text())
    assert summary["overall"] == pytest.approx(2 / 3)
    assert {k: v["accuracy"] for k, v in summary["kinds"].items()} == {"colors": 1.0, "counting": 0.0, "position": 1.0}
    assert summary["settings"]["model"] == f"run {walk['run']}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_eval_through_the_reward_server_equals_the_local_reward(walk, tmp_path, capsys):
    from flowrl.commands.sample import eval_main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a red circle", "tag": "colors"}\n{"prompt": "a green square", "tag": "colors"}\n')
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "flowrl", "serve-reward", "--reward", "jpeg_incompressibility",
                               "--host", "127.0.0.1", "--port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        results = {}
        for name, reward in (("remote", f"remote:url=http://127.0.0.1:{port}"), ("local", "jpeg_incompressibility")):
            out = tmp_path / f"{name}.json"
            assert eval_main(["--run", str(walk["run"]), "--reward", reward, "--prompts", str(prompts), "--steps",
                              "3", "--out", str(out), "--no-progress"]) == 0, capsys.readouterr().err
            results[name] = json.loads(out.read_text())
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert results["remote"]["score_mean"] == pytest.approx(results["local"]["score_mean"], abs=1e-6)


def test_model_options_mistakes_are_one_line(walk, capsys):
    from flowrl.commands.sample import sample_main

    w = walk
    cases = [
        (["--run", str(w["run"]), "--lora", str(w["lora"])], "--run loads the run's own base model"),
        (["--model", "flux", "--path", str(w["tiny"])], "is a sd3 pipeline, not flux; give --model sd3"),
        (["--model", "sd3", "--path", str(w["tiny"]), "--lora", str(w["root"])], "is neither a run directory"),
        (["--model", "shapes", "--path", str(w["tiny"])], "--path goes with --model sd3 or --model flux"),
        (["--model", "flux", "--path", str(w["tiny"]), "--lora", str(w["run"])], "trained a sd3 model, not flux"),
        (["--run", str(w["root"] / "nowhere")], "no checkpoint at"),
    ]
    for args, message in cases:
        code = sample_main([*args, "--prompt", "a", "--seeds", "0", "--steps", "1", "--no-progress"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and message in err[-1] and err[-1].startswith("flowrl sample: error:"), (args, err[-3:])


@pytest.mark.slow
def test_the_demo_loads_sd3_runs_and_pipelines(walk):
    from flowrl.demo import engine
    from flowrl.demo.cli import make_state

    w = walk
    state = make_state(model=str(w["tiny"]), checkpoints=[f"tuned={w['run']}", f"merged={w['merged']}"],
                       rewards=["jpeg_incompressibility"], runs_dir=str(w["run"].parent), device="cpu")
    rows = {r["name"]: r for r in state.bank.describe()}
    assert rows["tuned"]["state"] == "loaded (epoch 2, LoRA, EMA)" and rows["merged"]["state"] == "loaded"
    models = {n: state.bank.get(n) for n in ("tuned", "merged")}
    result = engine.compare(models, ["a red cat"], [0, 1], steps=3, guidance=None, sampler="ode", noise_level=None,
                            rewards=state.rewards, reward_names=["jpeg_incompressibility"])
    torch.testing.assert_close(result.images["tuned"], result.images["merged"], rtol=0, atol=1e-5)
