"""One readable file per training algorithm. Each module exposes ``RECIPE = Recipe(Config, main)``."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple


class Recipe(NamedTuple):
    config_class: type
    main: Callable[[Any], int | None]
