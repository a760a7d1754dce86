"""``flowrl train CONFIG [a.b=c ...] [--dry-run]``: load a recipe's typed config and run it.

``--dry-run`` runs one epoch of the config's recipe on a tiny model of its architecture, offline, and prints what
the real run needs (weights, rewards, prompt files, a memory estimate, the work of an epoch):
``flowrl.commands.dryrun``.

The YAML's top-level ``recipe`` key names the recipe (``pretrain``, ``flow_grpo``, ...); each recipe
module defines a ``Config`` dataclass and ``main(cfg)``. A YAML may name ``base: other.yaml`` and keep
only what differs (:func:`flowrl.config.load_config_data`). Under ``accelerate launch`` the same command
runs on every process.
"""

from __future__ import annotations

import argparse
import sys

from flowrl.config import ConfigError
from flowrl.errors import user_errors
from flowrl.recipes import RECIPES, load_recipe_config  # noqa: F401  (the recipe table; re-exported)

__all__ = ["RECIPES", "load_recipe_config", "main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flowrl train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="recipe YAML, e.g. configs/shapes/flow_grpo.yaml")
    parser.add_argument("overrides", nargs="*", help="a.b=c overrides, e.g. run.seed=3 run.resume=true")
    parser.add_argument("--dry-run", action="store_true",
                        help="one epoch on a tiny model of the config's architecture, offline; print what the real "
                             "run needs (weights, memory, steps per epoch)")
    args = parser.parse_intermixed_args(argv)  # --dry-run may come before, between or after the overrides
    try:
        recipe, cfg = load_recipe_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"flowrl train: config error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        from flowrl.commands.dryrun import main as dry_run_main

        try:
            return dry_run_main(args.config, args.overrides)
        except ConfigError as err:
            print(f"flowrl train --dry-run: config error: {err}", file=sys.stderr)
            return 2
    try:
        return int(recipe.main(cfg) or 0)
    except user_errors() as err:
        print(f"flowrl train: error: {err}", file=sys.stderr)
        return getattr(err, "exit_code", 2)


if __name__ == "__main__":
    raise SystemExit(main())
