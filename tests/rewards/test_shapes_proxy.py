"""The learned proxy of the shapes world's gold (rewards/shapes_proxy.py), its labelled pools
(rewards/shapes_proxy_data.py), `flowrl train-reward shapes-proxy[-data]` and the best-of-n study
(experiments/best_of_n.py): labels from the strict judge on hand-made scenes, training beats chance on a separable
set, hand-valued metrics and ensemble aggregation, the best-of-n estimator against every subset, loader errors."""

from __future__ import annotations

import itertools
import json
import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import rewards
from flowrl.data.shapes import Scene, SceneObject, TASK_KINDS, parse_prompt, prompt_rows, render, render_batch, \
    scene_for_prompt
from rewards.base import RewardError
from rewards.shapes_proxy import (PROMPT_DIM, ShapesProxyNet, aggregate_members, agreement_metrics, brier_score,
                                  canonical_spec, encode_prompt, expected_calibration_error, log_loss, mirror_prompt,
                                  roc_auc, save_proxy, train_shapes_proxy)
from rewards.shapes_proxy_data import HELDOUT_STREAM, judge_images, pool_rows, read_pool, sample_pool, write_pool
from rewards.train_reward import main as train_reward

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # experiments/ is a folder of scripts beside the packages
    sys.path.insert(0, str(ROOT))

from experiments import best_of_n  # noqa: E402


def _scene(*objects: tuple[str, str, float, float]) -> Scene:
    return Scene(tuple(SceneObject(shape, color, x, y, 10.0) for shape, color, x, y in objects))


def _as_tensor(scenes: list[Scene]) -> torch.Tensor:
    return torch.from_numpy(np.stack([render(s) for s in scenes])).permute(0, 3, 1, 2).contiguous()  # uint8


# Prompts with hand-made scenes whose strict verdicts are known: (prompt, kind, scene, correct).
HAND_MADE = [
    ("a red circle", "colors", _scene(("circle", "red", 16, 16)), 1),
    ("a red circle", "colors", _scene(("circle", "red", 8, 8), ("circle", "red", 24, 24)), 0),  # a duplicate
    ("a red circle left of a blue square", "position",
     _scene(("circle", "red", 8, 16), ("square", "blue", 24, 16)), 1),
    ("a red circle left of a blue square", "position",
     _scene(("circle", "red", 24, 16), ("square", "blue", 8, 16)), 0),  # the relation reversed
    ("three green triangles", "counting",
     _scene(("triangle", "green", 7, 8), ("triangle", "green", 24, 8), ("triangle", "green", 16, 24)), 1),
    ("three green triangles", "counting", _scene(("triangle", "green", 8, 8), ("triangle", "green", 24, 24)), 0),
    ("a circle and a square", "two_object", _scene(("circle", "cyan", 8, 8), ("square", "purple", 24, 24)), 1),
    ("a circle and a square", "two_object", _scene(("circle", "cyan", 16, 16)), 0),  # the square is missing
]


def _pool(tmp_path: Path, n_train: int, n_heldout: int, seed: int = 0, name: str = "pool") -> Path:
    """A pool of rendered scenes: even rows draw their prompt's scene (correct), odd rows another prompt's (wrong as
    a rule; the judge labels them either way)."""
    train, held = pool_rows(n_train, n_heldout, seed)
    rows = train + held
    scenes = [scene_for_prompt(rows[i if i % 2 == 0 else (i + 7) % len(rows)][0], random.Random(i))
              for i in range(len(rows))]
    write_pool(tmp_path / name, _as_tensor(scenes), train, held, {"source": "rendered"})
    return tmp_path / name


@pytest.fixture(scope="module")
def proxy_dirs(tmp_path_factory) -> list[Path]:
    """Two proxies of different seeds trained briefly on a rendered pool (the ensemble's members)."""
    root = tmp_path_factory.mktemp("proxies")
    pool = read_pool(_pool(root, 48, 12))
    images, prompts, labels, _ = pool.prefix(48)
    out = []
    for seed in (0, 1):
        model, report = train_shapes_proxy((images, prompts, labels), steps=30, seed=seed, log=None)
        out.append(save_proxy(model, root / f"s{seed}", {"training": report}))
    return out


# ------------------------------------------------------------------------------------------- data


