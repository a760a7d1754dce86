"""Smoke test of experiments/credit.py on the tiny shapes model: it trains each method, reads the runs back and
writes the figure and table with one row per method."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments import credit  # noqa: E402


@pytest.mark.slow
def test_credit_benchmark_trains_analyses_and_plots(tiny_shapes_dir, tmp_path):
    result = credit.main([
        "--model-path", str(tiny_shapes_dir), "--minutes", "5", "--max-epochs", "2", "--eval-every-minutes", "100",
        "--seeds", "0", "--methods", "outcome", "shuffled", "--num-eval-prompts", "2",
        "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "results"),
        "--set", "sampling.num_steps=3", "--set", "sampling.window.max_start=null",
        "--set", "sampling.eval_num_steps=2",
        "--set", "sampling.group_size=2", "--set", "sampling.groups_per_epoch=2", "--set", "sampling.batch_size=4",
        "--set", "train.micro_batch_size=4", "--set", "eval.grid_size=0",
    ])
    assert [r["status"] for r in result["launched"]] == ["ok", "ok"]
    # The control run really shuffled: its saved config says so, the outcome run's does not.
    assert "shuffle: true" in (tmp_path / "runs" / "shuffled_s0" / "config.yaml").read_text()
    assert "shuffle: false" in (tmp_path / "runs" / "outcome_s0" / "config.yaml").read_text()
    summary = result["summary"]["methods"]
    assert set(summary) == {"outcome", "shuffled"}
    for entry in summary.values():
        assert entry["epochs"] == 2 and entry["final_images"] == 2 * 2 * 2  # 2 epochs of 2 groups of 2
        assert 0.0 <= entry["acc_initial"] <= 1.0
    saved = json.loads((tmp_path / "results" / "credit.json").read_text())
    assert saved["settings"]["methods"] == ["outcome", "shuffled"]
    table = (tmp_path / "results" / "credit.md").read_text()
    assert "| outcome |" in table and "| shuffled |" in table
    assert (tmp_path / "results" / "credit.png").stat().st_size > 10_000
