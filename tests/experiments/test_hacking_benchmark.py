"""experiments/hacking.py and its analysis (experiments/hacking_report.py): the issue's rule on constructed
summaries, the phases' choice of variants, the variants' overrides, and a smoke test that trains the variants on
the tiny shapes model and writes every output."""

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments import hacking, hacking_report  # noqa: E402
from flowrl.run.metrics import read_metrics  # noqa: E402

TINY = ["--set", "sampling.num_steps=4", "--set", "sampling.group_size=2", "--set", "sampling.groups_per_epoch=2",
        "--set", "sampling.batch_size=4", "--set", "train.micro_batch_size=4", "--set", "eval.grid_size=0",
        "--set", "sampling.window.max_start=null", "--set", "eval.hacking.diversity_prompts=2",
        "--set", "eval.hacking.diversity_seeds=2", "--set", "eval.hacking.kl_prompts=2"]


def row(lenient, strict, extra, kinds=None, seeds=1):
    """A summary row whose start is the base (lenient 0.6, strict 0.5, extra 0.16, every kind 0.5)."""
    out = {"seeds": seeds, "epochs": 10, "minutes": 10.0,
           hacking_report.LENIENT: {"start": (0.6, 0), "end": (lenient, 0)},
           hacking_report.STRICT: {"start": (0.5, 0), "end": (strict, 0)},
           hacking_report.EXTRA: {"start": (0.16, 0), "end": (extra, 0)}}
    for kind in hacking_report.KINDS:
        out[f"eval/shapes/{kind}"] = {"start": (0.5, 0), "end": ((kinds or {}).get(kind, 0.6), 0)}
    return out


def test_the_rule_recommends_the_best_passing_variant_and_names_the_failures():
    summary = {"none": row(0.72, 0.13, 0.81),
               "artifact_0.5": row(0.67, 0.51, 0.20, {"position": 0.45}),  # lenient 5 points down, a kind down
               "kl_high": row(0.71, 0.52, 0.20),  # passes
               "crd_anchor": row(0.715, 0.55, 0.21),  # passes, higher lenient
               "adversarial": row(0.73, 0.49, 0.18)}  # strict below base
    base = hacking_report.base_values(summary)
    assert base[hacking_report.STRICT] == 0.5 and base[hacking_report.EXTRA] == 0.16
    checks = hacking_report.criteria(summary, base)
    assert checks["kl_high"]["all"] and checks["crd_anchor"]["all"]
    assert checks["artifact_0.5"] == {"strict": True, "extra": True, "lenient": False, "kinds": False, "all": False,
                                      "low_kinds": ["position"]}
    assert checks["adversarial"]["strict"] is False and checks["none"]["strict"] is False
    assert checks["crd_anchor"]["extra"] and not hacking_report.criteria(
        {**summary, "crd_anchor": row(0.715, 0.55, 0.2101)}, base)["crd_anchor"]["extra"]  # 0.05 above base
    assert hacking_report.recommend(summary, checks) == "crd_anchor"
    assert hacking_report.ranking(summary, base)[:2] == ["crd_anchor", "kl_high"]
    # Nearest to the rule first: artifact_0.5 is 0.03 short on lenient (0.67 against 0.72 - 0.02) and 0.05 on
    # position, 0.08 in all; kl_low meets as many criteria (lenient, kinds) with a higher lenient accuracy but is
    # 0.20 short on strict and 0.24 over on extra objects.
    with_kl_low = {**summary, "kl_low": row(0.73, 0.30, 0.45)}
    gap = hacking_report.shortfall(with_kl_low, base)
    assert gap["kl_high"] == 0 and gap["adversarial"] == pytest.approx(0.01)
    assert gap["artifact_0.5"] == pytest.approx(0.08) and gap["kl_low"] == pytest.approx(0.44)
    assert hacking_report.ranking(with_kl_low, base) == ["crd_anchor", "kl_high", "adversarial", "artifact_0.5",
                                                         "kl_low"]
    # Pareto front on (lenient, strict, -extra): kl_high is beaten by crd_anchor on lenient and strict but
    # not on extra, so both stay; kl_high beats artifact_0.5 on all three, adversarial beats none.
    assert hacking_report.pareto_front(summary) == ["kl_high", "crd_anchor", "adversarial"]
    table = hacking_report.markdown(summary, base, checks)
    assert "| crd_anchor |" in table and "fails: lenient, kinds" in table and "0.450*" in table


