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

Images that cannot be scored are skipped and listed at the end, and the run continues: unreadable
files, shard samples without a prompt, prompts the reward cannot read (a batch that fails is scored again
one image at a time, so only the culprit is skipped), and images too large for ``--max-memory-mb`` at the
reward's measured cost per pixel (:mod:`rewards.memory`; checked from the image header, before decoding).
Batches are also cut so that their images fit in ``--max-memory-mb``. Only a failure of a service the
reward depends on (an unreachable reward server or VLM endpoint) stops the run.

Output: ``--out X.jsonl`` (one JSON object per image) or ``X.csv``, with columns ``file, prompt, score``
and every detail (for several rewards, one column per reward plus their own details). Rows go to a
temporary file beside ``--out`` that replaces it only when the run completes: an existing output is never
emptied or half-overwritten. A run that stops early (an error, Ctrl-C) keeps what it scored in
``X.partial.jsonl`` / ``X.partial.csv``. A summary table (mean, std, min, max, count per column; NaN
ignored) ends the run. Every usage mistake is a one-line error with exit code 2; exit code 1 means nothing
could be scored, 130 an interrupted run.
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from flowrl.commands.args import OneLineParser, UsageError, device_arg, one_line, output_file, read_text_file
from flowrl.untrusted import same_path

__all__ = ["score_main", "OneLineParser", "ArgumentError", "build_from_args", "parse_reward_args",
           "iter_directory", "iter_shards", "summarise"]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
# The decoders PIL may use: a file's contents decide its format, never its name, so an EPS file called
# x.png is refused rather than handed to Ghostscript.
SCORE_FORMATS = ("PNG", "JPEG", "WEBP", "BMP")
_SHARD_IMAGE_KEYS = ("png", "jpg", "jpeg", "webp")
_SHARD_PROMPT_KEYS = ("txt", "prompt")


# One usage-error type for every flowrl command (printed as one line, exit code 2).
ArgumentError = UsageError


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
            raise ArgumentError(f"--reward-arg {item!r} must look like NAME.KEY=VALUE; e.g. pickscore.model=/models/ps")
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
        raise ArgumentError(f"--reward lists a reward twice: {spec!r}; give each reward once (with a weight)")
    kwargs = parse_reward_args(reward_args, names)
    mapping = {name: {"weight": weight, "kwargs": kwargs.get(name, {})} for name, weight in items}
    return build_reward(mapping, device=device)


# ----------------------------------------------------------------------------------------------- inputs


class ImageTooLarge(ValueError):
    """An image whose pixels would cost more memory to score than ``--max-memory-mb`` allows."""


@dataclass
class ImageLimit:
    """How large an image may be for the reward being run (``max_pixels`` None: unlimited)."""

    max_pixels: int | None = None
    bytes_per_pixel: float = 0.0
    reward: str = ""
    budget_mb: float = 0.0

    def check(self, width: int, height: int) -> None:
        if self.max_pixels is not None and width * height > self.max_pixels:
            from .memory import format_bytes

            raise ImageTooLarge(f"{width}x{height} image ({width * height / 1e6:.1f} MP) would need "
                                f"{format_bytes(width * height * self.bytes_per_pixel)} to score with {self.reward}, "
                                f"over --max-memory-mb {self.budget_mb:g}; downscale it or raise --max-memory-mb")


def _decode(source: bytes | Path, limit: ImageLimit | None = None):
    """An RGB PIL image from encoded bytes or a file; its size is checked from the header first."""
    from PIL import Image

    from flowrl.untrusted import open_image

    with warnings.catch_warnings():
        # PIL warns above 89 MP; our own limit (checked before any pixel is decoded) is the one that matters.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with open_image(source, SCORE_FORMATS) as image:
            if limit is not None:
                limit.check(*image.size)
            image.load()
            return image.convert("RGB")


def _read_prompt_text(path: Path, what: str) -> str:
    return read_text_file(path, what=what, fix="give a UTF-8 text file")


