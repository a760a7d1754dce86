"""Turn-level credit (flowrl/core/turn_credit.py) against hand-derived values."""

import pytest
import torch

from flowrl.core.turn_credit import anchor_index, discounted_turn_returns, gigpo_advantages, turn_return_advantages

# One task group of three episodes in the zoom environment: two zoom (-0.05) then answer right (+1),
# one answers at once and is wrong (0). Anchors: 0 = the start state, 1 = zoomed into the same quadrant.
REWARDS = torch.tensor([[-0.05, 1.0], [0.0, 0.0], [-0.05, 1.0]])
MASK = torch.tensor([[1, 1], [1, 0], [1, 1]], dtype=torch.bool)
ANCHORS = torch.tensor([[0, 1], [0, -1], [0, 1]])
GROUPS = torch.tensor([7, 7, 7])


def test_discounted_returns_by_hand():
    g = discounted_turn_returns(REWARDS, MASK, gamma=0.95)
    # G_1 = 1, G_0 = -0.05 + 0.95 * 1 = 0.9; the single-turn episode has G_0 = 0; masked turns are 0.
    assert torch.allclose(g, torch.tensor([[0.9, 1.0], [0.0, 0.0], [0.9, 1.0]]), atol=1e-7)
    # A masked turn in the middle is skipped, not a discount step.
    g = discounted_turn_returns(torch.tensor([[1.0, 5.0, 2.0]]), torch.tensor([[1, 0, 1]]), gamma=0.5)
    assert torch.allclose(g, torch.tensor([[2.0, 0.0, 2.0]]))


def test_gigpo_mean_norm_by_hand():
    adv = gigpo_advantages(REWARDS, MASK, GROUPS, ANCHORS, gamma=0.95, std_scope="none", clip=None)
    # Episode returns 0.95, 0, 0.95: mean 0.63333, A^E = 0.31667, -0.63333, 0.31667.
    # Start-state step group: G = 0.9, 0, 0.9 -> mean 0.6 -> A^S = 0.3, -0.6, 0.3.
    # Zoomed step group: G = 1, 1 -> constant -> A^S = 0.
    expected = torch.tensor([[0.31667 + 0.3, 0.31667], [-0.63333 - 0.6, 0.0], [0.31667 + 0.3, 0.31667]])
    assert torch.allclose(adv, expected, atol=1e-5)


def test_gigpo_std_norm_and_weight_by_hand():
    adv = gigpo_advantages(REWARDS, MASK, GROUPS, ANCHORS, gamma=0.95, std_scope="group", eps=0.0, clip=None,
                           step_weight=0.5)
    std_e = torch.tensor([0.95, 0.0, 0.95]).std(unbiased=False)  # population std 0.44783
    std_s = torch.tensor([0.9, 0.0, 0.9]).std(unbiased=False)  # 0.42426
    a_e = torch.tensor([0.31667, -0.63333, 0.31667]) / std_e
    a_s = torch.tensor([0.3, -0.6, 0.3]) / std_s
    expected = torch.stack([a_e + 0.5 * a_s, torch.tensor([a_e[0], 0.0, a_e[2]])], dim=1)
    assert torch.allclose(adv, expected, atol=1e-4)


def test_gigpo_unique_state_has_no_step_part():
    # A fourth episode zooms into another quadrant (anchor 2, visited by no other episode) and is right.
    rewards = torch.cat([REWARDS, torch.tensor([[-0.05, 1.0]])])
    mask = torch.cat([MASK, torch.tensor([[1, 1]], dtype=torch.bool)])
    anchors = torch.cat([ANCHORS, torch.tensor([[0, 2]])])
    adv = gigpo_advantages(rewards, mask, torch.tensor([7, 7, 7, 7]), anchors, std_scope="none", clip=None)
    episode = torch.tensor([0.95, 0.0, 0.95, 0.95])
    a_e = episode - episode.mean()
    # Its second step is alone in its step group: the step part is exactly 0, only A^E remains.
    assert adv[3, 1] == pytest.approx(float(a_e[3]), abs=1e-6)
    # The zoomed state of episodes 0 and 2 is still shared by those two (constant returns: 0).
    assert adv[0, 1] == pytest.approx(float(a_e[0]), abs=1e-6)


