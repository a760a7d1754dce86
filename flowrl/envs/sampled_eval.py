"""Sampled evaluation of a VLM / LM policy: each held-out question answered greedily once and sampled ``k`` times at a
temperature, summarised by :func:`flowrl.eval.passk.summarise_samples` (greedy accuracy, sampled pass@1, pass@j,
majority@k, the greedy-wrong questions some sample gets right, the share of groups of ``g`` with mixed rewards), per
question kind and over all, for each evaluation set of the environment (the main one and its ``extra_evals``).

What it answers: whether a policy's errors are confident (pass@k near greedy accuracy: no sample finds the answer, RL
has nothing to reinforce) or not (pass@k far above, many mixed groups: the answer is in the policy's support), and
what pure sharpening gives (majority@k). ``flowrl eval --task vqa --samples K`` runs it.

A sample is right when the episode answered and every answer is right (``exact``, normalised; for a question set,
every question's: ``all_right``); its vote in the majority is its normalised answers (joined for a question set).
Sample ``s`` of question ``i`` is episode ``i * k + s`` of one :func:`flowrl.envs.rollout.play_episodes` stream
(seeds ``sample_seed(seed, i * k + s, turn)``), so a question's samples do not depend on the batch size.
"""

from __future__ import annotations

__all__ = ["sample_episodes", "episode_right", "episode_vote", "truth_vote", "sampled_evaluation",
           "sampled_markdown"]


def episode_right(episode) -> bool:
    """Whether the episode answered and every answer in it is right (exact match)."""
    from flowrl.data.vqa import normalize_answer
    from flowrl.envs.evaluate import question_rows

    rows = question_rows([episode])
    return bool(episode.answered) and all(normalize_answer(a) == normalize_answer(t.answer) for a, t, *_ in rows)


def episode_vote(episode) -> str:
    """The episode's normalised answer (`` ; ``-joined for a question set), ``""`` when it never answered."""
    from flowrl.data.vqa import normalize_answer
    from flowrl.envs.evaluate import question_rows

    if not episode.answered:
        return ""
    return " ; ".join(normalize_answer(a) for a, *_ in question_rows([episode]))


def truth_vote(task) -> str:
    """The vote a right episode of ``task`` casts (:func:`episode_vote`)."""
    from flowrl.data.vqa import normalize_answer
    from flowrl.envs.vqa import sub_tasks

    return " ; ".join(normalize_answer(t.answer) for t in sub_tasks(task))


def sample_episodes(policy, make_env, tasks: list, k: int, *, temperature: float, top_p: float = 1.0,
                    max_new_tokens: int = 16, max_turns: int = 1, batch_size: int = 100, seed: int = 0,
                    system_prompt: str | None = None, progress=None) -> list[list]:
    """``[N][k]`` episodes: ``k`` samples of each of the ``N`` tasks (prompts shared within a question), the policy in
    eval mode and restored after; ``batch_size`` episodes per call."""
    from flowrl.envs.evaluate import play_in_chunks
    from flowrl.envs.rollout import SamplingSettings

    sampling = SamplingSettings(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                                batch_size=batch_size, share_prompts=True)
    episodes = play_in_chunks(policy, make_env, [t for t in tasks for _ in range(k)], sampling, batch_size=batch_size,
                              max_turns=max_turns, seed=seed, system_prompt=system_prompt, progress=progress)
    return [episodes[i * k:(i + 1) * k] for i in range(len(tasks))]


def sampled_evaluation(policy, env_name: str, n: int, *, k: int, temperature: float = 1.0, top_p: float = 1.0,
                       group_sizes: tuple[int, ...] = (4,), max_new_tokens: int = 16, max_turns: int | None = None,
                       batch_size: int = 100, seed: int = 0, system_prompt: str | None = None,
                       env_options: dict | None = None) -> dict[str, dict]:
    """``{set name: summary}`` for the environment's main evaluation set (``main``) and each of its ``extra_evals``
    (``heldout``, ``multi``): the first ``n`` tasks of each, greedy once and ``k`` samples
    (:func:`flowrl.eval.passk.summarise_samples`; group sizes above ``k`` are left out)."""
    from flowrl.envs.evaluate import greedy_episodes
    from flowrl.envs.registry import get_env
    from flowrl.eval.passk import majority_vote, summarise_samples

    spec = get_env(env_name, **(env_options or {}))
    turns = max_turns or spec.max_turns
    sets = {"main": spec.eval_tasks, **spec.extra_evals}
    out = {}
    for name, build in sets.items():
        tasks = build(n)
        _, greedy = greedy_episodes(policy, env_name, n, batch_size=batch_size, max_turns=turns,
                                    max_new_tokens=max_new_tokens, system_prompt=system_prompt,
                                    env_options=env_options, tasks=tasks)
        samples = sample_episodes(policy, spec.make, tasks, k, temperature=temperature, top_p=top_p,
                                  max_new_tokens=max_new_tokens, max_turns=turns, batch_size=batch_size, seed=seed,
                                  system_prompt=system_prompt)
        truth = [truth_vote(t) for t in tasks]
        votes = [[episode_vote(e) for e in row] for row in samples]
        out[name] = summarise_samples([t.kind for t in tasks], [episode_right(e) for e in greedy],
                                      [[episode_right(e) for e in row] for row in samples],
                                      [majority_vote(v) == t for v, t in zip(votes, truth)],
                                      tuple(g for g in group_sizes if 2 <= g <= k))
    return out


def sampled_markdown(results: dict[str, dict], *, k: int, temperature: float, env_name: str) -> str:
    """One table per evaluation set of :func:`sampled_evaluation`, with what the columns mean."""
    from flowrl.eval.passk import markdown_table

    short = env_name.removeprefix("shapes_")
    parts = []
    for name, summary in results.items():
        label = f"eval/{short}" + ("" if name == "main" else f"_{name}")
        parts.append(markdown_table(summary, k, title=f"**{label}**: greedy and {k} samples per question at "
                                                       f"temperature {temperature}"))
    parts.append("greedy: greedy accuracy; sampled pass@1: the share of right samples; pass@j: unbiased estimate "
                 "of P(one of j samples is right); majority: the most frequent normalised answer of the samples is "
                 "right (a tie goes to the answer sampled first); greedy wrong, right in >= 1 of k: of the questions "
                 "the greedy answer gets wrong, the share some sample gets right; mixed@g: unbiased estimate of the "
                 "share of groups of g samples with both a right and a wrong one (GRPO groups with a non-zero "
                 "advantage). A question set's sample is right when every answer is.")
    return "\n\n".join(parts) + "\n"
