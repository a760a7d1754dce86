"""Held-out evaluation of a policy on an environment: greedy decoding, exact-match accuracy per task kind,
tool use per kind, and what the policy answers per kind (a kind answered by a constant is visible as a
top-answer share of 1). An environment's further evaluation sets (a named split's held-out combinations,
question-set episodes: :class:`flowrl.envs.registry.EnvSpec` ``extra_evals``) are reported beside the main one
by :func:`evaluate_with_baselines`. Sampled evaluation (pass@k, majority@k) is :mod:`flowrl.envs.sampled_eval`, the
``flowrl eval --task`` command :mod:`flowrl.envs.eval_command`."""

from __future__ import annotations

from collections import Counter, defaultdict

__all__ = ["greedy_episodes", "evaluate_policy", "evaluate_with_baselines", "format_kind_table", "answer_distribution",
           "first_zoom_quadrant", "ZOOM_BASELINES", "ANSWER_MAX_NEW_TOKENS"]

# Tokens per turn where a user evaluates or tries a model (flowrl eval, the demo's Agent tab): the shipped
# Shapes-VQA model writes a reasoning trace before its answer (a count over four objects is ~60 tokens), and
# greedy decoding stops at the end of the turn, so a short answer costs no more.
ANSWER_MAX_NEW_TOKENS = 96

# One-turn baselines on the zoom environment's held-out tasks: the plain question on the overview (what the
# tool must beat) and on the right quadrant at full resolution (what a perfect zoom gives).
ZOOM_BASELINES = ("shapes_zoom_overview", "shapes_zoom_crop")


def answer_distribution(episodes) -> dict[str, dict[str, int]]:
    """``{kind: {normalised answer: count}}`` of the episodes' final answers (every question's, for question
    sets), most common first ("" for an episode that never answered)."""
    from flowrl.data.vqa import normalize_answer

    by_kind: dict[str, Counter] = defaultdict(Counter)
    for answer, task, answered, _, _ in question_rows(episodes):
        by_kind[task.kind][normalize_answer(answer) if answered else ""] += 1
    return {kind: dict(counts.most_common()) for kind, counts in sorted(by_kind.items())}


def question_rows(episodes) -> list[tuple[str, object, bool, str, int]]:
    """``(answer, task, answered, turn text, episode index)`` per question asked: one per episode, or one per
    question of a question set's episode (each turn's answer with its own single-question task)."""
    from flowrl.envs.tools import extract_answer
    from flowrl.envs.vqa import QuestionSet, episode_questions

    rows = []
    for i, e in enumerate(episodes):
        if isinstance(e.task.data, QuestionSet):
            for text, task in zip(*episode_questions(e)):
                rows.append((extract_answer(text), task, e.answered, text, i))
        else:
            rows.append((e.answer, e.task, e.answered, e.final_text, i))
    return rows


def first_zoom_quadrant(episode) -> str | None:
    """The quadrant of the episode's first zoom (from its anchors ``("zoom", quadrants so far)``), or None."""
    for anchor in episode.anchors:
        if isinstance(anchor, tuple) and len(anchor) == 2 and anchor[0] == "zoom" and anchor[1]:
            return anchor[1][0]
    return None


def play_in_chunks(policy, make_env, tasks: list, sampling, *, batch_size: int, max_turns: int, seed: int = 0,
                   system_prompt: str | None = None, progress=None) -> list:
    """Episodes of ``tasks`` (episode ``i`` plays ``tasks[i]``, seeded by ``i``), ``batch_size`` at a time with
    ``sampling`` (:class:`flowrl.envs.rollout.SamplingSettings`), the policy in eval mode and restored after;
    ``progress(k)`` after each chunk."""
    from flowrl.envs.rollout import play_episodes

    was_training = policy.model.training
    policy.eval()
    episodes = []
    try:
        for start in range(0, len(tasks), batch_size):
            chunk = tasks[start:start + batch_size]
            episodes += play_episodes(policy, make_env, chunk, list(range(start, start + len(chunk))), seed=seed,
                                      sampling=sampling, max_turns=max_turns, system_prompt=system_prompt)
            if progress is not None:
                progress(len(chunk))
    finally:
        policy.train(was_training)
    return episodes


