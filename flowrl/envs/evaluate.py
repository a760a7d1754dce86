"""Held-out evaluation of a policy on an environment: greedy decoding, exact-match accuracy per task kind,
tool use per kind, and what the policy answers per kind (a kind answered by a constant is visible as a
top-answer share of 1). An environment's further evaluation sets (a named split's held-out combinations,
question-set episodes: :class:`flowrl.envs.registry.EnvSpec` ``extra_evals``) are reported beside the main one
by :func:`evaluate_with_baselines`. Sampled evaluation (pass@k, majority@k) is :mod:`flowrl.envs.passk`."""

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


def greedy_episodes(policy, env_name: str, n: int, *, batch_size: int = 100, max_turns: int | None = None,
                    max_new_tokens: int = 16, progress=None, system_prompt: str | None = None,
                    env_options: dict | None = None, tasks: list | None = None):
    """``(env spec, episodes)``: greedy episodes of ``policy`` on the first ``n`` held-out tasks of ``env_name``
    (built with ``env_options``, :func:`flowrl.envs.registry.get_env`; or on ``tasks`` when given), played
    ``batch_size`` tasks at a time (episode ``i`` plays task ``i``; ``progress(k)`` after each chunk).
    The policy is put in eval mode for the episodes and restored after."""
    from flowrl.envs.registry import get_env
    from flowrl.envs.rollout import SamplingSettings, play_episodes

    spec = get_env(env_name, **(env_options or {}))
    tasks = spec.eval_tasks(n) if tasks is None else tasks
    sampling = SamplingSettings(greedy=True, max_new_tokens=max_new_tokens, batch_size=batch_size)
    was_training = policy.model.training
    policy.eval()
    episodes = []
    try:
        for start in range(0, len(tasks), batch_size):
            chunk = tasks[start:start + batch_size]
            episodes += play_episodes(policy, spec.make, chunk, list(range(start, start + len(chunk))), seed=0,
                                      sampling=sampling, max_turns=max_turns or spec.max_turns,
                                      system_prompt=system_prompt)
            if progress is not None:
                progress(len(chunk))
    finally:
        policy.train(was_training)
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

    prefix = prefix if prefix is not None else f"eval/{env_name.removeprefix('shapes_')}/"
    from flowrl.envs.vqa import QuestionSet

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
    if turns > 1 and not sets:
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


def _model_arg(text: str) -> str:
    """``shapes_vlm`` (the shipped model), a model folder, or a run directory holding ``model/``."""
    from pathlib import Path

    from flowrl.policies.shapes_vlm import resolve_model_path

    path = Path(text)
    if text != "shapes_vlm" and (path / "model" / "config.json").is_file():
        return str(path / "model")
    return resolve_model_path(text)


