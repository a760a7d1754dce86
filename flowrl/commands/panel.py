"""``flowrl panel``: the hacking panel (``flowrl/eval/hacking.py``) of a tuned shapes model against its base model.

Generates, with the deterministic Euler ODE and the same per-sample seeds for both models,

- the held-out evaluation set (``flowrl.data.shapes.eval_prompt_set``: 600 eval-split prompts, one fixed
  seed each): drift, extra objects, background shift and (strict) accuracy per task kind;
- a diversity set (``flowrl.eval.hacking.diversity_rows``: 16 eval-split prompts x 8 seeds): diversity,

and writes both models' panels (the base model's drift is 0 by definition and left out) as JSON and a
Markdown table::

    flowrl panel --tuned runs/shapes_flow_grpo --out panel/main_job \
        [--artifact-model DIR]      # adds hack/p_artifact, the classifier's mean P(artifact)
    flowrl panel --tuned DIR --base DIR --n 12 --steps 2 --group-prompts 2 --group-seeds 2 --out X

``--tuned``/``--base`` take what ``app.py`` takes: ``shapes`` (the shipped model), a saved model directory,
or a fine-tuning run directory (its newest checkpoint; EMA weights when the run kept them).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def load(spec: str, device: str = "cpu"):
    from flowrl.models.resolve import load_finetuned
    from flowrl.models.resolve import load_named_model

    if spec == "shapes" or (Path(spec) / "model.json").is_file():
        return load_named_model(spec, device=device)
    return load_finetuned(spec, device=device)


def panel(model, rows, group_rows, features, *, steps: int, base=None, artifact=None) -> tuple[dict, dict]:
    """The panel of ``model`` and its images ``{"eval": [N, 3, H, W], "groups": [M, 3, H, W]}``; with an
    ``artifact`` reward also ``hack/p_artifact``, its mean P(artifact) on the held-out images."""
    from flowrl.eval.hacking import group_diversity, hacking_panel
    from flowrl.eval.generate import generate

    images = generate(model, [r[0] for r in rows], [r[2] for r in rows], steps=steps)
    group_images = generate(model, [r[0] for r in group_rows], [r[2] for r in group_rows], steps=steps)
    out = hacking_panel(images, [r[0] for r in rows], base_images=None if base is None else base["eval"],
                        features=features)
    out.pop("hack/diversity", None)  # one image per prompt here: diversity comes from the group set
    out["hack/diversity"] = group_diversity(features(group_images), [r[0] for r in group_rows])
    if artifact is not None:
        out["hack/p_artifact"] = float(artifact(images, [r[0] for r in rows]).details["artifact/p_artifact"].mean())
    return out, {"eval": images, "groups": group_images}


def adversarial_probe(tuned_model, base_images, tuned_images, prompts, *, updates: int, pool: int = 512,
                      batch: int = 32, steps: int = 10, seed: int = 0) -> dict:
    """Does the adversarial reward see the tuned model's drift? A fresh discriminator (shipped shapes encoder,
    references rendered for each prompt, default settings) is trained for ``updates`` steps on batches of a
    pool of ``pool`` tuned-model images of training prompts (``steps``-step ODE, as rollouts), then scores
    the held-out images of both models."""
    import rewards
    from flowrl.data.shapes import prompt_rows
    from flowrl.eval.generate import generate

    rows = prompt_rows("train", pool, seed=97)
    fakes = generate(tuned_model, [r[0] for r in rows], [r[2] for r in rows], steps=steps)
    reward = rewards.load("adversarial", seed=seed)
    order = torch.randperm(pool, generator=torch.Generator().manual_seed(seed))
    for step in range(updates):
        index = order[(step * batch) % pool:(step * batch) % pool + batch]
        if len(index) < batch:
            order = torch.randperm(pool, generator=torch.Generator().manual_seed(seed + step))
            index = order[:batch]
        metrics = reward.update(fakes[index], [rows[i][0] for i in index.tolist()])
    base_scores, tuned_scores = reward(base_images, prompts).scores, reward(tuned_images, prompts).scores
    return {"updates": updates, "pool": pool, "final_d_acc": metrics["adv/d_acc"],
            "reward_base_mean": float(base_scores.mean()), "reward_tuned_mean": float(tuned_scores.mean()),
            "frac_base_above_tuned": float((base_scores > tuned_scores).float().mean())}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``flowrl panel``; 0 on success, 2 with a one-line error (a model that does not load)."""
    from flowrl.errors import FlowrlError

    try:
        panel_report(argv)
    except FlowrlError as err:
        print(f"flowrl panel: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    return 0


def panel_report(argv: list[str] | None = None) -> dict:
    """Measure both panels as the command line says, write ``--out``.json / .md and return the result."""
    from flowrl.commands.args import OneLineParser

    parser = OneLineParser(prog="flowrl panel", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tuned", required=True)
    parser.add_argument("--base", default="shapes")
    parser.add_argument("--n", type=int, default=600, help="held-out prompts (default 600)")
    parser.add_argument("--steps", type=int, default=40, help="ODE steps (default 40)")
    parser.add_argument("--group-prompts", type=int, default=16)
    parser.add_argument("--group-seeds", type=int, default=8)
    parser.add_argument("--artifact-model", default=None,
                        help="an artifact classifier (flowrl train-reward artifact --out DIR): adds hack/p_artifact")
    parser.add_argument("--adversarial-updates", type=int, default=0,
                        help="also train a fresh adversarial discriminator on the tuned model's images for this "
                             "many updates and report how it scores both models' held-out images")
    parser.add_argument("--adversarial-pool", type=int, default=512, help="tuned images the probe trains on")
    parser.add_argument("--out", required=True, help="output path without suffix (.json and .md are written)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from flowrl.data.shapes import eval_prompt_set
    from flowrl.eval.hacking import diversity_rows, shapes_feature_fn

    start = time.time()
    rows = eval_prompt_set(args.n)
    group_rows = diversity_rows("eval", args.group_prompts, args.group_seeds)
    features = shapes_feature_fn()
    artifact = None
    if args.artifact_model is not None:
        import rewards

        artifact = rewards.load("artifact", path=args.artifact_model)
    base_panel, base_images = panel(load(args.base), rows, group_rows, features, steps=args.steps, artifact=artifact)
    base_panel = {k: v for k, v in base_panel.items() if not k.startswith("hack/drift")}
    tuned_model = load(args.tuned)
    tuned_panel, tuned_images = panel(tuned_model, rows, group_rows, features, steps=args.steps, base=base_images,
                                      artifact=artifact)
    result = {"base": args.base, "tuned": args.tuned, "n": len(rows), "steps": args.steps,
              "diversity_set": f"{args.group_prompts} prompts x {args.group_seeds} seeds",
              "panel": {"base": base_panel, "tuned": tuned_panel}}
    if args.adversarial_updates > 0:
        result["adversarial_probe"] = adversarial_probe(tuned_model, base_images["eval"], tuned_images["eval"],
                                                        [r[0] for r in rows], updates=args.adversarial_updates,
                                                        pool=args.adversarial_pool)
    result["seconds"] = round(time.time() - start, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"| metric | base ({args.base}) | tuned ({args.tuned}) |", "|---|---|---|"]
    for key in sorted(set(base_panel) | set(tuned_panel)):
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(f"| `{key}` | {fmt(base_panel.get(key))} | {fmt(tuned_panel.get(key))} |")
    if "adversarial_probe" in result:
        probe = result["adversarial_probe"]
        lines += ["", f"Adversarial probe ({probe['updates']} updates on {probe['pool']} tuned images): mean reward "
                  f"base {probe['reward_base_mean']:.3f}, tuned {probe['reward_tuned_mean']:.3f}; base above tuned "
                  f"on {probe['frac_base_above_tuned']:.3f} of the held-out prompts."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    raise SystemExit(main())
