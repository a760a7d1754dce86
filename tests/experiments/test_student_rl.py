"""experiments/student_rl.py on constructed runs: the target is the teachers' mean final strict accuracy, a student
meets it only when an evaluation reaches it within half the teachers' minutes, and images per training minute come
from the config's groups x group size."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import yaml

from experiments.student_rl import main


def fake_run(directory: Path, points: list[tuple[float, int, float]], *, gz: bool = False) -> Path:
    """A run folder (or a record, gzip) whose evaluations are (minutes, epoch, strict); 4 groups of 8 per epoch."""
    directory.mkdir(parents=True)
    rows = []
    for minutes, epoch, strict in points:
        rows.append({"epoch": epoch, "time/train_min": minutes, "train/loss": 0.1})
        rows.append({"epoch": epoch, "time/train_min": minutes, "eval/shapes/accuracy": strict,
                     "eval/shapes/position": 0.25, "hack/hf_energy": 0.05})
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(directory / "metrics.jsonl.gz", "wt") as f:
            f.write(text)
    else:
        (directory / "metrics.jsonl").write_text(text)
    (directory / "config.yaml").write_text(yaml.safe_dump({"sampling": {"groups_per_epoch": 4, "group_size": 8}}))
    return directory


def test_the_target_the_half_budget_and_the_verdict(tmp_path):
    t0 = fake_run(tmp_path / "t0", [(0.0, 0, 0.5), (10.0, 20, 0.6), (30.0, 60, 0.70)], gz=True)
    t1 = fake_run(tmp_path / "t1", [(0.0, 0, 0.5), (30.0, 60, 0.74)])
    fast = fake_run(tmp_path / "fast", [(0.0, 0, 0.5), (5.0, 30, 0.65), (14.0, 80, 0.73)])
    slow = fake_run(tmp_path / "slow", [(0.0, 0, 0.5), (10.0, 60, 0.71), (20.0, 120, 0.75)])
    out = tmp_path / "results"
    assert main(["--teacher", f"t0={t0}", "--teacher", f"t1={t1}", "--student", f"fast={fast}",
                 "--student", f"slow={slow}", "--results", str(out)]) == 0
    result = json.loads((out / "student_rl.json").read_text())
    assert result["target"] == pytest.approx(0.72) and result["half_budget_minutes"] == pytest.approx(15.0)
    fast_r, slow_r = result["students"]
    assert fast_r["reaches_target_at"] == pytest.approx(14.0) and fast_r["meets"] is True
    assert slow_r["reaches_target_at"] == pytest.approx(20.0) and slow_r["meets"] is False  # late, though higher
    assert fast_r["images_per_minute"] == pytest.approx(32 * 80 / 14.0)
    assert result["teachers"][0]["images_per_minute"] == pytest.approx(32 * 60 / 30.0)
    kinds = fast_r["evals"][0]["per_kind"]
    assert kinds["position"] == 0.25 and kinds["counting"] is None  # a kind the run did not log is missing, not 0
    assert "| fast | 14.0 | 80 | 0.730 |" in (out / "student_rl.md").read_text()
    assert (out / "student_rl.png").is_file()


def test_a_folder_without_metrics_is_a_one_line_error(tmp_path):
    (tmp_path / "empty").mkdir()
    t = fake_run(tmp_path / "t", [(30.0, 60, 0.7)])
    with pytest.raises(SystemExit, match="holds no metrics.jsonl"):
        main(["--teacher", f"t={t}", "--student", f"s={tmp_path / 'empty'}", "--results", str(tmp_path / "r")])
