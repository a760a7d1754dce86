"""Benchmarks under test keep their run records (``experiments.runs.RECORDS``) in the test's folder, never in the
checkout's committed ``experiments/results/records``."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(autouse=True)
def records_in_tmp(tmp_path, monkeypatch):
    from experiments import runs

    monkeypatch.setattr(runs, "RECORDS", tmp_path / "records")
    return tmp_path / "records"


@pytest.fixture(autouse=True)
def clock_as_measured(monkeypatch):
    """Runs under test take their budgets as measured (no calibration workload: it costs seconds per process)."""
    monkeypatch.setenv("FLOWRL_BENCH_CLOCK_SCALE", "1")
