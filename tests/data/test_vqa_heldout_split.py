"""A named held-out split of Shapes-VQA (flowrl/data/vqa.py ``heldout``): the config's combinations are never asked in
training (the questions, the SFT data's scene questions and zoom demonstrations, the RL environment's tasks), only in
the held-out evaluation; the in-distribution evaluation asks training questions on scenes of its own stream; the
default split named explicitly draws the same training stream."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from flowrl.data.vqa import (_combination, held_out_combinations, heldout_kinds, parse_combinations, sample_vqa,
                             scene_questions, split_questions, vqa_eval_set, vqa_indist_eval_set)

ROOT = Path(__file__).resolve().parents[2]
NAMED = ["red circle", "blue square", "triangle left of circle"]


def test_config_text_names_pairs_and_relations_with_their_mirror():
    keys = parse_combinations(NAMED)
    assert keys == {"pair:red circle", "pair:blue square", "relation:circle right of triangle"}
    # A relation and its mirror are one combination, whichever way the config writes it.
    assert parse_combinations(["circle right of triangle"]) == parse_combinations(["triangle left of circle"])
    for bad in ("red hexagon", "circle near triangle", "circle left of circle", "red"):
        with pytest.raises(ValueError, match="is not a combination"):
            parse_combinations([bad])
    with pytest.raises(ValueError, match="at least one"):
        parse_combinations([])


def test_training_never_asks_a_named_combination_and_evaluation_asks_only_them():
    held = parse_combinations(NAMED)
    train, ev = split_questions("train", held), split_questions("eval", held)
    for kind in ("count", "exists", "position"):
        assert not any(_combination(s) in held for s in train[kind]), kind
        assert all(_combination(s) in held for s in ev[kind]), kind
    # 2 pairs (count and exists each), 1 relation in both directions (position: 2 of the 24 questions).
    assert (len(ev["count"]), len(ev["exists"]), len(ev["position"])) == (2, 2, 2)
    assert (len(train["count"]), len(train["exists"]), len(train["position"])) == (16, 16, 22)
    assert {s.text() for s in ev["position"]} == {"is the triangle left of the circle?",
                                                  "is the circle right of the triangle?"}
    # The default split's held-out pairs are training pairs of this one.
    assert "how many green circles are there?" in {s.text() for s in train["count"]}
    assert heldout_kinds(held) == ("count", "position", "exists")
    assert heldout_kinds(parse_combinations(["red circle"])) == ("count", "exists")
    examples = sample_vqa("train", 400, seed=2, heldout=held)
    assert not any(_combination(e.spec) in held for e in examples)
    rng = random.Random(0)
    asked = [q for e in examples for q, _ in scene_questions(e.scene, ("exists", "position", "count"), rng,
                                                             heldout=held)]
    assert asked and not {q for s in ev.values() for q in (x.text() for x in s)} & set(asked)
    held_set = vqa_eval_set(60, kinds=heldout_kinds(held), heldout=held)
    assert all(_combination(e.spec) in held for e in held_set)


def test_a_split_that_leaves_a_kind_nothing_to_train_is_refused():
    from flowrl.data.shapes import COLORS, SHAPES

    every_pair = parse_combinations([f"{c} {s}" for c in COLORS for s in SHAPES])
    with pytest.raises(ValueError, match="no count question to train on; hold out fewer pairs"):
        split_questions("train", every_pair)


def test_in_distribution_set_asks_training_questions_on_scenes_no_training_stream_draws():
    held = parse_combinations(NAMED)
    indist = vqa_indist_eval_set(50, heldout=held)
    train_texts = {s.text() for specs in split_questions("train", held).values() for s in specs}
    assert all(e.question in train_texts for e in indist)
    assert [e.seed for e in indist] == [e.seed for e in vqa_indist_eval_set(50, heldout=held)]  # fixed
    # Its own stream: not the training stream of the evaluation's seed, nor the held-out set's scenes.
    assert not {e.seed for e in indist} & {e.seed for e in sample_vqa("train", 50, seed=4321, heldout=held)}
    assert not {e.seed for e in indist} & {e.seed for e in vqa_eval_set(50)}


def test_the_default_split_named_is_the_default_split():
    """Naming the hash-chosen combinations changes nothing that trains: the shipped model's data is such a base."""
    names = [k.split(":", 1)[1] for k in sorted(held_out_combinations())]
    named = parse_combinations(names)
    assert named == held_out_combinations()
    assert split_questions("train", named) == split_questions("train")
    a, b = sample_vqa("train", 40, seed=7), sample_vqa("train", 40, seed=7, heldout=named)
    assert [(e.question, e.scene) for e in a] == [(e.question, e.scene) for e in b]


