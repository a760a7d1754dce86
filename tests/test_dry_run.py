"""`flowrl train CONFIG --dry-run` passes for every shipped recipe config (configs/**/*.yaml, so configs added
later are covered without touching this file): one epoch of the config's own recipe on a tiny model of its
architecture, offline, with stand-ins only where weights or files are missing, and a report of what the real
run needs."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowrl.logging import read_metrics

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if p.parent.name not in ("accelerate", "base", "tasks"))


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def dry(path, tmp_path, *overrides):
    from flowrl.dryrun import dry_run

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
    from flowrl.train import load_recipe_config

    _, cfg = load_recipe_config(str(path), [])
    model = getattr(cfg, "model", None)
    from flowrl.models.families import FAMILIES

    if getattr(model, "name", None) in FAMILIES:
        # No weights here: the report says so, with the download command, and sizes the real run.
        assert "model weights: MISSING" in report and "huggingface-cli download" in report
        assert "transformer rows in the rollout" in report
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
    from flowrl.train import main

    code = main(["configs/shapes/flow_grpo.yaml", "--dry-run", "sampling.num_steps=4",
                 "sampling.window.max_start=null"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "one epoch of the flow_grpo recipe on a tiny model" in out and "model weights: found" in out
    assert "128 samples per epoch (16 prompts x 8), 4 denoising steps" in out
    assert main(["configs/shapes/flow_grpo.yaml", "--dry-run", "sampling.group_sise=4"]) == 2
    assert "config error: sampling.group_sise: unknown key" in capsys.readouterr().err
