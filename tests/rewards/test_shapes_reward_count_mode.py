"""The shapes reward's count_mode: ``strict`` never pays more for a wrong count than for a right one, and
leaves every other prompt (and the default) as it was; ``no_extra_objects`` adds a constraint against objects the
prompt did not ask for."""

from __future__ import annotations

import pytest
import torch

import rewards
from flowrl.data.shapes import Scene, SceneObject, parse_prompt, render_batch, sample_examples
from rewards import RewardError
from rewards.shapes import ShapesReward, constraints_met, detect_objects


def _tri(color: str, x: float, y: float) -> SceneObject:
    return SceneObject("triangle", color, x, y, 9.0)


SCENES = {
    "one green": Scene((_tri("green", 16, 16),)),
    "three green": Scene((_tri("green", 7, 8), _tri("green", 24, 8), _tri("green", 16, 24))),
    "three red": Scene((_tri("red", 7, 8), _tri("red", 24, 8), _tri("red", 16, 24))),
    "two green one red": Scene((_tri("green", 7, 8), _tri("green", 24, 8), _tri("red", 16, 24))),
}


@pytest.fixture(scope="module")
def images():
    return render_batch(list(SCENES.values()))


def test_counting_prompt_partial_and_strict_hand_values(images):
    prompts = ["three green triangles"] * 4
    partial = rewards.load("shapes")(images, prompts)
    strict = rewards.load("shapes", count_mode="strict")(images, prompts)
    # Constraints: a triangle; a green triangle; exactly three green triangles.
    # one green: yes, yes, no; three green: all; three red: yes, no, no (0 green); 2 green + 1 red: yes, yes, no.
    assert partial.scores.tolist() == pytest.approx([2 / 3, 1.0, 1 / 3, 2 / 3])
    assert strict.scores.tolist() == pytest.approx([0.0, 1.0, 0.0, 0.0])
    assert torch.equal(partial.details["correct"], strict.details["correct"])
    assert strict.details["correct"].tolist() == [0.0, 1.0, 0.0, 0.0]


def test_default_is_partial_and_other_prompts_are_unchanged(images):
    assert ShapesReward().count_mode == "partial"
    prompts = ["a triangle", "a green triangle", "a red triangle and a green triangle",
               "a green triangle left of a red triangle"]
    partial = rewards.load("shapes")(images, prompts)
    strict = rewards.load("shapes", count_mode="strict")(images, prompts)
    assert torch.equal(partial.scores, strict.scores)
    # a triangle: 1; a green triangle: 2 of 2 (shape, colour); three red has no green: 3 of 4;
    # 2 green + 1 red (red at the bottom): shapes and colours yes, "green left of red": the red one is
    # at x 16 and a green one at x 7 -> yes: 5 of 5.
    assert partial.scores.tolist() == pytest.approx([1.0, 1.0, 0.75, 1.0])


def test_strict_never_pays_a_wrong_count_more_than_a_right_one():
    # Every eval scene scored against every counting prompt of the eval set: right counts score 1 in strict
    # mode, wrong ones 0; partial mode pays wrong counts up to 2/3. Non-counting prompts are unchanged.
    examples = sample_examples("eval", 120, seed=3)
    detections = [detect_objects(e.image.astype("float32") / 255.0) for e in examples]  # uint8 renders
    prompts = sorted({e.prompt for e in examples})
    counting = [p for p in prompts if parse_prompt(p).kind == "counting"]
    assert len(counting) >= 5
    right, wrong, wrong_partial = [], [], []
    for prompt in prompts:
        spec = parse_prompt(prompt)
        for found in detections:
            partial = constraints_met(spec, found)
            strict = constraints_met(spec, found, "strict")
            assert len(strict) == len(partial) and all(partial) == all(strict)
            if spec.kind != "counting":
                assert strict == partial
                continue
            score = sum(strict) / len(strict)
            (right if all(partial) else wrong).append(score)
            if not all(partial):
                wrong_partial.append(sum(partial) / len(partial))
    assert right and wrong
    assert max(wrong) == 0.0 and min(right) == 1.0
    assert max(wrong_partial) == pytest.approx(2 / 3)  # what partial credit paid for a wrong count


def test_bad_count_mode_is_a_reward_error():
    with pytest.raises(RewardError, match="count_mode must be one of partial, strict; received 'exact'"):
        rewards.load("shapes", count_mode="exact")
    with pytest.raises(RewardError, match="count_mode must be one of"):
        constraints_met(parse_prompt("a circle"), [], "loose")


