"""Smoke test of benchmarks/hacking.py on the tiny shapes model: the main job, the adversarial variant and CRD
trained and read back with the hacking panel at every evaluation, the table and the figure."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import hacking  # noqa: E402

TINY = ["--set", "sampling.num_steps=4", "--set", "sampling.group_size=2", "--set", "sampling.groups_per_epoch=2",
        "--set", "sampling.batch_size=4", "--set", "train.micro_batch_size=4", "--set", "eval.grid_size=0",
        "--set", "sampling.window.max_start=null", "--set", "eval.hacking.diversity_prompts=2",
        "--set", "eval.hacking.diversity_seeds=2", "--set", "eval.hacking.kl_prompts=2"]


@pytest.mark.slow
def test_hacking_benchmark_trains_the_variants_and_reports_the_panel(tiny_shapes_dir, tmp_path):
    result = hacking.main(["--model-path", str(tiny_shapes_dir), "--minutes", "5", "--max-epochs", "2",
                           "--eval-every-minutes", "100", "--seeds", "0", "--num-eval-prompts", "2", "--eval-steps",
                           "2", "--adv-warmup", "1", "--variants", "main", "adversarial", "crd", "--out",
                           str(tmp_path / "runs"), "--results", str(tmp_path / "results"), *TINY])
    summary = result["summary"]
    assert list(summary) == ["main", "adversarial", "crd"]
    for row in summary.values():
        assert row["epochs"] == 2
        # The evaluation before training is the base model itself: no drift; after two epochs, a value.
        assert row["hack/drift_pixel"]["start"][0] == 0
        assert row["hack/bg_shift"]["end"][0] is not None and row["hack/extra_object_rate"]["end"][0] is not None
    adversarial = (tmp_path / "runs" / "adversarial_s0" / "config.yaml").read_text()
    assert "adversarial" in adversarial and "warmup_epochs: 1" in adversarial
    rows = [json.loads(line) for line in (tmp_path / "runs" / "adversarial_s0" / "metrics.jsonl").open()]
    assert [r["adv/d_epoch"] for r in rows if "adv/d_epoch" in r] == [1.0, 0.0]  # warm-up, then alternating
    table = (tmp_path / "results" / "hacking.md").read_text()
    assert "| main |" in table and "| adversarial |" in table and "| crd |" in table and "extra_object_rate" in table
    assert (tmp_path / "results" / "hacking.png").stat().st_size > 10_000
