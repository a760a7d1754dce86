"""``flowrl eval --task vqa|zoom|zoom_overview|zoom_crop``: the held-out evaluation of a VLM policy
(:mod:`flowrl.envs.evaluate`, greedy) and, with ``--samples K``, its sampled evaluation
(:mod:`flowrl.envs.sampled_eval`: pass@k, majority@k, mixed groups); printed as tables, written as JSON and markdown."""

from __future__ import annotations

from .evaluate import ANSWER_MAX_NEW_TOKENS, evaluate_with_baselines, format_kind_table

__all__ = ["vqa_eval_main"]


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
