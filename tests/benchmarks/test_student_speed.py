"""benchmarks/student_speed.py on a handful of prompts: every sampler row is written with its model calls and strict
accuracy per kind, and a "student" that is the shipped model itself at 4 steps draws exactly what the teacher's
4-step row drew (same prompts and seeds: the same images, so the same accuracy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.slow
def test_the_benchmark_writes_every_sampler_and_a_student_row(tmp_path):
    from benchmarks.student_speed import main

    shipped = ROOT / "flowrl" / "models" / "shapes_checkpoint"
    result = main(["--prompts", "12", "--timed", "4", "--repeats", "1", "--student", f"same={shipped}:4",
                   "--results", str(tmp_path)])
    rows = result["rows"]
    assert list(rows) == ["teacher, 20 steps", "teacher, 20 steps, guidance 2", "teacher, 10 steps",
                          "teacher, 4 steps", "same, 4 steps"]
    assert [r["model_calls_per_image"] for r in rows.values()] == [20, 40, 10, 4, 4]
    assert rows["same, 4 steps"]["strict"] == rows["teacher, 4 steps"]["strict"]
    assert rows["same, 4 steps"]["per_kind"] == rows["teacher, 4 steps"]["per_kind"]
    assert all(r["cpu_s_per_image"] > 0 and 0 <= r["strict"] <= 1 for r in rows.values())
    assert len(rows["teacher, 20 steps"]["per_kind"]) == 6  # 12 prompts: two of each kind
    assert json.loads((tmp_path / "student_speed.json").read_text())["rows"] == rows
    assert "| same, 4 steps | 4 |" in (tmp_path / "student_speed.md").read_text()
