"""Training data of the shapes proxy (:mod:`rewards.shapes_proxy`): base-model images labelled by the strict judge.

A **pool** is one folder::

    pool.json              rows (prompt, kind, seed, gold labels) and what made them
    images.safetensors     "images": [N, 3, H, W] uint8

Its rows are two streams of the training split's prompts (:func:`flowrl.data.shapes.prompt_rows`, whose task kinds
cycle, so every prefix is balanced over kinds to within one row; every row has its own sampling seed):

- the **training stream**, rows ``0 .. n_train - 1``: ``prompt_rows("train", n_train, seed)``. Row ``i`` depends
  only on ``(seed, i)``, so the first ``n`` rows of a pool of the largest ``n`` *are* the pool of ``n``: one labelled
  pool serves every smaller ``n`` as a prefix (``flowrl train-reward shapes-proxy --n N`` reads the first ``N``);
- the **held-out stream**, rows ``n_train ..``: ``prompt_rows("train", n_heldout, seed + HELDOUT_STREAM)``, disjoint
  from every training prefix (other sampling seeds) and the same whatever ``n_train`` is, so proxies trained on
  pools of different sizes are compared on the same held-out images.

Images come from the base model's deterministic ODE (:func:`flowrl.eval.generate.generate`, one image per row's
seed), are stored as uint8, and are labelled **after** rounding to uint8, so every stored label is the judge's
verdict on exactly the stored image. Labels: ``correct`` (the gold, strict accuracy: ``details["correct"]`` of the
``shapes`` reward), and beside it ``lenient`` and ``objects`` (the number of detected objects) for analysis.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ._loading import require_files
from .base import RewardError

__all__ = ["ProxyPool", "POOL_FILES", "HELDOUT_STREAM", "pool_rows", "judge_images", "write_pool", "sample_pool",
           "read_pool", "to_uint8"]

POOL_FILES = ("pool.json", "images.safetensors")
POOL_FORMAT = "shapes_proxy_pool"
HELDOUT_STREAM = 1000  # the held-out stream's prompt_rows seed is the pool's seed + this
MAX_STREAM = 100_000  # prompt_rows gives row i of seed s the sampling seed s * 100_000 + i: streams stay disjoint
POOL_FIX = "Write one with `flowrl train-reward shapes-proxy-data --n N --heldout-n M --out DIR` and pass --data DIR."


Row = tuple[str, str, int]  # (prompt, kind, sampling seed), as flowrl.data.shapes.prompt_rows gives them


def pool_rows(n_train: int, n_heldout: int, seed: int = 0) -> tuple[list[Row], list[Row]]:
    """The (prompt, kind, sampling seed) rows of a pool's training and held-out streams (module docstring)."""
    from flowrl.data.shapes import prompt_rows

    if not 0 < n_train <= MAX_STREAM or not 0 <= n_heldout <= MAX_STREAM:
        raise RewardError(f"shapes_proxy data: n must be 1 to {MAX_STREAM} and the held-out size 0 to {MAX_STREAM} "
                          f"(received {n_train} and {n_heldout}); beyond that the streams' seeds would overlap")
    return prompt_rows("train", n_train, seed), prompt_rows("train", n_heldout, seed + HELDOUT_STREAM)


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """``[N, 3, H, W]`` float in [0, 1] (or uint8, returned as is) -> uint8, rounded to the nearest level."""
    if images.dtype == torch.uint8:
        return images
    return (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()


def judge_images(images: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
    """The strict judge's verdicts on ``images`` (``[N, 3, H, W]`` uint8 or float in [0, 1]).

    Returns:
        ``correct`` (strict accuracy, the gold), ``lenient`` and ``objects`` (detected objects): ``[N]`` float32 each.
    """
    from .shapes import ShapesReward

    out = ShapesReward()(images, list(prompts))  # uint8 is read as value / 255
    return {name: out.details[name] for name in ("correct", "lenient", "objects")}


def write_pool(out: str | Path, images: torch.Tensor, train_rows: Sequence[tuple[str, str, int]],
               heldout_rows: Sequence[tuple[str, str, int]] = (), info: dict[str, Any] | None = None) -> dict[str, Any]:
    """Label ``images`` with the strict judge and write a pool into the folder ``out`` (created if needed).

    Args:
        images: ``[n_train + n_heldout, 3, H, W]`` in [0, 1] or uint8, the training rows' images first.
        train_rows, heldout_rows: ``(prompt, kind, seed)`` per image.
        info: provenance stored in ``pool.json`` (generator, steps, ...).

    Returns:
        The summary stored in ``pool.json`` (sizes and gold rates, overall and per kind).
    """
    from safetensors.torch import save_file

    rows = list(train_rows) + list(heldout_rows)
    if images.dim() != 4 or images.shape[0] != len(rows) or images.shape[1] != 3:
        raise RewardError(f"shapes_proxy data: {tuple(images.shape)} images for {len(rows)} rows; give "
                          "[rows, 3, H, W]")
    stored = to_uint8(images)
    labels = judge_images(stored, [r[0] for r in rows])  # the verdict on exactly the stored pixels
    n_train = len(train_rows)
    records = [{"prompt": prompt, "kind": kind, "seed": int(seed), "correct": int(labels["correct"][i]),
                "lenient": int(labels["lenient"][i]), "objects": int(labels["objects"][i])}
               for i, (prompt, kind, seed) in enumerate(rows)]
    summary = {"n_train": n_train, "n_heldout": len(rows) - n_train,
               "gold_rate_train": _rate(records[:n_train]), "gold_rate_heldout": _rate(records[n_train:]),
               "gold_rate_train_by_kind": _rate_by_kind(records[:n_train])}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({"images": stored.contiguous()}, str(out / "images.safetensors"))
    document = {"format": POOL_FORMAT, "version": 1, **summary, "info": info or {}, "rows": records}
    (out / "pool.json").write_text(json.dumps(document, indent=1) + "\n")
    return summary


def _rate(records: list[dict]) -> float | None:
    return sum(r["correct"] for r in records) / len(records) if records else None


def _rate_by_kind(records: list[dict]) -> dict[str, float]:
    kinds: dict[str, list[dict]] = {}
    for record in records:
        kinds.setdefault(record["kind"], []).append(record)
    return {kind: _rate(group) for kind, group in kinds.items()}


def sample_pool(out: str | Path, n: int, heldout_n: int = 1000, *, model=None, seed: int = 0, steps: int = 20,
                precision: str = "float32", batch_size: int = 64,
                log: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Draw the base model's images of a pool's rows (module docstring), label them, write the pool into ``out``.

    Args:
        n: rows of the training stream (the largest ``n`` the pool will serve).
        heldout_n: rows of the held-out stream.
        model: a loaded :class:`flowrl.models.base.FlowModel`, a saved shapes-model folder, or None / ``"shapes"``
            for the shipped model.
        seed: the pool's seed (prompts and sampling seeds of both streams derive from it).
        steps, precision, batch_size: of :func:`flowrl.eval.generate.generate` (20 steps: the evaluation's).

    Returns:
        The pool's summary (sizes, gold rates).
    """
    from flowrl.eval.generate import generate

    train_rows, heldout_rows = pool_rows(n, heldout_n, seed)
    name = "shapes" if model is None or model == "shapes" else (str(model) if isinstance(model, (str, Path))
                                                                  else type(model).__name__)
    if model is None or isinstance(model, (str, Path)):
        from flowrl.models.base import ModelLoadError
        from flowrl.models.shapes import ShapesModel

        try:
            model = ShapesModel.from_pretrained(None if model in (None, "shapes") else model)
        except ModelLoadError as err:
            raise RewardError(f"shapes_proxy data: {err}") from None
    rows = train_rows + heldout_rows
    start = time.perf_counter()
    chunks = []
    chunk_size = max(batch_size, 256)
    for first in range(0, len(rows), chunk_size):  # uint8 as it goes: a pool of 9k images never sits in float32
        part = rows[first:first + chunk_size]
        images = generate(model, [r[0] for r in part], [r[2] for r in part], steps=steps, precision=precision,
                          batch_size=batch_size)
        chunks.append(to_uint8(images))
        if log is not None:
            log(f"sampled {first + len(part)}/{len(rows)} images ({time.perf_counter() - start:.0f} s)")
    info = {"generator": name, "steps": steps, "precision": precision, "seed": seed, "split": "train",
            "heldout_stream_seed": seed + HELDOUT_STREAM, "sampler": "euler ODE (flowrl.eval.generate)",
            "seconds": round(time.perf_counter() - start, 1), "torch": torch.__version__}
    return write_pool(out, torch.cat(chunks), train_rows, heldout_rows, info)


@dataclass
class ProxyPool:
    """A pool read back (:func:`read_pool`).

    Attributes:
        images: ``[N, 3, H, W]`` uint8, the training stream's rows first.
        prompts, kinds, seeds: per row.
        correct: ``[N]`` float32 gold labels (strict accuracy); lenient: ``[N]`` the lenient rule's.
        n_train, n_heldout: the streams' sizes (``N = n_train + n_heldout``).
        info: the pool's provenance.
    """

    images: torch.Tensor
    prompts: list[str]
    kinds: list[str]
    seeds: list[int]
    correct: torch.Tensor
    lenient: torch.Tensor
    n_train: int
    n_heldout: int
    info: dict = field(default_factory=dict)

    def prefix(self, n: int) -> tuple[torch.Tensor, list[str], torch.Tensor, list[str]]:
        """The first ``n`` training rows: ``(images [n, 3, H, W] uint8, prompts, labels [n], kinds)``."""
        if not 1 <= n <= self.n_train:
            raise RewardError(f"shapes_proxy data: --n {n} asks for more training rows than the pool's {self.n_train}; "
                              f"give --n up to {self.n_train} or write a larger pool")
        return self.images[:n], self.prompts[:n], self.correct[:n], self.kinds[:n]

    def heldout(self) -> tuple[torch.Tensor, list[str], torch.Tensor, list[str]]:
        """The held-out rows, as :meth:`prefix` returns them."""
        s = slice(self.n_train, self.n_train + self.n_heldout)
        return self.images[s], self.prompts[s], self.correct[s], self.kinds[s]


def read_pool(path: str | Path) -> ProxyPool:
    """Read a pool written by :func:`write_pool`.

    Raises:
        RewardError: the folder or a file is missing, or the files are not a consistent pool (names the fix).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = require_files(path, "shapes_proxy data", "pool", POOL_FILES, POOL_FIX)
    try:
        document = json.loads((folder / "pool.json").read_text())
        if not isinstance(document, dict) or document.get("format") != POOL_FORMAT:
            raise ValueError(f"pool.json is not a {POOL_FORMAT} file")
        rows = document["rows"]
        images = load_file(str(folder / "images.safetensors"))["images"]
        n_train, n_heldout = int(document["n_train"]), int(document["n_heldout"])
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[0] != len(rows) \
                or len(rows) != n_train + n_heldout:
            raise ValueError(f"{tuple(images.shape)} {images.dtype} images for {len(rows)} rows "
                             f"({n_train} + {n_heldout})")
        pool = ProxyPool(images, [str(r["prompt"]) for r in rows], [str(r["kind"]) for r in rows],
                         [int(r["seed"]) for r in rows],
                         torch.tensor([float(r["correct"]) for r in rows]),
                         torch.tensor([float(r["lenient"]) for r in rows]), n_train, n_heldout,
                         document.get("info", {}))
    except (ValueError, KeyError, TypeError, OSError, SafetensorError) as err:
        raise RewardError(f"shapes_proxy data: {str(folder)!r} is not a readable pool ({type(err).__name__}: "
                          f"{' '.join(str(err).split())[:200]}). {POOL_FIX}") from None
    return pool
