"""The built-in environments by name: how to build one, its training and held-out tasks, its turn limit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["EnvSpec", "get_env", "ENV_NAMES"]


@dataclass(frozen=True)
class EnvSpec:
    name: str
    make: Callable[[], object]
    train_tasks: Callable  # (split, n, seed, start) -> list[Task]
    eval_tasks: Callable  # (n) -> list[Task]
    kinds: tuple[str, ...]
    max_turns: int


def _vqa() -> EnvSpec:
    from flowrl.data.vqa import QUESTION_KINDS
    from flowrl.envs.vqa import VQAEnv, vqa_eval_tasks, vqa_tasks

    return EnvSpec("shapes_vqa", VQAEnv, vqa_tasks, vqa_eval_tasks, QUESTION_KINDS, 1)


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


def get_env(name: str) -> EnvSpec:
    """The environment ``name`` (``shapes_vqa``, ``shapes_zoom`` or a zoom baseline)."""
    if name not in _BUILDERS:
        from flowrl.registry import UnknownNameError

        raise UnknownNameError("environment", name, list(_BUILDERS))
    return _BUILDERS[name]()