def test_the_pool_writer_labels_with_the_strict_judge_and_reads_back(tmp_path):
    rows = [(prompt, kind, 10 + i) for i, (prompt, kind, _, _) in enumerate(HAND_MADE)]
    images = _as_tensor([scene for _, _, scene, _ in HAND_MADE])
    summary = write_pool(tmp_path / "pool", images, rows[:6], rows[6:], {"note": "hand-made"})
    assert summary["n_train"] == 6 and summary["n_heldout"] == 2
    assert summary["gold_rate_train"] == pytest.approx(0.5) and summary["gold_rate_heldout"] == pytest.approx(0.5)
    pool = read_pool(tmp_path / "pool")
    assert pool.correct.tolist() == [float(c) for *_, c in HAND_MADE]
    assert pool.lenient.tolist() == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]  # the duplicate passes the lenient rule
    assert torch.equal(pool.images, images)  # uint8 renders are stored as they are
    assert pool.prompts == [r[0] for r in rows] and pool.seeds == [r[2] for r in rows]
    assert pool.info == {"note": "hand-made"}
    train_images, _, labels, kinds = pool.prefix(4)
    assert torch.equal(train_images, images[:4]) and labels.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert kinds == ["colors", "colors", "position", "position"]
    _, held_prompts, held_labels, _ = pool.heldout()
    assert held_prompts == ["a circle and a square"] * 2 and held_labels.tolist() == [1.0, 0.0]
    with pytest.raises(RewardError, match="more training rows than the pool's 6"):
        pool.prefix(7)


def test_float_images_are_labelled_as_stored_in_uint8(tmp_path):
    image = _as_tensor([HAND_MADE[0][2]]).float() / 255.0
    nudged = (image + 0.3 / 255.0).clamp(0, 1)  # rounds back to the same uint8 levels
    write_pool(tmp_path / "p", nudged, [("a red circle", "colors", 0)])
    pool = read_pool(tmp_path / "p")
    assert torch.equal(pool.images, (image * 255).round().to(torch.uint8)) and pool.correct.tolist() == [1.0]


def test_pool_rows_serve_smaller_n_as_prefixes_with_one_heldout_stream():
    big_train, big_held = pool_rows(30, 12, seed=3)
    small_train, small_held = pool_rows(12, 12, seed=3)
    assert big_train[:12] == small_train and big_held == small_held
    assert big_train == prompt_rows("train", 30, 3) and big_held == prompt_rows("train", 12, 3 + HELDOUT_STREAM)
    assert not {r[2] for r in big_train} & {r[2] for r in big_held}  # disjoint sampling seeds
    assert [r[1] for r in big_train[:12]] == list(TASK_KINDS) * 2  # kinds cycle: every prefix is balanced
    with pytest.raises(RewardError, match="streams' seeds would overlap"):
        pool_rows(100_001, 10)


def test_sample_pool_draws_the_model_and_labels_the_stored_images(tiny_shapes_dir, tmp_path):
    summary = sample_pool(tmp_path / "pool", 4, 2, model=str(tiny_shapes_dir), steps=2, seed=5, log=None)
    pool = read_pool(tmp_path / "pool")
    assert (pool.n_train, pool.n_heldout) == (4, 2) and summary["n_train"] == 4
    assert pool.info["steps"] == 2 and pool.info["heldout_stream_seed"] == 5 + HELDOUT_STREAM
    train, held = pool_rows(4, 2, seed=5)
    assert pool.prompts == [r[0] for r in train + held] and pool.seeds == [r[2] for r in train + held]
    from flowrl.eval.generate import generate
    from flowrl.models.shapes import ShapesModel

    model = ShapesModel.from_pretrained(tiny_shapes_dir)
    drawn = generate(model, pool.prompts, pool.seeds, steps=2)
    assert torch.equal(pool.images, (drawn * 255).round().to(torch.uint8))
    judged = rewards.load("shapes")(pool.images, pool.prompts).details["correct"]
    assert torch.equal(pool.correct, judged)


