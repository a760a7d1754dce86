"""The benchmarks' clock calibration (experiments/calibrate.py): budgets in reference CPU-minutes."""

import gzip
import json

import pytest


def test_benchmark_runs_count_reference_cpu_minutes_unless_a_scale_is_set(monkeypatch):
    from experiments import calibrate, runs

    monkeypatch.delenv(calibrate.ENV, raising=False)
    assert runs.cpu_budget() == ("run.clock=reference", "run.threads=1")
    monkeypatch.setenv(calibrate.ENV, "0.8")  # plain CPU time, scaled by hand: no probes
    assert runs.cpu_budget() == ("run.clock=cpu", "run.clock_scale=0.8000", "run.threads=1")


def test_epoch_cpu_seconds_are_differences_of_training_minutes(tmp_path):
    from experiments.calibrate import epoch_cpu_seconds, read_jsonl

    rows = [{"epoch": 1, "time/epoch_s": 9.0, "time/train_min": 0.5},
            {"eval/shapes/accuracy": 0.6, "time/train_min": 0.5},  # an evaluation row: not an epoch
            {"epoch": 2, "time/epoch_s": 9.0, "time/train_min": 0.9},
            {"epoch": 3, "time/epoch_s": 9.0, "time/train_min": 1.2}]
    with gzip.open(tmp_path / "m.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert read_jsonl(tmp_path / "m.jsonl.gz") == read_jsonl(tmp_path / "m.jsonl") == rows
    assert epoch_cpu_seconds(rows) == pytest.approx({2: 24.0, 3: 18.0})


def test_speed_now_reports_the_probe_and_the_rate_at_its_median(monkeypatch):
    from experiments import calibrate
    from flowrl.run import calibration

    times = iter([0.5, 0.3, 0.4])
    monkeypatch.setattr(calibration, "probe_seconds", lambda: next(times))
    monkeypatch.setattr(calibration, "probe_precision", lambda: "bfloat16")
    monkeypatch.setattr(calibration, "PROBE_REFERENCE_SECONDS", 0.6)
    speed = calibrate.speed_now(probes=3)
    assert speed["probe_s"] == {"min": 0.3, "median": 0.4, "max": 0.5}
    assert speed["rate_at_median"] == pytest.approx(1.5)  # 0.6 / 0.4: this CPU 1.5x the reference's speed


def test_the_probe_times_float32_where_the_cpu_has_no_bfloat16_hardware(monkeypatch):
    """Without bf16 hardware the clock probes in float32 against the float32 constant (a bf16 probe would time the
    emulation, ~30x slower, and undervalue every float32 epoch); with it, the records' bf16 probe and constant."""
    from flowrl import hardware
    from flowrl.run import calibration

    monkeypatch.setattr(calibration, "PROBE_REFERENCE_SECONDS", 0.3)
    monkeypatch.setattr(calibration, "PROBE_REFERENCE_SECONDS_FLOAT32", 0.45)
    for native, precision, seconds in ((True, "bfloat16", 0.3), (False, "float32", 0.45)):
        monkeypatch.setattr(hardware, "native_bfloat16", lambda native=native: native)
        assert calibration.probe_precision() == precision and calibration.reference_seconds() == seconds
    probe = calibration.Probe(precision="float32")
    assert probe.precision == "float32" and probe() > 0


def test_the_reference_clock_probes_in_the_precision_the_run_computes_in(monkeypatch):
    """A float32 run on a CPU with bf16 hardware is valued by the float32 probe and its constant (the CPU's bf16
    speed against the reference machine's is not its float32 speed), a bf16 run by the bf16 ones; a run that names
    no precision gets the CPU's default."""
    from flowrl import hardware
    from flowrl.run import calibration
    from flowrl.run.runtime import make_deadline

    monkeypatch.setattr(calibration, "PROBE_REFERENCE_SECONDS", 0.3)
    monkeypatch.setattr(calibration, "PROBE_REFERENCE_SECONDS_FLOAT32", 0.45)
    monkeypatch.setattr(hardware, "native_bfloat16", lambda: True)
    timed = []
    monkeypatch.setattr(calibration, "probe_seconds", lambda precision=None: timed.append(precision) or 0.15)
    for precision, seconds in (("float32", 0.45), ("bfloat16", 0.3), (None, 0.3)):
        clock = make_deadline("reference", 10.0, precision=precision)
        assert clock.reference_seconds == seconds and clock.rate() == pytest.approx(seconds / 0.15)
        assert timed[-1] == calibration.probe_precision(precision)
        clock.close()
    assert timed == ["float32", "bfloat16", "bfloat16"]
