"""The ``flowrl sample`` / ``flowrl eval`` commands (their library: :mod:`flowrl.eval.generate`)::

    flowrl sample --model shapes|PATH --prompt "a red circle" [--prompt ...] --seeds 0-7 --steps 20 \\
        [--guidance G] [--reward shapes] --out grid.png
    flowrl eval --model shapes|PATH --reward shapes --split eval --steps 40 [--n 600] [--guidance G] \\
        [--batch-size B] [--prompts FILE] --out eval.json

    Editing models (FLUX.1-Kontext, Qwen-Image-Edit): ``sample --source IMAGE`` (one for every prompt, or one per
    ``--prompt``) draws each source as the grid's first column; ``eval --prompts EDITS`` takes editing shards
    (``<key>.src.png`` + ``<key>.txt``).

    SD3 / FLUX and training runs (flowrl.models.select): --model sd3|flux [--path DIR_OR_HUB_ID]
    [--lora RUN_DIR_OR_EXPORT], --model PIPELINE_DIR, or --run RUN_DIR; eval --prompts FILE.jsonl
    (GenEval-style: a "prompt" and its metadata per line) hands each prompt's metadata to the reward,
    and --reward NAME:key=value,... passes arguments (e.g. remote:url=http://127.0.0.1:18085).

Both exit with code 2 and one line on stderr for bad input (unknown model path, bad seeds, unknown
reward, a prompt the reward cannot read, an output path that cannot be written, sizes that would
exhaust memory or never finish), never with a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from flowrl.commands.args import (OneLineParser, UsageError, bounded_int, device_arg, finite_float, one_line,
                                  output_file, positive_int, read_text_file)
from flowrl.eval.generate import evaluate, generate
from flowrl.eval.grid import image_grid

__all__ = ["parse_seeds", "format_table", "sample_main", "eval_main"]


# ----------------------------------------------------------------------------- helpers of the commands


MAX_SEED = 2 ** 63 - 1  # seeds are int64 tensors (per-sample noise); torch.Generator takes them all
MAX_SEEDS = 1024  # columns of one grid
MAX_IMAGES = 4096  # images of one `flowrl sample` call (prompts x seeds)
MAX_STEPS = 1000
MAX_EVAL_PROMPTS = 100_000
MAX_SCALE = 16


def parse_seeds(text: str, max_count: int = MAX_SEEDS) -> list[int]:
    """Seeds from ``"0-7"`` (inclusive range), ``"0,3,5"`` (list), ``"4"`` or mixes (``"0-3,8"``).

    Raises:
        ValueError: the text is not of that form, a seed is outside ``0..2**63-1``, or it names more than
            ``max_count`` seeds (checked before any range is expanded; the message shows the forms).
    """
    forms = "expected a seed ('4'), an inclusive range ('0-7') or a comma-separated list ('0,3,5' or '0-3,8')"
    spans: list[tuple[int, int]] = []
    items = [item.strip() for item in str(text).split(",")]
    if not text or not all(items):
        raise ValueError(f"bad seeds {text!r}: {forms}")
    for item in items:
        low, dash, high = item.partition("-")
        try:
            first, last = (int(low), int(high)) if dash else (int(item), int(item))
            if last < first:
                raise ValueError
        except ValueError:
            raise ValueError(f"bad seeds {text!r} (at {item!r}): {forms}; seeds are non-negative") from None
        if first < 0 or last > MAX_SEED:
            raise ValueError(f"bad seeds {text!r}: seed {last if last > MAX_SEED else first} is outside 0..{MAX_SEED} "
                             "(seeds are 64-bit signed integers); use smaller seeds")
        spans.append((first, last))
    count = sum(last - first + 1 for first, last in spans)
    if count > max_count:
        raise ValueError(f"--seeds {text!r} names {count} seeds, more than the {max_count} one command takes; "
                         "give a shorter range")
    return [seed for first, last in spans for seed in range(first, last + 1)]

def format_table(summary: dict) -> str:
    """A GenEval-style table: accuracy and n per task kind, then overall."""
    from flowrl.data.shapes import TASK_KINDS

    kinds = summary["kinds"]
    order = [k for k in TASK_KINDS if k in kinds] + sorted(k for k in kinds if k not in TASK_KINDS)
    width = max([len("overall"), len("task")] + [len(k) for k in order])
    rule = f"{'-' * width}  {'-' * 8}  {'-' * 5}"
    lines = [f"{'task'.ljust(width)}  {'accuracy':>8}  {'n':>5}", rule]
    lines += [f"{k.ljust(width)}  {kinds[k]['accuracy']:8.3f}  {kinds[k]['n']:5d}" for k in order]
    lines += [rule, f"{'overall'.ljust(width)}  {summary['overall']:8.3f}  {summary['n']:5d}"]
    return "\n".join(lines)


def _seeds_arg(text: str) -> list[int]:
    try:
        return parse_seeds(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _common_args(parser: argparse.ArgumentParser, default_steps: int) -> None:
    parser.add_argument("--model", default="shapes",
                        help="`shapes` (the shipped model, default) or a saved shapes-model directory")
    parser.add_argument("--steps", type=bounded_int(1, MAX_STEPS, "more steps change nothing visible"),
                        default=default_steps, help=f"Euler ODE steps, 1-{MAX_STEPS} (default {default_steps})")
    parser.add_argument("--guidance", type=finite_float, default=None,
                        help="classifier-free guidance scale (default: the model's own)")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="samples per model call (default 64)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--precision", choices=("float32", "bfloat16"), default="float32",
                        help="model calls in float32 or under bfloat16 autocast (as eval.precision; default float32)")
    from flowrl.models.select import add_model_args

    add_model_args(parser)  # --path, --lora, --run, --dtype, --resolution, --no-ema (SD3 / FLUX, runs)


def _out_path(text: str, suffixes: tuple[str, ...], what: str) -> Path:
    return output_file(text, suffixes=suffixes, what=what)


def _check_prompts(reward, prompts: list[str]) -> None:
    """Fail before generating when the reward cannot read a prompt (the shapes grammar)."""
    if getattr(reward, "name", None) != "shapes":
        return
    from flowrl.data.shapes import PromptParseError, parse_prompt
    from rewards import RewardError

    for prompt in prompts:
        try:
            parse_prompt(prompt)
        except PromptParseError as err:
            raise RewardError(f"shapes reward: {err}") from None


def _run_command(prog: str, body, argv: list[str]) -> int:
    """Run ``body(argv)``, turning the user's mistakes into one stderr line and exit code 2."""
    from flowrl.data.shapes import PromptParseError
    from flowrl.models.base import ModelLoadError
    from flowrl.registry import UnknownNameError
    from rewards import RewardError

    try:
        return int(body(argv) or 0)
    except SystemExit as exit_:  # --help
        return int(exit_.code or 0)
    except (UsageError, ModelLoadError, UnknownNameError, RewardError, PromptParseError) as err:
        message = err.message if isinstance(err, UnknownNameError) else str(err)
        print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"{prog}: error: out of memory; use fewer prompts, seeds or a smaller --batch-size", file=sys.stderr)
        return 2
    except OSError as err:  # e.g. the disk filled up while writing the output
        where = f" at {err.filename!r}" if getattr(err, "filename", None) else ""
        print(f"{prog}: error: {one_line(err.strerror or err)}{where}; check that path and the free disk space",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


# ----------------------------------------------------------------------------- flowrl sample


def _sample(argv: list[str]) -> int:
    parser = OneLineParser(prog="flowrl sample", description="Sample a labelled image grid: one row per prompt, "
                                                            "one column per seed.")
    _common_args(parser, default_steps=20)
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for more rows)")
    parser.add_argument("--seeds", type=_seeds_arg, default=parse_seeds("0-7"),
                        help="columns: '0-7' (default), '0,3,5' or '4'")
    parser.add_argument("--scale", type=bounded_int(1, MAX_SCALE), default=4,
                        help=f"nearest-neighbour upscaling, 1-{MAX_SCALE} (default 4)")
    parser.add_argument("--reward", default=None, help="optionally score each image with this reward "
                                                       "(drawn under it), e.g. shapes")
    parser.add_argument("--source", action="append", default=None,
                        help="editing models: the source image (PNG / JPEG / WebP) every prompt edits, or one per "
                             "--prompt in order")
    parser.add_argument("--out", default="grid.png", help="output image (default grid.png)")
    args = parser.parse_args(argv)
    if len(args.prompt) * len(args.seeds) > MAX_IMAGES:
        raise UsageError(f"{len(args.prompt)} prompts x {len(args.seeds)} seeds = {len(args.prompt) * len(args.seeds)} "
                         f"images, more than the {MAX_IMAGES} of one grid; use fewer prompts or seeds")
    out = _out_path(args.out, (".png", ".jpg", ".jpeg", ".webp"), "the grid")
    reward = None
    if args.reward:
        reward = _load_reward(args.reward)
        _check_prompts(reward, args.prompt)
    model = _model(args, device_arg(args.device))
    model.eval()
    sources = _sources(args.source, len(args.prompt), model)
    prompts = [p for p in args.prompt for _ in args.seeds]
    seeds = [s for _ in args.prompt for s in args.seeds]
    metadata = None if sources is None else [{"source_image": src} for src in sources for _ in args.seeds]
    from tqdm import tqdm

    with tqdm(total=len(prompts), desc="sampling", unit="img", disable=args.no_progress) as bar:
        images = generate(model, prompts, seeds, steps=args.steps, guidance=args.guidance,
                          batch_size=args.batch_size, progress=bar.update, precision=args.precision,
                          metadata=metadata)
    captions = None
    if reward is not None:
        from rewards.base import checked_reward

        scores = checked_reward(reward, images, prompts, metadata).scores.tolist()  # an editing reward sees sources
        captions = [f"{args.reward} {s:.2f}" for s in scores]
    columns = [f"seed {s}" for s in args.seeds]
    if sources is not None:  # the source as the first column of its row
        import torch

        per_row = images.reshape(len(args.prompt), len(args.seeds), *images.shape[1:])
        images = torch.cat([torch.stack(sources)[:, None].to(images.dtype), per_row], dim=1).flatten(0, 1)
        columns = ["source", *columns]
        if captions is not None:
            captions = [c for row in range(len(args.prompt))
                        for c in ["", *captions[row * len(args.seeds):(row + 1) * len(args.seeds)]]]
    # images [B, 3, H, W]; a video model's [B, F, 3, H, W] are drawn as frame strips
    grid = image_grid(images, args.prompt, columns, captions, cell=max(images.shape[-2:]) * args.scale)
    out.parent.mkdir(parents=True, exist_ok=True)
    grid.save(out)
    print(f"wrote {out} ({len(args.prompt)} prompts x {len(args.seeds)} seeds, {args.steps} steps)")
    if images.dim() == 5:
        written = _write_videos(images, out, len(args.seeds), args.seeds)
        print(f"wrote {len(written)} animated GIFs beside it ({written[0].name}, ...)")
    return 0


