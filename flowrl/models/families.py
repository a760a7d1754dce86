"""The diffusers model families flowrl adapts, in one table: the ``model.name`` of a config, the diffusers pipeline
class, the adapter, its default LoRA targets and the hub id its recipes train. Export, ``--model``, the dry run and
the footprint read it, so a new family is one adapter module plus one row here (and its tiny pipeline in
``flowrl.testing``). Entries are strings: reading the table imports neither diffusers nor the adapters."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

__all__ = ["Family", "FAMILIES", "family", "pipeline_class", "lora_targets", "family_of_pipeline"]


@dataclass(frozen=True)
class Family:
    name: str  # model.name, --model NAME
    pipeline: str  # the diffusers pipeline class
    adapter: str  # "module:Class" of the FlowModel adapter
    targets: str  # "module:CONSTANT": the default LoRA targets
    hub_id: str  # the model the family's recipes train
    label: str  # for messages and the README
    edits: bool = False  # an editing model: its prompts come with source images (the adapter's conditions_on_source)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("sd3", "StableDiffusion3Pipeline", "flowrl.models.sd3:SD3Model", "flowrl.models.sd3:SD3_LORA_TARGETS",
           "stabilityai/stable-diffusion-3.5-medium", "Stable Diffusion 3 / 3.5"),
    Family("flux", "FluxPipeline", "flowrl.models.flux:FluxModel", "flowrl.models.flux:FLUX_LORA_TARGETS",
           "black-forest-labs/FLUX.1-dev", "FLUX.1"),
    Family("qwen_image", "QwenImagePipeline", "flowrl.models.qwen_image:QwenImageModel",
           "flowrl.models.qwen_image:QWEN_IMAGE_LORA_TARGETS", "Qwen/Qwen-Image", "Qwen-Image"),
    Family("z_image", "ZImagePipeline", "flowrl.models.z_image:ZImageModel",
           "flowrl.models.z_image:Z_IMAGE_LORA_TARGETS", "Tongyi-MAI/Z-Image-Turbo", "Z-Image"),
    Family("flux2_klein", "Flux2KleinPipeline", "flowrl.models.flux2:Flux2KleinModel",
           "flowrl.models.flux2:FLUX2_LORA_TARGETS", "black-forest-labs/FLUX.2-klein-base-4B", "FLUX.2 [klein]"),
    Family("flux2", "Flux2Pipeline", "flowrl.models.flux2:Flux2DevModel", "flowrl.models.flux2:FLUX2_LORA_TARGETS",
           "black-forest-labs/FLUX.2-dev", "FLUX.2 [dev]"),
    Family("flux_kontext", "FluxKontextPipeline", "flowrl.models.flux_kontext:FluxKontextModel",
           "flowrl.models.flux_kontext:FLUX_KONTEXT_LORA_TARGETS", "black-forest-labs/FLUX.1-Kontext-dev",
           "FLUX.1-Kontext (editing)", edits=True),
    Family("qwen_image_edit", "QwenImageEditPipeline", "flowrl.models.qwen_image_edit:QwenImageEditModel",
           "flowrl.models.qwen_image_edit:QWEN_IMAGE_EDIT_LORA_TARGETS", "Qwen/Qwen-Image-Edit",
           "Qwen-Image-Edit (editing)", edits=True),
    Family("wan", "WanPipeline", "flowrl.models.wan:WanModel", "flowrl.models.wan:WAN_LORA_TARGETS",
           "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "Wan 2.1 / 2.2 (text-to-video)"),
)}


def family(name: str) -> Family:
    """The row of ``name``; a ValueError naming the valid ones otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; valid: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def _load(target: str):
    module, attribute = target.split(":")
    return getattr(importlib.import_module(module), attribute)


def pipeline_class(name: str) -> type:
    """The diffusers pipeline class of family ``name``."""
    import diffusers

    return getattr(diffusers, family(name).pipeline)


def lora_targets(name: str) -> list[str]:
    """The default LoRA targets of family ``name``."""
    return list(_load(family(name).targets))


def family_of_pipeline(class_name: str) -> str | None:
    """The family whose pipeline class is ``class_name`` (a ``model_index.json``'s ``_class_name``), else None."""
    return next((f.name for f in FAMILIES.values() if f.pipeline == class_name), None)
