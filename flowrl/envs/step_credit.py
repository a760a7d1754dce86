"""Per-step credit of the ``consistent`` checks: each reasoning step's own check, as an advantage on that step's tokens.

The ``consistent`` reward (:func:`flowrl.envs.rewards.consistent_match`) is one number per turn: the share of a trace's
checks that hold (:func:`flowrl.data.vqa_reasoning.step_checks`: each lookup against the step before it, a position
trace's pair and relation word; then whether the answer is the one the trace derives). Added to the episode's reward it
moves every token of the turn alike: a wrong second lookup pushes down the perception step and the answer too. With
``algorithm.step_credit: w`` (vlm_grpo) each check is also credited where it was earned:

    A_t = A_episode + w * A_check(t)

for a token ``t`` of the step a check judges (trace step ``s >= 1`` for the ``s``-th check; the answer's tokens for the
answer check), where ``A_check`` is that check's value (1 holds, 0 fails; a turn without a trace fails every check)
normalised across the group's episodes like the outcome (same normaliser, std scope, eps and clip; a ``batch`` std
scope is taken per group here): the check of the same step of the same question, since a group asks one question.
Other tokens (the perception step, which ``scene`` judges, the tags, the ``;`` between steps, the end of turn) get
the outcome advantage alone. A group whose episodes all pass (or all fail) a check gets 0 for it, as the outcome does.

Which step a token belongs to is read from the text decoded up to and including it: the number of ``;`` since
``<think>`` (step 0 is the listing), or inside ``<answer> ... </answer>``; a token whose own text is a ``;`` or a tag
belongs to none. Every action with a Shapes-VQA question is credited (each turn of a question set against its own
question); a zoom tool call has no trace and gets nothing.
"""

from __future__ import annotations

import torch

__all__ = ["ANSWER", "token_sections", "turn_checks", "step_credit", "place_token_credit"]

ANSWER = -1  # the section of the answer's tokens


def token_sections(ids: list[int], decode) -> list[int | None]:
    """Per token of one action: the trace step it is in (0 = the listing), :data:`ANSWER`, or None (tags, ``;``,
    anything outside). ``decode(ids)`` is the tokenizer's decoding (special tokens skipped)."""
    sections: list[int | None] = []
    for t in range(len(ids)):
        text = decode(ids[:t + 1])
        own = decode(ids[t:t + 1]).strip()
        think, end_think = text.find("<think>"), text.find("</think>")
        answer, end_answer = text.find("<answer>"), text.find("</answer>")
        if own in (";", "<think>", "</think>", "<answer>", "</answer>", ""):
            sections.append(None)
        elif think >= 0 and end_think < 0:
            sections.append(text[think:].count(";"))
        elif answer >= 0 and end_answer < 0:
            sections.append(ANSWER)
        else:
            sections.append(None)
    return sections


def turn_checks(text: str, task) -> list[tuple[int, float]] | None:
    """``[(section, value)]``: the ``consistent`` checks of one turn's ``text`` against ``task``'s question, each with
    the section it judges (check ``j`` judges trace step ``j + 1``; the answer check :data:`ANSWER`); a turn without a
    trace fails them all. None when the task has no Shapes-VQA question (nothing to check)."""
    from flowrl.data.vqa_reasoning import step_checks
    from flowrl.envs.rewards import _answer_follows_trace, _question_spec
    from flowrl.envs.tools import extract_trace

    spec = _question_spec(task)
    if spec is None:
        return None
    trace = extract_trace(text)
    n = len(step_checks(spec, ""))  # the number of checks of the question's kind
    checks = step_checks(spec, trace) + [_answer_follows_trace(spec, trace, text)] if trace is not None else \
        [False] * (n + 1)
    return [(j + 1, float(c)) for j, c in enumerate(checks[:-1])] + [(ANSWER, float(checks[-1]))]


def step_credit(episodes: list, group_ids: torch.Tensor, decode, *, weight: float, normalizer: str = "group",
                std_scope: str = "group", eps: float = 1e-4, clip: float | None = 5.0) -> list[list[torch.Tensor]]:
    """Per episode, per action: ``[n_tokens]`` extra advantages (``weight * A_check`` on the tokens of the step each
    check judges, 0 elsewhere; see the module docstring).

    Args:
        episodes: ``N`` played episodes (groups as ``group_ids [N]``).
        decode: ``decode(ids) -> text`` (the policy's tokenizer, special tokens skipped).
        normalizer / std_scope / eps / clip: the outcome's (:func:`flowrl.core.estimators.outcome_advantages`).
    """
    from flowrl.core.estimators import outcome_advantages
    from flowrl.envs.vqa import QuestionSet, sub_tasks

    extra = [[torch.zeros(len(t.token_ids or ())) for t in e.conversation if t.role == "assistant"] for e in episodes]
    # (action index, section) -> [(episode, value)]: the same question's same check across a group.
    cells: dict[tuple[int, int, int], list[tuple[int, float]]] = {}
    for i, e in enumerate(episodes):
        actions = [t for t in e.conversation if t.role == "assistant"]
        questions = sub_tasks(e.task) if isinstance(e.task.data, QuestionSet) else [e.task]
        # A question set's turn a answers question a; otherwise only the final turn answers (zoom calls come first).
        pairs = list(enumerate(questions)) if len(questions) > 1 else [(len(actions) - 1, e.task)] if e.answered else []
        for a, task in pairs:
            if a >= len(actions):
                continue
            checks = turn_checks(actions[a].text, task)
            for section, value in checks or ():
                cells.setdefault((int(group_ids[i]), a, section), []).append((i, value))
    sections = {}
    for (group, a, section), members in cells.items():
        values = torch.tensor([v for _, v in members])
        adv = outcome_advantages(values, torch.zeros(len(members), dtype=torch.long), normalizer=normalizer,
                                 std_scope=std_scope if std_scope != "batch" else "group", eps=eps, clip=clip)
        for (i, _), value in zip(members, adv.tolist()):
            if value != 0.0:
                sections.setdefault((i, a), {})[section] = weight * value
    for (i, a), by_section in sections.items():
        ids = [t for t in episodes[i].conversation if t.role == "assistant"][a].token_ids or []
        for t, section in enumerate(token_sections(list(ids), decode)):
            if section is not None and section in by_section:
                extra[i][a][t] = by_section[section]
    return extra


def place_token_credit(turn_index: torch.Tensor, extra: list[list[torch.Tensor]]) -> torch.Tensor:
    """``[b, T]``: each row's per-action values (``extra[row][action]``, one per generated token) at that action's
    trained positions (``turn_index == action``, in order), 0 elsewhere.

    Raises:
        ValueError: an action whose values do not match its trained tokens in number.
    """
    out = torch.zeros(turn_index.shape, dtype=torch.float32)
    for row, actions in enumerate(extra):
        for a, values in enumerate(actions):
            where = (turn_index[row] == a).nonzero().flatten()
            if len(where) != len(values):
                raise ValueError(f"row {row}, action {a}: {len(values)} credited tokens but {len(where)} trained")
            out[row, where] = values.float()
    return out
