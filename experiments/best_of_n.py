"""Best-of-n against learned proxies of the shapes world's gold: over-optimisation without training.

Gao, Schulman & Hilton 2023 ("Scaling laws for reward model overoptimization") measure how the gold score of the
proxy's best-of-n choice moves as ``n`` grows, against ``KL_bon = log n - (n - 1) / n``, the KL divergence of the
best-of-n policy from the base. Here the base is the shipped shapes model (the deterministic ODE, one image per
seed), the gold is strict accuracy (:func:`rewards.shapes.strict_correct`), and each proxy is a learned reward
(:mod:`rewards.shapes_proxy`: one model, or an ensemble of several seeds scored by ``mean`` or ``mean - k std``,
Coste et al. 2024).

For each of ``--prompts`` eval prompts the script draws ``--samples`` (``N``) images, scores every image with the gold
and every proxy, and reports for ``n`` in 1, 2, 4, ... up to ``N`` the expected gold and proxy score of the proxy's
best of ``n`` with the unbiased estimator of the paper (:func:`best_of_n_expectation`: the expectation over every
``n``-subset of the ``N`` samples, computed in closed form, ties in the proxy broken uniformly at random), averaged
over prompts, with the task kinds beside it. Beside the proxies, ``gold`` is the gold's own best of ``n`` (the
oracle: pass@n). Per proxy it also fits Gao et al.'s best-of-n form ``gold(d) - gold(0) = d (a - b d)`` with
``d = sqrt(KL_bon)`` (least squares) and reports the proxy's agreement with the gold on all ``P x N`` samples
(accuracy, AUC, ECE, Brier).

Writes ``OUT.json`` (settings, curves, fits, agreement) and ``OUT.png`` (gold and proxy score against ``d``). The
images and gold labels are cached in ``--cache`` (a safetensors file) so that more proxies can be scored later
without sampling again. Tiny defaults for a quick check; the study's sizes, after training the proxies
(``flowrl train-reward shapes-proxy-data --n 8000 --out POOL`` and ``flowrl train-reward shapes-proxy --data POOL
--n N --seed S --out DIR`` for several ``N`` and seeds)::

    python experiments/best_of_n.py --prompts 120 --samples 64 --precision bfloat16 \\
        --proxy n1000=proxies/n1000_s0 --proxy ens1000=proxies/n1000_s0,proxies/n1000_s1,proxies/n1000_s2 \\
        --cache experiments/out/bon_samples.safetensors --out experiments/results/best_of_n
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

SEED_STRIDE = 1_000_003  # sample j of a prompt uses its evaluation seed + j * SEED_STRIDE (as experiments/headroom.py)


def kl_bon(n: int) -> float:
    """KL divergence of the best-of-``n`` policy from the base: ``log n - (n - 1) / n`` (Gao et al. 2023)."""
    return math.log(n) - (n - 1) / n


def best_of_n_weights(total: int, n: int) -> np.ndarray:
    """Chance that the sample of ascending rank ``i`` (1-based) is the best of a uniformly random ``n``-subset of
    ``total``: ``C(i - 1, n - 1) / C(total, n)`` (it is in the subset and the other ``n - 1`` rank below it).

    Returns:
        ``[total]`` float64, summing to 1.
    """
    if not 1 <= n <= total:
        raise ValueError(f"best of {n} needs 1 <= n <= N (N={total})")
    denominator = math.comb(total, n)
    # Python's int / int rounds the exact ratio once, even for binomials far beyond float range.
    return np.array([math.comb(i - 1, n - 1) / denominator for i in range(1, total + 1)])


def best_of_n_expectation(selector, values, n: int) -> float:
    """Expected ``values`` of the sample with the highest ``selector`` among a uniformly random ``n``-subset.

    The unbiased estimator of best-of-n from ``N`` samples (Gao et al. 2023, following Nakano et al. 2021): the mean
    over all ``C(N, n)`` subsets, in closed form (:func:`best_of_n_weights`). Ties in ``selector`` are broken
    uniformly at random: tied samples share the mean of their ranks' weights.

    Args:
        selector: ``[N]`` scores that choose (the proxy); values: ``[N]`` what is measured (the gold, or the proxy).
        n: subset size, ``1 <= n <= N``.
    """
    s, v = np.asarray(selector, dtype=np.float64), np.asarray(values, dtype=np.float64)
    if s.shape != v.shape or s.ndim != 1:
        raise ValueError(f"selector {s.shape} and values {v.shape} must both be [N]")
    weights = best_of_n_weights(s.size, n)
    order = np.argsort(s, kind="stable")
    sorted_s, sorted_v = s[order], v[order]
    total, start = 0.0, 0
    while start < s.size:  # one group of equal selector values at a time
        end = start + 1
        while end < s.size and sorted_s[end] == sorted_s[start]:
            end += 1
        total += weights[start:end].mean() * sorted_v[start:end].sum()
        start = end
    return float(total)


def powers_of_two(total: int) -> list[int]:
    """1, 2, 4, ... up to ``total``, and ``total`` itself."""
    return sorted({2 ** i for i in range(int(math.log2(total)) + 1)} | {total})


def curve(selector: np.ndarray, gold: np.ndarray, proxy: np.ndarray, kinds: list[str], ns: list[int]) -> list[dict]:
    """Best-of-n curve of one selector over prompts.

    Args:
        selector, gold, proxy: ``[P, N]`` (prompt x sample); kinds: ``P`` task kinds.

    Returns:
        Per ``n``: ``n``, ``kl``, ``d`` (``sqrt(kl)``), the prompt means of the expected ``gold`` and ``proxy`` of the
        selector's choice, and ``gold_by_kind``.
    """
    points = []
    for n in ns:
        g = np.array([best_of_n_expectation(s, v, n) for s, v in zip(selector, gold)])
        p = np.array([best_of_n_expectation(s, v, n) for s, v in zip(selector, proxy)])
        by_kind = {kind: float(g[[k == kind for k in kinds]].mean()) for kind in dict.fromkeys(kinds)}
        points.append({"n": n, "kl": kl_bon(n), "d": math.sqrt(kl_bon(n)), "gold": float(g.mean()),
                       "proxy": float(p.mean()), "gold_by_kind": by_kind})
    return points


def fit_gold(points: list[dict]) -> dict | None:
    """Least-squares ``gold(d) - gold(d=0) = d (a - b d)`` over a curve's points (Gao et al.'s best-of-n form);
    None with fewer than two points beyond ``n = 1``."""
    d = np.array([p["d"] for p in points])
    gain = np.array([p["gold"] for p in points]) - points[0]["gold"]
    if (d > 0).sum() < 2:
        return None
    design = np.stack([d, -d ** 2], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, gain, rcond=None)
    return {"a": float(a), "b": float(b), "d_peak": float(a / (2 * b)) if b > 0 else None}


def parse_proxy(text: str) -> tuple[str, list[str]]:
    """``LABEL=DIR[,DIR...]`` or ``DIR[,DIR...]`` (labelled by the first folder's name) -> (label, folders)."""
    label, _, folders = text.rpartition("=")
    dirs = [d for d in folders.split(",") if d]
    if not dirs:
        raise argparse.ArgumentTypeError(f"--proxy {text!r}: give LABEL=DIR or LABEL=DIR1,DIR2,... (an ensemble)")
    return label or Path(dirs[0]).name, dirs


def sample(model_spec: str, rows: list[tuple[str, str, int]], samples: int, *, steps: int, precision: str,
           batch_size: int, cache: str | None) -> tuple[torch.Tensor, np.ndarray]:
    """The base model's ``samples`` images per row, uint8 ``[P * N, 3, H, W]`` (prompt-major), and their gold labels
    ``[P, N]`` (judged on the stored uint8 pixels, as the proxies' training pools are); read from ``cache`` when it
    holds the same rows, samples and steps."""
    from safetensors.torch import load_file, save_file

    from rewards.shapes_proxy_data import judge_images, to_uint8

    prompts = [r[0] for r in rows for _ in range(samples)]
    seeds = [r[2] + j * SEED_STRIDE for r in rows for j in range(samples)]
    described = json.dumps({"model": model_spec, "seeds": seeds, "prompts": prompts, "steps": steps,
                            "precision": precision})
    key = hashlib.sha256(described.encode()).hexdigest()  # what the cached images were drawn for
    if cache and Path(cache).is_file():
        from safetensors import safe_open

        with safe_open(cache, "pt") as handle:
            stored_key = (handle.metadata() or {}).get("key")
        if stored_key == key:
            images = load_file(cache)["images"]
            gold = judge_images(images, prompts)["correct"].numpy().reshape(len(rows), samples)
            return images, gold
        print(f"best_of_n: {cache} holds other samples; sampling again and replacing it", flush=True)
    from flowrl.eval.generate import generate
    from flowrl.models.shapes import ShapesModel

    model = ShapesModel.from_pretrained(None if model_spec == "shapes" else model_spec)
    images = to_uint8(generate(model, prompts, seeds, steps=steps, precision=precision, batch_size=batch_size))
    if cache:
        Path(cache).parent.mkdir(parents=True, exist_ok=True)
        save_file({"images": images.contiguous()}, cache, metadata={"key": key})
    gold = judge_images(images, prompts)["correct"].numpy().reshape(len(rows), samples)
    return images, gold


def score_members(folders: list[str], images: torch.Tensor, prompts: list[str], output: str,
                  batch_size: int = 512) -> dict[str, np.ndarray]:
    """Each proxy folder's scores (``output`` space) and probabilities of ``images``: folder -> ``[2, B]``."""
    import rewards

    out = {}
    for folder in folders:
        reward = rewards.load("shapes_proxy", path=folder, output=output)
        scores, probs = [], []
        for start in range(0, len(prompts), batch_size):
            chunk = images[start:start + batch_size].float() / 255.0
            result = reward(chunk, prompts[start:start + batch_size])
            scores.append(result.scores)
            probs.append(result.details["shapes_proxy/p_correct"])
        out[folder] = np.stack([torch.cat(scores).numpy(), torch.cat(probs).numpy()])
    return out


def plot(result: dict, path: Path) -> None:
    """Gold (solid) and proxy score (dashed) of each selector's best of n against ``d = sqrt(KL_bon)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    oracle = result["oracle"]
    for ax in axes:
        ax.plot([p["d"] for p in oracle], [p["gold"] for p in oracle], "k:", label="gold's own best of n (pass@n)")
    for index, (label, entry) in enumerate(result["proxies"].items()):
        colour = colours[index % len(colours)]
        d = [p["d"] for p in entry["curve"]]
        axes[0].plot(d, [p["gold"] for p in entry["curve"]], "-o", color=colour, ms=3, label=f"{label}: gold")
        axes[0].plot(d, [p["proxy"] for p in entry["curve"]], "--", color=colour, label=f"{label}: proxy")
        gain = [p["gold"] - entry["curve"][0]["gold"] for p in entry["curve"]]
        axes[1].plot(d, np.array(gain) + oracle[0]["gold"], "o", color=colour, ms=3, label=label)
        if entry["fit"] is not None:
            grid = np.linspace(0, max(d), 100)
            fit = entry["fit"]
            axes[1].plot(grid, grid * (fit["a"] - fit["b"] * grid) + oracle[0]["gold"], "-", color=colour,
                         label=f"{label}: fit d(a - bd), a={fit['a']:.3f}, b={fit['b']:.3f}")
    axes[0].set_title("gold (strict accuracy) and proxy score of the proxy's best of n")
    axes[1].set_title("gold against d, with Gao et al.'s best-of-n fit")
    for ax in axes:
        ax.set_xlabel("d = sqrt(KL_bon),  KL_bon = log n - (n - 1) / n")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("score")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxy", type=parse_proxy, action="append", default=[],
                        help="LABEL=DIR (one proxy) or LABEL=DIR1,DIR2,... (an ensemble); repeat for several")
    parser.add_argument("--aggregates", nargs="+", default=["mean", "mean_minus_std"],
                        choices=("mean", "mean_minus_std", "min"), help="how ensembles are scored (default: both)")
    parser.add_argument("--k", type=float, default=1.0, help="the std's weight in mean_minus_std (default 1)")
    parser.add_argument("--output", choices=("probability", "logit"), default="probability",
                        help="the proxies' score (default: the probability)")
    parser.add_argument("--model", default="shapes", help="the base model: shapes (shipped) or a saved model folder")
    parser.add_argument("--prompts", type=int, default=12, help="eval prompts, the first of the eval set (default 12)")
    parser.add_argument("--samples", type=int, default=8, help="N, samples per prompt (default 8)")
    parser.add_argument("--steps", type=int, default=20, help="ODE steps (default 20, the evaluation's)")
    parser.add_argument("--precision", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache", default=None, help="a .safetensors file keeping the samples for later runs")
    parser.add_argument("--out", required=True, help="output path without suffix (.json and .png are written)")
    args = parser.parse_args(argv)
    if args.samples < 1 or args.prompts < 1:
        parser.error("--samples and --prompts must be at least 1")
    if args.k < 0:
        parser.error("--k must be >= 0")
    torch.set_num_threads(args.threads)

    from flowrl.data.shapes import eval_prompt_set
    from rewards.shapes_proxy import agreement_metrics, aggregate_members

    rows = eval_prompt_set(args.prompts)
    kinds = [r[1] for r in rows]
    start = time.process_time()
    images, gold = sample(args.model, rows, args.samples, steps=args.steps, precision=args.precision,
                          batch_size=args.batch_size, cache=args.cache)
    sampling_seconds = round(time.process_time() - start, 1)
    prompts = [r[0] for r in rows for _ in range(args.samples)]
    folders = list(dict.fromkeys(d for _, dirs in args.proxy for d in dirs))
    members = score_members(folders, images, prompts, args.output)
    ns = powers_of_two(args.samples)
    shape = (len(rows), args.samples)
    result = {"settings": {k: v for k, v in vars(args).items() if k not in ("out", "proxy")},
              "proxy_folders": {label: dirs for label, dirs in args.proxy}, "seed_stride": SEED_STRIDE,
              "ns": ns, "kl_bon": [kl_bon(n) for n in ns], "gold_rate": float(gold.mean()),
              "oracle": curve(gold, gold, gold, kinds, ns), "proxies": {}}
    for label, dirs in args.proxy:
        scores = torch.from_numpy(np.stack([members[d][0] for d in dirs]))  # [K, P * N]
        probs = np.stack([members[d][1] for d in dirs]).mean(0)
        aggregates = args.aggregates if len(dirs) > 1 else ["mean"]  # one member: every aggregate is its score
        for how in aggregates:
            name = label if how == "mean" else f"{label}:{how}" + (f"(k={args.k:g})" if how == "mean_minus_std" else "")
            score = aggregate_members(scores, how, args.k).numpy().reshape(shape)
            points = curve(score, gold, score, kinds, ns)
            result["proxies"][name] = {"members": dirs, "aggregate": how, "curve": points, "fit": fit_gold(points),
                                       "agreement": agreement_metrics(probs, gold.reshape(-1))}
    result["cpu_seconds"] = {"sampling": sampling_seconds, "total": round(time.process_time() - start, 1)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"best_of_n: {len(rows)} prompts x {args.samples} samples, gold rate {result['gold_rate']:.3f}")
    for name, entry in [("gold (oracle)", {"curve": result["oracle"]}), *result["proxies"].items()]:
        print(f"  {name:36s} " + "  ".join(f"n={p['n']}: gold {p['gold']:.3f} proxy {p['proxy']:.3f}"
                                           for p in entry["curve"]), flush=True)
    return result


if __name__ == "__main__":
    main()
