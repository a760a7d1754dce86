"""Where a Shapes-VQA model's errors are: perception (the trace's listing of the scene) or the reasoning after it.

Plays the first ``N`` held-out questions greedily (as ``flowrl eval`` does) and splits them by whether the trace
lists the scene exactly (the ``scene`` reward is 1), giving the accuracy per kind on each side, and the ``consistent``
reward of the traces (each reasoning step judged against the trace's own step before it):

    python experiments/vlm_trace_errors.py                      # the shipped model, 500 questions
    python experiments/vlm_trace_errors.py runs/shapes_vqa_grpo/model --n 200 --json out.json

A model that lists scenes right and answers them wrong needs better reasoning, not better eyes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flowrl.envs.evaluate import ANSWER_MAX_NEW_TOKENS  # noqa: E402


def trace_errors(policy, n: int, batch_size: int = 100) -> dict:
    """``{"accuracy", "consistency", "fully_consistent", "listed_exactly", "kinds": {kind: {"listed_exactly": [count,
    accuracy], "otherwise": [count, accuracy]}}}`` over the first ``n`` held-out Shapes-VQA questions, greedy."""
    from flowrl.envs.evaluate import greedy_episodes
    from flowrl.envs.rewards import consistent_match, exact_match, scene_match

    _, episodes = greedy_episodes(policy, "shapes_vqa", n, batch_size=batch_size, max_turns=1,
                                  max_new_tokens=ANSWER_MAX_NEW_TOKENS)
    texts, tasks = [e.final_text for e in episodes], [e.task for e in episodes]
    correct = exact_match([e.answer for e in episodes], tasks).tolist()
    exact_listing = (scene_match(texts, tasks) > 0.999).tolist()
    consistency = consistent_match(texts, tasks)
    split: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"listed_exactly": [], "otherwise": []})
    for task, right, listed in zip(tasks, correct, exact_listing):
        for kind in (task.kind, "all"):
            split[kind]["listed_exactly" if listed else "otherwise"].append(right)
    summary = {kind: {side: [len(v), sum(v) / len(v) if v else None] for side, v in sides.items()}
               for kind, sides in sorted(split.items())}
    return {"n": n, "accuracy": sum(correct) / n, "consistency": float(consistency.mean()),
            "fully_consistent": float((consistency > 0.999).float().mean()),
            "listed_exactly": sum(exact_listing) / n, "kinds": summary}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None, help="a model folder (default: the shipped model)")
    parser.add_argument("--n", type=int, default=500, help="held-out questions (default 500)")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args(argv)

    from flowrl.policies import TokenPolicy
    from flowrl.policies.shapes_vlm import SHIPPED_VLM

    result = trace_errors(TokenPolicy.from_pretrained(args.model or SHIPPED_VLM), args.n)
    print(f"accuracy {result['accuracy']:.3f}; scenes listed exactly {result['listed_exactly']:.3f}; trace "
          f"consistency {result['consistency']:.3f} (fully consistent {result['fully_consistent']:.3f})")
    for kind, sides in result["kinds"].items():
        cells = [f"{side.replace('_', ' ')} {count:4d} at {acc:.2f}" if count else f"{side} 0"
                 for side, (count, acc) in sides.items()]
        print(f"  {kind:9s} " + " | ".join(cells))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
