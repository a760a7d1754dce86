"""The figure of `make demo`'s result for the README: strict accuracy (the gold) on the 600 held-out prompts against
training minutes, overall and per task kind, with the share of images that draw an object the prompt did not ask for
and the lenient rule beside it.

    python experiments/demo_figure.py RUN_OR_RECORD [--out docs/demo_strict_eval.png]

``RUN_OR_RECORD``: a run folder (``metrics.jsonl``) or a record folder (``metrics.jsonl.gz``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

KINDS = ["single_object", "two_object", "counting", "colors", "position", "color_attr"]


def evaluations(folder: Path) -> list[dict]:
    """The rows of ``folder``'s metrics that hold a held-out evaluation, in order."""
    from experiments.runs import read_rows

    return [r for r in read_rows(folder) if "eval/shapes/accuracy" in r]


def draw(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.runs import save_figure

    minutes = [r.get("time/train_min", 0.0) for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 2]})
    left.plot(minutes, [r["eval/shapes/accuracy"] for r in rows], "k-o", lw=2.5, label="strict accuracy (all)")
    for kind in KINDS:
        left.plot(minutes, [r[f"eval/shapes/{kind}"] for r in rows], "-o", lw=1, ms=3, label=kind)
    left.plot(minutes, [r["eval/shapes/lenient_accuracy"] for r in rows], "k:", lw=1, label="lenient rule (all)")
    left.set(xlabel="training minutes", ylabel="held-out accuracy (600 prompts)", ylim=(0, 1.02),
             title="make demo: strict accuracy per task kind")
    left.grid(alpha=0.3)
    left.legend(fontsize=7, loc="lower right")
    right.plot(minutes, [r.get("hack/extra_object_rate", float("nan")) for r in rows], "r-o")
    right.set(xlabel="training minutes", ylabel="share of images", ylim=(0, None),
              title="images with an object not asked for")
    right.grid(alpha=0.3)
    save_figure(fig, out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="experiments/demo_figure.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "demo_strict_eval.png")
    args = p.parse_args(argv)
    draw(evaluations(args.run), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