def _resolve_prompts(directory: Path, files: list[Path], prompts_file: str | None, empty: bool) -> list[str]:
    if empty:
        return [""] * len(files)
    if prompts_file is not None:
        path = Path(prompts_file)
        if not path.is_file() and not path.is_dir():
            raise ArgumentError(f"--prompts file {prompts_file!r} does not exist; give a .txt or .jsonl prompts file")
        text = _read_prompt_text(path, f"--prompts {prompts_file!r}")
        if path.suffix == ".jsonl":
            table: dict[str, str] = {}
            for number, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    table[str(row["file"])] = str(row["prompt"])
                except (ValueError, KeyError, TypeError, RecursionError):
                    raise ArgumentError(f"{prompts_file}:{number}: expected a JSON object with 'file' and "
                                        f"'prompt'") from None
            def key(f: Path) -> str | None:  # the name, the path as given with --images, or the absolute path
                return next((k for k in (f.name, str(directory / f.name), str(f)) if k in table), None)

            missing = [f.name for f in files if key(f) is None]
            if missing:
                raise ArgumentError(f"{prompts_file} has no prompt for {len(missing)} image(s), e.g. {missing[0]!r}")
            return [table[key(f)] for f in files]
        lines = text.splitlines()
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
            prompts.append(_read_prompt_text(sidecar, f"the prompt sidecar {str(sidecar)!r}").strip())
        else:
            missing.append(sidecar.name)
    if missing:
        raise ArgumentError(f"no prompts for {len(missing)} image(s) (e.g. no {missing[0]!r}); give --prompts FILE "
                            f"(.txt or .jsonl), .txt sidecars, or --empty-prompts")
    return prompts


def iter_directory(directory: Path, prompts: list[str], files: list[Path],
                   limit: ImageLimit | None = None) -> Iterator[tuple[str, Any, str]]:
    """Yield ``(file name, image or exception, prompt)`` for every image file."""
    for path, prompt in zip(files, prompts):
        try:
            yield path.name, _decode(path, limit), prompt
        except Exception as err:  # any unreadable or oversized file is reported, never fatal
            yield path.name, err, prompt


def iter_shards(shards: list[str], empty_prompts: bool,
                limit: ImageLimit | None = None) -> Iterator[tuple[str, Any, str]]:
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
                    yield name, _decode(entries[image_key], limit), prompt
                except Exception as err:  # unreadable or oversized image: reported, never fatal
                    yield name, err, prompt
        except ShardError as err:
            yield os.path.basename(shard), err, ""


# ----------------------------------------------------------------------------------------------- outputs


def _clean(value: float) -> float | None:
    return value if math.isfinite(value) else None


class _Writer:
    """Rows go to a hidden temporary file beside ``path``; :meth:`commit` renames it over ``path``,
    :meth:`keep_partial` renames it to ``<stem>.partial<suffix>``, :meth:`discard` removes it."""

    def __init__(self, path: Path):
        self.path = path
        self.kind = "jsonl" if path.suffix == ".jsonl" else "csv"
        self.tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        self.partial = path.with_name(f"{path.stem}.partial{path.suffix}")
        self.handle = None
        self.csv = None
        self.columns: list[str] | None = None
        self.rows = 0

    def write(self, rows: list[dict]) -> None:
        if not rows:
            return
        if self.handle is None:
            self.handle = open(self.tmp, "w", encoding="utf-8", newline="")
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
        self.rows += len(rows)

    def _close(self) -> bool:
        if self.handle is None:
            return False
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        self.handle = None
        return True

    def commit(self) -> None:
        """Replace ``path`` with the rows written (nothing happens when no row was written)."""
        if self._close():
            os.replace(self.tmp, self.path)

    def keep_partial(self) -> Path | None:
        """Keep the rows of an interrupted run as ``<stem>.partial<suffix>``; ``path`` is left as it was."""
        if self._close():
            os.replace(self.tmp, self.partial)
            return self.partial
        return None

    def discard(self) -> None:
        self._close()
        try:
            self.tmp.unlink()
        except FileNotFoundError:
            pass


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


def _default_memory_mb() -> float:
    """4 GiB of working memory for images, or half the machine's memory if that is less."""
    try:
        import psutil

        return min(4096.0, psutil.virtual_memory().total / 2 ** 20 / 2)
    except Exception:  # noqa: BLE001 - psutil missing or the platform hides its memory size
        return 4096.0


