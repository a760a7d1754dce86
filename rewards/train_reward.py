"""``flowrl train-reward``: train the small learned reward models.

::

    flowrl train-reward artifact --synthetic shapes --out DIR [--n 4000] [--heldout-n 1000] [--steps 1200]
    flowrl train-reward artifact --clean DIR_OR_SHARDS --artifact DIR_OR_SHARDS --out DIR [--image-size 64]
        [--heldout-fraction 0.2] [--steps 1200]
    OMP_NUM_THREADS=1 flowrl train-reward shapes-encoder --out DIR [--steps 2500]   # byte-identical rebuild

``artifact`` trains the classifier of ``rewards.load("artifact", path=DIR)``, prints the held-out accuracy
(per artifact kind for synthetic data) and writes ``DIR/config.json`` (architecture, training settings,
the report) and ``DIR/model.safetensors``. With ``--clean``/``--artifact`` the held-out set is a random
``--heldout-fraction`` of each class (seeded). ``shapes-encoder`` rebuilds the frozen encoder shipped in
``rewards/shapes_encoder`` (see ``rewards/backbones.py``). Usage mistakes are one line on stderr, exit 2.

``--out`` is written whole or not at all: the files go to a temporary folder beside it that replaces it when
training and saving succeeded (:mod:`flowrl.atomic`), so a crash, a full disk or Ctrl-C keeps a previous
model there intact. ``--out`` must be new, empty or an earlier output of this command (``config.json`` and
``model.safetensors`` only), and never one of the input folders.
"""

from __future__ import annotations

import argparse
import json
import sys

from flowrl.commands.args import OneLineParser, UsageError, positive_int

__all__ = ["main"]


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="flowrl train-reward", description="Train a small learned reward model.")
    sub = parser.add_subparsers(dest="model", metavar="MODEL", parser_class=OneLineParser)
    sub.required = True
    art = sub.add_parser("artifact", help="the artifact classifier (reward 1 - P(artifact))",
                         description="Train the artifact classifier read by rewards.load('artifact', path=OUT).")
    source = art.add_mutually_exclusive_group(required=True)
    source.add_argument("--synthetic", choices=("shapes",), help="synthetic artifacts on rendered shapes scenes")
    source.add_argument("--clean", help="clean images: a folder or webdataset shards")
    art.add_argument("--artifact", help="images with artifacts: a folder or webdataset shards (with --clean)")
    art.add_argument("--out", required=True, help="output directory (config.json + model.safetensors)")
    art.add_argument("--n", type=positive_int, default=4000, help="synthetic training images (default 4000)")
    art.add_argument("--heldout-n", type=positive_int, default=1000, help="synthetic held-out images (default 1000)")
    art.add_argument("--heldout-fraction", type=_fraction, default=0.2,
                     help="held-out share of --clean/--artifact images (default 0.2)")
    art.add_argument("--image-size", type=positive_int, default=None,
                     help="classifier input side (default 32 for --synthetic shapes, 64 otherwise)")
    art.add_argument("--width", type=positive_int, default=16, help="channels of the first stage (default 16)")
    art.add_argument("--steps", type=positive_int, default=1200, help="optimizer steps (default 1200)")
    art.add_argument("--batch-size", type=positive_int, default=64, help="batch size (default 64)")
    art.add_argument("--lr", type=_positive_float, default=3e-3, help="Adam learning rate (default 3e-3)")
    art.add_argument("--seed", type=int, default=0, help="seed of the data, the weights and the batches")
    enc = sub.add_parser("shapes-encoder", help="the frozen shapes-world encoder of the adversarial reward",
                         description="Rebuild the frozen encoder shipped in rewards/shapes_encoder.")
    enc.add_argument("--out", required=True, help="output directory (config.json + model.safetensors)")
    enc.add_argument("--steps", type=positive_int, default=2500, help="optimizer steps (default 2500)")
    enc.add_argument("--batch-size", type=positive_int, default=64, help="batch size (default 64)")
    enc.add_argument("--lr", type=_positive_float, default=2e-3, help="Adam learning rate (default 2e-3)")
    enc.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    return parser


def _split(images, fraction: float, seed: int):
    import torch

    order = torch.randperm(images.shape[0], generator=torch.Generator().manual_seed(seed))
    n_held = max(1, round(images.shape[0] * fraction))
    if n_held >= images.shape[0]:
        raise UsageError(f"{images.shape[0]} image(s) cannot be split into training and held-out sets; give more")
    return images[order[n_held:]], images[order[:n_held]]


