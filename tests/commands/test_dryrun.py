"""`flowrl train CONFIG --dry-run` passes for every shipped recipe config (configs/**/*.yaml, so configs added
later are covered without touching this file): one epoch of the config's own recipe on a tiny model of its
architecture, offline, with stand-ins only where weights or files are missing, and a report of what the real
run needs."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if p.parent.name not in ("accelerate", "base", "tasks"))


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def dry(path, tmp_path, *overrides):
    from flowrl.commands.dryrun import dry_run

    lines: list[str] = []
    result = dry_run(str(path), list(overrides), out=lines.append, workdir=tmp_path)
    return result, "\n".join(lines)


def test_the_configs_are_found():
    names = {p.relative_to(ROOT / "configs").as_posix() for p in CONFIGS}
    assert {"shapes/flow_grpo.yaml", "shapes/pretrain.yaml", "sd3/flow_grpo_pickscore.yaml",
            "flux/flow_grpo_pickscore.yaml"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.relative_to(ROOT / "configs").as_posix())
def test_every_shipped_config_passes_the_dry_run(path, tmp_path):
    result, report = dry(path, tmp_path)
    assert result["exit_code"] == 0, report
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rows and rows[-1]["epoch"] == 1, report  # one real epoch of the recipe ran and was logged
    assert "The real run needs:" in report
    assert "cannot read the architecture" not in report  # every shipped config's architecture is read (or skipped)
    from flowrl.models.footprint import KNOWN_MODELS
    from flowrl.commands.train import load_recipe_config

    recipe, cfg = load_recipe_config(str(path), [])
    model = getattr(cfg, "model", None)
    from flowrl.models.families import FAMILIES

    if getattr(model, "name", None) in FAMILIES:
        # No weights here: the report says so, with the download command, and sizes the real run.
        assert "model weights: MISSING" in report and "huggingface-cli download" in report
        import importlib

        own_epoch = hasattr(importlib.import_module(recipe.main.__module__), "dry_run_work")  # DMD2, reward gradient
        assert ("  - one epoch: " in report) if own_epoch else ("transformer rows in the rollout" in report)
        if FAMILIES[model.name].edits:  # an editing model's epoch needs editing prompts: stand-in shards here
            assert "stand-in editing prompts (random sources)" in report
        if model.path in KNOWN_MODELS:
            assert "memory per GPU, rough" in report and "total" in report
            if model.name == "qwen_image_edit":  # the source's tokens are counted
                assert "latent tokens beside the noisy latent's and its 196 vision tokens in the text" in report
        else:  # e.g. configs/sd3/tiny.yaml before `python -m flowrl.testing sd3 models/tiny_sd3`
            assert "memory: unknown architecture" in report


def test_the_family_table_marks_exactly_the_editing_adapters():
    """``Family.edits`` (which the dry run reads to give stand-in editing shards) agrees with each adapter's
    ``conditions_on_source``."""
    import importlib

    from flowrl.models.families import FAMILIES

    for name, row in FAMILIES.items():
        module, cls = row.adapter.split(":")
        assert getattr(importlib.import_module(module), cls).conditions_on_source == row.edits, name
    assert {n for n, f in FAMILIES.items() if f.edits} == {"flux_kontext", "qwen_image_edit"}


@pytest.mark.slow
def test_stand_ins_only_where_weights_are_missing(tmp_path):
    """OCR's weights ship with the ocr extra: it runs for real; pickscore's are not here: stand-in, said so."""
    result, report = dry(ROOT / "configs/sd3/flow_grpo_ocr.yaml", tmp_path / "ocr",
                         "reward.train={ocr: 1.0, pickscore: 0.5}", "reward.eval=[ocr, aesthetic]")
    assert result["exit_code"] == 0, report
    assert "reward ocr: loads and scores here" in report
    assert "reward.train.pickscore: replaced by the stand-in jpeg_incompressibility (weight 0.5)" in report
    assert "reward pickscore: NOT AVAILABLE here" in report
    assert "reward.eval: aesthetic replaced by the stand-in" in report
    assert not any(note.startswith(("reward.train.ocr", "reward.eval: ocr")) for note in result["notes"])
    row = read_metrics(tmp_path / "ocr" / "run" / "metrics.jsonl")[-1]
    assert "eval/ocr/mean" in row


def test_the_command_line_and_a_bad_config(tmp_path, capsys):
    from flowrl.commands.train import main

    code = main(["configs/shapes/flow_grpo.yaml", "--dry-run", "sampling.num_steps=4",
                 "sampling.window.max_start=null"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "one epoch of the flow_grpo recipe on a tiny model" in out and "model weights: found" in out
    assert "128 samples per epoch (16 prompts x 8), 4 denoising steps" in out
    assert main(["configs/shapes/flow_grpo.yaml", "--dry-run", "sampling.group_sise=4"]) == 2
    assert "config error: sampling.group_sise: unknown key" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- the memory estimate

GIB = 2 ** 30


def _model(**fields):
    from flowrl.models.config import LoraConfig, ModelConfig

    lora = fields.pop("lora", None)
    return ModelConfig(name="flux", path="black-forest-labs/FLUX.1-dev", dtype=fields.pop("dtype", "bfloat16"),
                       lora=LoraConfig(rank=lora) if lora else None, **fields)


def _footprint(trainable: int):
    from flowrl.models.footprint import Footprint

    # round numbers: 1e9 transformer, 0.1e9 + 4e9 text encoders, 0.1e9 VAE
    return Footprint("test", {"transformer": 10 ** 9, "vae": 10 ** 8, "text_encoder (CLIP-L)": 10 ** 8,
                              "text_encoder_2 (T5)": 4 * 10 ** 9}, trainable)


def test_memory_estimate_full_finetune_accounting():
    from flowrl.models.footprint import memory_estimate

    fp = _footprint(10 ** 9)
    est = memory_estimate(_model(), fp, micro_batch=1, guidance=False, ema=True, reference=True, snapshots=2,
                          rewards=3 * 10 ** 9)
    # float32 master weights (4 B) + the float32 VAE; the text encoders offloaded (model.offload_text_encoders)
    assert est["weights"] == pytest.approx((4e9 + 4e8) / GIB)
    assert est["training state"] == pytest.approx(12e9 / GIB)  # float32 gradients and AdamW's two moments
    assert est["reference copy"] == pytest.approx(2e9 / GIB)  # the denoiser in bfloat16
    assert est["EMA"] == pytest.approx(4e9 / GIB) and est["snapshots"] == pytest.approx(8e9 / GIB)
    assert est["rewards"] == pytest.approx(3e9 / GIB)
    # no activation estimate here: the lent text encoders (4.1e9 x 2 B) set the peak beside the resident parts
    assert est["text encoders lent to encode"] == pytest.approx(8.2e9 / GIB)
    assert est["total"] == pytest.approx((4.4e9 + 12e9 + 2e9 + 4e9 + 8e9 + 3e9 + 8.2e9) / GIB)
    lean = memory_estimate(_model(offload_text_encoders=False), fp, micro_batch=1, guidance=False, ema=False,
                           reference=False)
    assert not {"reference copy", "EMA", "snapshots", "rewards", "text encoders lent to encode"} & set(lean)
    assert lean["weights"] == pytest.approx((4e9 + 4e8 + 8.2e9) / GIB)  # the text encoders resident, in bf16
    assert lean["total"] == pytest.approx((12.6e9 + 12e9) / GIB)


def test_memory_estimate_lora_accounting():
    from flowrl.models.footprint import memory_estimate

    est = memory_estimate(_model(lora=8), _footprint(10 ** 7), micro_batch=1, guidance=False, ema=True,
                          reference=True, snapshots=1)
    assert est["weights"] == pytest.approx((2e9 + 4e8) / GIB)  # the base in bfloat16
    assert est["training state"] == pytest.approx(16e7 / GIB)  # float32 LoRA weights, gradients, two moments
    assert "reference copy" not in est  # adapters off: no copy whatever the run uses
    assert est["EMA"] == pytest.approx(4e7 / GIB) and est["snapshots"] == pytest.approx(4e7 / GIB)


def test_reward_memory_counts_each_built_copy_at_its_precision():
    from rewards.config import RewardConfig

    from flowrl.models.footprint import REWARD_PARAMS, reward_memory

    h, c = REWARD_PARAMS["pickscore"], REWARD_PARAMS["clip_score"]
    cfg = RewardConfig(train={"pickscore": 1.0, "clip_score": {"weight": 0.5, "kwargs": {"precision": "fp32"}},
                              "jpeg_incompressibility": 0.1},
                       eval=["pickscore", "jpeg_incompressibility"], heldout=["hpsv2"])
    assert reward_memory(cfg) == {"pickscore (train, bf16)": 2 * h, "clip_score (train, fp32)": 4 * c,
                                  "pickscore (eval, bf16)": 2 * h, "hpsv2 (held out, bf16)": 2 * h}
    on_cpu = RewardConfig(train={"pickscore": {"kwargs": {"device": "cpu"}}}, eval=[])
    assert reward_memory(on_cpu) == {}


def _sd3_memory(objective, *overrides):
    from flowrl.commands.dryrun import _memory
    from flowrl.models.footprint import footprint
    from flowrl.commands.train import load_recipe_config

    _, cfg = load_recipe_config(str(ROOT / "configs/sd3/flow_grpo_pickscore.yaml"), list(overrides))
    return cfg, footprint(cfg.model), _memory(cfg, objective)


def test_the_report_counts_the_reference_only_when_used():
    off = ("model.lora=null", "train.kl_coef=0", "eval.hacking.enabled=false", "eval.grid_size=0")
    cfg, fp, lines = _sd3_memory(False, *off)
    report = "\n".join(lines)
    assert "reference copy" not in lines[1] and "keeps no reference copy" in report
    assert "trains float32 master weights" in report
    assert "text encoders offloaded to the CPU" in report
    assert "pickscore (train, bf16) 1.9 GiB, pickscore (eval, bf16) 1.9 GiB" in report  # 986M x 2 B, each copy
    _, _, used = _sd3_memory(True, *off[:1], "train.kl_coef=0.01", *off[2:])
    from flowrl.models.footprint import format_gib

    copy = format_gib(fp.params["transformer"] * 2 / GIB)  # SD3.5-medium's transformer in bfloat16
    assert f"reference copy {copy}" in used[1] and "for: the objective" in "\n".join(used)
    _, _, evaluated = _sd3_memory(False, *off[:2])  # the hacking panel and grid (defaults) draw the base model
    assert f"reference copy {copy}" in evaluated[1] and "eval.hacking" in "\n".join(evaluated)
    _, _, lora = _sd3_memory(True)  # the shipped LoRA config: the reference is the adapters off
    assert "reference copy" not in "\n".join(lora)


def test_the_dry_run_reads_the_recipes_declaration(tmp_path):
    """Through the whole dry run: the recipe's ``ImageTraining(reference=...)`` of the tiny epoch sizes the real run."""
    result, report = dry(ROOT / "configs/sd3/flow_grpo_pickscore.yaml", tmp_path, "model.lora=null", "train.kl_coef=0",
                         "eval.hacking.enabled=false", "eval.grid_size=0")
    assert result["exit_code"] == 0, report
    (estimate,) = [line for line in report.splitlines() if "memory per GPU" in line]
    assert "reference copy" not in estimate and "full fine-tuning keeps no reference copy" in report
    assert "training state" in estimate and "rewards" in estimate and "text encoders lent to encode" in estimate