def test_sft_data_and_rl_tasks_honour_the_named_split():
    from flowrl.commands.train import load_recipe_config
    from flowrl.envs.registry import env_options, get_env
    from flowrl.recipes.vlm_sft import batch_conversations

    held = parse_combinations(NAMED)
    forbidden = {s.text() for specs in split_questions("eval", held).values() for s in specs
                 if s.kind in ("count", "exists", "position")}
    _, cfg = load_recipe_config(str(ROOT / "configs/vlm/shapes_vqa_sft.yaml"),
                                [f"data.heldout_combinations={NAMED}", "data.zoom_fraction=0.5",
                                 "data.answer_format=direct", "data.scene_questions=[exists,position,count]"])
    asked = [t.text for step in range(3) for c in batch_conversations(cfg, step) for t in c if t.role == "user"]
    assert len(asked) > 300 and not any(q.split(" tool :")[0] in forbidden for q in asked)
    assert any("how many" in q and "tool" in q for q in asked)  # zoom demonstrations were asked too
    _, grpo = load_recipe_config(str(ROOT / "configs/vlm/shapes_vqa_grpo.yaml"),
                                 [f"env.heldout_combinations={NAMED}"])
    spec = get_env("shapes_vqa", **env_options(grpo.env))
    tasks = spec.train_tasks("train", 300, seed=1, color_position_fraction=0.2)
    assert not any(t.question in forbidden for t in tasks)
    assert {t.question for t in spec.extra_evals["heldout"](30)} <= forbidden
    assert not any(t.question in forbidden for t in spec.eval_tasks(30))  # eval/vqa/: in distribution


def test_bad_named_splits_are_one_line_config_errors():
    from flowrl.commands.train import load_recipe_config
    from flowrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"^env.heldout_combinations: 'red hexagon' is not a combination"):
        load_recipe_config(str(ROOT / "configs/vlm/shapes_vqa_grpo.yaml"), ["env.heldout_combinations=[red hexagon]"])
    with pytest.raises(ConfigError, match=r"^data.heldout_combinations: 'circle near square'"):
        load_recipe_config(str(ROOT / "configs/vlm/shapes_vqa_sft.yaml"),
                           ["data.heldout_combinations=[circle near square]"])
    with pytest.raises(ConfigError, match=r"^env.heldout_combinations: an option of shapes_vqa, not of shapes_zoom"):
        load_recipe_config(str(ROOT / "configs/vlm/shapes_zoom_gigpo.yaml"), ["env.heldout_combinations=[red circle]"])


def test_the_heldout_sft_config_is_the_shipped_sft_config_on_the_named_default_split():
    from flowrl.commands.train import load_recipe_config
    from flowrl.config import to_dict
    from flowrl.recipes.vlm_sft import batch_conversations

    _, shipped = load_recipe_config(str(ROOT / "configs/vlm/shapes_vqa_sft.yaml"), [])
    _, named = load_recipe_config(str(ROOT / "configs/vlm/shapes_vqa_sft_heldout.yaml"), [])
    assert parse_combinations(named.data.heldout_combinations) == held_out_combinations()
    a, b = to_dict(shipped), to_dict(named)
    assert {k for k in a if a[k] != b[k]} == {"run", "data"}
    assert {k for k in a["run"] if a["run"][k] != b["run"][k]} == {"output_dir"}
    assert {k for k in a["data"] if a["data"][k] != b["data"][k]} == {"heldout_combinations"}
    for step in (0, 7):  # the same training data, token for token
        assert [[(t.role, t.text) for t in c] for c in batch_conversations(shipped, step)] == \
               [[(t.role, t.text) for t in c] for c in batch_conversations(named, step)]
