"""The dry run's memory estimate for the distillation recipes (DMD2, DMDR; flowrl/commands/dryrun.py with the recipes'
``dry_run_memory``): the fake score's second float32 copy of the trained tensors with its gradients and AdamW moments
is counted for every shipped SD3 / FLUX / Z-Image config (and a full fine-tune's is a whole second denoiser), DMD2
counts no training reward (it builds none), DMDR does and says what it leaves out."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GIB = 2 ** 30

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _estimate(config: str, *overrides: str, hook: bool = True):
    """``(cfg, footprint, report lines, estimate line)`` of ``_memory`` for a shipped config."""
    from flowrl.commands.dryrun import _memory
    from flowrl.models.footprint import footprint
    from flowrl.recipes import load_recipe_config

    recipe, cfg = load_recipe_config(str(ROOT / "configs" / config), list(overrides))
    module = importlib.import_module(recipe.main.__module__)
    lines = _memory(cfg, True, module.dry_run_memory if hook else None)
    (estimate,) = [line for line in lines if line.startswith("memory per GPU")]
    return cfg, footprint(cfg.model), lines, estimate


def _parts(estimate: str) -> dict[str, float]:
    """``{"weights": 4.5, ...}`` from an estimate line (GiB, rounded up to 0.1)."""
    items = [item.rsplit(" ", 2) for item in estimate.split("): ", 1)[1].split(", ")]
    return {name: float(value) for name, value, _ in items}


def test_the_fake_score_adds_a_float32_trained_copy_with_its_optimizer_to_the_total():
    from flowrl.models.config import LoraConfig, ModelConfig
    from flowrl.models.footprint import Footprint, memory_estimate

    fp = Footprint("test", {"transformer": 10 ** 9, "vae": 10 ** 8, "text_encoder (T5)": 10 ** 9}, 10 ** 7)
    model = ModelConfig(name="flux", path="black-forest-labs/FLUX.1-dev", dtype="bfloat16", lora=LoraConfig(rank=8))
    without = memory_estimate(model, fp, micro_batch=1, guidance=False, ema=False)
    with_fake = memory_estimate(model, fp, micro_batch=1, guidance=False, ema=False, fake_score=True)
    assert "fake score" not in without
    assert with_fake["fake score"] == pytest.approx(16e7 / GIB)  # weights, gradients, two moments, all float32
    assert with_fake["fake score"] == pytest.approx(with_fake["training state"])  # as the LoRA student's own
    assert with_fake["total"] == pytest.approx(without["total"] + 16e7 / GIB)
    assert {k: v for k, v in with_fake.items() if k not in ("fake score", "total")} == {
        k: v for k, v in without.items() if k != "total"}


@pytest.mark.parametrize("family", ["sd3", "flux", "z_image"])
@pytest.mark.parametrize("recipe", ["dmd2", "dmdr"])
def test_the_shipped_distillation_configs_count_the_fake_score(family, recipe):
    from flowrl.models.footprint import REWARD_PARAMS, format_gib

    cfg, fp, lines, estimate = _estimate(f"{family}/{recipe}.yaml")
    _, _, _, before = _estimate(f"{family}/{recipe}.yaml", hook=False)  # what the report said without the hook
    fake = fp.trainable * 16 / GIB
    assert cfg.model.lora is not None and f"fake score {format_gib(fake)}" in estimate
    report = "\n".join(lines)
    assert f"the fake score, a second float32 copy of the {fp.trainable / 1e6:,.2f}M trained parameters" in report
    assert "fake score" not in before
    total, total_before = _parts(estimate)["total"], _parts(before)["total"]
    pickscore_train = 2 * REWARD_PARAMS["pickscore"] / GIB  # the PickScore training reward's copy in bf16
    if recipe == "dmd2":  # DMD2 builds no training reward: its PickScore copy is no longer counted
        assert "(train," not in report and "no training reward is built" in report
        assert total == pytest.approx(total_before + fake - pickscore_train, abs=0.25)
    else:
        assert "pickscore (train, bf16)" in report and "no training reward is built" not in report
        assert "not counted: the activations of the reward term's backward through the VAE decoder" in report
        assert total == pytest.approx(total_before + fake, abs=0.15)


def test_a_full_fine_tune_s_fake_score_is_a_whole_second_denoiser():
    from flowrl.models.footprint import format_gib

    cfg, fp, lines, estimate = _estimate("sd3/dmd2.yaml", "model.lora=null")
    assert fp.trainable == fp.params["transformer"]
    assert f"fake score {format_gib(fp.params['transformer'] * 16 / GIB)}" in estimate  # ~33 GiB for SD3.5-M
    assert "a full fine-tune's is a whole second denoiser" in "\n".join(lines)
    assert "reference copy" in estimate  # the frozen teacher beside it


@pytest.mark.slow
def test_the_dry_run_report_of_a_distillation_config_counts_the_fake_score(tmp_path):
    from flowrl.commands.dryrun import dry_run

    lines: list[str] = []
    result = dry_run(str(ROOT / "configs/shapes/dmd2.yaml"), [], out=lines.append, workdir=tmp_path)
    report = "\n".join(lines)
    assert result["exit_code"] == 0, report
    (estimate,) = [line for line in report.splitlines() if "memory per GPU" in line]
    assert "fake score" in estimate and "the fake score, a second float32 copy" in report


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_on_policy_distillation_counts_the_teachers_denoiser(family):
    """Flow-GRPO with ``train.teacher`` (flowrl/rl/teacher.py) holds a second frozen denoiser in ``model.dtype``."""
    from flowrl.models.footprint import format_gib

    config = f"{family}/flow_grpo_pickscore.yaml"
    _, fp, lines, estimate = _estimate(config, "train.teacher={path: /teacher}")
    _, _, _, plain = _estimate(config)
    denoiser = fp.params.get("transformer", 0) * 2 / GIB  # bfloat16
    assert denoiser > 1 and f"teacher {format_gib(denoiser)}" in estimate and "teacher" not in plain
    assert _parts(estimate)["total"] == pytest.approx(_parts(plain)["total"] + denoiser, abs=0.15)
    assert "the teacher of on-policy distillation, a second frozen denoiser in bfloat16" in "\n".join(lines)
