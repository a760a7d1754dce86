"""The sampled evaluation of a VLM policy (flowrl/envs/sampled_eval.py): a scripted policy whose samples are right by
their seeds gives exactly the summary of those samples (each question's own k samples, the majority against its
answer, question sets right only when every turn is), for every evaluation set; and ``flowrl eval --samples``."""

from __future__ import annotations

import json

import pytest

from flowrl.envs.registry import get_env
from flowrl.envs.rollout import sample_seed
from flowrl.envs.sampled_eval import sampled_evaluation
from flowrl.envs.vqa import sub_tasks
from flowrl.eval.passk import majority_vote, summarise_samples

K = 4


def _policy(scripted, tasks):
    """Greedy: right on even-numbered questions of the set. Sampled: right when the sample's seed is even, else
    the answer "wrong"."""
    truth = scripted.truth_table(tasks)
    greedy_right = {scripted.scene_of([_turn(t)]) for t in tasks[::2]}

    def answer(conversation, seed, greedy):
        right = truth[(scripted.scene_of(conversation), scripted.question_of(conversation))]
        ok = scripted.scene_of(conversation) in greedy_right if greedy else seed % 2 == 0
        return f"<think> x </think> <answer> {right if ok else 'wrong'} </answer>"

    return scripted.Policy(answer)


def _turn(task):
    from flowrl.policies import Turn

    return Turn("user", task.question, [task.data.image()])


def _expected(tasks, questions: int, seed: int = 0):
    """The summary the policy's samples must give: sample s of question i is episode i * K + s of the stream."""
    right, majority = [], []
    for i, task in enumerate(tasks):
        ok = [all(sample_seed(seed, i * K + s, turn) % 2 == 0 for turn in range(questions)) for s in range(K)]
        votes = [t.answer if ok[s] else "wrong" for s, t in ((s, task) for s in range(K))]
        right.append(ok)
        majority.append(majority_vote(votes) == task.answer)
    greedy = [i % 2 == 0 for i in range(len(tasks))]
    return summarise_samples([t.kind for t in tasks], greedy, right, majority, group_sizes=(2, 4))


def test_each_question_is_summarised_from_its_own_samples(scripted):
    spec = get_env("shapes_vqa")
    tasks = spec.eval_tasks(10)
    result = sampled_evaluation(_policy(scripted, tasks), "shapes_vqa", 10, k=K, group_sizes=(2, 4, 8),
                                batch_size=7)  # a batch that cuts questions' samples apart
    assert list(result) == ["main"]
    assert result["main"] == _expected(tasks, 1)  # the same numbers from the same samples
    every = result["main"]["all"]
    assert every["greedy"] == 0.5 and "mixed@8" not in every  # group sizes above k are left out
    assert 0 < every["pass@1"] < 1 and every["pass@4"] >= every["pass@2"] >= every["pass@1"]


def test_question_sets_are_right_only_when_every_turn_is(scripted):
    spec = get_env("shapes_vqa", questions=2)
    main, sets = spec.eval_tasks(8), spec.extra_evals["multi"](8)
    result = sampled_evaluation(_policy(scripted, main + sets), "shapes_vqa", 8, k=K, group_sizes=(2, 4),
                                env_options={"questions": 2})
    assert list(result) == ["main", "multi"]
    assert result["main"] == _expected(main, 1)
    # A set's votes are its answers joined: right only when both turns' seeds are even.
    expected = _expected(sets, 2)
    for kind in expected:
        for key in ("questions", "pass@1", "pass@2", "pass@4", "mixed@2", "mixed@4"):
            assert result["multi"][kind][key] == pytest.approx(expected[kind][key]), (kind, key)
    assert [len(sub_tasks(t)) for t in sets] == [2] * 4


def test_flowrl_eval_samples_writes_json_and_markdown(tmp_path, capsys):
    from flowrl.commands.sample import eval_main
    from flowrl.policies.shapes_vlm import ShapesVLMConfig, build_model

    model, processor = build_model(ShapesVLMConfig(hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate_size=64,
                                                   vision_width=32, vision_layers=1, vision_heads=2))
    model.save_pretrained(tmp_path / "m")
    processor.save_pretrained(tmp_path / "m")
    out = tmp_path / "eval" / "passk.json"
    assert eval_main(["--task", "vqa", "--model", str(tmp_path / "m"), "--n", "4", "--samples", "2",
                      "--group-size", "2", "--max-new-tokens", "4", "--heldout-combinations",
                      "red circle, circle left of triangle", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "eval/vqa_heldout/" in printed and "majority of 2" in printed
    result = json.loads(out.read_text())
    assert result["sampled"]["k"] == 2 and set(result["sampled"]["sets"]) == {"main", "heldout"}
    main = result["sampled"]["sets"]["main"]["all"]
    assert main["questions"] == 4 and 0 <= main["pass@1"] <= main["pass@2"] <= 1 and "mixed@2" in main
    assert "eval/vqa_heldout/accuracy" in result
    md = out.with_suffix(".md").read_text()
    assert "**eval/vqa_heldout**" in md and "| all | 4 |" in md


@pytest.mark.parametrize("args,message", [
    (["--group-size", "2"], "add --samples"),
    (["--samples", "2", "--group-size", "3"], "a group holds 2 to --samples (2)"),
    (["--samples", "2", "--temperature", "0"], "--temperature must be > 0"),
    (["--heldout-combinations", "red hexagon"], "--heldout-combinations: 'red hexagon' is not a combination"),
])
def test_bad_sampling_arguments_are_one_line(args, message, capsys):
    from flowrl.commands.sample import eval_main

    assert eval_main(["--task", "vqa", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert eval_main(["--task", "zoom", "--questions", "2"]) == 2
    assert "options of --task vqa" in capsys.readouterr().err
