"""What ``k`` samples per question say about a policy: pass@j, majority@k, and the share of groups with mixed rewards.

Pure functions of per-sample correctness (no model): the image side's best-of-k (``experiments/headroom.py``) and the
VLM's sampled evaluation (:mod:`flowrl.envs.sampled_eval`, ``flowrl eval --task vqa --samples K``) share them.

- ``pass@j`` (:func:`pass_at`): the unbiased estimate of P(at least one of ``j`` samples is right) from ``n`` samples of
  which ``c`` are (Chen et al. 2021), ``1 - C(n - c, j) / C(n, j)``.
- ``mixed@g`` (:func:`mixed_at`): the unbiased estimate of P(a group of ``g`` samples holds both a right and a wrong
  one), ``1 - (C(c, g) + C(n - c, g)) / C(n, g)``: the share of GRPO groups of size ``g`` whose exact-answer advantage
  is not zero.
- ``majority@k`` (:func:`majority_vote`): the most frequent normalised answer among the ``k`` samples is right. Ties go
  to the tied answer sampled first; the samples are independent draws, so that is a uniform random tie-break, fixed by
  the seeds. An episode that never answered votes for the empty answer, which is never right.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

__all__ = ["pass_at", "mixed_at", "majority_vote", "summarise_samples", "pass_ks", "markdown_table"]


def pass_at(n: int, c: int, j: int) -> float:
    """Unbiased estimate of P(at least one of ``j`` samples is correct) from ``n`` samples of which ``c`` are:
    ``1 - C(n - c, j) / C(n, j)``."""
    if not 0 <= c <= n or not 1 <= j <= n:
        raise ValueError(f"pass@{j} needs 0 <= c <= n and 1 <= j <= n (n={n}, c={c})")
    if n - c < j:
        return 1.0
    return 1.0 - math.comb(n - c, j) / math.comb(n, j)


def mixed_at(n: int, c: int, g: int) -> float:
    """Unbiased estimate of P(a group of ``g`` of the samples holds a right and a wrong one) from ``n`` samples of
    which ``c`` are right: ``1 - (C(c, g) + C(n - c, g)) / C(n, g)``."""
    if not 0 <= c <= n or not 2 <= g <= n:
        raise ValueError(f"mixed@{g} needs 0 <= c <= n and 2 <= g <= n (n={n}, c={c})")
    return 1.0 - (math.comb(c, g) + math.comb(n - c, g)) / math.comb(n, g)


def majority_vote(answers: list[str]) -> str:
    """The most frequent of ``answers`` (normalised answers, in sample order); a tie goes to the tied answer whose
    first sample comes first."""
    if not answers:
        raise ValueError("a majority vote needs at least one answer")
    counts = Counter(answers)
    top = max(counts.values())
    return next(a for a in answers if counts[a] == top)


def pass_ks(k: int) -> list[int]:
    """``j`` = 1, 2, 4, ... up to ``k``, and ``k`` itself."""
    return sorted({2**i for i in range(int(math.log2(k)) + 1)} | {k})


def summarise_samples(kinds: list[str], greedy: list[bool], right: list[list[bool]], majority: list[bool],
                      group_sizes: tuple[int, ...] = (4,)) -> dict[str, dict[str, float | None]]:
    """Per question kind and over all (``"all"``), from ``N`` questions of ``k`` samples each.

    Args:
        kinds: ``[N]`` the kind of each question.
        greedy: ``[N]`` whether the greedy answer is right.
        right: ``[N][k]`` whether each sample is right.
        majority: ``[N]`` whether the majority answer of the samples is right (:func:`majority_vote`).
        group_sizes: the ``g`` of ``mixed@g`` (each between 2 and ``k``).

    Returns:
        ``{kind: {...}}`` with ``questions``, ``greedy`` (accuracy), ``pass@1`` (the mean of the samples: sampled
        accuracy), ``pass@j`` for :func:`pass_ks`, ``majority@k``, ``greedy_wrong`` (share of questions), ``rescued``
        (of the greedy-wrong questions, the share right in at least one sample; None when there are none),
        ``rescued_p_right`` (their mean share of right samples), ``greedy_right_sampled_minority`` (right greedily,
        sampled right in less than half the samples), ``greedy_wrong_sampled_majority`` (wrong greedily, sampled right
        in more than half), ``mixed@g``.
    """
    n = len(kinds)
    if not (len(greedy) == len(right) == len(majority) == n) or n == 0:
        raise ValueError(f"need the same number (> 0) of kinds, greedy, right and majority rows; got {n}, "
                         f"{len(greedy)}, {len(right)}, {len(majority)}")
    k = len(right[0])
    if k == 0 or any(len(r) != k for r in right):
        raise ValueError("every question needs the same number (> 0) of samples")
    bad = [g for g in group_sizes if not 2 <= g <= k]
    if bad:
        raise ValueError(f"group sizes must be between 2 and k = {k}; got {bad[0]}")
    rows: dict[str, list[int]] = defaultdict(list)
    for i, kind in enumerate(kinds):
        rows[kind].append(i)
    rows = {kind: rows[kind] for kind in sorted(rows)}
    rows["all"] = list(range(n))
    out = {}
    for kind, index in rows.items():
        counts = [sum(right[i]) for i in index]
        wrong = [(i, c) for i, c in zip(index, counts) if not greedy[i]]
        entry: dict[str, float | None] = {
            "questions": len(index), "greedy": _mean(greedy[i] for i in index)}
        entry.update({f"pass@{j}": _mean(pass_at(k, c, j) for c in counts) for j in pass_ks(k)})
        entry["majority@k"] = _mean(majority[i] for i in index)
        entry["greedy_wrong"] = len(wrong) / len(index)
        entry["rescued"] = _mean(c > 0 for _, c in wrong) if wrong else None
        entry["rescued_p_right"] = _mean(c / k for _, c in wrong) if wrong else None
        entry["greedy_right_sampled_minority"] = _mean(greedy[i] and 2 * c < k for i, c in zip(index, counts))
        entry["greedy_wrong_sampled_majority"] = _mean(not greedy[i] and 2 * c > k for i, c in zip(index, counts))
        entry.update({f"mixed@{g}": _mean(mixed_at(k, c, g) for c in counts) for g in group_sizes})
        out[kind] = entry
    return out


def _mean(values) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values)


def markdown_table(summary: dict[str, dict[str, float | None]], k: int, title: str = "") -> str:
    """One row per kind of :func:`summarise_samples`'s result, ``all`` last."""
    first = next(iter(summary.values()))
    passes = [key for key in first if key.startswith("pass@")]
    mixed = [key for key in first if key.startswith("mixed@")]
    columns = ["greedy", *passes, "majority@k", "rescued", *mixed]
    names = {"pass@1": "sampled pass@1", "majority@k": f"majority of {k}",
             "rescued": f"greedy wrong, right in >= 1 of {k}"}
    lines = [title, ""] if title else []
    lines += ["| kind | questions | " + " | ".join(names.get(c, c) for c in columns) + " |",
              "|---|---|" + "---|" * len(columns)]
    for kind in [kd for kd in summary if kd != "all"] + ["all"]:
        e = summary[kind]
        cells = ["-" if e[c] is None else f"{e[c]:.3f}" for c in columns]
        lines.append(f"| {kind} | {e['questions']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
