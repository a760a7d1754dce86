"""``flowrl score``: score a folder of images (or webdataset shards) with one or more rewards.

::

    flowrl score --reward pickscore,aesthetic:0.5 --images DIR --prompts prompts.txt --out scores.jsonl \\
        --reward-arg aesthetic.mlp_path=/models/sac+logos+ava1-l14-linearMSE.pth --batch-size 16 --device cuda

Inputs:

- ``--images DIR``: the ``.png/.jpg/.jpeg/.webp/.bmp`` files directly in DIR, in sorted filename order.
  Prompts come from, in this order of precedence:
  ``--prompts FILE.txt`` (one prompt per line, matched to the images in sorted filename order; the
  counts must agree), ``--prompts FILE.jsonl`` (lines ``{"file": "name.png", "prompt": "..."}``, file names
  relative to DIR), or sidecars (``DIR/name.txt`` beside ``DIR/name.png``). ``--empty-prompts`` scores
  against empty prompts (for prompt-free rewards such as aesthetic or jpeg_*).
- ``--images SHARDS``: webdataset tar shards: a ``.tar`` file, a brace pattern
  (``data/shard-{000..009}.tar``), a glob, or a folder holding only ``.tar`` files. Each sample's image
  is its ``png``/``jpg``/``jpeg``/``webp`` entry and its prompt its ``txt`` or ``prompt`` entry.

Unreadable images (and shard samples without a prompt) are skipped and listed at the end; the run
continues. Output: ``--out X.jsonl`` (one JSON object per image) or ``X.csv``, with columns
``file, prompt, score`` and every detail (for several rewards, one column per reward plus their own
details). A summary table (mean, std, min, max, count per column; NaN ignored) ends the run.
Every usage mistake is a one-line error with exit code 2.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

__all__ = ["score_main", "OneLineParser", "ArgumentError", "build_from_args", "parse_reward_args",
           "iter_directory", "iter_shards", "summarise"]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
_SHARD_IMAGE_KEYS = ("png", "jpg", "jpeg", "webp")
_SHARD_PROMPT_KEYS = ("txt", "prompt")


class ArgumentError(Exception):
    """A usage mistake: printed as one line, exit code 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises :class:`ArgumentError` instead of printing usage and exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise ArgumentError(message)


def parse_reward_args(items: list[str], names: list[str]) -> dict[str, dict[str, Any]]:
    """``["pickscore.model=/m", "aesthetic.batch_size=8"]`` -> ``{"pickscore": {"model": "/m"}, ...}``.

    Values are read as YAML scalars (``8`` -> int, ``true`` -> bool, ``[1, 2]`` -> list).
    """
    import yaml

    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, eq, raw = item.partition("=")
        name, dot, arg = key.partition(".")
        if not eq or not dot or not name or not arg:
            raise ArgumentError(f"--reward-arg {item!r} must look like NAME.KEY=VALUE, e.g. pickscore.model=/models/ps")
        if name not in names:
            raise ArgumentError(f"--reward-arg {item!r}: {name!r} is not one of the rewards given to --reward "
                                f"({', '.join(names)})")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        out.setdefault(name, {})[arg] = value
    return out


def check_reward_names(spec: str, reward_args: list[str]) -> None:
    """Fail fast on unknown reward names or malformed ``--reward-arg`` (nothing is loaded)."""
    from flowrl.registry import UnknownNameError

    from .compose import parse_reward_string
    from .registry import REWARDS

    names = [name for name, _ in parse_reward_string(spec)]
    for name in names:
        if name not in REWARDS and name != "gated":
            raise UnknownNameError("reward", name, REWARDS.names())
    parse_reward_args(reward_args, names)


def build_from_args(spec: str, reward_args: list[str], device: str | None):
    """The reward of ``--reward``/``--reward-arg``/``--device``."""
    from .compose import build_reward, parse_reward_string

    items = parse_reward_string(spec)
    names = [name for name, _ in items]
    if len(set(names)) != len(names):
        raise ArgumentError(f"--reward lists a reward twice: {spec!r}")
    kwargs = parse_reward_args(reward_args, names)
    mapping = {name: {"weight": weight, "kwargs": kwargs.get(name, {})} for name, weight in items}
    return build_reward(mapping, device=device)


