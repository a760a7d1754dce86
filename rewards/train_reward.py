"""``flowrl train-reward``: train the small learned reward models.

::

    flowrl train-reward artifact --synthetic shapes --out DIR [--n 4000] [--heldout-n 1000] [--steps 1200]
    flowrl train-reward artifact --clean DIR_OR_SHARDS --artifact DIR_OR_SHARDS --out DIR [--image-size 64]
        [--heldout-fraction 0.2] [--steps 1200]
    OMP_NUM_THREADS=1 flowrl train-reward shapes-encoder --out DIR [--steps 2500]   # byte-identical rebuild
    flowrl train-reward shapes-proxy-data --n 8000 [--heldout-n 1000] [--seed 0] [--steps 20] --out POOL
    flowrl train-reward shapes-proxy --data POOL --n N [--seed S] [--steps K] --out DIR

``artifact`` trains the classifier of ``rewards.load("artifact", path=DIR)``, prints the held-out accuracy
(per artifact kind for synthetic data) and writes ``DIR/config.json`` (architecture, training settings,
the report) and ``DIR/model.safetensors``. With ``--clean``/``--artifact`` the held-out set is a random
``--heldout-fraction`` of each class (seeded). ``shapes-encoder`` rebuilds the frozen encoder shipped in
``rewards/shapes_encoder`` (see ``rewards/backbones.py``).

``shapes-proxy-data`` samples a pool of base-model images of training-split prompts (``--n`` of the training stream,
``--heldout-n`` held out), labels them with the strict judge and writes ``POOL/pool.json`` and
``POOL/images.safetensors`` (:mod:`rewards.shapes_proxy_data`). ``shapes-proxy`` trains the learned proxy of strict
accuracy (:mod:`rewards.shapes_proxy`) on the pool's first ``--n`` training rows, evaluates it on the pool's held-out
rows (accuracy, AUC, expected calibration error over 10 bins, Brier score, log loss, accuracy per task kind) and writes
``DIR/config.json``, ``DIR/model.safetensors`` and the metrics as ``DIR/report.json``; several ``--seed`` per ``--n``
make an ensemble (``rewards.load("shapes_proxy", path=[DIR1, DIR2, ...], aggregate="mean_minus_std")``).
Usage mistakes are one line on stderr, exit 2.

``--out`` is written whole or not at all: the files go to a temporary folder beside it that replaces it when
training and saving succeeded (:mod:`flowrl.atomic`), so a crash, a full disk or Ctrl-C keeps a previous
model there intact. ``--out`` must be new, empty or an earlier output of this command (its files only:
:data:`OUTPUTS_BY_COMMAND`), and never one of the input folders.
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
    data = sub.add_parser("shapes-proxy-data", help="a labelled pool of base-model images for the shapes proxy",
                          description="Sample base-model images of training-split prompts, label them with the strict "
                                      "judge and write the pool read by `flowrl train-reward shapes-proxy --data`.")
    data.add_argument("--n", type=positive_int, required=True,
                      help="training rows: the largest --n the pool will serve (smaller ones read its prefix)")
    data.add_argument("--heldout-n", type=positive_int, default=1000, help="held-out rows (default 1000)")
    data.add_argument("--out", required=True, help="output directory (pool.json + images.safetensors)")
    data.add_argument("--model", dest="base_model", default="shapes",
                      help="the base model: shapes (shipped) or a saved model folder")
    data.add_argument("--seed", type=int, default=0, help="seed of the prompts and sampling seeds (default 0)")
    data.add_argument("--steps", type=positive_int, default=20, help="ODE steps (default 20, the evaluation's)")
    data.add_argument("--precision", choices=("float32", "bfloat16"), default="float32",
                      help="of the model calls (bfloat16: about 1.7x faster on a CPU with bf16 dot products)")
    data.add_argument("--batch-size", type=positive_int, default=64, help="images per model call (default 64)")
    proxy = sub.add_parser("shapes-proxy", help="the learned proxy of strict accuracy (P(correct | image, prompt))",
                           description="Train the proxy read by rewards.load('shapes_proxy', path=OUT) on the first "
                                       "--n rows of a pool.")
    proxy.add_argument("--data", required=True, help="a pool written by `flowrl train-reward shapes-proxy-data`")
    proxy.add_argument("--n", type=positive_int, required=True, help="gold labels to train on: the pool's first N rows")
    proxy.add_argument("--out", required=True, help="output directory (config.json, model.safetensors, report.json)")
    proxy.add_argument("--seed", type=int, default=0, help="seed of the head's weights and the batches (default 0)")
    proxy.add_argument("--steps", type=positive_int, default=None,
                       help="optimizer steps (default: 20 passes over the N rows, at least 300)")
    proxy.add_argument("--batch-size", type=positive_int, default=64, help="batch size (default 64)")
    proxy.add_argument("--lr", type=_positive_float, default=2e-3, help="AdamW learning rate (default 2e-3)")
    proxy.add_argument("--weight-decay", type=float, default=0.05, help="AdamW weight decay (default 0.05)")
    proxy.add_argument("--no-mirror", dest="mirror", action="store_false",
                       help="do not add the left-right mirror image of every training image (with left/right swapped)")
    proxy.add_argument("--encoder", default=None,
                       help="the frozen shapes encoder's folder (default: the shipped rewards/shapes_encoder)")
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


def _proxy_data(args) -> int:
    from .shapes_proxy_data import sample_pool

    summary = sample_pool(args.stage, args.n, args.heldout_n, model=args.base_model, seed=args.seed, steps=args.steps,
                          precision=args.precision, batch_size=args.batch_size)
    print(json.dumps(summary))
    print(f"wrote {args.out}/pool.json and {args.out}/images.safetensors; train with `flowrl train-reward shapes-proxy "
          f"--data {args.out} --n N --out DIR` (N up to {args.n})")
    return 0


def _proxy(args) -> int:
    from .shapes_proxy import save_proxy, train_shapes_proxy
    from .shapes_proxy_data import read_pool

    pool = read_pool(args.data)
    images, prompts, labels, _ = pool.prefix(args.n)
    held_images, held_prompts, held_labels, held_kinds = pool.heldout()
    if not held_prompts:
        raise UsageError(f"the pool {args.data!r} has no held-out rows to evaluate on; write it with --heldout-n")
    model, report = train_shapes_proxy((images, prompts, labels), (held_images, held_prompts, held_labels),
                                       heldout_kinds=held_kinds, steps=args.steps, batch_size=args.batch_size,
                                       lr=args.lr, weight_decay=args.weight_decay, seed=args.seed,
                                       mirror=args.mirror, encoder_path=args.encoder)
    data = {"path": args.data, "n": args.n, "pool_n_train": pool.n_train, "pool_n_heldout": pool.n_heldout,
            "pool_info": pool.info}
    save_proxy(model, args.stage, {"data": data, "training": {k: v for k, v in report.items()
                                                              if k not in ("train", "heldout")}})
    (args.stage / "report.json").write_text(json.dumps({"data": data, **report}, indent=2) + "\n")
    held = report["heldout"]
    auc = "n/a" if held["auc"] is None else f"{held['auc']:.3f}"
    print(f"held-out ({held['n']} images, gold rate {held['gold_rate']:.3f}): accuracy {held['accuracy']:.3f}, "
          f"AUC {auc}, ECE {held['ece']:.3f}, Brier {held['brier']:.3f} (train accuracy "
          f"{report['train']['accuracy']:.3f}, {report['seconds']:.0f} s)")
    for kind, entry in held.get("by_kind", {}).items():
        print(f"  {kind:14s} accuracy {entry['accuracy']:.3f} (n {entry['n']}, gold rate {entry['gold_rate']:.3f})")
    print(f"wrote {args.out}/config.json, model.safetensors and report.json; use "
          f"rewards.load('shapes_proxy', path={str(args.out)!r})")
    return 0


COMMANDS = {"artifact": _artifact, "shapes-encoder": _encoder, "shapes-proxy-data": _proxy_data,
            "shapes-proxy": _proxy}


def main(argv: list[str] | None = None) -> int:
    """Run ``flowrl train-reward``; returns the exit code (2 for bad input, with one line on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from .base import RewardError

    from flowrl.atomic import WRITE_ERRORS, staged_directory

    try:
        args = _parser().parse_args(argv)
        _check_out(args)
        with staged_directory(args.out, replace=True) as args.stage:
            return COMMANDS[args.model](args)
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
#: What each command writes into ``--out`` (an earlier output of the same command may be replaced).
OUTPUTS_BY_COMMAND = {"artifact": OUTPUT_FILES, "shapes-encoder": OUTPUT_FILES,
                      "shapes-proxy": OUTPUT_FILES + ("report.json",),
                      "shapes-proxy-data": ("pool.json", "images.safetensors")}


def _check_out(args) -> None:
    """``--out`` may be new, empty or an earlier output (only :data:`OUTPUT_FILES`); never an input."""
    from pathlib import Path

    from flowrl.atomic import is_inside

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {args.out!r} is a file; give a directory")
    for attribute, flag in (("clean", "--clean"), ("artifact", "--artifact"), ("data", "--data"),
                            ("encoder", "--encoder"), ("base_model", "--model")):
        source = getattr(args, attribute, None)
        # --out replaces its folder: it may not be an input or hold one (a folder inside an input is fine)
        if source and Path(source).exists() and is_inside(source, out):
            raise UsageError(f"--out {args.out!r} is (or holds) the {flag} input {source!r}; choose another "
                             "--out so that the input is never overwritten")
    allowed = OUTPUTS_BY_COMMAND[args.model]
    others = sorted(p.name for p in out.iterdir() if p.name not in allowed) if out.is_dir() else []
    if others:
        raise UsageError(f"--out {args.out!r} holds other files ({', '.join(others[:3])}); give a new or empty "
                         f"folder, or an earlier output of this command ({' and '.join(allowed)} only)")
