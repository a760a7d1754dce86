"""experiments/vlm_compare.py: each method's overrides load as its recipe's config on the named split (and from
another checkpoint), and the analysis of constructed runs gives the table's numbers and RL's margin over SFT."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments import vlm_compare  # noqa: E402


@pytest.mark.parametrize("method", list(vlm_compare.TASKS["vqa"]["methods"]))
def test_each_methods_overrides_load_on_the_named_split(method, tmp_path):
    from flowrl.commands.train import load_recipe_config

    args = vlm_compare.parse_args(["--init", str(tmp_path / "plateau"), "--heldout", "red circle, square above "
                                                                                    "triangle"])
    job = next(j for j in vlm_compare.jobs_for(args) if j["method"] == method)
    _, cfg = load_recipe_config(str(job["config"]), [f"{k}={v}" for k, v in job["overrides"].items()] + job["extra"])
    assert cfg.run.max_minutes == 30.0 and cfg.run.seed == 0
    if method == "sft":
        assert cfg.data.heldout_combinations == ["red circle", "square above triangle"]
        assert cfg.init_from == str(tmp_path / "plateau") and cfg.run.max_epochs == 12  # the config's own bound
    else:
        assert cfg.env.heldout_combinations == ["red circle", "square above triangle"]
        assert cfg.model.path == str(tmp_path / "plateau") and cfg.run.max_epochs == 100_000
    assert job["out"].name == f"{method}_s0"


def _write_run(folder: Path, in_dist: list[float], heldout: list[float]) -> None:
    """A run's metrics.jsonl: an evaluation every 5 minutes with both splits (one kind each), training rows between."""
    folder.mkdir(parents=True)
    rows = []
    for i, (a, b) in enumerate(zip(in_dist, heldout)):
        rows.append({"epoch": 2 * i, "time/train_min": 5.0 * i, "eval/vqa/accuracy": a, "eval/vqa/count": a - 0.1,
                     "eval/vqa/top_answer_share/count": 0.3, "eval/vqa_heldout/accuracy": b,
                     "eval/vqa_heldout/count": b})
        rows.append({"epoch": 2 * i + 1, "train/reward_mean": 0.5, "train/loss": 0.1})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_analysis_reports_start_end_per_kind_and_the_margin_over_sft(tmp_path):
    out = tmp_path / "runs"
    _write_run(out / "sft_s0", [0.70, 0.74, 0.76], [0.50, 0.50, 0.52])
    _write_run(out / "sft_s1", [0.70, 0.73, 0.74], [0.50, 0.51, 0.50])
    _write_run(out / "grpo_s0", [0.70, 0.72, 0.73], [0.50, 0.56, 0.60])
    _write_run(out / "grpo_s1", [0.70, 0.71, 0.71], [0.50, 0.55, 0.58])
    _write_run(out / "grpo_plateau_s0", [0.9, 0.9], [0.1, 0.1])  # another comparison's run: not mixed in
    result = vlm_compare.main(["--analyse-only", "--out", str(out), "--results", str(tmp_path / "results")])
    assert sorted(result["runs"]) == ["grpo_s0", "grpo_s1", "sft_s0", "sft_s1"]
    grpo, sft = result["summary"]["grpo"], result["summary"]["sft"]
    held = "held-out combinations"
    assert grpo[held]["end"] == pytest.approx((0.59, 0.01)) and sft[held]["end"] == pytest.approx((0.51, 0.01))
    assert grpo[held]["margin_over_sft"] == pytest.approx(0.08)
    assert grpo["in distribution"]["margin_over_sft"] == pytest.approx(0.72 - 0.75)
    assert grpo["in distribution"]["kinds_end"] == {"count": pytest.approx((0.62, 0.01))}  # no top_answer_share
    assert "rft" not in result["summary"]
    table = (tmp_path / "results" / "vlm_compare.md").read_text()
    assert "| grpo | 2 | 0.500 | 0.590 ± 0.010 | +0.080 | 0.59 |" in table
    assert (tmp_path / "results" / "vlm_compare.png").stat().st_size > 10_000


@pytest.mark.parametrize("method", list(vlm_compare.TASKS["zoom"]["methods"]))
def test_the_zoom_comparison_runs_sft_on_demonstrations_and_gigpo_at_the_same_budget(method, tmp_path):
    from flowrl.commands.train import load_recipe_config

    args = vlm_compare.parse_args(["--task", "zoom", "--seeds", "1"])
    job = next(j for j in vlm_compare.jobs_for(args) if j["method"] == method)
    _, cfg = load_recipe_config(str(job["config"]), [f"{k}={v}" for k, v in job["overrides"].items()] + job["extra"])
    assert job["out"].name == f"zoom_{method}_s1" and cfg.run.max_minutes == 30.0
    if method == "sft":
        assert cfg.data.zoom_fraction == 0.5 and cfg.run.max_epochs == 12 and cfg.eval.num_zoom_examples == 200
    else:
        assert cfg.env.name == "shapes_zoom" and cfg.advantage.estimator == "gigpo" and cfg.eval.num_examples == 200
    with pytest.raises(SystemExit):
        vlm_compare.parse_args(["--task", "zoom", "--methods", "grpo"])  # not one of the zoom comparison's


def test_the_zoom_analysis_reads_the_zoom_evaluations(tmp_path):
    out = tmp_path / "runs"
    for name, values in (("zoom_sft_s0", [0.5, 0.6]), ("zoom_gigpo_s0", [0.5, 0.7]), ("sft_s0", [0.9, 0.9])):
        (out / name).mkdir(parents=True)
        rows = [{"epoch": i, "time/train_min": 10.0 * i, "eval/zoom/accuracy": v, "eval/vqa/accuracy": 0.9,
                 "eval/vqa_heldout/accuracy": 0.9} for i, v in enumerate(values)]
        (out / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = vlm_compare.main(["--task", "zoom", "--analyse-only", "--out", str(out), "--results",
                               str(tmp_path / "results")])
    assert sorted(result["runs"]) == ["zoom_gigpo_s0", "zoom_sft_s0"]
    assert result["summary"]["gigpo"]["zoom tasks"]["margin_over_sft"] == pytest.approx(0.1)
    assert (tmp_path / "results" / "vlm_compare_zoom.md").is_file()
