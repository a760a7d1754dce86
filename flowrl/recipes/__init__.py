"""One readable file per training algorithm, and the table of them.

Each module exposes ``RECIPE = Recipe(Config, main)``; :data:`RECIPES` maps the ``recipe:`` key of a config to it,
and :func:`load_recipe_config` turns a YAML file (with its ``base:`` chain) plus ``a.b=c`` overrides into the
recipe and its validated config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, NamedTuple

from flowrl.config import ConfigError
from flowrl.registry import Registry, UnknownNameError

__all__ = ["Recipe", "RECIPES", "load_recipe_config"]


class Recipe(NamedTuple):
    config_class: type
    main: Callable[[Any], int | None]


RECIPES: Registry = Registry("recipe")
RECIPES.register("pretrain", "flowrl.recipes.pretrain:RECIPE")
RECIPES.register("flow_grpo", "flowrl.recipes.flow_grpo:RECIPE")
RECIPES.register("crd", "flowrl.recipes.crd:RECIPE")
RECIPES.register("nft", "flowrl.recipes.nft:RECIPE")
RECIPES.register("awm", "flowrl.recipes.awm:RECIPE")
RECIPES.register("dgpo", "flowrl.recipes.dgpo:RECIPE")
RECIPES.register("dpo", "flowrl.recipes.dpo:RECIPE")
RECIPES.register("d3po", "flowrl.recipes.d3po:RECIPE")
RECIPES.register("raft", "flowrl.recipes.raft:RECIPE")
RECIPES.register("reward_gradient", "flowrl.recipes.reward_gradient:RECIPE")
RECIPES.register("dmd2", "flowrl.recipes.dmd2:RECIPE")
RECIPES.register("dmdr", "flowrl.recipes.dmdr:RECIPE")
RECIPES.register("vlm_sft", "flowrl.recipes.vlm_sft:RECIPE")
RECIPES.register("vlm_grpo", "flowrl.recipes.vlm_grpo:RECIPE")
RECIPES.register("vlm_rft", "flowrl.recipes.vlm_rft:RECIPE")


def load_recipe_config(path: str, overrides: list[str]):
    """(recipe module entry, validated config) for a YAML file (with its ``base:`` chain) plus overrides."""
    from flowrl.config import apply_overrides, config_value, from_dict, load_config_data, parse_overrides

    name = config_value(path, "recipe")
    for keys, value in parse_overrides(overrides):
        if keys == ["recipe"]:
            name = value
    if name is None:
        if Path(path).parent.name in ("base", "tasks"):
            raise ConfigError("recipe", f"{path} is a base that training configs compose (their `base:` key), not "
                              "a config to run; run a config that names it, e.g. configs/shapes/flow_grpo.yaml")
        raise ConfigError("recipe", f"{path} has no 'recipe' key; add e.g. `recipe: flow_grpo` "
                          f"(valid: {', '.join(RECIPES.names())})")
    try:
        recipe = RECIPES.get(name)
    except UnknownNameError as err:
        raise ConfigError("recipe", str(err)) from None
    data = apply_overrides(load_config_data(path, recipe.config_class, extra_keys=("recipe",)), overrides)
    data.pop("recipe", None)
    return recipe, from_dict(recipe.config_class, data)
