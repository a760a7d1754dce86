"""Does the shapes model's text conditioning tell the prompt's words apart? For pairs of prompts that differ in one
word (a shape, a colour, a count, a relation's direction), the cosine similarity of the text encoder's outputs at the
tokens where the two prompts differ. The UNet sees the prompt only through these vectors (cross-attention), and every
RL trainer here trains the UNet alone: a word whose vector barely changes is a word no UNet-only trainer can learn
to obey.

    python experiments/text_conditioning.py [--model DIR ...] [--out experiments/results/text_conditioning]

``--model``: model folders to compare (default: the shipped model only); writes ``.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: (what differs, prompt pairs): each pair differs in exactly one word.
PAIRS = {
    "shape": [("a square and a circle", "a square and a triangle"), ("a red circle", "a red square")],
    "colour": [("a red square and a purple triangle", "a red square and a blue triangle"),
               ("a green triangle", "a yellow triangle")],
    "count": [("three purple squares", "two purple squares"), ("two red circles", "four red circles")],
    "relation, left vs right": [("a red circle left of a blue square", "a red circle right of a blue square"),
                                ("a yellow triangle left of a green circle",
                                 "a yellow triangle right of a green circle")],
    "relation, above vs below": [("a green triangle above a blue square", "a green triangle below a blue square"),
                                 ("a red circle above a blue square", "a red circle below a blue square")],
}


def token_cosines(model, a: str, b: str) -> list[float]:
    """Cosine similarity of the text encoder's outputs for ``a`` and ``b`` at each token where their ids differ."""
    import torch

    with torch.no_grad():
        hidden = model.encode_prompts([a, b])["encoder_hidden_states"].float()  # [2, L, D]
    ids = model.tokenize([a, b])["input_ids"]
    differ = (ids[0] != ids[1]).nonzero().flatten().tolist()
    if not differ:
        raise ValueError(f"{a!r} and {b!r} tokenize the same")
    return [float(torch.nn.functional.cosine_similarity(hidden[0, t], hidden[1, t], dim=0)) for t in differ]


def measure(path: str | None) -> dict[str, float]:
    """``{what differs: the lowest cosine at a differing token, averaged over its pairs}`` for one model folder."""
    from flowrl.models.config import ModelConfig, build_model

    model = build_model(ModelConfig(name="shapes", path=path), "cpu").eval()
    return {what: sum(min(token_cosines(model, a, b)) for a, b in pairs) / len(pairs) for what, pairs in PAIRS.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="experiments/text_conditioning.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=[], metavar="NAME=DIR")
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "text_conditioning")
    args = p.parse_args(argv)
    models = {"shipped model": None} | {spec.partition("=")[0]: spec.partition("=")[2] for spec in args.model}
    result = {name: measure(path) for name, path in models.items()}
    lines = ["| word that differs | " + " | ".join(result) + " |", "|---|" + "---|" * len(result)]
    for what in PAIRS:
        lines.append(f"| {what} | " + " | ".join(f"{result[m][what]:.3f}" for m in result) + " |")
    table = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"pairs": PAIRS, "cosine": result}, indent=2) + "\n")
    args.out.with_suffix(".md").write_text("Cosine similarity of the text encoder's outputs at the differing token "
                                           "(1 = the UNet cannot tell the two prompts apart)\n\n" + table)
    print(table)
    return result


if __name__ == "__main__":
    main()