def test_no_extra_objects_adds_one_constraint_against_unasked_objects(images):
    # Scenes: one green, three green, three red, two green + one red triangle.
    prompts = ["a green triangle", "a green triangle", "a triangle", "two green triangles"]
    plain = rewards.load("shapes", count_mode="strict")(images, prompts)
    guarded = rewards.load("shapes", count_mode="strict", no_extra_objects=True)(images, prompts)
    # plain: one green -> 2/2; three green for "a green triangle" -> 2/2 (the extra two are free); three red for
    # "a triangle" -> 1/1; two green + one red for "two green triangles" -> 3/3.
    assert plain.scores.tolist() == pytest.approx([1.0, 1.0, 1.0, 1.0])
    # guarded: the same constraints plus "nothing beyond the 1 / 1 / 1 / 2 objects named": only the first holds it.
    assert guarded.scores.tolist() == pytest.approx([1.0, 2 / 3, 1 / 2, 3 / 4])
    assert torch.equal(plain.details["correct"], guarded.details["correct"])  # the gold does not depend on the reward
    # The gold (strict) passes the exact scene only; the lenient rule passes all four: the guard's optimum is the gold.
    assert guarded.details["correct"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert guarded.details["lenient"].tolist() == [1.0, 1.0, 1.0, 1.0]
    assert guarded.details["extra"].tolist() == [0.0, 1.0, 1.0, 1.0]
    assert ShapesReward().no_extra_objects is False
    for bad in ("yes", [], ["counting", "colour"]):
        with pytest.raises(RewardError, match=r"no_extra_objects must be true, false or a list of task kinds from "
                                              r"single_object, .* \(e.g. \[counting\]\); received "):
            rewards.load("shapes", no_extra_objects=bad)


def test_no_extra_objects_for_some_task_kinds_only(images):
    # "a green triangle" (a colors prompt) drawn as three green triangles; "two green triangles" (counting) drawn as
    # two green and one red: guarding counting only leaves the first at 2/2 and adds the constraint to the second.
    prompts = ["a green triangle", "two green triangles"]
    pair = images[[1, 3]]  # three green; two green + one red
    counting_only = rewards.load("shapes", count_mode="strict", no_extra_objects=["counting"])(pair, prompts)
    assert counting_only.scores.tolist() == pytest.approx([1.0, 3 / 4])
    everywhere = rewards.load("shapes", count_mode="strict", no_extra_objects=True)(pair, prompts)
    assert everywhere.scores.tolist() == pytest.approx([2 / 3, 3 / 4])
    colors_only = rewards.load("shapes", count_mode="strict", no_extra_objects=("colors",))(pair, prompts)
    assert colors_only.scores.tolist() == pytest.approx([2 / 3, 1.0])


def test_extra_objects_weight_makes_the_guard_count_as_part_of_a_constraint(images):
    # As above with the guard at half a constraint: one green 2.5/2.5; three green for "a green triangle" 2/2.5;
    # three red for "a triangle" 1/1.5; two green + one red for "two green triangles" 3/3.5.
    prompts = ["a green triangle", "a green triangle", "a triangle", "two green triangles"]
    half = rewards.load("shapes", count_mode="strict", no_extra_objects=True, extra_objects_weight=0.5)(images, prompts)
    assert half.scores.tolist() == pytest.approx([1.0, 0.8, 2 / 3, 6 / 7])
    assert half.details["correct"].tolist() == [1.0, 0.0, 0.0, 0.0]  # the gold: only the exact scene
    # Without the guard the weight has nothing to weigh.
    unguarded = rewards.load("shapes", count_mode="strict", extra_objects_weight=0.5)(images, prompts)
    assert unguarded.scores.tolist() == pytest.approx([1.0, 1.0, 1.0, 1.0])
    for bad in (0, -1.0, "1", True, None, float("inf"), float("nan")):
        with pytest.raises(RewardError, match=r"extra_objects_weight must be a number above 0 .*; received "):
            rewards.load("shapes", extra_objects_weight=bad)


def test_all_met_share_pays_part_of_the_score_only_for_a_whole_prompt(images):
    # Fractions as in test_default_is_partial_...: 1, 1, 3/4 (three red triangles have no green one), 1.
    prompts = ["a triangle", "a green triangle", "a red triangle and a green triangle",
               "a green triangle left of a red triangle"]
    half = rewards.load("shapes", all_met_share=0.5)(images, prompts)
    assert half.scores.tolist() == pytest.approx([1.0, 1.0, 0.375, 1.0])
    whole = rewards.load("shapes", all_met_share=1)(images, prompts)
    assert torch.equal(whole.scores, whole.details["lenient"])  # the score is the lenient accuracy itself
    assert whole.scores.tolist() == [1.0, 1.0, 0.0, 1.0]
    # With the guard the all-or-nothing share needs it met too: the score is the gold itself.
    guarded_prompts = ["a green triangle", "a green triangle", "a triangle", "two green triangles"]
    guarded = rewards.load("shapes", count_mode="strict", no_extra_objects=True, all_met_share=1.0)(images,
                                                                                                   guarded_prompts)
    assert guarded.scores.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert torch.equal(guarded.scores, guarded.details["correct"])
    for bad in (1.5, -0.1, None, "0.5", float("nan")):
        with pytest.raises(RewardError, match=r"all_met_share must be a number from 0 to 1 .*; received "):
            rewards.load("shapes", all_met_share=bad)


def _obj(shape: str, color: str, x: float, y: float = 16.0) -> SceneObject:
    return SceneObject(shape, color, x, y, 9.0)


def test_relation_ramp_pays_a_failed_relation_by_its_signed_distance_when_one_a_and_one_b_are_seen():
    prompt = ["a red circle left of a blue square"]  # 5 constraints: 2 shapes, 2 colours, the relation
    wrong_way = render_batch([Scene((_obj("circle", "red", 20), _obj("square", "blue", 10)))])  # d = 10 - 20 = -10 px
    right_way = render_batch([Scene((_obj("circle", "red", 10), _obj("square", "blue", 20)))])
    duplicated = render_batch([Scene((_obj("circle", "red", 22, 8), _obj("circle", "red", 22, 24),
                                      _obj("square", "blue", 8)))])  # no pair holds; two A
    plain = rewards.load("shapes")
    assert plain(wrong_way, prompt).scores.tolist() == pytest.approx([4 / 5])
    ramp16 = rewards.load("shapes", relation_ramp=16)
    # credit = clip((d - margin + ramp) / ramp, 0, 1) = (-10 - 3 + 16) / 16 = 3 / 16
    assert ramp16(wrong_way, prompt).scores.tolist() == pytest.approx([(4 + 3 / 16) / 5], abs=2e-3)
    assert rewards.load("shapes", relation_ramp=8)(wrong_way, prompt).scores.tolist() == pytest.approx([4 / 5])
    assert ramp16(right_way, prompt).scores.tolist() == pytest.approx([1.0])
    # Duplicates earn no dense credit (it needs the one A and the one B); the gold fails them, the lenient rule too.
    out = ramp16(duplicated, prompt)
    assert out.scores.tolist() == pytest.approx([4 / 5])
    assert out.details["correct"].tolist() == [0.0] and out.details["lenient"].tolist() == [0.0]
    # The gold and the lenient rule do not depend on the option.
    assert ramp16(wrong_way, prompt).details["correct"].tolist() == [0.0]
    for bad in (0, -2.0, "8", True, float("nan")):
        with pytest.raises(RewardError, match=r"relation_ramp must be null or a number of pixels above 0 .*; received"):
            rewards.load("shapes", relation_ramp=bad)


def test_the_gold_fails_a_relation_that_only_a_duplicate_satisfies():
    # "a red circle left of a blue square" with two red circles, one on each side: the lenient rule finds the pair that
    # holds; the gold asks for one A and one B.
    scene = Scene((_obj("circle", "red", 6), _obj("circle", "red", 26), _obj("square", "blue", 16)))
    out = rewards.load("shapes")(render_batch([scene]), ["a red circle left of a blue square"])
    assert out.details["lenient"].tolist() == [1.0] and out.details["correct"].tolist() == [0.0]
    assert out.details["extra"].tolist() == [1.0] and out.scores.tolist() == [1.0]


def test_relation_weight_makes_the_relation_count_as_several_constraints():
    prompt = ["a red circle left of a blue square"]
    wrong_way = render_batch([Scene((_obj("circle", "red", 20), _obj("square", "blue", 10)))])
    # 4 constraints met of 4 + 3 (the relation at weight 3): 4/7; with the dense ramp (3/16 of it): (4 + 9/16) / 7
    assert rewards.load("shapes", relation_weight=3)(wrong_way, prompt).scores.tolist() == pytest.approx([4 / 7])
    dense = rewards.load("shapes", relation_weight=3, relation_ramp=16)(wrong_way, prompt)
    assert dense.scores.tolist() == pytest.approx([(4 + 3 * 3 / 16) / 7], abs=2e-3)
    # Prompts without a relation are unchanged.
    one = render_batch([Scene((_obj("circle", "red", 16),))])
    assert rewards.load("shapes", relation_weight=3)(one, ["a red circle"]).scores.tolist() == [1.0]
    for bad in (0, -1, "2", None, float("inf")):
        with pytest.raises(RewardError, match=r"relation_weight must be a number above 0"):
            rewards.load("shapes", relation_weight=bad)