def _parser() -> OneLineParser:
    parser = OneLineParser(prog="flowrl score", description="Score images with reward models.",
                           epilog="Prompts: --prompts FILE.txt (one per line, sorted filename order), "
                                  "FILE.jsonl ({file, prompt}), or DIR/name.txt sidecars.")
    parser.add_argument("--reward", required=True, help="reward(s): pickscore or pickscore,aesthetic:0.5")
    parser.add_argument("--images", required=True, help="a folder of images, or webdataset .tar shard(s)")
    parser.add_argument("--prompts", default=None, help="prompts file (.txt or .jsonl) for an image folder")
    parser.add_argument("--empty-prompts", action="store_true", help="score against empty prompts")
    parser.add_argument("--out", required=True, help="output file: .jsonl or .csv (replaced when the run completes)")
    parser.add_argument("--reward-arg", action="append", default=[], metavar="NAME.KEY=VALUE",
                        help="keyword argument of one reward, e.g. pickscore.model=/models/ps (repeatable)")
    parser.add_argument("--batch-size", type=int, default=16, help="images per reward call (default 16)")
    parser.add_argument("--max-memory-mb", type=float, default=None,
                        help="memory for the images of one batch, at the reward's cost per pixel (default 4096 or "
                             "half the machine's memory); larger images are skipped")
    parser.add_argument("--device", default=None, help="device for every reward (cpu, cuda, cuda:1, auto)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def score_main(argv: list[str]) -> int:
    """Entry point of ``flowrl score``; returns the exit code (0 ok, 1 nothing scored, 2 usage/loading
    error, 130 interrupted)."""
    from .base import RewardError
    from flowrl.registry import UnknownNameError

    prog = "flowrl score"
    try:
        args = _parser().parse_args(argv)
    except ArgumentError as err:
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except SystemExit as stop:  # --help
        return int(stop.code or 0)
    try:
        if args.batch_size < 1:
            raise ArgumentError(f"--batch-size must be >= 1, got {args.batch_size}; e.g. --batch-size 16")
        budget_mb = _default_memory_mb() if args.max_memory_mb is None else args.max_memory_mb
        if not (math.isfinite(budget_mb) and budget_mb > 0):
            raise ArgumentError(f"--max-memory-mb must be a positive number, got {args.max_memory_mb}; give the MiB "
                                "one batch of images may use, e.g. 4096")
        if args.device not in (None, "auto"):
            device_arg(args.device)  # one-line error for meta, mps without Metal, missing GPUs
        if Path(args.out).suffix not in (".jsonl", ".csv"):
            raise ArgumentError(f"--out must end in .jsonl or .csv, got {args.out!r}; e.g. --out scores.jsonl")
        check_reward_names(args.reward, args.reward_arg)  # cheap checks before reading any input
        if Path(args.out).is_dir():
            raise ArgumentError(f"--out {args.out!r} is a folder; give a file name ending in .jsonl or .csv")
        out = output_file(args.out, suffixes=(".jsonl", ".csv"))  # writable? (before any scoring)
        source = args.images
        is_dir = os.path.isdir(source)
        # Absolute paths: a listed name is a local file whatever it is called (docs/security.md).
        files = sorted(p for p in Path(source).absolute().iterdir()
                       if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS) if is_dir else []
        shards: list[str] = []
        prompts: list[str] = []
        if is_dir and files:
            prompts = _resolve_prompts(Path(source), files, args.prompts, args.empty_prompts)
        else:
            from flowrl.data.webdataset_io import ShardError, shard_paths

            try:
                shards = shard_paths(source)
            except ShardError as err:
                if is_dir:
                    raise ArgumentError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) or .tar shards in {source!r}; "
                                        "give a folder of images or webdataset shards") from None
                raise ArgumentError(f"--images {source!r} is not a folder of images or a .tar shard ({err}); give a "
                                    "folder of images, a .tar shard or a shard pattern") from None
            if args.prompts is not None:
                raise ArgumentError("--prompts applies to an image folder; shards carry their prompts as txt/prompt "
                                    "entries")
        if args.prompts is not None and same_path(out, args.prompts):
            # (--out ends in .jsonl / .csv, so no image, sidecar or shard can be it; a .jsonl prompts file can)
            raise ArgumentError(f"--out {args.out!r} is also the --prompts file; the scores would replace the "
                                "prompts; choose another --out")
        reward = build_from_args(args.reward, args.reward_arg, args.device)
    except ArgumentError as err:
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except UnknownNameError as err:
        print(f"{prog}: error: {err.message}", file=sys.stderr)
        return 2
    except (RewardError, OSError, ValueError) as err:
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        return 2
    from .memory import DECODE_BYTES_PER_PIXEL, bytes_per_pixel

    per_pixel = bytes_per_pixel(reward) + DECODE_BYTES_PER_PIXEL
    budget = budget_mb * 2 ** 20
    limit = ImageLimit(max_pixels=max(1, int(budget // per_pixel)), bytes_per_pixel=per_pixel, reward=args.reward,
                       budget_mb=budget_mb)
    if shards:
        items: Iterator = iter_shards(shards, args.empty_prompts, limit)
        total: int | None = None
    else:
        items, total = iter_directory(Path(source), prompts, files, limit), len(files)
    return _run(reward, items, total, out, args.batch_size, budget, per_pixel, not args.no_progress, prog)


def _short(err: BaseException) -> str:
    """Why an image was skipped: our own errors speak for themselves, others are named by type."""
    from flowrl.untrusted import UntrustedImageError

    from .base import RewardError

    text = (str(err) if isinstance(err, (RewardError, ImageTooLarge, UntrustedImageError))
            else f"{type(err).__name__}: {err}")
    return one_line(text)[:300]


def _run(reward, items: Iterator, total: int | None, out: Path, batch_size: int, budget: float, per_pixel: float,
         progress: bool, prog: str) -> int:
    import torch
    from tqdm import tqdm

    from ._http import UpstreamError
    from .batching import score_grouped

    writer = _Writer(out)
    columns: dict[str, list[float]] = {}
    skipped: list[tuple[str, str]] = []
    scored = 0
    start = time.perf_counter()
    bar = tqdm(total=total, unit="img", desc="scoring", disable=not progress, file=sys.stderr)
    batch: list[tuple[str, Any, str]] = []
    batch_bytes = 0.0

    def score(chunk: list[tuple[str, Any, str]]) -> None:
        """Score ``chunk``; if it fails, score its images one by one and skip those that fail alone."""
        nonlocal scored
        names, images, prompts = zip(*chunk)
        try:
            with torch.no_grad():
                result = score_grouped(reward, list(images), list(prompts), None)
        except UpstreamError:
            raise  # the same for every image: stop the run
        except Exception as err:  # noqa: BLE001 - a prompt the reward cannot read, an image it chokes on, ...
            if len(chunk) == 1:
                skipped.append((names[0], _short(err)))
                return
            for item in chunk:
                score([item])
            return
        values = {"score": result.scores.detach().float().cpu().tolist()}
        values.update({k: v.detach().float().cpu().tolist() for k, v in result.details.items()})
        rows = [{"file": name, "prompt": prompt, **{k: float(v[i]) for k, v in values.items()}}
                for i, (name, prompt) in enumerate(zip(names, prompts))]
        for key, vals in values.items():
            columns.setdefault(key, []).extend(float(v) for v in vals)
        writer.write(rows)
        scored += len(rows)

    def flush() -> None:
        nonlocal batch_bytes
        if batch:
            score(list(batch))
            bar.update(len(batch))
            batch.clear()
        batch_bytes = 0.0

    def stopped(message: str, code: int) -> int:
        bar.close()
        partial = writer.keep_partial()
        kept = (f"; the {writer.rows} row(s) scored are in {partial}" if partial is not None
                else "; nothing was scored")
        print(f"{prog}: {message}{kept} ({out} is unchanged)", file=sys.stderr)
        return code

    try:
        for name, image, prompt in items:
            if isinstance(image, BaseException):
                skipped.append((name, _short(image)))
                bar.update(1)
                continue
            cost = image.width * image.height * per_pixel
            if batch and batch_bytes + cost > budget:  # keep one batch's images within --max-memory-mb
                flush()
            batch.append((name, image, prompt))
            batch_bytes += cost
            if len(batch) >= batch_size:
                flush()
        flush()
    except UpstreamError as err:
        return stopped(f"error: {one_line(err)}", 2)
    except KeyboardInterrupt:
        return stopped("interrupted", 130)
    except OSError as err:  # writing the output failed (disk full, ...)
        writer.discard()
        bar.close()
        print(f"{prog}: error: cannot write the scores ({one_line(err.strerror or err)}); free space or choose another "
              f"--out ({out} is unchanged)", file=sys.stderr)
        return 2
    bar.close()
    writer.commit()
    seconds = time.perf_counter() - start
    if scored:
        print(f"scored {scored} image(s) in {seconds:.1f} s ({scored / max(seconds, 1e-9):.2f} images/s) -> {out}")
        print(summarise(columns))
    else:
        print(f"scored no image; {out} was not written" + (" (it is unchanged)" if out.exists() else ""))
    if skipped:
        print(f"skipped {len(skipped)} image(s) that could not be scored:")
        for name, reason in skipped[:50]:
            print(f"  {name}: {reason}")
        if len(skipped) > 50:
            print(f"  ... and {len(skipped) - 50} more")
    return 0 if scored else 1
