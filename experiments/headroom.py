"""How much of the shapes task a model can already draw: best-of-k on the held-out prompts.

RL post-training moves a model's probability mass towards the images it already draws correctly sometimes. Where
a prompt's correct image never comes up in k samples, the policy gradient has nothing to push towards (the group's
rewards are all equal) and the limit is the model (its capacity, its text conditioning), not the trainer. This
benchmark samples ``k`` images per held-out prompt (the deterministic ODE, ``k`` seeds per prompt) and reports per
task kind

- ``mean``: the share of correct images (the evaluation's accuracy, averaged over k seeds instead of one);
- ``pass@j``: the chance that at least one of ``j`` samples is correct (the unbiased estimator of Chen et al. 2021
  from the ``k`` samples, for j = 1, 2, 4, ... up to k): ``pass@k`` is what the model can draw at all;
- ``never``: the share of prompts none of the k samples gets right;

for the lenient accuracy the evaluation uses (``eval/shapes/accuracy``) and the strict one (the hacking panel's:
the counts exact, no extra object)::

    python experiments/headroom.py --model shapes --model experiments/out/trainers/dgpo_beta=10_s0_30min \\
        --prompts 120 --k 16 --out experiments/results/headroom

``--model`` takes what ``app.py`` takes: ``shapes`` (the shipped model), a saved model directory, or a fine-tuning
run directory (its newest checkpoint; EMA weights when the run kept them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from flowrl.eval.passk import pass_at, pass_ks  # noqa: E402 (the path above first); shared with the VLM's pass@k

SEED_STRIDE = 1_000_003  # sample j of a prompt uses its evaluation seed + j * SEED_STRIDE (j = 0: the evaluation's)


def score(images: torch.Tensor, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per image: lenient correctness (every constraint of the prompt met, as ``eval/shapes/accuracy``) and strict
    (counts exact, no other object, as ``hack/accuracy``). ``images``: ``[B, 3, H, W]`` in [0, 1]."""
    from flowrl.eval.hacking import judge_shapes_image

    judgements = [judge_shapes_image(prompt, image)
                  for prompt, image in zip(prompts, images.permute(0, 2, 3, 1).numpy())]
    lenient = [j.lenient for j in judgements]
    strict = [j.correct for j in judgements]
    return np.array(lenient, dtype=bool), np.array(strict, dtype=bool)


def summarise(correct: np.ndarray, kinds: list[str]) -> dict:
    """``correct``: ``[N, k]`` booleans (prompt x sample); per task kind and over all: mean, pass@j for j = 1, 2,
    4, ... up to k (and k itself), never (no sample correct)."""
    n_prompts, k = correct.shape
    js = pass_ks(k)
    groups: dict[str, list[int]] = defaultdict(list)
    for index, kind in enumerate(kinds):
        groups[kind].append(index)
    groups["all"] = list(range(n_prompts))
    out = {}
    for kind, rows in groups.items():
        counts = correct[rows].sum(axis=1)
        entry = {"prompts": len(rows), "mean": float(correct[rows].mean()),
                 "never": float(np.mean(counts == 0))}
        entry.update({f"pass@{j}": float(np.mean([pass_at(k, int(c), j) for c in counts])) for j in js})
        out[kind] = entry
    return out


def headroom(model, rows: list[tuple[str, str, int]], *, k: int, steps: int, precision: str = "float32",
             batch_size: int = 64) -> dict:
    """Best-of-``k`` of ``model`` on ``rows`` (prompt, kind, seed): the lenient and strict summaries and the raw
    per-sample correctness (``[N][k]`` lists of 0 / 1)."""
    from flowrl.eval.generate import generate

    prompts = [r[0] for r in rows for _ in range(k)]
    seeds = [r[2] + j * SEED_STRIDE for r in rows for j in range(k)]
    images = generate(model, prompts, seeds, steps=steps, precision=precision, batch_size=batch_size)
    lenient, strict = score(images, prompts)
    lenient, strict = lenient.reshape(len(rows), k), strict.reshape(len(rows), k)
    kinds = [r[1] for r in rows]
    return {"lenient": summarise(lenient, kinds), "strict": summarise(strict, kinds),
            "correct": {"lenient": lenient.astype(int).tolist(), "strict": strict.astype(int).tolist()}}


def markdown(results: dict[str, dict], k: int) -> str:
    """One table per measure: a row per (model, task kind), mean / pass@j / never."""
    lines = []
    for measure in ("lenient", "strict"):
        first = next(iter(results.values()))[measure]["all"]
        js = [key for key in first if key.startswith("pass@")]
        lines += [f"**{measure}** accuracy, best of {k} samples per prompt:", "",
                  "| model | kind | prompts | mean | " + " | ".join(js) + " | never |",
                  "|---|---|---|---|" + "---|" * len(js) + "---|"]
        for name, result in results.items():
            for kind, e in result[measure].items():
                lines.append(f"| {name} | {kind} | {e['prompts']} | {e['mean']:.3f} | "
                             + " | ".join(f"{e[j]:.3f}" for j in js) + f" | {e['never']:.3f} |")
        lines.append("")
    lines.append("mean: share of correct samples; pass@j: unbiased estimate of P(one of j samples is correct); "
                 "never: share of prompts with no correct sample among the k.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True,
                        help="a model to measure (repeat for several): shapes, a model directory or a run directory")
    parser.add_argument("--prompts", type=int, default=120, help="held-out prompts, the first of the eval set")
    parser.add_argument("--k", type=int, default=16, help="samples per prompt (default 16)")
    parser.add_argument("--steps", type=int, default=20, help="ODE steps (default 20, the evaluation's)")
    parser.add_argument("--precision", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True, help="output path without suffix (.json and .md are written)")
    args = parser.parse_args(argv)
    if args.k < 1 or args.prompts < 1:
        parser.error("--k and --prompts must be at least 1")
    torch.set_num_threads(args.threads)

    from flowrl.commands.panel import load
    from flowrl.data.shapes import eval_prompt_set

    rows = eval_prompt_set(args.prompts)
    results, seconds = {}, {}
    for spec in args.model:
        start = time.process_time()
        results[spec] = headroom(load(spec), rows, k=args.k, steps=args.steps, precision=args.precision)
        seconds[spec] = round(time.process_time() - start, 1)
        print(f"headroom: {spec}: lenient mean {results[spec]['lenient']['all']['mean']:.3f}, "
              f"pass@{args.k} {results[spec]['lenient']['all'][f'pass@{args.k}']:.3f} "
              f"({seconds[spec]} CPU-s)", flush=True)
    table = markdown(results, args.k)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "cpu_seconds": seconds,
              "seed_stride": SEED_STRIDE, "models": results, "table_md": table}
    out.with_suffix(".json").write_text(json.dumps(result) + "\n")
    out.with_suffix(".md").write_text(f"# headroom\n\n{table}\n")
    print(table, flush=True)
    return result


if __name__ == "__main__":
    main()
