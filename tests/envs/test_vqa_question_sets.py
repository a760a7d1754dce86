"""Episodes of several questions about one image (``env.questions_per_episode``, flowrl/envs/vqa.py): played one
question per turn, each answer scored against its own question, ``all_right`` 1 only when every answer is right, the
RFT selection and the evaluation (``eval/vqa_multi/``) read every turn; one question per episode is unchanged."""

from __future__ import annotations

import pytest

from flowrl.data.vqa_reasoning import reasoning_answer
from flowrl.envs.epoch import answer_scores, score_episodes
from flowrl.envs.registry import get_env
from flowrl.envs.rewards import AnswerRewards
from flowrl.envs.rollout import SamplingSettings, play_episodes
from flowrl.envs.vqa import VQAEnv, episode_questions, sub_tasks, vqa_tasks


def _play(policy, tasks, max_turns=3):
    return play_episodes(policy, VQAEnv, tasks, list(range(len(tasks))), seed=0, sampling=SamplingSettings(),
                         max_turns=max_turns)


def _answering(scripted, tasks, wrong=()):
    """A policy answering every question of ``tasks`` right with its reasoning turn, except (episode, question)
    pairs in ``wrong``, answered with a wrong answer after the right trace (every task has its own scene)."""
    turns = {}
    for i, task in enumerate(tasks):
        for j, sub in enumerate(sub_tasks(task)):
            text = reasoning_answer(sub.data)
            if (i, j) in wrong:
                text = text.replace(f"<answer> {sub.answer} </answer>", "<answer> wrong </answer>")
            turns[(task.data.image().tobytes(), sub.question)] = text
    return lambda conversation, seed, greedy: turns[(scripted.scene_of(conversation),
                                                     scripted.question_of(conversation))]


def test_a_question_set_is_asked_one_question_per_turn(scripted):
    tasks = vqa_tasks("train", 3, seed=3, questions=3)
    questions = [[s.question for s in sub_tasks(t)] for t in tasks]
    policy = scripted.Policy(lambda conversation, seed, greedy: "<answer> yes </answer>")
    episodes = _play(policy, tasks)
    for e, asked in zip(episodes, questions):
        roles = [t.role for t in e.conversation]
        assert roles == ["user", "assistant"] * 3
        users = [t for t in e.conversation if t.role == "user"]
        assert [t.text for t in users] == asked
        assert [len(t.images) for t in users] == [1, 0, 0]  # the image once, with the first question
        assert e.answered and e.num_turns == 3 and e.counts["turn_limit"] == 0
        assert e.anchors == [("start",), ("question", 1), ("question", 2)]
    # Fewer turns than questions: the episode never answers them all.
    short = _play(policy, tasks, max_turns=2)
    assert all(not e.answered and e.counts["turn_limit"] == 1 for e in short)
    assert policy.calls == 5  # lock-step: one generate call per turn for every unfinished episode


