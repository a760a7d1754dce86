"""experiments/overopt.py: Gao et al.'s RL fit, the replayed stopping rules, the mitigation verdict on constructed
runs, the runs' overrides as configs, and a tiny grid trained on tiny proxies end to end."""

import json
import math
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments import overopt  # noqa: E402


def points(gold, **series):
    """Constructed evaluation points: ``gold`` per evaluation, other keys from ``series`` (NaN when absent)."""
    keys = ("d", "proxy", "heldout_proxy", "ensemble", "disagreement", "diversity", "reward")
    return [{"epoch": 3 * i, "minutes": float(i), "gold": g, **{k: series.get(k, [math.nan] * len(gold))[i]
                                                                 for k in keys}} for i, g in enumerate(gold)]


def test_the_fit_recovers_gaos_rl_form_and_its_peak():
    a, b, start = 0.3, 0.2, 0.5
    ds = [0.0, 0.2, 0.5, 1.0, 1.5, 2.5]
    gold = [start + (d * (a - b * math.log(d)) if d else 0.0) for d in ds]
    fit = overopt.fit_rl(points(gold, d=ds))
    assert fit["a"] == pytest.approx(a, abs=1e-9) and fit["b"] == pytest.approx(b, abs=1e-9)
    assert fit["d_peak"] == pytest.approx(math.exp(a / b - 1), rel=1e-9)
    assert overopt.fit_rl(points([0.5, 0.6], d=[0.0, 1.0])) is None  # one point beyond the start


def test_distance_prefers_the_kl_and_falls_back_to_the_flow_matching_distance():
    assert overopt.distance({"hack/kl_to_base": 0.04, "hack/fm_to_base": 9.0}) == pytest.approx(0.2)
    assert overopt.distance({"hack/fm_to_base": 0.09}) == pytest.approx(0.3)
    assert math.isnan(overopt.distance({}))


def test_the_stopping_rules_keep_the_best_and_stop_where_run_stop_on_would():
    held = [0.5, 0.6, 0.7, 0.65, 0.64, 0.66, 0.8]
    pts = points([0.5] * 7, heldout_proxy=held, disagreement=[0.1, 0.11, 0.12, 0.13, 0.2, 0.2, 0.2],
                 diversity=[0.4, 0.39, 0.35, 0.29, 0.2, 0.2, 0.2], reward=[0.1 * i for i in range(7)])
    assert overopt.stop_on_replay(pts, "heldout_proxy", patience=2) == (2, 4)
    assert overopt.stop_on_replay(pts, "heldout_proxy", patience=5) == (6, None)
    # while_reward_rises: a falling training reward keeps the run going
    flat = points([0.5] * 7, heldout_proxy=held, reward=[1.0 - 0.1 * i for i in range(7)])
    assert overopt.stop_on_replay(flat, "heldout_proxy", patience=2, while_reward_rises=True) == (6, None)
    assert overopt.rise_replay(pts, "disagreement", rise=0.25) == (2, 3)  # 0.13 / 0.10 - 1 = 0.3
    assert overopt.rise_replay(pts, "diversity", rise=0.25, sign=-1.0) == (2, 3)  # 0.29 / 0.40 - 1 = -0.275


def test_a_mitigation_beats_none_only_on_peak_and_final_by_one_standard_error_on_every_seed():
    def run(method, mitigation, seed, peak, final):
        return {"method": method, "n": 500, "mitigation": mitigation, "seed": seed,
                "summary": {"peak_gold": peak, "final_gold": final}}

    se = overopt.binomial_se(0.5, 300)  # 0.0289
    runs = {"a": run("dgpo", "none", 0, 0.60, 0.40), "b": run("dgpo", "none", 1, 0.60, 0.50),
            "c": run("dgpo", "kl", 0, 0.65, 0.50), "d": run("dgpo", "kl", 1, 0.65, 0.52),
            "e": run("dgpo", "ensemble", 0, 0.65, 0.50), "f": run("dgpo", "ensemble", 1, 0.65, 0.50 + se + 1e-3)}
    table = {row["mitigation"]: row for row in overopt.mitigation_table(runs, 300)}
    assert table["none"]["beats_none"] is None
    assert table["kl"]["beats_none"] is False  # seed 1's final gain 0.02 is under one SE (0.029)
    assert table["ensemble"]["beats_none"] is True
    assert table["kl"]["peak"] == pytest.approx((0.65, 0.0)) and table["kl"]["compared_seeds"] == [0, 1]