def test_gigpo_groups_do_not_mix_and_constant_group_is_zero():
    rewards = torch.cat([REWARDS, torch.tensor([[1.0, 0.0], [1.0, 0.0]])])
    mask = torch.cat([MASK, torch.tensor([[1, 0], [1, 0]], dtype=torch.bool)])
    anchors = torch.cat([ANCHORS, torch.tensor([[0, -1], [0, -1]])])  # same anchor id, other group
    adv = gigpo_advantages(rewards, mask, torch.tensor([7, 7, 7, 3, 3]), anchors, std_scope="none", clip=None)
    assert torch.equal(adv[3:], torch.zeros(2, 2))
    alone = gigpo_advantages(REWARDS, MASK, GROUPS, ANCHORS, std_scope="none", clip=None)
    assert torch.allclose(adv[:3], alone)


def test_anchor_index_is_per_group():
    ids = anchor_index([[("start",), ("zoom", "a")], [("start",)], [("start",)]], ["g1", "g1", "g2"])
    assert ids.tolist() == [[0, 1], [0, -1], [2, -1]]


def test_turn_return_advantages_by_hand():
    adv = turn_return_advantages(REWARDS, MASK, GROUPS, gamma=0.95, std_scope="none", clip=None)
    # Turn 0: G = 0.9, 0, 0.9 -> 0.3, -0.6, 0.3; turn 1: G = 1, 1 (episode 1 has no turn 1) -> 0.
    assert torch.allclose(adv, torch.tensor([[0.3, 0.0], [-0.6, 0.0], [0.3, 0.0]]), atol=1e-6)


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="shape"):
        gigpo_advantages(REWARDS[0], None, GROUPS, ANCHORS)
    with pytest.raises(ValueError, match="gamma"):
        discounted_turn_returns(REWARDS, MASK, gamma=1.5)
    with pytest.raises(ValueError, match="non-finite"):
        discounted_turn_returns(torch.tensor([[float("nan")]]))


def test_trloo_reference_values():
    """TRLOO (Dr. Kernel / KernelGYM): the return of each turn minus the mean return of the *other* episodes of
    its group at that turn (hand-computed below); a lone (group, turn) cell keeps its return."""
    from flowrl.core.turn_credit import trloo_advantages

    r = torch.tensor([[-0.05, 1.0], [0.0, 0.0], [-0.05, 0.0], [1.0, 0.0], [0.0, 0.0], [0.5, 0.25]])
    m = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0], [1, 0], [1, 1]], dtype=torch.bool)
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    adv = trloo_advantages(r, m, groups, gamma=1.0)
    # Returns (gamma 1): [0.95, 1], [0], [-0.05, 0], [1], [0], [0.75, 0.25].
    # Group 0, turn 0: 0.95 - (0 - 0.05) / 2 = 0.975; 0 - (0.95 - 0.05) / 2 = -0.45; -0.05 - 0.95 / 2 = -0.525.
    # Group 0, turn 1 (episodes 0 and 2): 1 - 0 = 1 and 0 - 1 = -1. Group 1: 1 and -1. Group 2 is alone.
    expected = torch.tensor([[0.975, 1.0], [-0.45, 0.0], [-0.525, -1.0], [1.0, 0.0], [-1.0, 0.0], [0.75, 0.25]])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)
    # The authors' form: n / (n - 1) (G - mean over all n), on group 0's first turn.
    g = torch.tensor([0.95, 0.0, -0.05])
    torch.testing.assert_close(adv[:3, 0], 3 / 2 * (g - g.mean()), rtol=0, atol=1e-6)
    # A discount enters through the returns: gamma 0.5 gives episode 0 the return -0.05 + 0.5 = 0.45 at turn 0.
    half = trloo_advantages(r, m, groups, gamma=0.5)
    assert abs(float(half[0, 0]) - (0.45 + 0.025)) < 1e-6
    # Masked turns are 0 and the estimator registry serves it.
    from flowrl.core.estimators import ADVANTAGE_ESTIMATORS, CreditBatch

    batch = CreditBatch(rewards=(r * m).sum(1), group_ids=groups, steps=[0, 1], num_steps=2, turn_rewards=r,
                        turn_mask=m)
    via_registry, _ = ADVANTAGE_ESTIMATORS.get("trloo")(batch, gamma=1.0, clip=None)
    torch.testing.assert_close(via_registry, expected, rtol=0, atol=1e-6)