def test_all_right_pays_only_when_every_answer_is_right(scripted):
    from flowrl.recipes.vlm_grpo import VARIANTS

    tasks = vqa_tasks("train", 4, seed=5, questions=3)
    wrong = {(1, 1), (2, 0), (2, 1), (2, 2)}  # episode 1: one wrong answer; episode 2: all three wrong
    episodes = _play(scripted.Policy(_answering(scripted, tasks, wrong)), tasks)
    texts, subs = episode_questions(episodes[1])
    assert [t.split("<answer>")[1].split("</answer>")[0].strip() for t in texts] == \
           [subs[0].answer, "wrong", subs[2].answer]
    rewards = AnswerRewards({"all_right": 1.0, "exact": 0.5, "consistent": 0.25})
    total, details = answer_scores(rewards, episodes)
    assert details["all_right"].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert details["exact"].tolist() == pytest.approx([1.0, 2 / 3, 0.0, 1.0])
    # A wrong answer after the right trace fails the answer's own check (the trace says otherwise): per question
    # 2 or 3 checks plus the answer's, averaged per question, then over the episode's questions.
    assert details["consistent"][0] == 1.0 and details["consistent"][3] == 1.0
    assert 0.0 < float(details["consistent"][1]) < 1.0
    assert total.tolist() == pytest.approx((details["all_right"] + 0.5 * details["exact"]
                                            + 0.25 * details["consistent"]).tolist())
    # The recipe's rewards: the answer reward on the last of the three turns, nothing on the others.
    scores, turn_rewards, turn_mask, _ = score_episodes(episodes, AnswerRewards({"all_right": 1.0}), VARIANTS["grpo"],
                                                        max_new_tokens=16, overlong_cache=None)
    assert scores.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert turn_rewards.tolist() == [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
    assert turn_mask.all()
    # One question per episode: all_right is exact, by_episode the plain call.
    single = vqa_tasks("train", 6, seed=5)
    ones = _play(scripted.Policy(_answering(scripted, single, {(2, 0), (4, 0)})), single, max_turns=1)
    plain = AnswerRewards({"exact": 1.0})([e.final_text for e in ones], single)[0]
    assert answer_scores(AnswerRewards({"all_right": 1.0}), ones)[0].tolist() == plain.tolist() == \
           [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]


def test_rejection_sampling_keeps_a_question_set_only_when_every_turn_is_right_and_consistent(scripted):
    from flowrl.recipes.vlm_rft import selection_scores

    tasks = vqa_tasks("train", 3, seed=8, questions=2)
    episodes = _play(scripted.Policy(_answering(scripted, tasks, {(1, 1)})), tasks, max_turns=2)
    # Episode 2's second trace loses its last step (a right answer after an inconsistent trace).
    turn = [t for t in episodes[2].conversation if t.role == "assistant"][1]
    trace, answer = turn.text.split("</think>")
    turn.text = trace.rsplit(";", 1)[0] + " </think>" + answer
    right, consistent = selection_scores(episodes, "exact")
    assert right.tolist() == [True, False, True]
    assert consistent.tolist() == [True, False, False]  # 1: the wrong answer does not follow its trace
    right, _ = selection_scores(episodes, "all_right")
    assert right.tolist() == [True, False, True]


def test_evaluation_reports_all_right_and_per_question_accuracy(scripted):
    from flowrl.envs.evaluate import evaluate_with_baselines

    spec = get_env("shapes_vqa", questions=3)
    main, sets = spec.eval_tasks(10), spec.extra_evals["multi"](10)
    assert len(sets) == 4 and [t.question for t in main[:4]] == [sub_tasks(t)[0].question for t in sets]
    truth = scripted.truth_table(main + sets)

    def answer(conversation, seed, greedy):  # right, except every count question
        question = scripted.question_of(conversation)
        right = truth[(scripted.scene_of(conversation), question)]
        return f"<answer> {'9' if question.startswith('how many') else right} </answer>"

    metrics = evaluate_with_baselines(scripted.Policy(answer), "shapes_vqa", 10, env_options={"questions": 3})
    counts = [s.kind == "count" for t in sets for s in sub_tasks(t)]
    assert metrics["eval/vqa/accuracy"] == pytest.approx(0.8)  # 2 of the 10 single questions are counts
    assert metrics["eval/vqa/count"] == 0.0 and metrics["eval/vqa/shape"] == 1.0
    assert metrics["eval/vqa_multi/accuracy"] == pytest.approx(1 - sum(counts) / 12)
    no_count = sum(not any(s.kind == "count" for s in sub_tasks(t)) for t in sets)
    assert metrics["eval/vqa_multi/all_right"] == pytest.approx(no_count / 4)
    assert metrics["eval/vqa_multi/count"] == 0.0 and "eval/vqa_multi/tool_calls/count" not in metrics
    assert "eval/vqa/all_right" not in metrics  # single questions: no all_right
    assert not [k for k in metrics if "tool_calls" in k or k.endswith("_frac")]  # no tools to report
    # A named split: eval/vqa/ in distribution, eval/vqa_heldout/ the held-out combinations.
    from flowrl.data.vqa import parse_combinations

    held = parse_combinations(["red circle", "circle left of triangle"])
    named = get_env("shapes_vqa", heldout=held)
    truth = scripted.truth_table(named.eval_tasks(10) + named.extra_evals["heldout"](10))
    metrics = evaluate_with_baselines(scripted.Policy(answer), "shapes_vqa", 10, env_options={"heldout": held})
    assert {k.split("/")[1] for k in metrics} == {"vqa", "vqa_heldout"}
    assert metrics["eval/vqa_heldout/accuracy"] == pytest.approx(1 - 4 / 10)  # kinds count, position, exists


def test_the_recipes_take_the_option(scripted):
    from pathlib import Path

    from flowrl.commands.train import load_recipe_config
    from flowrl.config import ConfigError
    from flowrl.envs.registry import env_options

    root = Path(__file__).resolve().parents[2]
    _, cfg = load_recipe_config(str(root / "configs/vlm/shapes_vqa_grpo.yaml"),
                                ["env.questions_per_episode=3", "reward.answer={all_right: 1.0}"])
    spec = get_env(cfg.env.name, **env_options(cfg.env))
    assert spec.max_turns == 3 and set(spec.extra_evals) == {"multi"}
    assert all(len(sub_tasks(t)) == 3 for t in spec.train_tasks("train", 8, seed=0, color_position_fraction=0.2))
    _, rft = load_recipe_config(str(root / "configs/vlm/shapes_vqa_rft.yaml"),
                                ["env.questions_per_episode=2", "train.correct=all_right"])
    assert get_env(rft.env.name, **env_options(rft.env)).max_turns == 2
    assert get_env("shapes_vqa").max_turns == 1 and not get_env("shapes_vqa").extra_evals  # the default
    with pytest.raises(ConfigError, match=r"^env.max_turns: 2 turns cannot answer 3 questions"):
        load_recipe_config(str(root / "configs/vlm/shapes_vqa_grpo.yaml"),
                           ["env.questions_per_episode=3", "env.max_turns=2"])
    with pytest.raises(ConfigError, match=r"^env.questions_per_episode: an option of shapes_vqa"):
        load_recipe_config(str(root / "configs/vlm/shapes_zoom_gigpo.yaml"), ["env.questions_per_episode=2"])
    with pytest.raises(ValueError, match="options of shapes_vqa only"):
        get_env("shapes_zoom", questions=2)