def test_read_pool_errors_name_the_fix(tmp_path):
    with pytest.raises(RewardError, match="pool directory not found.*shapes-proxy-data"):
        read_pool(tmp_path / "missing")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "pool.json").write_text("{}")
    with pytest.raises(RewardError, match="lacks images.safetensors"):
        read_pool(tmp_path / "half")
    (tmp_path / "half" / "images.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(RewardError, match="not a readable pool"):
        read_pool(tmp_path / "half")


# ------------------------------------------------------------------------------------------- prompt code


def test_prompt_code_is_one_hot_per_factor_and_shares_codes_across_the_judges_symmetries():
    code = encode_prompt("three green triangles")
    assert code.shape == (PROMPT_DIM,) == (41,) and code.sum() == 6  # present, shape, colour, count, relation, kind
    assert torch.equal(encode_prompt("a red circle right of a blue square"),
                       encode_prompt("a blue square left of a red circle"))
    assert torch.equal(encode_prompt("a red circle below a blue square"),
                       encode_prompt("a blue square above a red circle"))
    assert torch.equal(encode_prompt("a circle and a square"), encode_prompt("a square and a circle"))
    assert not torch.equal(encode_prompt("a red circle left of a blue square"),
                           encode_prompt("a blue square left of a red circle"))
    assert canonical_spec(parse_prompt("a red circle")) == parse_prompt("a red circle")
    with pytest.raises(RewardError, match="shapes_proxy: cannot parse prompt 'a cow'"):
        rewards.shapes_proxy.encode_prompts(["a cow"])


def test_mirroring_an_image_and_its_prompt_keeps_the_judges_verdict():
    """The premise of the training's mirror augmentation, on the hand-made scenes."""
    assert mirror_prompt("a red circle left of a blue square") == "a red circle right of a blue square"
    assert mirror_prompt("a red circle above a blue square") == "a red circle above a blue square"
    assert mirror_prompt("three green triangles") == "three green triangles"
    images = _as_tensor([scene for _, _, scene, _ in HAND_MADE])
    prompts = [prompt for prompt, *_ in HAND_MADE]
    mirrored = judge_images(images.flip(-1), [mirror_prompt(p) for p in prompts])["correct"]
    assert mirrored.tolist() == [float(c) for *_, c in HAND_MADE]


# ------------------------------------------------------------------------------------------- metrics


def test_metrics_against_hand_computed_values():
    probs, labels = [0.05, 0.15, 0.12, 0.95, 1.0], [0, 1, 0, 1, 1]
    # bins [0, .1): {.05} |0 - .05| 1/5; [.1, .2): {.15, .12} |.5 - .135| 2/5; [.9, 1]: {.95, 1.} |1 - .975| 2/5
    assert expected_calibration_error(probs, labels) == pytest.approx(0.01 + 0.146 + 0.01, abs=1e-12)
    assert brier_score(probs, labels) == pytest.approx((0.0025 + 0.7225 + 0.0144 + 0.0025 + 0.0) / 5, abs=1e-12)
    expected_log_loss = -(math.log(0.95) + math.log(0.15) + math.log(0.88) + math.log(0.95) + math.log(1 - 1e-7)) / 5
    assert log_loss(probs, labels) == pytest.approx(expected_log_loss, abs=1e-9)
    assert roc_auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)  # 3 of 4 pairs ordered
    assert roc_auc([0.5, 0.5, 0.2, 0.9], [1, 0, 0, 1]) == pytest.approx(3.5 / 4)  # the tie counts half
    assert roc_auc([0.2, 0.3], [1, 1]) is None
    report = agreement_metrics(probs, labels, kinds=["colors", "colors", "counting", "counting", "counting"])
    assert report["accuracy"] == pytest.approx(4 / 5) and report["gold_rate"] == pytest.approx(3 / 5)
    assert report["auc"] == pytest.approx(1.0)  # every positive (.15, .95, 1) above every negative (.05, .12)
    assert report["by_kind"] == {
        "counting": {"n": 3, "gold_rate": pytest.approx(2 / 3), "accuracy": 1.0, "mean_probability": pytest.approx(
            (0.12 + 0.95 + 1.0) / 3)},
        "colors": {"n": 2, "gold_rate": 0.5, "accuracy": 0.5, "mean_probability": pytest.approx(0.1)}}
    assert list(report["by_kind"]) == ["counting", "colors"]  # the grammar's order of kinds