def _sources(paths: list[str] | None, n_prompts: int, model) -> list | None:
    """The ``--source`` images as ``[3, H, W]`` float32 in [0, 1] at the model's image size, one per prompt
    (None without ``--source``). A UsageError when the count fits neither one nor every prompt, a file is not
    an allowed image, or sources are given to (or missing for) an editing model."""
    edits = getattr(model, "conditions_on_source", False)
    if not paths:
        if edits:
            raise UsageError(f"{type(model).__name__} edits a source image: give it with --source IMAGE")
        return None
    if not edits:
        raise UsageError(f"--source is for editing models; {type(model).__name__} draws from the prompt alone")
    if len(paths) not in (1, n_prompts):
        raise UsageError(f"{len(paths)} --source images for {n_prompts} prompts: give one for all or one per --prompt")
    import numpy as np
    import torch
    from PIL import Image

    from flowrl.untrusted import open_image

    height, width = (side * model.vae_scale_factor for side in model.latent_shape[-2:])
    images = []
    for path in paths:
        try:
            with open_image(path) as image:
                image = image.convert("RGB").resize((width, height), Image.Resampling.BICUBIC)
        except (OSError, ValueError, Image.DecompressionBombError) as err:
            raise UsageError(f"--source {path!r}: {one_line(err)}; give a PNG, JPEG or WebP image") from None
        images.append(torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous())
    return images * n_prompts if len(images) == 1 else images