def greedy_episodes(policy, env_name: str, n: int, *, batch_size: int = 100, max_turns: int | None = None,
                    max_new_tokens: int = 16, progress=None, system_prompt: str | None = None,
                    env_options: dict | None = None, tasks: list | None = None):
    """``(env spec, episodes)``: greedy episodes of ``policy`` on the first ``n`` held-out tasks of ``env_name``
    (built with ``env_options``, :func:`flowrl.envs.registry.get_env`; or on ``tasks`` when given), played
    ``batch_size`` tasks at a time (episode ``i`` plays task ``i``; ``progress(k)`` after each chunk).
    The policy is put in eval mode for the episodes and restored after."""
    from flowrl.envs.registry import get_env
    from flowrl.envs.rollout import SamplingSettings

    spec = get_env(env_name, **(env_options or {}))
    tasks = spec.eval_tasks(n) if tasks is None else tasks
    sampling = SamplingSettings(greedy=True, max_new_tokens=max_new_tokens, batch_size=batch_size)
    episodes = play_in_chunks(policy, spec.make, tasks, sampling, batch_size=batch_size,
                              max_turns=max_turns or spec.max_turns, system_prompt=system_prompt, progress=progress)
    return spec, episodes


def evaluate_policy(policy, env_name: str, n: int, *, batch_size: int = 100, max_turns: int | None = None,
                    max_new_tokens: int = 16, prefix: str | None = None, progress=None,
                    system_prompt: str | None = None, answers: dict | None = None, env_options: dict | None = None,
                    tasks: list | None = None) -> dict[str, float]:
    """Accuracy of greedy episodes on the first ``n`` held-out tasks of ``env_name``.

    Args:
        answers: if given, filled with :func:`answer_distribution` of the episodes.
        env_options / tasks: as :func:`greedy_episodes`. Question sets are scored per question (``accuracy`` and
            the kinds are per question), and ``prefix + "all_right"`` is the share of episodes whose every answer is
            right.

    Returns:
        ``{prefix + "accuracy": overall, prefix + kind: accuracy of that kind, ...}``,
        ``prefix + "top_answer_share/" + kind`` (the share of the most common answer: 1 means the kind is
        answered by a constant), for Shapes-VQA tasks ``prefix + "scene_f1"`` (the ``scene`` reward of the final
        turns: how well their traces list the scene; 0 for a model that answers without one), and, for multi-turn
        environments, ``prefix + "tool_calls/" + kind`` (mean tool calls per episode),
        ``prefix + "correct_quadrant"`` (of the episodes that zoomed, the share whose first
        zoom was the quadrant holding the objects) and the fraction of episodes that ended in an error or the
        turn limit. ``prefix`` defaults to ``eval/<env short name>/`` (``eval/vqa/`` for ``shapes_vqa``).
    """
    from flowrl.envs.rewards import exact_match, scene_match
    from flowrl.envs.vqa import QuestionSet

    prefix = prefix if prefix is not None else f"eval/{env_name.removeprefix('shapes_')}/"
    spec, episodes = greedy_episodes(policy, env_name, n, batch_size=batch_size, max_turns=max_turns,
                                     max_new_tokens=max_new_tokens, progress=progress, system_prompt=system_prompt,
                                     env_options=env_options, tasks=tasks)
    turns = max_turns or spec.max_turns
    rows = question_rows(episodes)
    correct = exact_match([r[0] for r in rows], [r[1] for r in rows])
    correct = correct * (1 - (~torch_bool([r[2] for r in rows])).float())
    by_kind: dict[str, list[float]] = defaultdict(list)
    tools: dict[str, list[float]] = defaultdict(list)
    for r, c in zip(rows, correct.tolist()):
        by_kind[r[1].kind].append(c)
    for e in episodes:
        tools[e.task.kind].append(e.counts["tool_call"])
    metrics = {f"{prefix}accuracy": float(correct.mean())}
    sets = any(isinstance(e.task.data, QuestionSet) for e in episodes)
    if sets:  # every answer of an episode right (the all_right reward)
        wrong = {r[4] for r, c in zip(rows, correct.tolist()) if c < 1}
        metrics[f"{prefix}all_right"] = 1 - len(wrong) / len(episodes)
    for kind in spec.kinds:
        if by_kind.get(kind):
            metrics[f"{prefix}{kind}"] = sum(by_kind[kind]) / len(by_kind[kind])
    distribution = answer_distribution(episodes)
    for kind, counts in distribution.items():
        metrics[f"{prefix}top_answer_share/{kind}"] = max(counts.values()) / sum(counts.values())
    if answers is not None:
        answers.update(distribution)
    with_scene = [r for r in rows if getattr(r[1].data, "scene", None) is not None]
    if with_scene:  # Shapes-VQA: how well the traces' first step lists the scene (the perception step)
        metrics[f"{prefix}scene_f1"] = float(scene_match([r[3] for r in with_scene],
                                                         [r[1] for r in with_scene]).mean())
    zoomed = [(first_zoom_quadrant(e), e.task) for e in episodes]
    zoomed = [(q, t) for q, t in zoomed if q is not None and isinstance(t.data, dict) and "quadrant" in t.data]
    if zoomed:
        metrics[f"{prefix}correct_quadrant"] = sum(q == t.data["quadrant"] for q, t in zoomed) / len(zoomed)
    if turns > 1 and getattr(spec.make, "tools", None):  # an agent with tools (not a question per turn)
        for kind in spec.kinds:
            if tools.get(kind):
                metrics[f"{prefix}tool_calls/{kind}"] = sum(tools[kind]) / len(tools[kind])
        metrics[f"{prefix}malformed_frac"] = sum(e.counts["malformed"] > 0 for e in episodes) / len(episodes)
        metrics[f"{prefix}turn_limit_frac"] = sum(e.counts["turn_limit"] > 0 for e in episodes) / len(episodes)
    return metrics