def test_phases_pick_their_variants_budgets_and_seeds(tmp_path):
    screen = hacking.parse_args(["--phase", "screen", "--results", str(tmp_path)])
    assert screen.minutes == 10 and screen.seeds == [0]
    assert screen.variants == ["none", "artifact_0.25", "artifact_0.5", "artifact_1", "adversarial",
                               "adversarial_clipped", "kl_low", "kl_high", "crd_anchor", "elastic_reset", "base_tail"]
    with pytest.raises(SystemExit, match="run --phase screen first"):
        hacking.parse_args(["--phase", "final", "--results", str(tmp_path)])
    (tmp_path / "hacking_screen.json").write_text(json.dumps({"ranking": ["kl_high", "base_tail", "crd_anchor",
                                                                          "adversarial"]}))
    final = hacking.parse_args(["--phase", "final", "--results", str(tmp_path)])
    assert final.minutes == 30 and final.seeds == [0, 1]
    assert final.variants == ["none", "kl_high", "base_tail", "crd_anchor"]
    named = hacking.parse_args(["--phase", "final", "--best", "elastic_reset", "kl_low", "--results", str(tmp_path)])
    assert named.variants == ["none", "elastic_reset", "kl_low"] and named.out.endswith("hacking_final")
    with pytest.raises(SystemExit):
        hacking.parse_args(["--variants", "no_such_variant"])
    # The base is evaluated once per seed; the runs start training at once.
    (base,) = hacking.base_jobs(screen)
    assert base["out"].name == "base_s0" and base["overrides"]["run.max_epochs"] == 0
    assert base["overrides"]["eval.at_start"] == "true" and base["overrides"]["run.seed"] == 0
    assert {job["overrides"]["eval.at_start"] for job in hacking.jobs_for(screen)} == {"false"}
    assert [job["out"].name for job in hacking.base_jobs(final)] == ["base_s0", "base_s1"]


def test_each_variant_sets_its_regulariser():
    args = hacking.parse_args([])
    over = {v: " ".join(hacking.variant_overrides(args, v)) for v in args.variants}
    assert over["none"] == ""
    assert "artifact: {weight: 0.25" in over["artifact_0.25"]
    assert "d_steps: 16, lr: 0.001" in over["adversarial"] and "clip_margin" not in over["adversarial"]
    assert "clip_margin: 0" in over["adversarial_clipped"]
    assert "train.kl_coef=0.01" in over["kl_low"] and "train.kl_coef=0.04" in over["kl_high"]
    assert "train.kl_reward_adaptive=true" in over["crd_anchor"] and "train.kl_floor=4e-05" in over["crd_anchor"]
    assert over["elastic_reset"] == "train.elastic_reset={every_epochs: 10, decay_per_epoch: 0.9}"
    assert over["base_tail"] == "sampling.base_last_steps=4"
    # Every variant's config loads (the window of the main job ends before the base's 4 steps).
    from flowrl.commands.train import load_recipe_config

    for variant in args.variants:
        if not variant.startswith("artifact_"):
            load_recipe_config(str(ROOT / "configs" / "shapes" / "flow_grpo.yaml"),
                               hacking.variant_overrides(args, variant))