def vqa_eval_main(argv: list[str]) -> int:
    """``flowrl eval --task vqa|zoom [--model shapes_vlm|DIR] [--n N] [--out FILE.json]``: held-out accuracy of
    a VLM policy (greedy) with a table per question kind. ``--samples K [--temperature T] [--group-size G]``: also
    pass@k and majority@k (:mod:`flowrl.envs.sampled_eval`), printed and written as ``FILE.json`` / ``FILE.md``.
    ``--questions Q`` / ``--heldout-combinations "red circle, circle left of triangle"`` (vqa): the environment's
    options (``env.questions_per_episode`` / ``env.heldout_combinations``), adding their evaluation sets."""
    import json
    import sys
    import time
    from pathlib import Path

    from flowrl.commands.args import OneLineParser, UsageError, device_arg, finite_float, positive_int

    parser = OneLineParser(prog="flowrl eval --task", description="Held-out accuracy of a VLM policy on Shapes-VQA "
                                                                  "(or the zoom environment), per question kind.")
    parser.add_argument("--task", choices=("vqa", "zoom", "zoom_overview", "zoom_crop"), required=True,
                        help="zoom_overview / zoom_crop: one-turn baselines on the zoom tasks")
    parser.add_argument("--model", default="shapes_vlm", help="shapes_vlm (the shipped model, default), a model "
                                                              "folder, or a run directory with model/")
    parser.add_argument("--n", type=positive_int, default=None, help="examples (default 500 for vqa, 200 for zoom)")
    parser.add_argument("--batch-size", type=positive_int, default=100)
    parser.add_argument("--max-turns", type=positive_int, default=None)
    parser.add_argument("--max-new-tokens", type=positive_int, default=ANSWER_MAX_NEW_TOKENS,
                        help=f"tokens per turn (default {ANSWER_MAX_NEW_TOKENS}: the shipped model writes a reasoning "
                             "trace before its answer)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=None, help="write the metrics as JSON here (with --samples, FILE.md too)")
    parser.add_argument("--samples", type=positive_int, default=None,
                        help="also sample each question K times: pass@k, majority@k, mixed groups")
    parser.add_argument("--temperature", type=finite_float, default=None, help="sampling temperature (default 1)")
    parser.add_argument("--top-p", type=finite_float, default=None, help="nucleus mass (default 1: off)")
    parser.add_argument("--group-size", type=positive_int, action="append", default=None,
                        help="the g of the share of groups of g samples with mixed rewards (repeat; default 4)")
    parser.add_argument("--seed", type=int, default=0, help="the samples' seed (default 0)")
    parser.add_argument("--questions", type=positive_int, default=None,
                        help="vqa: questions per episode (env.questions_per_episode); adds eval/vqa_multi/")
    parser.add_argument("--heldout-combinations", default=None,
                        help="vqa: a named split, comma-separated (env.heldout_combinations): eval/vqa/ in "
                             "distribution, eval/vqa_heldout/ the held-out combinations")
    try:
        args = parser.parse_args(argv)
        if args.out and not args.out.endswith(".json"):
            raise UsageError(f"--out {args.out!r}: the results must end in .json")
        env_options = _env_options_args(args)
        from flowrl.policies import PolicyLoadError, TokenPolicy

        device = device_arg(args.device)
        try:
            policy = TokenPolicy.from_pretrained(_model_arg(args.model), device=device, inference=True)
        except PolicyLoadError as err:
            raise UsageError(str(err)) from None
    except UsageError as err:
        print(f"flowrl eval: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except SystemExit as exit_:
        return int(exit_.code or 0)
    env = f"shapes_{args.task}"
    n = args.n or (500 if args.task == "vqa" else 200)  # the zoom tasks and their baselines: 200
    start = time.perf_counter()
    answers: dict = {}
    metrics = evaluate_with_baselines(policy, env, n, baselines=False, batch_size=args.batch_size,
                                      max_turns=args.max_turns, answers=answers, max_new_tokens=args.max_new_tokens,
                                      env_options=env_options)
    from flowrl.envs.registry import get_env

    for set_prefix in sorted({k.rsplit("/", 1)[0] + "/" for k in metrics if k.endswith("/accuracy")}):
        if set_prefix != f"eval/{args.task}/":
            print(f"\n{set_prefix}")
        print(format_kind_table(metrics, set_prefix, get_env(env).kinds,
                                answers if set_prefix == f"eval/{args.task}/" else None))
        for key, value in metrics.items():
            if key.startswith(set_prefix) and ("tool_calls" in key or key.endswith(("_frac", "correct_quadrant",
                                                                                   "all_right"))):
                print(f"{key.removeprefix(set_prefix)}: {value:.3f}")
    print(f"({n} held-out examples, greedy, {time.perf_counter() - start:.1f} s)")
    result = {"model": args.model, "task": args.task, "n": n, **metrics, "answers": answers}
    if args.samples:
        from flowrl.envs.sampled_eval import sampled_evaluation, sampled_markdown

        start = time.perf_counter()
        temperature, top_p = args.temperature or 1.0, args.top_p or 1.0
        sampled = sampled_evaluation(policy, env, n, k=args.samples, temperature=temperature, top_p=top_p,
                                     group_sizes=tuple(args.group_size or (4,)), max_new_tokens=args.max_new_tokens,
                                     max_turns=args.max_turns, batch_size=args.batch_size, seed=args.seed,
                                     env_options=env_options)
        table = sampled_markdown(sampled, k=args.samples, temperature=temperature, env_name=env)
        print(f"\n{table}({n} held-out examples x {args.samples} samples, {time.perf_counter() - start:.1f} s)")
        result["sampled"] = {"k": args.samples, "temperature": temperature, "top_p": top_p, "seed": args.seed,
                             "sets": sampled}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
        if args.samples:
            Path(args.out).with_suffix(".md").write_text(f"# {args.model}: sampled evaluation\n\n{table}")
            print(f"wrote {Path(args.out).with_suffix('.md')}")
    return 0


def _env_options_args(args) -> dict:
    """The environment options of ``flowrl eval --task``'s arguments (refused where they do not apply)."""
    from flowrl.commands.args import UsageError

    if args.task != "vqa" and (args.questions or args.heldout_combinations):
        raise UsageError(f"--questions and --heldout-combinations are options of --task vqa, not {args.task}")
    if args.samples is None and any(v is not None for v in (args.temperature, args.top_p, args.group_size)):
        raise UsageError("--temperature, --top-p and --group-size set the sampling of --samples K; add --samples")
    if args.temperature is not None and not args.temperature > 0:
        raise UsageError(f"--temperature must be > 0, got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    bad = [g for g in args.group_size or () if not 2 <= g <= (args.samples or 0)]
    if bad:
        raise UsageError(f"--group-size {bad[0]}: a group holds 2 to --samples ({args.samples}) samples")
    heldout = None
    if args.heldout_combinations is not None:
        from flowrl.data.vqa import parse_combinations, split_questions

        try:
            heldout = parse_combinations([c for c in args.heldout_combinations.split(",") if c.strip()])
            split_questions("train", heldout)
        except ValueError as err:
            raise UsageError(f"--heldout-combinations: {err}") from None
    return {"questions": args.questions, "heldout": heldout}
