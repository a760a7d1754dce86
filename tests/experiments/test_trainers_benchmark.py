"""Smoke test of experiments/trainers.py on the tiny shapes model: pairs for Diffusion-DPO, a base evaluation
shared by every curve, two trainers trained and read back, the figure and the table with a row per trainer;
and the sweep's variants with their override in each run's config."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments import trainers  # noqa: E402

TINY = ["--set", "sampling.num_steps=4", "--set", "sampling.group_size=2", "--set", "sampling.groups_per_epoch=2",
        "--set", "sampling.batch_size=4", "--set", "train.micro_batch_size=4", "--set", "eval.grid_size=0",
        "--set", "sampling.window.max_start=null"]


@pytest.mark.slow
def test_trainers_benchmark_trains_analyses_and_plots(tiny_shapes_dir, tmp_path):
    pairs = tmp_path / "pairs"
    info = trainers.main(["--make-pairs", "--model-path", str(tiny_shapes_dir), "--pairs", str(pairs),
                          "--pair-prompts", "2"])
    assert info["images_sampled"] == 2 * 16 and (pairs / "info.json").is_file()
    common = ["--model-path", str(tiny_shapes_dir), "--minutes", "5", "--max-epochs", "2", "--eval-every-minutes",
              "100", "--seeds", "0", "--num-eval-prompts", "2", "--eval-steps", "2", "--out", str(tmp_path / "runs"),
              "--results", str(tmp_path / "results"), "--pairs", str(pairs), *TINY]
    # The random tiny model draws nothing correct: no pairs, so Diffusion-DPO is not run here.
    result = trainers.main([*common, "--trainers", "flow_grpo", "nft"])
    assert [r["status"] for r in result["launched"]] == ["ok", "ok"]
    assert "count_mode: strict" in (tmp_path / "runs" / "flow_grpo_s0" / "config.yaml").read_text()
    summary = result["summary"]["trainers"]
    assert set(summary) == {"flow_grpo", "nft"}
    for entry in summary.values():
        assert entry["epochs"] == 2 and entry["final_images"] == 2 * 2 * 2  # 2 epochs of 2 groups of 2
        assert entry["unfinished"] == 0  # stopped by --max-epochs before the minutes: finished all the same
    # Every curve starts at the one base evaluation.
    assert all(run["images"][0] == 0 and run["accuracy"][0] == result["base"]["eval/shapes/accuracy"]
               for run in result["runs"].values())
    table = (tmp_path / "results" / "trainers.md").read_text()
    assert "| flow_grpo |" in table and "| nft |" in table and "| base model |" in table
    assert (tmp_path / "results" / "trainers.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "results" / "trainers.json").read_text())["settings"]["trainers"] == ["flow_grpo",
                                                                                                         "nft"]
    sweep = trainers.main([*common, "--trainers", "nft", "--sweep"])
    assert sorted(sweep["runs"]) == sorted(["nft "] + [f"nft {k.split('.')[-1]}={v:g}"
                                                       for k, vs in trainers.SWEEP["nft"].items() for v in vs])
    assert "beta: 0.1" in (tmp_path / "runs" / "nft_beta=0.1_s0" / "config.yaml").read_text()
    assert "| nft | beta=0.1 |" in (tmp_path / "results" / "trainers_sweep.md").read_text()
    # The sweep's best setting runs again under its own name, with its override.
    best = trainers.main([*common, "--from-sweep", "--best", "1", "--tag", "again"])
    (winner,) = best["summary"]["trainers"]
    setting = best["summary"]["trainers"][winner]["setting"]
    assert winner == "nft" and [r["status"] for r in best["launched"]] == ["ok"]
    assert (tmp_path / "runs" / trainers.run_dir(Path("."), "nft", 0, setting, "again")).is_dir()


def test_the_sweep_picks_each_trainers_best_setting_then_the_best_trainers():
    base = {f"eval/shapes/{k}": 0.5 for k in trainers.KINDS}

    def run(trainer, variant, accuracy, override, below=()):
        end = {**base, **{f"eval/shapes/{k}": 0.4 for k in below}}
        return {"trainer": trainer, "variant": variant, "overrides": [override] if override else [],
                "accuracy": [0.64, accuracy], "evals": [base, end]}

    sweep = {"runs": {"dgpo ": run("dgpo", "", 0.715, None), "dgpo beta=10": run("dgpo", "beta=10", 0.752,
                                                                                 "train.beta=10.0"),
                      "nft ": run("nft", "", 0.645, None), "nft lr=3e-05": run("nft", "lr=3e-05", 0.70,
                                                                                 "optim.lr=3e-05"),
                      "awm ": run("awm", "", 0.703, None), "d3po ": run("d3po", "", 0.475, None)}}
    winners = trainers.sweep_winners(sweep, 3)
    assert [(w["trainer"], w["variant"], w["overrides"]) for w in winners] == [
        ("dgpo", "beta=10", ["train.beta=10.0"]), ("awm", "", []), ("nft", "lr=3e-05", ["optim.lr=3e-05"])]
    assert winners[0]["accuracy"] == 0.752 and winners[0]["kinds_below_base"] == []

    # A setting that loses a kind to the base gives way to its trainer's best clean one, and a trainer with no
    # clean setting ranks after every trainer that has one, whatever its accuracy.
    sweep["runs"]["dgpo beta=10"] = run("dgpo", "beta=10", 0.752, "train.beta=10.0", below=["counting"])
    sweep["runs"]["awm "] = run("awm", "", 0.80, None, below=["position", "colors"])
    winners = trainers.sweep_winners(sweep, 4)
    assert [(w["trainer"], w["variant"]) for w in winners] == [
        ("dgpo", ""), ("nft", "lr=3e-05"), ("d3po", ""), ("awm", "")]
    assert winners[-1]["kinds_below_base"] == ["colors", "position"]

    # The sweep's report leads with the same ranking, then every run.
    runs = {(r["trainer"], r["variant"]): {**r, "final_minutes": 10.0, "epochs": 20, "final_images": 2560}
            for r in sweep["runs"].values()}
    ranked, every = trainers.sweep_markdown(runs, base).split("| trainer | setting |")
    first = [line.split(" | ")[1:3] for line in ranked.splitlines() if line.startswith("| 1 |")]
    assert first == [["dgpo", "shipped config"]]
    assert "| 4 | awm | shipped config | 0.800 | 0.50 | 0.50 | 0.50 | 0.40* | 0.40* | 0.50 |" in ranked
    assert every.count("\n| ") == 6  # a row per run


def test_the_comparison_table_reports_the_hacking_panel_and_marks_kinds_below_the_base():
    base = {"eval/shapes/accuracy": 0.51, "hack/extra_object_rate": 0.18, "eval/shapes/lenient_accuracy": 0.64,
            **{f"eval/shapes/{k}": 0.5 for k in trainers.KINDS}}

    def run(accuracy, extra, lenient, counting):
        end = {**base, "eval/shapes/accuracy": accuracy, "hack/extra_object_rate": extra,
               "eval/shapes/lenient_accuracy": lenient, "eval/shapes/counting": counting}
        return {"minutes": [0.0, 10.0, 30.0], "images": [0, 1000, 3000], "accuracy": [0.64, 0.70, accuracy],
                "evals": [base, end, end], "final_images": 3000, "final_minutes": 30.0, "epochs": 60,
                "epoch_s": 45.0, "sampling_s": 20.0, "training_s": 10.0}

    runs = {("nft", 0): run(0.80, 0.70, 0.20, 0.40), ("nft", 1): run(0.76, 0.50, 0.30, 0.40)}
    summary = trainers.summarise(runs, ["nft"], None)
    entry = summary["trainers"]["nft"]
    assert entry["acc_at_30min"] == pytest.approx(0.78) and entry["acc_at_30min_std"] == pytest.approx(0.02)
    assert entry["extra_objects"] == pytest.approx(0.60) and entry["extra_objects_std"] == pytest.approx(0.10)
    assert entry["lenient_accuracy"] == pytest.approx(0.25) and entry["images_per_min"] == pytest.approx(100.0)
    table = trainers.markdown(summary, base)
    row = next(line for line in table.splitlines() if line.startswith("| nft |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    assert cells[header.index("counting")] == "0.40*" and cells[header.index("colors")] == "0.50"
    assert cells[header.index("extra objects")] == "0.600 ± 0.100"
    assert cells[header.index("lenient acc.")] == "0.250 ± 0.050"
    assert cells[header.index("s / epoch")] == "30.0" and cells[header.index("images / min")] == "100"
    base_row = next(line for line in table.splitlines() if line.startswith("| base model |"))
    assert [c.strip() for c in base_row.strip("|").split("|")][header.index("extra objects")] == "0.180"

    # An interim table: seed 1 has reached 10 minutes only; its 30-minute cell says one seed gave it.
    runs[("nft", 1)].update(minutes=[0.0, 10.0], images=[0, 1000], accuracy=[0.64, 0.72], final_minutes=10.0,
                            finished=False)
    interim = trainers.summarise(runs, ["nft"], None)["trainers"]["nft"]
    assert interim["unfinished"] == 1 and interim["acc_at_30min_n"] == 1 and interim["acc_at_10min_n"] == 2
    row = next(line for line in trainers.markdown({**summary, "trainers": {"nft": interim}}, base).splitlines()
               if line.startswith("| nft"))
    assert row.startswith("| nft, 1 of 2 runs unfinished |") and "| 0.800 ± 0.000 (1 of 2) |" in row