def _write_videos(videos, out: Path, per_prompt: int, seeds: list[int]) -> list[Path]:
    """Each video ``[F, 3, H, W]`` of ``videos`` as a looping GIF ``<out stem>_p<prompt>_s<seed>.gif`` beside the
    grid, at 16 fps (Wan's frame rate)."""
    from flowrl.eval.grid import save_gif

    paths = []
    for i, video in enumerate(videos):
        path = out.with_name(f"{out.stem}_p{i // per_prompt}_s{seeds[i % per_prompt]}.gif")
        save_gif(video, path, fps=16.0)
        paths.append(path)
    return paths


def sample_main(argv: list[str] | None = None) -> int:
    """``flowrl sample``; returns the exit code."""
    return _run_command("flowrl sample", _sample, list(sys.argv[1:] if argv is None else argv))


# ----------------------------------------------------------------------------- flowrl eval


def _eval(argv: list[str]) -> int:
    parser = OneLineParser(prog="flowrl eval", description="GenEval-style evaluation: generate one image per "
                                                          "(prompt, seed) of a balanced prompt set and score it.")
    _common_args(parser, default_steps=40)
    parser.add_argument("--reward", default="shapes", help="reward model (default shapes)")
    parser.add_argument("--split", choices=("eval", "train"), default="eval",
                        help="prompt split (default eval, the held-out prompts)")
    parser.add_argument("--n", type=bounded_int(1, MAX_EVAL_PROMPTS), default=None,
                        help=f"number of prompts, up to {MAX_EVAL_PROMPTS} (default 600; with --prompts, every line)")
    parser.add_argument("--seed", type=bounded_int(0, 2 ** 31 - 1), default=1234,
                        help="seed of the prompt set (default 1234)")
    parser.add_argument("--prompts", default=None, help="a text file of prompts, one per line, a GenEval-style .jsonl, "
                                                        "or editing shards (edits-*.tar), instead of --split")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    out = _out_path(args.out, (".json",), "the results") if args.out else None

    reward = _load_reward(args.reward)
    metadata = None
    from flowrl.data.prompts import is_edit_source

    if args.prompts and (args.prompts.endswith(".jsonl") or is_edit_source(args.prompts)):
        rows, metadata = _rows_from_jsonl(args.prompts, args.n, args.seed)
    elif args.prompts:
        rows = _rows_from_file(args.prompts, args.n, args.seed)
    else:
        from flowrl.data.shapes import prompt_rows

        rows = prompt_rows(args.split, args.n or 600, args.seed)
    _check_prompts(reward, [r[0] for r in rows])

    device = device_arg(args.device)
    start = time.perf_counter()
    model = _model(args, device)
    loaded = time.perf_counter()
    from tqdm import tqdm

    with tqdm(total=len(rows), desc="evaluating", unit="img", disable=args.no_progress) as bar:
        summary, _ = evaluate(model, reward, rows, steps=args.steps, guidance=args.guidance,
                              batch_size=args.batch_size, progress=bar.update, metadata=metadata,
                              precision=args.precision)
    done = time.perf_counter()
    summary["settings"] = {
        "model": model.description, "reward": args.reward, "split": None if args.prompts else args.split,
        "prompts": args.prompts, "n": len(rows), "seed": args.seed, "steps": args.steps, "precision": args.precision,
        "guidance": model.default_guidance if args.guidance is None else args.guidance,
        "batch_size": args.batch_size, "device": str(device),
    }
    summary["timing"] = {"load_s": round(loaded - start, 3), "eval_s": round(done - loaded, 3),
                         "images_per_s": round(len(rows) / max(done - loaded, 1e-9), 3)}
    print(format_table(summary))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