def test_combined_variants_join_their_parts_and_refuse_a_shared_key(capsys):
    args = hacking.parse_args(["--variants", "none", "artifact_1+kl_high", "base_tail+elastic_reset"])
    assert hacking.variant_overrides(args, "artifact_1+kl_high") == [
        *hacking.variant_overrides(args, "artifact_1"), *hacking.variant_overrides(args, "kl_high")]
    assert hacking.variant_overrides(args, "base_tail+elastic_reset") == [
        "sampling.base_last_steps=4", "train.elastic_reset={every_epochs: 10, decay_per_epoch: 0.9}"]
    assert [job["out"].name for job in hacking.jobs_for(args)][1] == "artifact_1+kl_high_s0"
    assert hacking.uses_artifact("kl_high+artifact_0.5") and not hacking.uses_artifact("kl_high+base_tail")
    from flowrl.commands.train import load_recipe_config

    _, config = load_recipe_config(str(ROOT / "configs" / "shapes" / "flow_grpo.yaml"),
                                   hacking.variant_overrides(args, "base_tail+elastic_reset"))
    assert config.sampling.base_last_steps == 4 and config.train.elastic_reset.every_epochs == 10
    for variants, message in ((["artifact_1+adversarial"], "the same key(s) ['reward.train']"),
                              (["kl_high+crd_anchor"], "'train.kl_coef'"), (["kl_high+kl_middle"], "kl_middle"),
                              (["kl_high+kl_high"], "['train.kl_coef', 'train.kl_coef_units']")):
        with pytest.raises(SystemExit):
            hacking.parse_args(["--variants", *variants])
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_hacking_benchmark_trains_the_variants_and_writes_every_output(tiny_shapes_dir, tmp_path):
    variants = ["none", "adversarial_clipped", "kl_low", "crd_anchor", "elastic_reset", "base_tail"]
    result = hacking.main(["--model-path", str(tiny_shapes_dir), "--minutes", "5", "--max-epochs", "2",
                           "--eval-every-minutes", "100", "--seeds", "0", "--num-eval-prompts", "2", "--eval-steps",
                           "2", "--adv-warmup", "1", "--adv-d-steps", "2", "--elastic-every", "1",
                           "--base-last-steps", "1", "--variants", *variants, "--out", str(tmp_path / "runs"),
                           "--results", str(tmp_path / "results"), *TINY])
    assert list(result["summary"]) == variants
    assert [(r["variant"], r["seed"], r["budget_minutes"]) for r in result["runs"]] == [(v, 0, 5.0) for v in variants]
    for record in result["runs"]:
        assert record["epochs"] == 2 and record["eval_epochs"] == [0, 2]
        series = record["series"]
        assert series["hack/drift_pixel"][0] == 0  # the evaluation before training is the base model
        assert all(math.isfinite(series[k][-1]) for k in (hacking_report.STRICT, hacking_report.EXTRA,
                                                           hacking_report.PROXY, "hack/kl_to_base"))
    assert set(result["criteria"]["crd_anchor"]) == {"strict", "extra", "lenient", "kinds", "all", "low_kinds"}
    assert result["recommended"] is None or result["recommended"] in variants
    assert result["ranking"] and "none" not in result["ranking"]
    config = lambda v: (tmp_path / "runs" / f"{v}_s0" / "config.yaml").read_text()  # noqa: E731
    # The base was evaluated once, in its own 0-epoch run, and is every run's first point.
    base = [r for r in read_metrics(tmp_path / "runs" / "base_s0" / "metrics.jsonl") if hacking_report.LENIENT in r]
    assert len(base) == 1 and base[0]["epoch"] == 0
    for record in result["runs"]:
        assert record["series"][hacking_report.STRICT][0] == base[0][hacking_report.STRICT]
        assert record["series"][hacking_report.LENIENT][0] == base[0][hacking_report.LENIENT]
    assert all("at_start: false" in config(v) for v in variants)
    assert "clip_margin: 0" in config("adversarial_clipped") and "kl_reward_adaptive: true" in config("crd_anchor")
    assert "every_epochs: 1" in config("elastic_reset") and "base_last_steps: 1" in config("base_tail")
    adversarial = next(r for r in result["runs"] if r["variant"] == "adversarial_clipped")
    assert [e for e, _ in adversarial["discriminator_accuracy"]] == [1, 2]  # a curve over every epoch
    results = tmp_path / "results"
    saved = json.loads((results / "hacking_custom.json").read_text())
    assert saved["recommended"] == result["recommended"] and len(saved["runs"]) == len(variants)
    table = (results / "hacking_custom.md").read_text()
    assert "| base (start) |" in table and "| base_tail |" in table and "single_object" in table
    for name in ("hacking_custom.png", "hacking_custom_gold_vs_kl.png", "hacking_custom_curves.png"):
        assert (results / name).stat().st_size > 10_000, name