# ----------------------------------------------------------------------------------------------- inputs


def _decode(data: bytes):
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    image.load()
    return image.convert("RGB")


def _resolve_prompts(directory: Path, files: list[Path], prompts_file: str | None, empty: bool) -> list[str]:
    if empty:
        return [""] * len(files)
    if prompts_file is not None:
        path = Path(prompts_file)
        if not path.is_file():
            raise ArgumentError(f"--prompts file {prompts_file!r} does not exist")
        if path.suffix == ".jsonl":
            table: dict[str, str] = {}
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    table[str(row["file"])] = str(row["prompt"])
                except (ValueError, KeyError, TypeError):
                    raise ArgumentError(f"{prompts_file}:{number}: expected a JSON object with 'file' and "
                                        f"'prompt'") from None
            missing = [f.name for f in files if f.name not in table and str(f) not in table]
            if missing:
                raise ArgumentError(f"{prompts_file} has no prompt for {len(missing)} image(s), e.g. {missing[0]!r}")
            return [table.get(f.name, table.get(str(f), "")) for f in files]
        lines = path.read_text(encoding="utf-8").splitlines()
        while lines and not lines[-1].strip():
            lines.pop()
        if len(lines) != len(files):
            raise ArgumentError(f"{prompts_file} has {len(lines)} prompt line(s) but {directory} has {len(files)} "
                                f"image(s); they are matched one per line in sorted filename order")
        return lines
    prompts, missing = [], []
    for f in files:
        sidecar = f.with_suffix(".txt")
        if sidecar.is_file():
            prompts.append(sidecar.read_text(encoding="utf-8").strip())
        else:
            missing.append(sidecar.name)
    if missing:
        raise ArgumentError(f"no prompts for {len(missing)} image(s) (e.g. no {missing[0]!r}); give --prompts FILE "
                            f"(.txt or .jsonl), .txt sidecars, or --empty-prompts")
    return prompts


def iter_directory(directory: Path, prompts: list[str], files: list[Path]) -> Iterator[tuple[str, Any, str]]:
    """Yield ``(file name, image or exception, prompt)`` for every image file."""
    for path, prompt in zip(files, prompts):
        try:
            yield path.name, _decode(path.read_bytes()), prompt
        except Exception as err:  # any unreadable file is reported, never fatal
            yield path.name, err, prompt


def iter_shards(shards: list[str], empty_prompts: bool) -> Iterator[tuple[str, Any, str]]:
    """Yield ``(shard:key, image or exception, prompt)`` for each sample of webdataset tar shards; an
    unreadable image or shard is yielded as its exception (reported, never fatal)."""
    from flowrl.data.webdataset_io import IMAGE_KEYS, PROMPT_KEYS, ShardError, iter_raw_samples

    for shard in shards:
        try:
            for key, _, entries in iter_raw_samples([shard]):
                image_key = next((k for k in IMAGE_KEYS if k in entries), None)
                if image_key is None:
                    continue  # a sample without an image (e.g. metadata only) is not an image to score
                name = f"{os.path.basename(shard)}:{key}"
                prompt_key = next((k for k in PROMPT_KEYS if k in entries), None)
                if prompt_key is None and not empty_prompts:
                    yield name, ValueError("no txt/prompt entry (use --empty-prompts for prompt-free rewards)"), ""
                    continue
                prompt = "" if prompt_key is None else entries[prompt_key].decode("utf-8", "replace").strip()
                try:
                    yield name, _decode(entries[image_key]), prompt
                except Exception as err:  # unreadable image: reported, never fatal
                    yield name, err, prompt
        except ShardError as err:
            yield os.path.basename(shard), err, ""


# ----------------------------------------------------------------------------------------------- outputs