def evaluate_with_baselines(policy, env_name: str, n: int, *, baselines: bool = True, **kwargs) -> dict[str, float]:
    """:func:`evaluate_policy`, plus the environment's further evaluation sets (``extra_evals`` of the environment
    built with ``env_options``: ``eval/vqa_heldout/...`` for a named split's held-out combinations,
    ``eval/vqa_multi/...`` for question sets), plus (for ``shapes_zoom`` with ``baselines``) the same policy on the
    same tasks in each of :data:`ZOOM_BASELINES` (one turn; ``eval/zoom_overview/...``, ``eval/zoom_crop/...``)."""
    from flowrl.envs.registry import get_env

    metrics = evaluate_policy(policy, env_name, n, **kwargs)
    short = env_name.removeprefix("shapes_")
    extra = {k: v for k, v in kwargs.items() if k not in ("answers", "prefix", "tasks")}
    for name, tasks in get_env(env_name, **(kwargs.get("env_options") or {})).extra_evals.items():
        metrics.update(evaluate_policy(policy, env_name, n, prefix=f"eval/{short}_{name}/", tasks=tasks(n), **extra))
    if baselines and env_name == "shapes_zoom":
        kwargs.pop("max_turns", None)
        kwargs.pop("answers", None)
        for name in ZOOM_BASELINES:
            metrics.update(evaluate_policy(policy, name, n, **kwargs))
    return metrics


def torch_bool(values):
    import torch

    return torch.tensor(values, dtype=torch.bool)


def format_kind_table(metrics: dict[str, float], prefix: str, kinds, answers: dict | None = None) -> str:
    """A table of accuracy per kind, then overall; with ``answers`` (:func:`answer_distribution`) a column of
    the most common answers of each kind and their shares."""
    width = max([len("overall")] + [len(k) for k in kinds])
    head = f"{'kind'.ljust(width)}  accuracy" + ("  answers (share)" if answers else "")
    lines = [head, f"{'-' * width}  --------" + ("  " + "-" * 15 if answers else "")]
    for k in kinds:
        if prefix + k not in metrics:
            continue
        line = f"{k.ljust(width)}  {metrics[prefix + k]:8.3f}"
        if answers and answers.get(k):
            total = sum(answers[k].values())
            line += "  " + ", ".join(f"{a or '(none)'} {c / total:.2f}" for a, c in list(answers[k].items())[:4])
        lines.append(line)
    lines += [f"{'-' * width}  --------", f"{'overall'.ljust(width)}  {metrics[prefix + 'accuracy']:8.3f}"]
    return "\n".join(lines)
