"""A finished benchmark run's record (metrics, config, done marker) is copied beside the results and brings the
run back on a machine that lost the run folder; an unfinished run leaves no record."""

import gzip
import json

import pytest

from experiments import runs


def _finished_run(out, rows):
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "config.yaml").write_text("run:\n  seed: 3\n")
    (out / runs.DONE).write_text(json.dumps({"command": ["train"], "returncode": 0}) + "\n")


def test_a_saved_record_restores_the_run_folder_and_is_reused(tmp_path, records_in_tmp):
    out = tmp_path / "trainers" / "nft_s0"
    rows = [{"epoch": 1, "train/loss": 0.5}, {"epoch": 2, "eval/shapes/accuracy": 0.71}]
    _finished_run(out, rows)
    dest = runs.save_record(out)
    assert dest == records_in_tmp / "trainers" / "nft_s0"
    with gzip.open(dest / "metrics.jsonl.gz", "rt") as f:
        assert [json.loads(line) for line in f] == rows
    # The machine goes away: the run folder is gone, the record is not.
    for p in out.iterdir():
        p.unlink()
    out.rmdir()
    result = runs.train_run(tmp_path / "unused.yaml", out, {}, reuse=True, label="t")
    assert result["status"] == "reused"
    assert runs.read_curve(out, "eval/shapes/accuracy")["accuracy"] == [0.71]
    assert (out / "config.yaml").read_text() == "run:\n  seed: 3\n"


def test_no_record_means_nothing_is_restored(tmp_path, records_in_tmp):
    out = tmp_path / "trainers" / "crd_s0"
    assert runs.restore_record(out) is False and not out.exists()
    # A record without its done marker (a copy cut short) is not a finished run either.
    (records_in_tmp / "trainers" / "crd_s0").mkdir(parents=True)
    (records_in_tmp / "trainers" / "crd_s0" / "config.yaml").write_text("x: 1\n")
    assert runs.restore_record(out) is False


def _record_made_with(out, command):
    _finished_run(out, [{"epoch": 1, "eval/shapes/accuracy": 0.7}])
    (out / runs.DONE).write_text(json.dumps({"command": command, "returncode": 0}) + "\n")
    runs.save_record(out)


def test_a_record_stands_only_for_a_run_of_the_same_settings(tmp_path, records_in_tmp):
    out = tmp_path / "trainers" / "dgpo_s0"
    config = tmp_path / "checkout" / "configs" / "shapes" / "dgpo.yaml"
    wanted = runs.run_command(config, out, {"run.max_minutes": 10.0}, ["sampling.precision=float32"])
    # The same run made in another checkout, interrupted once (resume flag): it stands for this one.
    elsewhere = [a.replace(str(tmp_path / "checkout"), "/other/machine/flowrl") for a in wanted[1:]]
    _record_made_with(out, [*elsewhere, "run.output_dir=/other/machine/out", "run.resume=true"])
    assert runs.settings_mismatch(out, wanted) is None
    # Made in bfloat16: it does not, and the reason names both settings.
    other = tmp_path / "trainers" / "nft_s0"
    _record_made_with(other, [a.replace("float32", "bfloat16") for a in wanted[1:]])
    why = runs.settings_mismatch(other, wanted)
    assert "sampling.precision=bfloat16" in why and "sampling.precision=float32" in why
    # No finished run: nothing to compare.
    assert runs.settings_mismatch(tmp_path / "trainers" / "none_s0", wanted) is None


def test_reuse_refuses_to_mix_settings_before_anything_trains(tmp_path, records_in_tmp):
    out = tmp_path / "trainers" / "awm_s0"
    config = tmp_path / "configs" / "shapes" / "awm.yaml"
    recorded = runs.run_command(config, out, {"run.max_minutes": 5.0}, [])
    _record_made_with(out, recorded[1:])
    job = {"config": config, "out": out, "overrides": {"run.max_minutes": 10.0}, "extra": [], "label": "awm",
           "reuse": True, "trainer": "awm", "seed": 0, "variant": ""}
    with pytest.raises(SystemExit, match=r"run.max_minutes=5.0.*run.max_minutes=10.0"):
        runs.launch([job], 1)
    # The same settings are reused, without training.
    job["overrides"] = {"run.max_minutes": 5.0}
    assert runs.launch([job], 1)[0]["status"] == "reused"


def test_a_run_before_its_first_evaluation_has_no_curve_even_with_the_base_point(tmp_path):
    """A run in progress that has not evaluated yet is left out of a table, not shown with the base's accuracy."""
    out = tmp_path / "trainers" / "crd_lr=3e-05_s0"
    out.mkdir(parents=True)
    base = {"eval/shapes/accuracy": 0.642}
    (out / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "train/loss": 0.5}) + "\n")
    assert runs.read_curve(out, "eval/shapes/accuracy", initial=base) is None
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"epoch": 2, "time/train_min": 5.0, "eval/shapes/accuracy": 0.7}) + "\n")
    curve = runs.read_curve(out, "eval/shapes/accuracy", initial=base)
    assert curve["accuracy"] == [0.642, 0.7] and curve["minutes"] == [0.0, 5.0]
