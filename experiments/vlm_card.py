"""Ship a Shapes-VQA model: copy a finished ``vlm_sft`` run's ``model/`` into ``flowrl/policies/shapes_vlm_checkpoint``
(or ``--dest``) and write its ``model_card.json`` from a fresh evaluation, so that the card's numbers are the shipped
weights' numbers (``tests/policies/test_shipped_vlm.py`` re-measures the first 100 questions).

The card records the run (config, steps, training CPU-minutes, from the run's ``metrics.jsonl``), the held-out
accuracy per kind on 500 questions with the answer distribution per kind (a kind answered by a constant has a
top-answer share of 1), the first 100 questions' accuracy, and the zoom tasks with their one-turn baselines.

    python experiments/vlm_card.py /work/runs/vlm_sft/r6 \\
        --recipe "flowrl train configs/vlm/shapes_vqa_sft.yaml run.max_epochs=6"
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flowrl.envs.evaluate import ANSWER_MAX_NEW_TOKENS  # noqa: E402


def run_summary(run_dir: Path) -> dict:
    """Steps, epochs and training CPU-minutes of a finished ``vlm_sft`` run (its last ``metrics.jsonl`` row)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = rows[-1]
    return {"epochs": last.get("epoch"), "steps": last.get("step"),
            "train_cpu_minutes": round(last.get("time/train_min", float("nan")), 2)}


def measure(model_dir: Path) -> dict:
    """Greedy held-out accuracy of the model in ``model_dir``: 500 Shapes-VQA questions, the first 100 of them, and
    100 zoom tasks with the one-turn baselines."""
    import torch

    from flowrl.envs.evaluate import evaluate_policy, evaluate_with_baselines
    from flowrl.policies import TokenPolicy

    torch.set_num_threads(1)
    policy = TokenPolicy.from_pretrained(model_dir)
    answers: dict = {}
    vqa = evaluate_policy(policy, "shapes_vqa", 500, answers=answers, max_new_tokens=ANSWER_MAX_NEW_TOKENS)
    first = evaluate_policy(policy, "shapes_vqa", 100, max_new_tokens=ANSWER_MAX_NEW_TOKENS)
    zoom = evaluate_with_baselines(policy, "shapes_zoom", 100, max_new_tokens=ANSWER_MAX_NEW_TOKENS)
    kinds = ("count", "color", "shape", "position", "exists")
    return {"examples": 500, "accuracy": vqa["eval/vqa/accuracy"],
            "kinds": {k: vqa[f"eval/vqa/{k}"] for k in kinds},
            "top_answer_share": {k: vqa[f"eval/vqa/top_answer_share/{k}"] for k in kinds},
            "answers": answers, "first_100_accuracy": first["eval/vqa/accuracy"],
            "zoom": {k.removeprefix("eval/"): v for k, v in zoom.items()},
            "max_new_tokens": ANSWER_MAX_NEW_TOKENS, "parameters": sum(p.numel() for p in policy.model.parameters())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a finished vlm_sft run (with model/ and metrics.jsonl)")
    parser.add_argument("--recipe", required=True, help="the command that trained it, for the card")
    parser.add_argument("--dest", type=Path, default=ROOT / "flowrl" / "policies" / "shapes_vlm_checkpoint")
    parser.add_argument("--machine", default="", help="where it was trained, for the card")
    args = parser.parse_args(argv)
    model = args.run_dir / "model"
    if not (model / "config.json").is_file():
        parser.error(f"{model} has no config.json: give a finished vlm_sft run directory")
    if args.dest.exists():
        shutil.rmtree(args.dest)
    shutil.copytree(model, args.dest)
    config = json.loads((args.dest / "config.json").read_text())
    card = {"model": f"{config['architectures'][0]} (flowrl/policies/shapes_vlm.py), word-level tokenizer built "
                     "with tokenizers",
            "recipe": args.recipe, "date": datetime.date.today().isoformat(), "machine": args.machine,
            **run_summary(args.run_dir), "eval": measure(args.dest)}
    card["parameters"] = card["eval"].pop("parameters")
    card["eval_first_100"] = {"accuracy": card["eval"].pop("first_100_accuracy")}
    (args.dest / "model_card.json").write_text(json.dumps(card, indent=2) + "\n")
    print(json.dumps({k: card["eval"][k] for k in ("accuracy", "kinds", "top_answer_share")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