@pytest.mark.parametrize("method", overopt.METHODS)
def test_every_runs_overrides_load_as_its_methods_config(method, tmp_path):
    from flowrl.commands.train import load_recipe_config

    args = overopt.parse_args(["--proxies", str(tmp_path / "p"), "--kl-coef", "0.5", "--ensemble-k", "2"])
    for mitigation in overopt.TRAINED:
        if mitigation == "elastic_reset" and method != "flow_grpo":
            with pytest.raises(SystemExit, match="elastic_reset is Flow-GRPO's"):
                overopt.run_overrides(args, method, mitigation, 500, 1)
            continue
        _, cfg = load_recipe_config(str(ROOT / "configs" / "shapes" / f"{method}.yaml"),
                                    overopt.run_overrides(args, method, mitigation, 500, 1))
        kwargs = cfg.reward.train["shapes_proxy"]["kwargs"]
        if mitigation == "ensemble":
            assert kwargs == {"path": [str(tmp_path / "p" / f"n500_s{s}") for s in (0, 1, 2)],
                              "aggregate": "mean_minus_std", "k": 2.0}
        else:
            assert kwargs == {"path": str(tmp_path / "p" / "n500_s1")}
        assert cfg.reward.eval == ["shapes", "shapes_proxy"]
        assert [next(iter(h)) for h in cfg.reward.heldout] == ["heldout_proxy", "ensemble"]
        assert cfg.reward.heldout[0]["heldout_proxy"]["kwargs"]["path"] == str(tmp_path / "p" / "n500_s3")
        assert cfg.train.kl_coef == (0.5 if mitigation == "kl" else 0.0)
        if mitigation == "elastic_reset":
            assert cfg.train.elastic_reset.every_epochs == 15


def _tiny_proxies(folder: Path) -> Path:
    """Four proxies ``n500_s0..3`` (the names the grid reads), each trained for a few steps on rendered scenes."""
    from flowrl.data.shapes import prompt_rows, render_batch, scene_for_prompt
    from rewards.shapes_proxy import save_proxy, train_shapes_proxy

    rows = prompt_rows("train", 24, seed=5)
    prompts = [r[0] for r in rows]
    # even rows draw their own prompt's scene, odd rows another's: both labels occur
    images = render_batch([scene_for_prompt(prompts[i if i % 2 == 0 else (i + 7) % 24], random.Random(i))
                           for i in range(24)])
    labels = [1.0 - (i % 2) for i in range(24)]
    import torch

    for seed in range(4):
        model, report = train_shapes_proxy((images, prompts, torch.tensor(labels)), steps=5, seed=seed, log=None)
        save_proxy(model, folder / f"n500_s{seed}", {"training": report})
    return folder


@pytest.mark.slow
def test_a_tiny_grid_trains_on_tiny_proxies_and_writes_every_output(tiny_shapes_dir, tmp_path):
    proxies = _tiny_proxies(tmp_path / "proxies")
    tiny = ["sampling.num_steps=4", "sampling.group_size=2", "sampling.groups_per_epoch=2", "sampling.batch_size=4",
            "train.micro_batch_size=4", "eval.grid_size=0", "eval.hacking.diversity_prompts=2",
            "eval.hacking.diversity_seeds=2", "eval.hacking.kl_prompts=2", "eval.hacking.fm_prompts=2",
            "sampling.window.max_start=null", f"model.path={tiny_shapes_dir}"]
    report = overopt.main(["--proxies", str(proxies), "--methods", "dgpo", "flow_grpo", "--sizes", "500",
                           "--seeds", "0", "--mitigations", "none", "ensemble", "early_stop", "--minutes", "5",
                           "--max-epochs", "2", "--eval-every", "100", "--eval-prompts", "4", "--eval-steps", "2",
                           "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "results"),
                           *[x for o in tiny for x in ("--set", o.replace("sampling.window", "sampling.window"))]])
    runs = report["runs"]
    assert sorted(runs) == ["dgpo_early_stop_n500_s0", "dgpo_ensemble_n500_s0", "dgpo_none_n500_s0",
                            "flow_grpo_early_stop_n500_s0", "flow_grpo_ensemble_n500_s0", "flow_grpo_none_n500_s0"]
    for name, run in runs.items():
        pts = run["points"]
        assert [p["epoch"] for p in pts] == [0, 2], name  # at the start and at the end
        for key in ("gold", "proxy", "heldout_proxy", "ensemble", "disagreement", "d"):
            assert all(math.isfinite(p[key]) for p in pts), (name, key)
        assert pts[0]["d"] == 0 and pts[-1]["d"] > 0, name  # the base, then a moved policy
        assert 0 <= pts[0]["proxy"] <= 1 and pts[0]["disagreement"] > 0
    # the same base and eval prompts: every run starts at the same gold; the held-out proxy is the same model
    starts = {(r["points"][0]["gold"], r["points"][0]["heldout_proxy"]) for r in runs.values()}
    assert len(starts) == 1
    config = (tmp_path / "runs" / "dgpo_ensemble_n500_s0" / "config.yaml").read_text()
    assert "mean_minus_std" in config and "n500_s3" in config
    results = tmp_path / "results"
    saved = json.loads((results / "overopt.json").read_text())
    assert {row["mitigation"] for row in saved["mitigations"]} == {"none", "ensemble", "early_stop"}
    assert saved["detector"]["held-out proxy, patience"]["count"] == 2
    assert "| dgpo | 500 | ensemble | 1 |" in (results / "overopt.md").read_text()
    assert (results / "overopt.png").stat().st_size > 10_000
