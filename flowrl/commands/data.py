"""``flowrl data``: write datasets.

    flowrl data shapes --split train|eval --n N --out DIR [--seed S] [--shard-size K]

writes ``N`` rendered examples of the shapes world as webdataset shards ``DIR/shapes-<split>-000000.tar``
... (``png`` image, ``txt`` prompt, ``json`` scene plus task kind; see ``flowrl/data/webdataset_io.py``).
"""

from __future__ import annotations

import argparse
import sys

from flowrl.commands.args import OneLineParser, UsageError, bounded_int, one_line, output_dir

MAX_EXAMPLES = 10_000_000  # about 20 GB of shards; more is a typo, not a dataset

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="flowrl data", description="Write datasets as webdataset shards.")
    sub = parser.add_subparsers(dest="dataset", metavar="DATASET", parser_class=OneLineParser)
    sub.required = True
    shapes = sub.add_parser("shapes", help="rendered examples of the shapes world",
                            description="Write rendered examples of the shapes world as webdataset shards "
                                        "(png image, txt prompt, json scene + task kind).")
    shapes.add_argument("--split", choices=("train", "eval"), required=True, help="prompt split")
    shapes.add_argument("--n", type=bounded_int(1, MAX_EXAMPLES), required=True,
                        help=f"number of examples (up to {MAX_EXAMPLES})")
    shapes.add_argument("--out", required=True, help="output directory (created if missing)")
    shapes.add_argument("--seed", type=bounded_int(0, 2 ** 63 - 1), default=0,
                        help="stream seed (default 0, as pretraining)")
    shapes.add_argument("--shard-size", type=bounded_int(1, 1_000_000), default=1000,
                        help="examples per shard (default 1000)")
    shapes.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``flowrl data``; returns the exit code (2 for bad input, with one line on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
        out = output_dir(args.out)
    except UsageError as err:
        print(f"flowrl data: error: {one_line(err)}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # --help
        return int(exit_.code or 0)
    from tqdm import tqdm

    from flowrl.data.webdataset_io import write_shapes_shards

    with tqdm(total=args.n, desc=f"shapes {args.split}", unit="img", disable=args.no_progress) as bar:
        try:
            paths = write_shapes_shards(args.split, args.n, out, seed=args.seed, shard_size=args.shard_size,
                                        progress=bar.update)
        except OSError as err:  # e.g. the disk filled up
            bar.close()
            print(f"flowrl data: error: cannot write to {str(out)!r} ({one_line(err.strerror or err)}); nothing in "
                  "it was changed; free space or choose another --out", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            bar.close()
            print(f"flowrl data: interrupted; nothing in {str(out)!r} was changed", file=sys.stderr)
            return 130
    print(f"wrote {args.n} examples of the {args.split} split in {len(paths)} shard(s): "
          f"{paths[0]}{' ... ' + str(paths[-1]) if len(paths) > 1 else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