def test_ensemble_mean_minus_std_is_hand_valued():
    members = torch.tensor([[0.2, 0.9], [0.4, 0.3], [0.6, 0.9]])
    # column 1: mean .4, population std sqrt((.04 + 0 + .04) / 3); column 2: mean .7, sqrt((.04 + .16 + .04) / 3)
    expected = torch.tensor([0.4 - 2 * math.sqrt(0.08 / 3), 0.7 - 2 * math.sqrt(0.08)])
    torch.testing.assert_close(aggregate_members(members, "mean_minus_std", k=2.0), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(aggregate_members(members, "mean"), torch.tensor([0.4, 0.7]), atol=1e-6, rtol=0)
    torch.testing.assert_close(aggregate_members(members, "min"), torch.tensor([0.2, 0.3]))
    assert torch.equal(aggregate_members(members[:1], "mean_minus_std", k=5.0), members[0])  # one member: std 0


def test_the_ensemble_reward_scores_mean_minus_k_std_of_its_members(proxy_dirs):
    rows = prompt_rows("train", 6, seed=9)
    images = render_batch([scene_for_prompt(r[0], random.Random(i)) for i, r in enumerate(rows)])
    prompts = [r[0] for r in rows]
    singles = [rewards.load("shapes_proxy", path=str(d))(images, prompts) for d in proxy_dirs]
    p = torch.stack([s.scores for s in singles])  # [2, B], each a probability
    assert p.min() >= 0 and p.max() <= 1 and not torch.equal(p[0], p[1])  # seeds differ
    ensemble = rewards.load("shapes_proxy", path=[str(d) for d in proxy_dirs], aggregate="mean_minus_std", k=1.5)
    out = ensemble(images, prompts)
    std = (p[0] - p.mean(0)).abs()  # with two members the population std is half their difference
    torch.testing.assert_close(out.scores, p.mean(0) - 1.5 * std, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.details["shapes_proxy/p_correct"], p.mean(0))
    torch.testing.assert_close(out.details["shapes_proxy/std"], std, atol=1e-6, rtol=0)
    assert "correct" not in out.details  # the gold's key: an evaluation would read the proxy as the result
    # As a held-out reward, the panel logs its mean score and its members' disagreement on the eval images.
    from flowrl.eval.panel import heldout_metrics

    logged = heldout_metrics("ens", out)
    assert set(logged) == {"hack/heldout/ens/mean", "hack/heldout/ens/std"}
    assert logged["hack/heldout/ens/mean"] == pytest.approx(float((p.mean(0) - 1.5 * std).mean()), abs=1e-6)
    assert logged["hack/heldout/ens/std"] == pytest.approx(float(std.mean()), abs=1e-6) and std.mean() > 0
    logits = rewards.load("shapes_proxy", path=str(proxy_dirs[0]), output="logit")(images, prompts).scores
    torch.testing.assert_close(torch.sigmoid(logits), p[0])
    # the score is differentiable with respect to the image (for reward-gradient trainers)
    pixels = images[:2].clone().requires_grad_(True)
    ensemble(pixels, prompts[:2]).scores.sum().backward()
    assert pixels.grad is not None and pixels.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------- training


def test_training_beats_chance_on_a_separable_set(tmp_path):
    """Correct renders of a prompt against renders of another prompt: held-out accuracy well above the base rate."""
    pool = read_pool(_pool(tmp_path, 144, 48))
    images, prompts, labels, _ = pool.prefix(144)
    held = pool.heldout()
    assert 0.3 < labels.mean() < 0.7 and 0.3 < held[2].mean() < 0.7
    model, report = train_shapes_proxy((images, prompts, labels), held[:3], heldout_kinds=held[3], steps=300,
                                       seed=0, log=None)
    majority = max(held[2].mean().item(), 1 - held[2].mean().item())
    assert report["heldout"]["accuracy"] >= majority + 0.15, report["heldout"]
    assert report["heldout"]["auc"] >= 0.8 and report["train"]["accuracy"] >= 0.9
    assert set(report["heldout"]["by_kind"]) == set(TASK_KINDS)
    # the same head on its own features, read back through the reward, agrees with the report
    save_proxy(model, tmp_path / "proxy", {})
    probs = rewards.load("shapes_proxy", path=str(tmp_path / "proxy"))(held[0], held[1]).scores
    assert agreement_metrics(probs, held[2])["accuracy"] == pytest.approx(report["heldout"]["accuracy"], abs=1e-6)


def test_training_needs_both_labels():
    images = _as_tensor([HAND_MADE[0][2]] * 4)
    with pytest.raises(RewardError, match="need both gold labels"):
        train_shapes_proxy((images, ["a red circle"] * 4, torch.ones(4)), steps=1, log=None)


# ------------------------------------------------------------------------------------------- loading


def test_loader_errors_name_the_fix(tmp_path, proxy_dirs):
    with pytest.raises(RewardError, match="pass path=.*flowrl train-reward shapes-proxy"):
        rewards.load("shapes_proxy")
    with pytest.raises(RewardError, match="pass path="):
        rewards.load("shapes_proxy", path=[])
    with pytest.raises(RewardError, match="shapes proxy directory not found.*flowrl train-reward shapes-proxy --data"):
        rewards.load("shapes_proxy", path=str(tmp_path / "missing"))
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(RewardError, match="lacks model.safetensors"):
        rewards.load("shapes_proxy", path=str(tmp_path / "half"))
    (tmp_path / "half" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(RewardError, match="could not load the proxy.*arch is None"):
        rewards.load("shapes_proxy", path=str(tmp_path / "half"))
    config = json.loads((proxy_dirs[0] / "config.json").read_text())
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes((proxy_dirs[0] / "model.safetensors").read_bytes())
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**config, "hidden": 64}))
    with pytest.raises(RewardError, match="could not load the proxy.*size mismatch"):
        rewards.load("shapes_proxy", path=str(tmp_path / "bad"))
    for kwargs, message in [({"aggregate": "median"}, "aggregate must be one of mean, mean_minus_std, min"),
                            ({"k": -1}, "k must be a number >= 0"), ({"output": "rank"}, "output must be one of")]:
        with pytest.raises(RewardError, match=message):
            rewards.load("shapes_proxy", path=str(proxy_dirs[0]), **kwargs)
    reward = rewards.load("shapes_proxy", path=str(proxy_dirs[0]))
    with pytest.raises(RewardError, match="cannot parse prompt"):
        reward(torch.ones(1, 3, 32, 32), ["a cow"])
    assert reward(torch.ones(2, 3, 64, 64), ["a circle", "a square"]).scores.shape == (2,)  # resized to 32 x 32
    assert "shapes_proxy" in rewards.available()


