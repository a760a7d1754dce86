"""The advantage-estimator registry: one signature, hand-derived values, and the inputs each declares."""

from __future__ import annotations

import pytest
import torch

from flowrl.core.advantages import PerPromptStatTracker, group_advantages
from flowrl.core.credit import stepwise_group_advantages, turning_point_rewards
from flowrl.core.estimators import ADVANTAGE_ESTIMATORS, CreditBatch, outcome_advantages


def batch(**extra) -> CreditBatch:
    # Two groups of two; trained steps 1 and 2 of a 4-step schedule.
    return CreditBatch(rewards=torch.tensor([1.0, 3.0, 2.0, 2.0]), group_ids=torch.tensor([0, 0, 1, 1]),
                       steps=[1, 2], num_steps=4, **extra)


def test_registry_names_needs_and_unknown_name():
    assert ADVANTAGE_ESTIMATORS.names() == ["cosine", "gigpo", "outcome", "tp_grpo", "trloo", "turn_return"]
    assert ADVANTAGE_ESTIMATORS.get("outcome").needs == ()
    assert ADVANTAGE_ESTIMATORS.get("tp_grpo").needs == ("completion_rewards",)
    assert ADVANTAGE_ESTIMATORS.get("cosine").needs == ("step_weights",)
    with pytest.raises(KeyError, match="unknown advantage estimator 'grpo'.*"
                                       "valid names: cosine, gigpo, outcome, tp_grpo, trloo, turn_return"):
        ADVANTAGE_ESTIMATORS.get("grpo")


def test_outcome_places_the_normalised_reward_on_the_trained_steps():
    adv, metrics = ADVANTAGE_ESTIMATORS.get("outcome")(batch())
    # Group 0: mean 2, population std 1, so (1 - 2) / (1 + 1e-4) and (3 - 2) / (1 + 1e-4); group 1 is constant.
    a = 1 / (1 + 1e-4)
    expected = torch.tensor([[0, -a, -a, 0], [0, a, a, 0], [0, 0, 0, 0], [0, 0, 0, 0.0]])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-7)
    assert metrics == {}
    # rloo: r_i - mean of the others = (1 - 3), (3 - 1).
    adv, _ = ADVANTAGE_ESTIMATORS.get("outcome")(batch(), normalizer="rloo")
    torch.testing.assert_close(adv[:, 1], torch.tensor([-2.0, 2.0, 0.0, 0.0]))
    # std over the whole batch: std([1, 3, 2, 2]) = sqrt(0.5).
    adv, _ = ADVANTAGE_ESTIMATORS.get("outcome")(batch(), std_scope="batch")
    torch.testing.assert_close(adv[0, 1], torch.tensor(-1 / (0.5**0.5 + 1e-4)))


def test_outcome_per_prompt_uses_the_tracker_it_is_given():
    tracker = PerPromptStatTracker(buffer_size=4, min_count=1)
    adv, _ = ADVANTAGE_ESTIMATORS.get("outcome")(batch(prompts=["a", "a", "b", "b"]), normalizer="per_prompt",
                                                 tracker=tracker)
    torch.testing.assert_close(adv[:2, 1], torch.tensor([-1 / (1 + 1e-4), 1 / (1 + 1e-4)]))
    assert tracker.stats()["num_prompts"] == 2  # the recipe owns the state; nothing is kept at module level
    with pytest.raises(ValueError, match="per_prompt normalizer needs a PerPromptStatTracker"):
        outcome_advantages(torch.ones(2), torch.zeros(2), normalizer="per_prompt")


