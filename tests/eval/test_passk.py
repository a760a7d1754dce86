"""pass@j, mixed@g and majority@k from k samples (flowrl/eval/passk.py): the estimators against enumeration of every
subset, the majority's tie-break, and the summary's every number on hand-built questions."""

from __future__ import annotations

import itertools

import pytest

from flowrl.eval.passk import majority_vote, markdown_table, mixed_at, pass_at, pass_ks, summarise_samples


@pytest.mark.parametrize("n,c", [(4, 0), (4, 1), (6, 3), (8, 7), (8, 8)])
def test_the_estimators_are_shares_of_all_subsets(n, c):
    samples = [True] * c + [False] * (n - c)
    for size in range(1, n + 1):
        subsets = list(itertools.combinations(samples, size))
        assert pass_at(n, c, size) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)
        if size >= 2:
            mixed = sum(any(s) and not all(s) for s in subsets) / len(subsets)
            assert mixed_at(n, c, size) == pytest.approx(mixed, abs=1e-12)
    with pytest.raises(ValueError, match="mixed@1"):
        mixed_at(n, c, 1)


def test_majority_ties_go_to_the_answer_sampled_first():
    assert majority_vote(["no", "yes", "yes", "no"]) == "no"
    assert majority_vote(["2", "3", "3", "1"]) == "3"
    assert majority_vote(["", "red", "", "red"]) == ""  # an unanswered sample votes for the empty answer
    assert pass_ks(8) == [1, 2, 4, 8] and pass_ks(6) == [1, 2, 4, 6]


def test_the_summary_of_hand_built_questions():
    kinds = ["a", "a", "b"]
    greedy = [True, False, False]
    right = [[True, False, False, False],   # right greedily, sampled 1 of 4: a confident-looking minority
             [True, True, True, False],     # wrong greedily, sampled 3 of 4: rescued, a sampled majority
             [False, False, False, False]]  # never right
    majority = [True, True, False]
    s = summarise_samples(kinds, greedy, right, majority, group_sizes=(2, 4))
    assert list(s) == ["a", "b", "all"]
    every = s["all"]
    expected = {"questions": 3, "greedy": 1 / 3, "pass@1": 1 / 3, "pass@2": (0.5 + 1.0) / 3, "pass@4": 2 / 3,
                "majority@k": 2 / 3, "greedy_wrong": 2 / 3, "rescued": 0.5, "rescued_p_right": 0.375,
                "greedy_right_sampled_minority": 1 / 3, "greedy_wrong_sampled_majority": 1 / 3,
                "mixed@2": (0.5 + 0.5) / 3, "mixed@4": 2 / 3}
    assert every == pytest.approx(expected)
    assert s["a"]["rescued"] == 1.0 and s["a"]["greedy"] == 0.5 and s["a"]["pass@2"] == 0.75
    assert s["b"]["rescued"] == 0.0 and s["b"]["mixed@4"] == 0.0
    only_right = summarise_samples(["a"], [True], [[True, True]], [True], group_sizes=(2,))
    assert only_right["a"]["rescued"] is None and only_right["a"]["rescued_p_right"] is None
    table = markdown_table(s, 4, title="**t**")
    assert table.splitlines()[-1].startswith("| all | 3 | 0.333 | 0.333 | 0.500 | 0.667 | 0.667 | 0.500 |")
    assert "| b | 1 | 0.000 |" in table and "majority of 4" in table
    assert "| a | 1 | 1.000 | 1.000 | 1.000 | 1.000 | - | 0.000 |" in markdown_table(only_right, 2)
    with pytest.raises(ValueError, match="between 2 and k = 4"):
        summarise_samples(kinds, greedy, right, majority, group_sizes=(8,))
    with pytest.raises(ValueError, match="same number"):
        summarise_samples(kinds, greedy, right[:2], majority)
