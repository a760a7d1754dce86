"""``flowrl train CONFIG [a.b=c ...]``: load a recipe's typed config and run it.

The YAML's top-level ``recipe`` key names the recipe (``pretrain``, ``flow_grpo``, ...); each recipe
module defines a ``Config`` dataclass and ``main(cfg)``. Under ``accelerate launch`` the same command
runs on every process.
"""

from __future__ import annotations

import argparse
import sys

from flowrl.config import ConfigError, load_yaml
from flowrl.registry import Registry, UnknownNameError

RECIPES: Registry = Registry("recipe")
RECIPES.register("pretrain", "flowrl.recipes.pretrain:RECIPE")
RECIPES.register("flow_grpo", "flowrl.recipes.flow_grpo:RECIPE")
RECIPES.register("vlm_sft", "flowrl.recipes.vlm_sft:RECIPE")
RECIPES.register("vlm_grpo", "flowrl.recipes.vlm_grpo:RECIPE")


def load_recipe_config(path: str, overrides: list[str]):
    """(recipe module entry, validated config) for a YAML file plus overrides."""
    from flowrl.config import apply_overrides, from_dict

    data = apply_overrides(load_yaml(path), overrides)
    name = data.pop("recipe", None)
    if name is None:
        raise ConfigError("recipe", f"{path} has no 'recipe' key; add e.g. `recipe: flow_grpo` "
                          f"(valid: {', '.join(RECIPES.names())})")
    try:
        recipe = RECIPES.get(name)
    except UnknownNameError as err:
        raise ConfigError("recipe", str(err)) from None
    return recipe, from_dict(recipe.config_class, data)


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that report a user's mistake or environment (bad config, missing weights or
    checkpoint, a failing reward, a bad prompt file): shown as one line, never as a traceback."""
    from flowrl.checkpoint import CheckpointError
    from flowrl.data.prompts import PromptSetError
    from flowrl.models.base import ModelLoadError
    from rewards.base import RewardError

    return (ConfigError, CheckpointError, ModelLoadError, RewardError, PromptSetError)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flowrl train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="recipe YAML, e.g. configs/shapes/flow_grpo.yaml")
    parser.add_argument("overrides", nargs="*", help="a.b=c overrides, e.g. run.seed=3 run.resume=true")
    args = parser.parse_args(argv)
    try:
        recipe, cfg = load_recipe_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"flowrl train: config error: {err}", file=sys.stderr)
        return 2
    try:
        return int(recipe.main(cfg) or 0)
    except user_errors() as err:
        print(f"flowrl train: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
