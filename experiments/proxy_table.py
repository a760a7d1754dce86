"""Held-out agreement of the learned shapes proxies with the gold, per number of gold labels (issue: reward
over-optimisation).

Reads the ``report.json`` that ``flowrl train-reward shapes-proxy`` writes beside each proxy (held-out rows of the
pool: prompts and seeds the proxy never saw) and writes one table: per ``n``, the mean ± std over seeds of the
accuracy at 0.5, AUC, expected calibration error and Brier score, then the per-kind accuracy::

    python experiments/proxy_table.py --proxies proxies/n500_s* proxies/n2000_s* proxies/n8000_s* \\
        --out experiments/results/proxies
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

METRICS = ("accuracy", "auc", "ece", "brier")


def mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def table(reports: list[dict]) -> tuple[dict, str]:
    """``reports``: the proxies' ``report.json``. Returns (summary by n, a markdown table)."""
    by_n: dict[int, list[dict]] = {}
    for report in reports:
        by_n.setdefault(int(report["n_train"]), []).append(report)
    kinds = list(reports[0]["heldout"]["by_kind"])
    summary, lines = {}, [
        "| gold labels n | seeds | accuracy | AUC | ECE | Brier | train accuracy | "
        + " | ".join(kinds) + " |",
        "|" + "---|" * (7 + len(kinds))]
    for n in sorted(by_n):
        group = by_n[n]
        entry = {m: [r["heldout"][m] for r in group] for m in METRICS}
        entry["train_accuracy"] = [r["train"]["accuracy"] for r in group]
        entry["by_kind"] = {k: [r["heldout"]["by_kind"][k]["accuracy"] for r in group] for k in kinds}
        entry["seeds"] = [r["seed"] for r in group]
        summary[n] = entry
        lines.append(f"| {n} | {len(group)} | " + " | ".join(mean_std(entry[m]) for m in METRICS)
                     + f" | {mean_std(entry['train_accuracy'])} | "
                     + " | ".join(f"{statistics.mean(entry['by_kind'][k]):.2f}" for k in kinds) + " |")
    heldout = reports[0]["heldout"]
    # A proxy that answers the majority label of a kind: the accuracy a per-kind number must beat.
    majority = {k: max(v["gold_rate"], 1 - v["gold_rate"]) for k, v in heldout["by_kind"].items()}
    overall = max(heldout["gold_rate"], 1 - heldout["gold_rate"])
    lines.append(f"| majority label (no proxy) | | {overall:.3f} | 0.5 | | | | "
                 + " | ".join(f"{majority[k]:.2f}" for k in kinds) + " |")
    lines.append("")
    lines.append(f"Held-out: {heldout['n']} pool rows (gold rate {heldout['gold_rate']:.3f}); per kind: the mean "
                 "accuracy over seeds.")
    return summary, "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--proxies", nargs="+", required=True, help="proxy folders (each with report.json)")
    parser.add_argument("--out", required=True, help="output path without suffix (.json and .md are written)")
    args = parser.parse_args(argv)
    reports = [json.loads((Path(folder) / "report.json").read_text()) for folder in args.proxies]
    summary, markdown = table(reports)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"proxies": args.proxies, "by_n": summary}, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown + "\n")
    print(markdown)


if __name__ == "__main__":
    main()