def _clean(value: float) -> float | None:
    return value if math.isfinite(value) else None


class _Writer:
    def __init__(self, path: Path):
        self.path = path
        self.kind = "jsonl" if path.suffix == ".jsonl" else "csv"
        self.handle = None
        self.csv = None
        self.columns: list[str] | None = None

    def write(self, rows: list[dict]) -> None:
        if not rows:
            return
        if self.handle is None:
            self.handle = open(self.path, "w", encoding="utf-8", newline="")
            self.columns = list(rows[0])
            if self.kind == "csv":
                self.csv = csv.DictWriter(self.handle, fieldnames=self.columns, extrasaction="ignore")
                self.csv.writeheader()
        for row in rows:
            if self.kind == "jsonl":
                self.handle.write(json.dumps({k: (_clean(v) if isinstance(v, float) else v) for k, v in row.items()})
                                  + "\n")
            else:
                self.csv.writerow({k: ("" if isinstance(v, float) and not math.isfinite(v) else v)
                                   for k, v in row.items()})
        self.handle.flush()

    def close(self) -> None:
        if self.handle is None:  # nothing scored: still leave a (header-less) file behind
            self.path.write_text("", encoding="utf-8")
        else:
            self.handle.close()


def summarise(columns: dict[str, list[float]]) -> str:
    """A table of mean, std (population), min, max and count per column, ignoring NaN."""
    width = max([len("reward")] + [len(k) for k in columns])
    lines = [f"{'reward'.ljust(width)}  {'mean':>11}  {'std':>11}  {'min':>11}  {'max':>11}  {'n':>6}"]
    for key, values in columns.items():
        finite = [v for v in values if math.isfinite(v)]
        if finite:
            mean = sum(finite) / len(finite)
            std = math.sqrt(sum((v - mean) ** 2 for v in finite) / len(finite))
            cells = [f"{x:11.4f}" for x in (mean, std, min(finite), max(finite))]
        else:
            cells = [f"{'nan':>11}"] * 4
        lines.append(f"{key.ljust(width)}  {'  '.join(cells)}  {len(finite):6d}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- main


def _parser() -> OneLineParser:
    parser = OneLineParser(prog="flowrl score", description="Score images with reward models.",
                           epilog="Prompts: --prompts FILE.txt (one per line, sorted filename order), "
                                  "FILE.jsonl ({file, prompt}), or DIR/name.txt sidecars.")
    parser.add_argument("--reward", required=True, help="reward(s): pickscore or pickscore,aesthetic:0.5")
    parser.add_argument("--images", required=True, help="a folder of images, or webdataset .tar shard(s)")
    parser.add_argument("--prompts", default=None, help="prompts file (.txt or .jsonl) for an image folder")
    parser.add_argument("--empty-prompts", action="store_true", help="score against empty prompts")
    parser.add_argument("--out", required=True, help="output file: .jsonl or .csv")
    parser.add_argument("--reward-arg", action="append", default=[], metavar="NAME.KEY=VALUE",
                        help="keyword argument of one reward, e.g. pickscore.model=/models/ps (repeatable)")
    parser.add_argument("--batch-size", type=int, default=16, help="images per reward call (default 16)")
    parser.add_argument("--device", default=None, help="device for every reward (cpu, cuda, cuda:1, auto)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def score_main(argv: list[str]) -> int:
    """Entry point of ``flowrl score``; returns the exit code (0 ok, 2 usage/loading error)."""
    from .base import RewardError
    from flowrl.registry import UnknownNameError

    prog = "flowrl score"
    try:
        args = _parser().parse_args(argv)
    except ArgumentError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except SystemExit as stop:  # --help
        return int(stop.code or 0)
    try:
        if args.batch_size < 1:
            raise ArgumentError(f"--batch-size must be >= 1, got {args.batch_size}")
        out = Path(args.out)
        if out.suffix not in (".jsonl", ".csv"):
            raise ArgumentError(f"--out must end in .jsonl or .csv, got {args.out!r}")
        check_reward_names(args.reward, args.reward_arg)  # cheap checks before reading any input
        if out.is_dir():
            raise ArgumentError(f"--out {args.out!r} is a folder; give a file name ending in .jsonl or .csv")
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a", encoding="utf-8"):  # writable? (an OSError here is a one-line error)
            pass
        source = args.images
        is_dir = os.path.isdir(source)
        files = sorted(p for p in Path(source).iterdir()
                       if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS) if is_dir else []
        if is_dir and files:
            prompts = _resolve_prompts(Path(source), files, args.prompts, args.empty_prompts)
            items: Iterator = iter_directory(Path(source), prompts, files)
            total: int | None = len(files)
        else:
            from flowrl.data.webdataset_io import ShardError, shard_paths

            try:
                shards = shard_paths(source)
            except ShardError as err:
                if is_dir:
                    raise ArgumentError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) or .tar shards in {source!r}") from None
                raise ArgumentError(f"--images {source!r} is not a folder of images or a .tar shard ({err})") from None
            if args.prompts is not None:
                raise ArgumentError("--prompts applies to an image folder; shards carry their prompts as txt/prompt "
                                    "entries")
            items, total = iter_shards(shards, args.empty_prompts), None
        reward = build_from_args(args.reward, args.reward_arg, args.device)
    except ArgumentError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except UnknownNameError as err:
        print(f"{prog}: error: {err.message}", file=sys.stderr)
        return 2
    except (RewardError, OSError, ValueError) as err:
        print(f"{prog}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    return _run(reward, items, total, out, args.batch_size, not args.no_progress, prog)


def _run(reward, items: Iterator, total: int | None, out: Path, batch_size: int, progress: bool, prog: str) -> int:
    import torch
    from tqdm import tqdm

    from .base import RewardError
    from .batching import score_grouped

    writer = _Writer(out)
    columns: dict[str, list[float]] = {}
    skipped: list[tuple[str, str]] = []
    scored = 0
    start = time.perf_counter()
    bar = tqdm(total=total, unit="img", desc="scoring", disable=not progress, file=sys.stderr)
    batch: list[tuple[str, Any, str]] = []

    def flush() -> None:
        nonlocal scored
        if not batch:
            return
        names, images, prompts = zip(*batch)
        with torch.no_grad():
            result = score_grouped(reward, list(images), list(prompts), None)
        values = {"score": result.scores.detach().float().cpu().tolist()}
        values.update({k: v.detach().float().cpu().tolist() for k, v in result.details.items()})
        rows = []
        for i, (name, prompt) in enumerate(zip(names, prompts)):
            rows.append({"file": name, "prompt": prompt, **{k: float(v[i]) for k, v in values.items()}})
        for key, vals in values.items():
            columns.setdefault(key, []).extend(float(v) for v in vals)
        writer.write(rows)
        scored += len(batch)
        bar.update(len(batch))
        batch.clear()

    try:
        for name, image, prompt in items:
            if isinstance(image, BaseException):
                skipped.append((name, " ".join(f"{type(image).__name__}: {image}".split())[:200]))
                bar.update(1)
                continue
            batch.append((name, image, prompt))
            if len(batch) >= batch_size:
                flush()
        flush()
    except RewardError as err:
        bar.close()
        writer.close()
        print(f"{prog}: error: {' '.join(str(err).split())} ({scored} image(s) written to {out})", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        bar.close()
        writer.close()
        print(f"{prog}: interrupted; {scored} image(s) written to {out}", file=sys.stderr)
        return 130
    bar.close()
    writer.close()
    seconds = time.perf_counter() - start
    print(f"scored {scored} image(s) in {seconds:.1f} s ({scored / max(seconds, 1e-9):.2f} images/s) -> {out}")
    if columns:
        print(summarise(columns))
    if skipped:
        print(f"skipped {len(skipped)} unreadable image(s):")
        for name, reason in skipped:
            print(f"  {name}: {reason}")
    return 0 if scored else 1