def test_the_proxy_net_keeps_its_encoder_frozen():
    net = ShapesProxyNet().train()
    assert not net.encoder.training and net.head.training
    assert not any(p.requires_grad for p in net.encoder.parameters())


# ------------------------------------------------------------------------------------------- command


def test_train_reward_shapes_proxy_end_to_end(tmp_path, capsys):
    pool = _pool(tmp_path, 48, 12)
    out = tmp_path / "proxy"
    code = train_reward(["shapes-proxy", "--data", str(pool), "--n", "36", "--seed", "2", "--steps", "20",
                         "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "report.json"]
    report = json.loads((out / "report.json").read_text())
    assert report["n_train"] == 36 and report["heldout"]["n"] == 12 and report["seed"] == 2
    assert report["data"]["n"] == 36 and report["data"]["pool_n_train"] == 48
    held = report["heldout"]
    assert {"accuracy", "auc", "ece", "brier", "log_loss", "by_kind"} <= set(held)
    assert f"accuracy {held['accuracy']:.3f}" in printed and "shapes_proxy" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["arch"] == "shapes_proxy" and config["training"]["steps"] == 20
    # an earlier output is replaced; other folders and bad --n are one-line errors
    assert train_reward(["shapes-proxy", "--data", str(pool), "--n", "36", "--steps", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    cases = [(["shapes-proxy", "--data", str(pool), "--n", "49", "--out", str(tmp_path / "o")],
              "more training rows than the pool's 48"),
             (["shapes-proxy", "--data", str(tmp_path / "none"), "--n", "4", "--out", str(tmp_path / "o")],
              "pool directory not found"),
             (["shapes-proxy", "--data", str(pool), "--n", "4", "--out", str(pool)], "is (or holds) the --data"),
             (["shapes-proxy", "--data", str(pool), "--n", "4", "--out", str(tmp_path)], "is (or holds) the --data"),
             (["shapes-proxy", "--data", str(pool), "--n", "4", "--out", str(other)], "holds other files (notes.txt)"),
             (["shapes-proxy", "--data", str(pool), "--out", str(tmp_path / "o")], "required: --n")]
    for argv, expected in cases:
        assert train_reward(argv) == 2
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "o").exists()


def test_train_reward_shapes_proxy_data_with_a_tiny_model(tiny_shapes_dir, tmp_path, capsys):
    out = tmp_path / "pool"
    code = train_reward(["shapes-proxy-data", "--model", str(tiny_shapes_dir), "--n", "3", "--heldout-n", "2",
                         "--steps", "2", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["images.safetensors", "pool.json"]
    pool = read_pool(out)
    assert (pool.n_train, pool.n_heldout) == (3, 2) and pool.info["generator"] == str(tiny_shapes_dir)
    assert train_reward(["shapes-proxy-data", "--model", str(tmp_path / "none"), "--n", "3", "--out",
                         str(tmp_path / "p2")]) == 2
    assert "is missing model.json" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- best of n


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_best_of_n_estimator_equals_the_mean_over_every_subset(seed):
    rng = np.random.default_rng(seed)
    total = 7
    selector = rng.integers(0, 4, size=total).astype(float)  # few values: ties, broken uniformly at random
    values = rng.normal(size=total)
    for n in range(1, total + 1):
        chosen = []
        for subset in itertools.combinations(range(total), n):
            best = max(selector[i] for i in subset)
            chosen.append(np.mean([values[i] for i in subset if selector[i] == best]))
        assert best_of_n.best_of_n_expectation(selector, values, n) == pytest.approx(np.mean(chosen), abs=1e-12)
    assert best_of_n.best_of_n_weights(total, 3).sum() == pytest.approx(1.0)
    assert best_of_n.best_of_n_expectation(np.arange(5.0), values[:5], 5) == pytest.approx(values[4])
    with pytest.raises(ValueError):
        best_of_n.best_of_n_weights(4, 5)


def test_kl_bon_and_the_fit():
    assert best_of_n.kl_bon(1) == 0.0 and best_of_n.kl_bon(4) == pytest.approx(math.log(4) - 0.75)
    points = [{"d": d, "gold": 0.5 + d * (0.3 - 0.1 * d)} for d in (0.0, 0.5, 1.0, 1.5)]
    fit = best_of_n.fit_gold(points)
    assert fit["a"] == pytest.approx(0.3) and fit["b"] == pytest.approx(0.1) and fit["d_peak"] == pytest.approx(1.5)
    assert best_of_n.powers_of_two(6) == [1, 2, 4, 6]


def test_the_best_of_n_script_writes_its_curves(tiny_shapes_dir, proxy_dirs, tmp_path):
    a, b = (str(d) for d in proxy_dirs)
    result = best_of_n.main(["--model", str(tiny_shapes_dir), "--prompts", "6", "--samples", "4", "--steps", "2",
                             "--proxy", f"one={a}", "--proxy", f"ens={a},{b}", "--k", "1",
                             "--cache", str(tmp_path / "samples.safetensors"), "--out", str(tmp_path / "bon")])
    saved = json.loads((tmp_path / "bon.json").read_text())
    assert (tmp_path / "bon.png").stat().st_size > 0
    assert saved["ns"] == [1, 2, 4] and saved["kl_bon"][0] == 0.0
    assert set(saved["proxies"]) == {"one", "ens", "ens:mean_minus_std(k=1)"}
    for entry in saved["proxies"].values():
        assert entry["curve"][0]["gold"] == pytest.approx(saved["gold_rate"])  # best of 1 is a random sample
        assert entry["agreement"]["n"] == 24
    oracle = saved["oracle"]
    assert [p["gold"] for p in oracle] == sorted(p["gold"] for p in oracle)  # pass@n never falls
    # a second run reads the cached samples and gives the same numbers
    again = best_of_n.main(["--model", str(tiny_shapes_dir), "--prompts", "6", "--samples", "4", "--steps", "2",
                            "--proxy", f"one={a}", "--cache", str(tmp_path / "samples.safetensors"),
                            "--out", str(tmp_path / "bon2")])
    assert again["proxies"]["one"]["curve"] == result["proxies"]["one"]["curve"]
