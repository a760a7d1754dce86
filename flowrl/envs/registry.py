"""The built-in environments by name: how to build one, its training and held-out tasks, its turn limit, and the
options an environment takes (``get_env("shapes_vqa", questions=3, heldout=...)``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

__all__ = ["EnvSpec", "get_env", "env_options", "ENV_NAMES"]


@dataclass(frozen=True)
class EnvSpec:
    name: str
    make: Callable[[], object]
    train_tasks: Callable  # (split, n, seed, start) -> list[Task]
    eval_tasks: Callable  # (n) -> list[Task]
    kinds: tuple[str, ...]
    max_turns: int
    # Further evaluation sets, name -> (n) -> list[Task], reported as eval/<env short name>_<name>/...
    extra_evals: dict[str, Callable] = field(default_factory=dict)


def _vqa(questions: int = 1, heldout: frozenset[str] | None = None) -> EnvSpec:
    """Shapes-VQA; ``questions`` per episode (one per turn), ``heldout`` a named split's held-out combinations
    (``flowrl.data.vqa.parse_combinations``)."""
    from flowrl.data.vqa import QUESTION_KINDS
    from flowrl.envs.vqa import VQAEnv, vqa_eval_sets, vqa_tasks

    if questions < 1:
        raise ValueError(f"questions per episode must be at least 1, got {questions}")
    main, extra = vqa_eval_sets(questions, heldout)
    return EnvSpec("shapes_vqa", VQAEnv, partial(vqa_tasks, questions=questions, heldout=heldout), main,
                   QUESTION_KINDS, questions, extra)


def _zoom() -> EnvSpec:
    from flowrl.envs.zoom import ZOOM_KINDS, ZoomEnv, zoom_eval_tasks, zoom_tasks

    return EnvSpec("shapes_zoom", ZoomEnv, zoom_tasks, zoom_eval_tasks, ZOOM_KINDS, 3)


def _zoom_baseline(env: str) -> Callable[[], EnvSpec]:
    def build() -> EnvSpec:
        from flowrl.envs import zoom

        cls = {"overview": zoom.OverviewEnv, "crop": zoom.CropEnv}[env]
        return EnvSpec(f"shapes_zoom_{env}", cls, zoom.zoom_tasks, zoom.zoom_eval_tasks, zoom.ZOOM_KINDS, 1)

    return build


# shapes_zoom_overview / shapes_zoom_crop: one-turn baselines on the zoom tasks (flowrl/envs/zoom.py).
_BUILDERS = {"shapes_vqa": _vqa, "shapes_zoom": _zoom, "shapes_zoom_overview": _zoom_baseline("overview"),
             "shapes_zoom_crop": _zoom_baseline("crop")}
ENV_NAMES = tuple(_BUILDERS)


def get_env(name: str, **options) -> EnvSpec:
    """The environment ``name`` (``shapes_vqa``, ``shapes_zoom`` or a zoom baseline) with ``options`` (shapes_vqa:
    ``questions``, ``heldout``; options left at None are the defaults).

    Raises:
        ValueError: an option the environment does not take.
    """
    if name not in _BUILDERS:
        from flowrl.registry import UnknownNameError

        raise UnknownNameError("environment", name, list(_BUILDERS))
    options = {k: v for k, v in options.items() if v is not None}
    if name != "shapes_vqa" and options:
        raise ValueError(f"{', '.join(options)}: options of shapes_vqa only; {name} takes none")
    return _BUILDERS[name](**options)


def env_options(env) -> dict:
    """The :func:`get_env` options of a recipe's ``env`` section (``questions_per_episode``,
    ``heldout_combinations``), None where unset."""
    from flowrl.data.vqa import parse_combinations

    held = getattr(env, "heldout_combinations", None)
    questions = getattr(env, "questions_per_episode", 1)
    return {"questions": questions if questions != 1 else None,
            "heldout": parse_combinations(held) if held is not None else None}
