"""A finished benchmark run's record (metrics, config, done marker) is copied beside the results and brings the
run back on a machine that lost the run folder; an unfinished run leaves no record."""

import gzip
import json

from benchmarks import runs


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
