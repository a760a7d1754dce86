"""Every image trainer on the fake accelerator, through ``flowrl train`` and the shipped configs, on tiny SD3, FLUX and
Z-Image pipelines, the distillations (DMD2, DMDR, on-policy distillation) included: the evaluation before training
with the hacking panel, a reward whose scores come back on the device (PickScore), checkpoints, a resume with an EMA of
the weights, and the LoRA export of the result.

Before the fixes they guard (2026-12-07) the first case failed twice, as every GPU user's SD3 / FLUX run did: the
evaluation at epoch 0 (``torch.cat`` of device scores with CPU padding, flowrl/eval/evaluate.py) and, with the reward
moved to the CPU, the first optimizer step after a resume (diffusers' EMA kept the checkpoint's CPU tensors)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flowrl.run.metrics import read_metrics
from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION, build_tiny

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.device, pytest.mark.usefixtures("one_thread")]

#: (config, family, overrides): the shipped SD3 / FLUX configs where they exist, every other trainer through its
#: shapes config with the model swapped.
CASES = [
    ("sd3/flow_grpo_pickscore", "sd3", {}),
    ("sd3/tp_grpo_pickscore", "sd3", {}),
    ("shapes/grpo_guard", "sd3", {}),
    ("shapes/flow_dppo", "sd3", {}),
    ("sd3/crd_ocr", "sd3", {}),
    ("sd3/nft_pickscore", "sd3", {}),
    ("sd3/awm_pickscore", "sd3", {}),
    ("sd3/dgpo_pickscore", "sd3", {}),
    ("sd3/d3po_pickscore", "sd3", {}),
    ("sd3/dpo_pickapic", "sd3", {}),
    ("shapes/raft", "sd3", {"train.select": "best"}),
    ("flux/flow_grpo_pickscore", "flux", {}),
    ("flux/nft_pickscore", "flux", {}),
    ("flux/awm_pickscore", "flux", {}),
    ("shapes/crd", "flux", {}),
    ("shapes/dgpo", "flux", {}),
    ("shapes/d3po", "flux", {}),
    ("shapes/dpo", "flux", {}),
    ("shapes/raft", "flux", {"train.select": "best"}),
    ("z_image/flow_grpo_pickscore", "z_image", {}),
    ("shapes/crd", "z_image", {}),
    ("shapes/nft", "z_image", {}),
    ("shapes/awm", "z_image", {}),
    ("shapes/dgpo", "z_image", {}),
    ("shapes/d3po", "z_image", {}),
    ("shapes/dpo", "z_image", {}),
    ("shapes/raft", "z_image", {"train.select": "best"}),
]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("a red apple\na blue car\na cat on a mat\na bowl of soup\n")
    return path


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    from flowrl.data.webdataset_io import write_pair_shards

    path = tmp_path_factory.mktemp("pairs")
    rng = np.random.default_rng(0)
    image = lambda: rng.integers(0, 256, (TINY_RESOLUTION, TINY_RESOLUTION, 3), dtype=np.uint8)  # noqa: E731
    write_pair_shards(((image(), image(), p, None) for p in ["a red apple", "a blue car"] * 2), path)
    return path


def arguments(config: str, family: str, out: Path, prompts: Path, pairs: Path, pickscore, extra: dict) -> list[str]:
    model, processor = pickscore
    settings = {
        "model.name": family, "model.path": str(build_tiny(family)), "model.resolution": TINY_RESOLUTION,
        "model.max_sequence_length": TINY_MAX_SEQUENCE_LENGTH, "model.lora": "{rank: 4, alpha: 8}",
        "model.dtype": "float32", "run.output_dir": str(out), "run.max_epochs": 1, "run.max_minutes": "null",
        "run.device": "fakegpu", "data.train_prompts": str(prompts), "data.eval_prompts": str(prompts),
        "data.num_eval_prompts": 4, "sampling.num_steps": 10, "sampling.eval_num_steps": 2, "sampling.group_size": 2,
        "sampling.groups_per_epoch": 2, "sampling.batch_size": 4, "train.micro_batch_size": 4,
        "reward.train": f"{{pickscore: {{weight: 1.0, kwargs: {{model: {model}, processor: {processor}}}}}}}",
        "reward.eval": "[pickscore]", "eval.at_start": "true", "eval.every_epochs": 1, "eval.every_minutes": "null",
        "eval.batch_size": 4, "eval.grid_size": 2, "checkpoint.every_epochs": 1,
    }
    if "dpo_" in config or config.endswith("/dpo"):
        for key in [k for k in settings if k.startswith(("sampling.group", "sampling.batch", "data.train_prompts"))]:
            del settings[key]
        # Offline pairs: no training reward, so the evaluation's reward is one without weights.
        settings.update({"pairs.path": str(pairs), "pairs.pairs_per_epoch": 2,
                         "reward.eval": "[jpeg_incompressibility]"})
        del settings["reward.train"]
    if "d3po" in config:
        settings.update({"sampling.window.max_start": "null", "train.micro_batch_size": 1})
    settings.update(extra)
    return [str(ROOT / "configs" / f"{config}.yaml")] + [f"{k}={v}" for k, v in settings.items()]


def run_ok(args: list[str], out: Path) -> list[dict]:
    from flowrl.commands.train import main

    error = out / "error.log"
    assert main(args) == 0, error.read_text() if error.is_file() else "a config error (printed above)"
    return read_metrics(out / "metrics.jsonl")


@pytest.mark.parametrize("config,family,extra", CASES, ids=[f"{c}-{f}" for c, f, _ in CASES])
def test_a_tiny_epoch_evaluates_and_checkpoints_on_the_device(config, family, extra, device, tiny_pickscore, prompts,
                                                               pairs, tmp_path):
    out = tmp_path / "run"
    rows = run_ok(arguments(config, family, out, prompts, pairs, tiny_pickscore, extra), out)
    evaluated = "eval/jpeg_incompressibility/mean" if "dpo" in config.split("/")[-1].split("_")[0] else \
        "eval/pickscore/mean"
    assert np.isfinite(rows[0][evaluated])  # the evaluation before training, on device scores
    assert "hack/drift_pixel" in rows[0] and "hack/fm_to_base" in rows[-1]  # with the panel
    assert np.isfinite(rows[-1]["train/loss"]) and rows[-1]["train/grad_norm"] > 0
    assert (out / "checkpoints" / "epoch_0000001" / "state.pt").is_file()


@pytest.mark.parametrize("config,family", [("sd3/flow_grpo_pickscore", "sd3"), ("flux/nft_pickscore", "flux"),
                                           ("shapes/dgpo", "z_image")])
def test_a_resume_with_an_ema_trains_on_and_exports(config, family, device, tiny_pickscore, prompts, pairs, tmp_path):
    """The EMA of the weights (train.ema_decay) comes back from the checkpoint on the CPU; the resumed run's first
    optimizer step updates it against the device's weights. The LoRA export then reads the result."""
    from flowrl.commands.export import main as export

    out = tmp_path / "run"
    args = arguments(config, family, out, prompts, pairs, tiny_pickscore, {"train.ema_decay": 0.9})
    run_ok(args, out)
    rows = run_ok(args + ["run.max_epochs=2", "run.resume=true"], out)
    assert [r["epoch"] for r in rows if "train/loss" in r] == [1, 2]
    assert np.isfinite(rows[-1]["train/loss"])
    assert export([str(out), "--format", "peft", "--out", str(tmp_path / "peft"), "--device", "fakegpu"]) == 0
    assert (tmp_path / "peft" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("family", ["sd3", "flux", "z_image"])
def test_on_policy_distillation_scores_the_students_transitions_on_the_device(family, device, tiny_pickscore, prompts,
                                                                             pairs, tmp_path):
    """configs/shapes/opd.yaml with the model swapped: the teacher's denoiser, loaded on the CPU, is moved to the
    device and re-scores the student's transitions there (a teacher left on the CPU raises on the fake accelerator).
    The teacher is the student's own pipeline, whose LoRA starts at B = 0: the KL is exactly 0, and the policy loss
    (kept on) trains."""
    out = tmp_path / "run"
    extra = {"train.teacher.path": str(build_tiny(family)), "train.teacher.policy_loss": "true"}
    rows = run_ok(arguments("shapes/opd", family, out, prompts, pairs, tiny_pickscore, extra), out)
    trained = [r for r in rows if "train/distill_kl" in r]
    assert trained and trained[-1]["train/distill_kl"] == pytest.approx(0.0, abs=1e-12)
    assert trained[-1]["train/grad_norm"] > 0


@pytest.mark.parametrize("recipe", ["dmd2", "dmdr"])
@pytest.mark.parametrize("family", ["sd3", "flux", "z_image"])
def test_distillation_trains_the_student_and_the_fake_score_on_the_device(recipe, family, device, tiny_pickscore,
                                                                         prompts, pairs, tmp_path):
    """configs/shapes/dmd2.yaml and dmdr.yaml with the model swapped: the frozen teacher (the LoRA's disabled base),
    the fake score (a second LoRA) and the 2-step student all run on the device, and DMDR back-propagates the device
    PickScore into the student's decoded samples. One generator step and one fake-score step, each with a finite
    positive loss and gradient; the checkpoint holds the student and the fake score."""
    from flowrl.run.checkpoint_files import latest_checkpoint, load_state

    out = tmp_path / "run"
    extra = {"train.student_steps": 2, "sampling.eval_num_steps": 2, "train.minibatches": 1,
             "train.micro_batch_size": 4, "train.real_guidance": 4.0, "optim.lr": 1e-2,
             # FLUX: its embedded guidance for the student and the fake score; the teacher's is real_guidance
             "sampling.guidance": 3.5 if family == "flux" else 1.0, "eval.hacking.enabled": "false"}
    if recipe == "dmdr":
        extra.update({"train.reward_weight": 1.0, "train.reward_loss": "negative"})  # PickScore is no probability
    rows = run_ok(arguments(f"shapes/{recipe}", family, out, prompts, pairs, tiny_pickscore, extra), out)
    assert np.isfinite(rows[0]["eval/pickscore/mean"])  # the evaluation before training, at the student's 2 steps
    row = [r for r in rows if "train/dmd_loss" in r][-1]
    assert row["train/generator_steps"] == 1 and row["train/fake_steps"] == 1, row
    for key in ("train/dmd_loss", "train/grad_norm", "train/fake_loss", "train/fake_grad_norm"):
        assert np.isfinite(row[key]) and row[key] > 0, (key, row)
    if recipe == "dmdr":
        assert row["train/reward_steps"] == 1 and np.isfinite(row["train/reward_mean"]), row
    state = load_state(latest_checkpoint(out))
    assert state["model"] and set(state["model"]) == set(state["fake_score"])


@pytest.fixture(scope="module")
def edits(tmp_path_factory) -> Path:
    """Two editing prompts, each with a random 48 px source image (resized to the model's on loading)."""
    from flowrl.data.edit_prompts import write_edit_shards

    path = tmp_path_factory.mktemp("edits")
    rng = np.random.default_rng(0)
    write_edit_shards([(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8), text, None, None)
                       for text in ["make the apple blue", "add a cat"]], path)
    return path


@pytest.mark.parametrize("config,family", [("shapes/flow_grpo", "flux_kontext"), ("shapes/dgpo", "qwen_image_edit")])
def test_editing_models_train_on_the_device(config, family, device, tiny_pickscore, edits, pairs, tmp_path):
    """The source image travels with each prompt and is encoded on the device (Kontext's reference latents,
    Qwen-Image-Edit's vision tokens)."""
    out = tmp_path / "run"
    guidance = {"flux_kontext": 2.5, "qwen_image_edit": 4.0}[family]
    args = arguments(config, family, out, edits, pairs, tiny_pickscore,
                     {"sampling.guidance": guidance, "reward.train": "{jpeg_incompressibility: 1.0}",
                      "reward.eval": "[jpeg_incompressibility]"})
    rows = run_ok(args, out)
    assert np.isfinite(rows[-1]["train/loss"]) and rows[-1]["train/grad_norm"] > 0