def _artifact(args) -> int:
    import torch

    from .artifact import images_from, save_classifier, train_artifact_classifier

    kinds = None
    if args.synthetic:
        if args.artifact:
            raise UsageError("--artifact goes with --clean, not with --synthetic")
        from .shapes_synth import artifact_dataset

        image_size = args.image_size or 32
        train_images, train_labels, _ = artifact_dataset(args.n, seed=args.seed, resolution=32)
        held_images, held_labels, kinds = artifact_dataset(args.heldout_n, seed=args.seed + 1_000_003, resolution=32)
        source = {"synthetic": "shapes", "n": args.n, "heldout_n": args.heldout_n}
    else:
        if not args.artifact:
            raise UsageError("--clean needs --artifact (a folder or shards of images with artifacts)")
        image_size = args.image_size or 64
        clean = images_from(args.clean, image_size)
        bad = images_from(args.artifact, image_size)
        clean_train, clean_held = _split(clean, args.heldout_fraction, args.seed)
        bad_train, bad_held = _split(bad, args.heldout_fraction, args.seed + 1)
        train_images = torch.cat([clean_train, bad_train])
        train_labels = torch.cat([torch.zeros(len(clean_train)), torch.ones(len(bad_train))])
        held_images = torch.cat([clean_held, bad_held])
        held_labels = torch.cat([torch.zeros(len(clean_held)), torch.ones(len(bad_held))])
        kinds = ["clean"] * len(clean_held) + ["artifact"] * len(bad_held)
        source = {"clean": args.clean, "artifact": args.artifact, "heldout_fraction": args.heldout_fraction}
    model, report = train_artifact_classifier((train_images, train_labels), (held_images, held_labels),
                                              heldout_kinds=kinds, image_size=image_size, width=args.width,
                                              steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                                              seed=args.seed)
    save_classifier(model, args.stage, {"data": source, "report": report})
    out = args.out
    print(f"held-out accuracy {report['heldout_accuracy']:.3f} on {report['n_heldout']} images "
          f"(train {report['train_accuracy']:.3f}, {report['seconds']:.0f} s)")
    for kind, value in report.get("heldout_accuracy_by_kind", {}).items():
        if kind != "overall":
            print(f"  {kind:16s} {value:.3f}")
    print(f"wrote {out}/config.json and {out}/model.safetensors; use rewards.load('artifact', path={str(out)!r})")
    return 0


def _encoder(args) -> int:
    from .backbones import train_shapes_encoder

    config = train_shapes_encoder(args.stage, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                                  seed=args.seed)
    print(json.dumps({k: config[k] for k in ("final_reconstruction_mse", "final_target_mse", "seconds")}))
    print(f"wrote {args.out}/config.json and {args.out}/model.safetensors; use backbone_path={args.out!r}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``flowrl train-reward``; returns the exit code (2 for bad input, with one line on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from .base import RewardError

    from flowrl.atomic import WRITE_ERRORS, staged_directory

    try:
        args = _parser().parse_args(argv)
        _check_out(args)
        with staged_directory(args.out, replace=True) as args.stage:
            return _artifact(args) if args.model == "artifact" else _encoder(args)
    except SystemExit as exit_:  # --help
        return int(exit_.code or 0)
    except (UsageError, RewardError) as err:
        print(f"flowrl train-reward: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except WRITE_ERRORS as err:
        reason = getattr(err, "strerror", None) or " ".join(str(err).split())[:200]
        print(f"flowrl train-reward: error: cannot write --out {args.out!r} ({reason}); it was left as it was; free "
              "space or choose another --out", file=sys.stderr)
        return 2


OUTPUT_FILES = ("config.json", "model.safetensors")


def _check_out(args) -> None:
    """``--out`` may be new, empty or an earlier output (only :data:`OUTPUT_FILES`); never an input."""
    from pathlib import Path

    from flowrl.atomic import is_inside

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {args.out!r} is a file; give a directory")
    for flag in ("clean", "artifact"):
        source = getattr(args, flag, None)
        # --out replaces its folder: it may not be an input or hold one (a folder inside an input is fine)
        if source and Path(source).exists() and is_inside(source, out):
            raise UsageError(f"--out {args.out!r} is (or holds) the --{flag} input {source!r}; choose another "
                             "--out so that the input is never overwritten")
    others = sorted(p.name for p in out.iterdir() if p.name not in OUTPUT_FILES) if out.is_dir() else []
    if others:
        raise UsageError(f"--out {args.out!r} holds other files ({', '.join(others[:3])}); give a new or empty "
                         "folder, or an earlier output of this command (config.json and model.safetensors only)")
