"""The model-adapter registry: ``load_model(name, **kwargs)`` and ``MODELS.names()``.

Entries are lazy ``"module:Class.factory"`` strings, so listing models imports neither diffusers nor
torch-heavy modules. Each factory takes keyword arguments (``path=...``, ``dtype=...``, ``lora=...``, ...)
and returns a :class:`~flowrl.models.base.FlowModel`.
"""

from __future__ import annotations

from typing import Any, Callable

from flowrl.registry import Registry

__all__ = ["MODELS", "load_model", "register_model", "available_models"]


MODELS: Registry = Registry("model")

MODELS.register("sd3", "flowrl.models.sd3:SD3Model.from_pretrained")
MODELS.register("flux", "flowrl.models.flux:FluxModel.from_pretrained")
MODELS.register("qwen_image", "flowrl.models.qwen_image:QwenImageModel.from_pretrained")
MODELS.register("z_image", "flowrl.models.z_image:ZImageModel.from_pretrained")
MODELS.register("flux2_klein", "flowrl.models.flux2:Flux2KleinModel.from_pretrained")
MODELS.register("flux2", "flowrl.models.flux2:Flux2DevModel.from_pretrained")
MODELS.register("flux_kontext", "flowrl.models.flux_kontext:FluxKontextModel.from_pretrained")
MODELS.register("qwen_image_edit", "flowrl.models.qwen_image_edit:QwenImageEditModel.from_pretrained")
MODELS.register("wan", "flowrl.models.wan:WanModel.from_pretrained")
MODELS.register("shapes", "flowrl.models.shapes:ShapesModel.from_pretrained")


def register_model(name: str) -> Callable:
    """Decorator registering a model factory (e.g. a ``from_pretrained`` classmethod) under ``name``."""
    return MODELS.register(name)


def load_model(name: str, path: Any = None, **kwargs: Any):
    """Build the model adapter registered as ``name``.

    Args:
        name: registered name (``sd3``, ``flux``, ``shapes``, ...).
        path: local directory or hub id; None: the adapter's default (e.g. SD3.5-medium for ``sd3``).
        **kwargs: the factory's keyword arguments (``dtype``, ``device``, ``lora``, ``resolution``, ...).

    Raises:
        UnknownNameError: no model is registered as ``name`` (the message lists the valid names).
        ModelLoadError: the weights cannot be found or read (the message says the fix).
    """
    factory = MODELS.get(name)
    if path is not None:
        kwargs["path"] = path
    return factory(**kwargs)


def available_models() -> list[str]:
    """Names of every registered model adapter."""
    return MODELS.names()