def _rows_from_file(path: str, n: int | None, seed: int) -> list[tuple[str, str, int]]:
    from flowrl.data.shapes import PromptParseError, parse_prompt

    text = read_text_file(path, what=f"--prompts {path!r}", fix="give a text file with one prompt per line")
    lines = [line.strip() for line in text.splitlines()]
    prompts = [line for line in lines if line and not line.startswith("#")][:n]
    if len(prompts) > MAX_EVAL_PROMPTS:
        raise UsageError(f"--prompts {path!r} holds {len(prompts)} prompts, more than the {MAX_EVAL_PROMPTS} one "
                         "evaluation takes; pass --n or split the file")
    if not prompts:
        raise UsageError(f"--prompts {path!r} holds no prompts (one per line; # starts a comment)")
    rows = []
    for index, prompt in enumerate(prompts):
        try:
            kind = parse_prompt(prompt).kind
        except PromptParseError:
            kind = "other"  # outside the shapes grammar: fine for rewards that read any prompt
        rows.append((prompt, kind, index + seed * 100_000))
    return rows


def eval_main(argv: list[str] | None = None) -> int:
    """``flowrl eval``; returns the exit code. ``--task vqa|zoom`` evaluates a VLM policy instead
    (``flowrl.envs.eval_command.vqa_eval_main``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--task" or a.startswith("--task=") for a in argv):
        from flowrl.envs.eval_command import vqa_eval_main

        return vqa_eval_main(argv)
    return _run_command("flowrl eval", _eval, argv)


# ----------------------------------------------------------------------------- SD3 / FLUX, runs, reward specs


def _model(args, device):
    """The model of ``--model`` / ``--path`` / ``--lora`` / ``--run`` (flowrl.models.select), in eval mode."""
    from flowrl.config import ConfigError
    from flowrl.models.select import model_from_args
    from flowrl.hardware import check_bfloat16

    try:  # before loading anything: bfloat16 where it is emulated is a 30x slowdown
        check_bfloat16(args.precision, device, "--precision")
    except ConfigError as err:
        raise UsageError(str(err).replace("set --precision=float32", "use --precision float32")) from None
    model = model_from_args(args, device)
    model.eval()
    return model


def _load_reward(spec: str):
    """``NAME`` or ``NAME:key=value,...`` (e.g. ``remote:url=http://127.0.0.1:18085``)."""
    import rewards
    from flowrl.demo.engine import parse_reward_spec

    try:
        name, kwargs = parse_reward_spec(spec)
    except ValueError as err:
        raise UsageError(str(err)) from None
    try:
        return rewards.load(name, **kwargs)
    except TypeError as err:  # an argument the reward does not take
        raise UsageError(f"--reward {spec!r}: {err}") from None


def _rows_from_jsonl(path: str, n: int | None, seed: int) -> tuple[list[tuple[str, str, int]], list[dict]]:
    """Rows and metadata of a GenEval-style prompt file (one JSON object per line with ``prompt`` and any
    metadata: GenEval's ``tag`` names the task kind; a ``seed`` key fixes that row's noise) or of editing shards
    (each row's metadata holds its ``source_image``, which the editing model resizes to its own size)."""
    from flowrl.data.prompts import PromptSetError, load_prompts

    try:
        prompt_set = load_prompts(path, n)
    except PromptSetError as err:
        raise UsageError(f"--prompts: {err}") from None
    rows = []
    for index, (prompt, meta) in enumerate(zip(prompt_set.prompts, prompt_set.metadata)):
        kind = str(meta.get("tag") or meta.get("kind") or "other")
        rows.append((prompt, kind, int(meta.get("seed", index + seed * 100_000))))
    return rows, list(prompt_set.metadata)