def test_one_epochs_work_is_described_for_what_the_recipe_does():
    """The report's "one epoch" lines: a forward-process trainer trains at its ``train.times`` (not the rollout's
    steps); DMD2 and the reward-gradient recipe describe their own epoch (``dry_run_work``); the evaluation's
    schedule is read as configured (minutes here)."""
    import importlib

    from flowrl.commands.dryrun import _epoch_work
    from flowrl.recipes import load_recipe_config

    def work(name: str, *overrides: str) -> list[str]:
        recipe, cfg = load_recipe_config(str(ROOT / "configs" / "shapes" / name), list(overrides))
        return _epoch_work(cfg, getattr(importlib.import_module(recipe.main.__module__), "dry_run_work", None))

    dgpo = work("dgpo.yaml")
    assert dgpo[1].startswith("training: 2 training times x 128 samples x 1 inner epoch(s) = 256 forward-backward")
    assert dgpo[-1] == "evaluation every 10 minutes: 600 prompts x 20 ODE steps"
    draft = work("draft.yaml", "train.k=3")
    assert "each a 10-step ODE chain (draft: the last 3 with gradients, the 7 before without)" in draft[0]
    assert draft[-1] == "evaluation every 10 minutes: 600 prompts x 20 ODE steps"
    dmd2 = work("dmd2.yaml", "eval.every_epochs=5")
    assert "in 8 step(s)" in dmd2[0] and "up to 3 student calls without gradients" in dmd2[0]
    assert dmd2[1].startswith("every 5th step is also a generator step")
    assert dmd2[-1] == "evaluation every 5 epochs and every 10 minutes: 600 prompts x 4 ODE steps"
