"""The best-of-k benchmark: its pass@j estimator against counting subsets, its scoring against rendered scenes,
and one small run of the script on a tiny model."""

import itertools
import json
import random

import numpy as np
import pytest
import torch

from experiments import headroom


@pytest.mark.parametrize("n,c", [(4, 0), (4, 1), (5, 2), (6, 5), (6, 6)])
def test_pass_at_j_is_the_share_of_j_subsets_holding_a_correct_sample(n, c):
    samples = [True] * c + [False] * (n - c)
    for j in range(1, n + 1):
        subsets = list(itertools.combinations(samples, j))
        exact = sum(any(s) for s in subsets) / len(subsets)
        assert headroom.pass_at(n, c, j) == pytest.approx(exact, abs=1e-12)
    with pytest.raises(ValueError):
        headroom.pass_at(n, c, n + 1)


def test_rendered_scenes_score_correct_and_blank_canvases_do_not():
    from flowrl.data.shapes import eval_prompt_set, render_batch, scene_for_prompt

    rows = eval_prompt_set(12)  # two prompts of each task kind
    images = render_batch([scene_for_prompt(r[0], random.Random(i)) for i, r in enumerate(rows)])
    lenient, strict = headroom.score(images, [r[0] for r in rows])
    assert lenient.all() and strict.all()
    blank = torch.ones_like(images)  # the background only: every prompt asks for at least one object
    lenient, strict = headroom.score(blank, [r[0] for r in rows])
    assert not lenient.any() and not strict.any()


def test_summary_per_kind():
    correct = np.array([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=bool)
    out = headroom.summarise(correct, ["counting", "counting", "colors"])
    assert list(out["counting"]) == ["prompts", "mean", "never", "pass@1", "pass@2", "pass@4"]
    assert out["counting"]["mean"] == pytest.approx(1 / 8) and out["counting"]["never"] == pytest.approx(0.5)
    assert out["counting"]["pass@2"] == pytest.approx((0.5 + 0.0) / 2)  # one correct of 4: 1 - C(3,2)/C(4,2)
    assert out["counting"]["pass@4"] == pytest.approx(0.5)
    assert out["colors"]["pass@1"] == 1.0 and out["all"]["mean"] == pytest.approx(5 / 12)
    assert out["all"]["pass@4"] == pytest.approx(2 / 3)


def test_the_script_writes_its_tables(tiny_shapes_dir, tmp_path):
    result = headroom.main(["--model", str(tiny_shapes_dir), "--prompts", "6", "--k", "3", "--steps", "2",
                            "--out", str(tmp_path / "h")])
    saved = json.loads((tmp_path / "h.json").read_text())
    per_model = saved["models"][str(tiny_shapes_dir)]
    assert np.array(per_model["correct"]["lenient"]).shape == (6, 3)
    for measure in ("lenient", "strict"):
        whole = per_model[measure]["all"]
        assert whole["prompts"] == 6 and whole["mean"] == pytest.approx(whole["pass@1"])
        assert whole["pass@1"] <= whole["pass@2"] <= whole["pass@3"] == 1 - whole["never"]
    assert "| " + str(tiny_shapes_dir) + " | all | 6 |" in (tmp_path / "h.md").read_text()
    assert result["settings"]["k"] == 3