def test_tp_grpo_from_completion_rewards_and_nan_rows():
    R = torch.tensor([[0.0, 1.0, 2.0], [0.0, -1.0, 3.0], [1.0, 0.5, 2.0], [1.0, 2.0, 2.0]])
    rows = batch(completion_rewards=R)
    adv, metrics = ADVANTAGE_ESTIMATORS.get("tp_grpo")(rows)
    step_rewards, turning = turning_point_rewards(R[:, 1:], R[:, 0])
    torch.testing.assert_close(adv[:, 1:3], stepwise_group_advantages(step_rewards, rows.group_ids).float())
    assert (adv[:, [0, 3]] == 0).all()
    # Sample 1: d = (-1, 4), Delta = 3 > 0: step 1 is against the trend, step 2 turns it back and
    # R_n - R_2 = 0, so not a turning point (the last step never is); sample 2: d = (-0.5, 1.5), Delta = 1.
    assert metrics["credit/tp_rate"] == int(turning.sum()) / 8
    assert metrics["credit/nan_rows"] == 0
    R_nan = R.clone()
    R_nan[2, 1] = float("nan")
    adv_nan, metrics_nan = ADVANTAGE_ESTIMATORS.get("tp_grpo")(batch(completion_rewards=R_nan))
    assert metrics_nan["credit/nan_rows"] == 1 and (adv_nan[2] == 0).all()
    torch.testing.assert_close(adv_nan[:2], adv[:2])  # the other group is unaffected
    with pytest.raises(ValueError, match=r"tp_grpo needs completion_rewards \[N, n \+ 1\] = \[4, 3\]"):
        ADVANTAGE_ESTIMATORS.get("tp_grpo")(batch())


def test_cosine_weights_the_outcome_advantage_then_restandardises():
    W = torch.tensor([[1.0, 0.5], [1.0, 0.25], [1.0, 0.5], [1.0, 1.0]])
    adv, metrics = ADVANTAGE_ESTIMATORS.get("cosine")(batch(step_weights=W))
    outcome = group_advantages(torch.tensor([1.0, 3.0, 2.0, 2.0]), torch.tensor([0, 0, 1, 1]))
    expected = stepwise_group_advantages(outcome[:, None] * W, torch.tensor([0, 0, 1, 1])).float()
    torch.testing.assert_close(adv[:, 1:3], expected)
    # Step 2 of group 0: A * w = (-0.49995, 0.249975): centred +-0.3749625, std 0.3749625.
    torch.testing.assert_close(adv[0, 2], torch.tensor(-0.3749625 / (0.3749625 + 1e-4)), rtol=1e-6, atol=0)
    assert metrics == {"credit/rho_mean": pytest.approx(0.78125)}
    with pytest.raises(ValueError, match="consecutive trained steps"):
        ADVANTAGE_ESTIMATORS.get("cosine")(CreditBatch(torch.ones(2), torch.zeros(2), steps=[0, 2], num_steps=4,
                                                       step_weights=torch.ones(2, 2)))


def test_turn_level_estimators_are_the_turn_credit_functions():
    from flowrl.core.turn_credit import gigpo_advantages, turn_return_advantages

    turn_rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    turn_mask = torch.tensor([[True, True], [True, False], [True, True], [True, True]])
    anchors = torch.tensor([[0, 1], [0, 2], [0, 1], [0, 1]])
    credit = batch(turn_rewards=turn_rewards, turn_mask=turn_mask, anchor_ids=anchors)
    credit.steps, credit.num_steps = [0, 1], 2
    adv, _ = ADVANTAGE_ESTIMATORS.get("gigpo")(credit, std_scope="batch", gamma=0.9, step_weight=0.5)
    expected = gigpo_advantages(turn_rewards, turn_mask, credit.group_ids, anchors, gamma=0.9, step_weight=0.5,
                                std_scope="group")
    assert torch.equal(adv, expected) and adv.abs().sum() > 0
    adv, _ = ADVANTAGE_ESTIMATORS.get("turn_return")(credit, std_scope="none")
    assert torch.equal(adv, turn_return_advantages(turn_rewards, turn_mask, credit.group_ids, std_scope="none"))
    # outcome on episodes: the episode's advantage on every turn it played, 0 on the turns it did not
    adv, _ = ADVANTAGE_ESTIMATORS.get("outcome")(credit)
    assert adv[1, 1] == 0 and adv[0, 0] == adv[0, 1] != 0
