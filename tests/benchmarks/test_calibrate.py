"""The benchmarks' clock calibration (benchmarks/calibrate.py): budgets in reference CPU-minutes."""

import gzip
import json

import pytest


def test_the_scale_comes_from_the_environment_when_set(monkeypatch):
    from benchmarks import calibrate, runs

    monkeypatch.setenv(calibrate.ENV, "0.8")
    assert calibrate.clock_scale() == 0.8
    assert "run.clock_scale=0.8000" in runs.cpu_budget() and "run.clock=cpu" in runs.cpu_budget()


def test_the_scale_is_the_reference_time_over_this_machines(monkeypatch):
    from benchmarks import calibrate

    monkeypatch.delenv(calibrate.ENV, raising=False)
    monkeypatch.setattr(calibrate, "_cached", None)
    monkeypatch.setattr(calibrate, "workload_seconds", lambda: 2.0)
    monkeypatch.setattr(calibrate, "REFERENCE_SECONDS", 1.5)
    assert calibrate.clock_scale() == pytest.approx(0.75)  # a slower CPU counts each of its seconds as 0.75


def test_epoch_cpu_seconds_are_differences_of_training_minutes(tmp_path):
    from benchmarks.calibrate import epoch_cpu_seconds, read_jsonl

    rows = [{"epoch": 1, "time/epoch_s": 9.0, "time/train_min": 0.5},
            {"eval/shapes/accuracy": 0.6, "time/train_min": 0.5},  # an evaluation row: not an epoch
            {"epoch": 2, "time/epoch_s": 9.0, "time/train_min": 0.9},
            {"epoch": 3, "time/epoch_s": 9.0, "time/train_min": 1.2}]
    with gzip.open(tmp_path / "m.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert read_jsonl(tmp_path / "m.jsonl.gz") == read_jsonl(tmp_path / "m.jsonl") == rows
    assert epoch_cpu_seconds(rows) == pytest.approx({2: 24.0, 3: 18.0})


def test_the_workload_runs_and_costs_cpu_time():
    from benchmarks.calibrate import workload_seconds

    assert 0.05 < workload_seconds(repeats=1, batch=4) < 60
