"""LoRA files of flowrl's models: what an adapter is (kind, rank, alpha, targets), the trained tensors of a
checkpoint (its EMA when kept), and the two LoRA folder formats other tools read:

- diffusers (``pytorch_lora_weights.safetensors``, ``pipe.load_lora_weights(DIR)``): ``B`` stored already
  multiplied by ``alpha / r`` and ``lora_alpha = r`` in the metadata, so every loader applies flowrl's update
  ``W x + (alpha / r) B A x`` at full strength; Wan 2.2's low-noise expert in a second file,
  :data:`EXPERT_2_WEIGHTS` (``load_lora_weights(DIR, weight_name=..., load_into_transformer_2=True)``);
- PEFT (``adapter_config.json`` + ``adapter_model.safetensors``, unscaled, the run's own ``r`` / ``lora_alpha``).

Used by ``flowrl export`` (:mod:`flowrl.commands.export`) and by the run's checkpoints (each LoRA checkpoint of an SD3 /
FLUX run holds the diffusers folder). Library code: no command-line handling here.
"""

from __future__ import annotations

from flowrl.errors import FlowrlError

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ADAPTER_NAME",
    "ExportError",
    "LoraSpec",
    "default_lora_targets",
    "lora_layers",
    "lora_pipeline_class",
    "lora_spec",
    "lora_supported",
    "model_kind",
    "spec_for",
    "trained_tensors",
    "write_diffusers_lora",
    "EXPERT_2_WEIGHTS",
    "split_experts",
    "write_export_info",
    "write_peft_adapter",
]

#: The adapter name diffusers' ``add_adapter`` gives flowrl's LoRA; peft keeps it in parameter names.
ADAPTER_NAME = "default"


class ExportError(FlowrlError, ValueError):
    """The run cannot be exported as asked; the message says why and what works instead."""


@dataclass(frozen=True)
class LoraSpec:
    """What an exported LoRA needs to know of its model: the kind (``sd3``, ``flux``, ``shapes``), the rank,
    alpha and the adapted module names."""

    kind: str
    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return float(self.alpha) / float(self.rank)


def model_kind(model: Any) -> str:
    """The model's family (``flowrl.models.families``: ``sd3``, ``flux``, ``qwen_image``, ...) or ``shapes``."""
    return getattr(model, "family", None) or "shapes"


def default_lora_targets(kind: str) -> list[str]:
    from flowrl.models.families import FAMILIES, lora_targets

    if kind in FAMILIES:
        return lora_targets(kind)
    from flowrl.models.shapes import SHAPES_LORA_TARGETS

    return list(SHAPES_LORA_TARGETS)


def spec_for(kind: str, lora: Any) -> LoraSpec:
    targets = list(lora.target_modules) or default_lora_targets(kind)
    return LoraSpec(kind, int(lora.rank), float(lora.alpha), tuple(sorted(targets)))


def lora_spec(model: Any) -> LoraSpec | None:
    """The :class:`LoraSpec` of a model adapter (None when it fine-tunes the whole network)."""
    return None if model.lora is None else spec_for(model_kind(model), model.lora)


def lora_supported(model: Any) -> bool:
    """True for the adapters whose base is a diffusers pipeline with ``load_lora_weights`` (every family of
    ``flowrl.models.families``; not the shapes model)."""
    from flowrl.models.families import FAMILIES

    return model_kind(model) in FAMILIES


def lora_pipeline_class(kind: str):
    from flowrl.models.families import FAMILIES, pipeline_class

    if kind in FAMILIES:
        return pipeline_class(kind)
    raise ExportError(f"the {kind} model has no diffusers pipeline to load a LoRA folder into; export it with "
                      "--format peft or --format merged")


def trained_tensors(state: dict[str, Any], *, weights_key: str = "model", use_ema: bool = True,
                    ) -> tuple[dict[str, torch.Tensor], bool]:
    """The trained tensors of a checkpoint ``state`` (``state.pt``), by parameter name.

    The EMA (``state["ema"]["shadow_params"]``, in the order of the trainable parameters, which is the order
    of ``state["model"]``) replaces the raw weights when the run kept one and ``use_ema`` is set, as the
    recipes' evaluation and ``load_finetuned`` do.

    Returns:
        ``(tensors, ema_used)``.

    Raises:
        ExportError: the EMA does not match the weights.
    """
    weights = dict(state[weights_key])
    shadow = (state.get("ema") or {}).get("shadow_params") if use_ema else None
    if not shadow:
        return weights, False
    if len(shadow) != len(weights) or any(s.shape != w.shape for s, w in zip(shadow, weights.values())):
        raise ExportError("the checkpoint's EMA weights do not match its trained weights; export with --no-ema")
    return {name: value.detach().clone() for name, value in zip(weights, shadow)}, True


def lora_layers(tensors: dict[str, torch.Tensor], *, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """peft's adapter state dict (``...lora_A.weight``, ``...lora_B.weight``: the adapter name removed, as
    ``peft.get_peft_model_state_dict`` writes it) from flowrl's trained LoRA tensors, ``lora_B`` times
    ``scale``.

    Raises:
        ExportError: the tensors are not LoRA weights (a full fine-tuning run).
    """
    out = {}
    for name, value in tensors.items():
        if ".lora_A." not in name and ".lora_B." not in name:
            raise ExportError(f"{name} is not a LoRA weight: this run fine-tunes the whole model; export it with "
                              "--format merged")
        key = name.replace(f".{ADAPTER_NAME}.", ".")
        value = value.detach().to(torch.float32).contiguous()
        out[key] = value * scale if ".lora_B." in name else value
    return out


def write_diffusers_lora(spec: LoraSpec, state: dict[str, Any], directory: str | Path, *,
                         weights_key: str = "model", use_ema: bool = True) -> Path:
    """Write the run's LoRA as a diffusers LoRA folder (``pipe.load_lora_weights(directory)``).

    Args:
        spec: the LoRA's kind (``sd3`` / ``flux``), rank, alpha and targets.
        state: a checkpoint state (``{"model": tensors, "ema": ...}``).
        directory: created if needed.

    Returns:
        ``directory``.
    """
    pipeline_class = lora_pipeline_class(spec.kind)
    tensors, ema_used = trained_tensors(state, weights_key=weights_key, use_ema=use_ema)
    layers = lora_layers(tensors, scale=spec.scale)  # alpha / r baked into B: loaders that assume alpha = r agree
    metadata = {"r": spec.rank, "lora_alpha": float(spec.rank), "target_modules": list(spec.targets),
                "lora_dropout": 0.0}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    experts = split_experts(layers)
    if experts is not None:  # Wan 2.2: the high-noise expert as `transformer`, the low-noise one as `transformer_2`
        high, low = experts
        pipeline_class.save_lora_weights(directory, transformer_lora_layers=high,
                                         transformer_lora_adapter_metadata=metadata, safe_serialization=True)
        pipeline_class.save_lora_weights(directory, transformer_lora_layers=low, weight_name=EXPERT_2_WEIGHTS,
                                         transformer_lora_adapter_metadata=metadata, safe_serialization=True)
    else:
        pipeline_class.save_lora_weights(directory, transformer_lora_layers=layers,
                                         transformer_lora_adapter_metadata=metadata, safe_serialization=True)
    write_export_info(directory, {"format": "diffusers", "model": spec.kind, "rank": spec.rank, "alpha": spec.alpha,
                            "alpha_over_rank_baked_into_lora_B": spec.scale, "ema": ema_used})
    return directory


#: The file of a Wan 2.2 export's low-noise expert (``transformer_2``), which diffusers loads with
#: ``pipe.load_lora_weights(DIR, weight_name=EXPERT_2_WEIGHTS, load_into_transformer_2=True)``.
EXPERT_2_WEIGHTS = "pytorch_lora_weights_transformer_2.safetensors"


def split_experts(layers: dict[str, torch.Tensor]) -> tuple[dict, dict] | None:
    """``(high, low)``: the LoRA layers of a two-expert denoiser (:class:`flowrl.models.wan.WanExperts`, whose
    parameter names start with ``high.`` / ``low.``) as two transformers' layers, prefixes removed; None for a
    single denoiser."""
    if not layers or not all(k.startswith(("high.", "low.")) for k in layers):
        return None
    high = {k[len("high."):]: v for k, v in layers.items() if k.startswith("high.")}
    low = {k[len("low."):]: v for k, v in layers.items() if k.startswith("low.")}
    return high, low


def write_peft_adapter(spec: LoraSpec, state: dict[str, Any], directory: str | Path, *, weights_key: str = "model",
                       use_ema: bool = True, base_model: str | None = None) -> Path:
    """Write the run's LoRA as a PEFT adapter (``PeftModel.from_pretrained(denoiser, directory)``), with the
    run's own rank and alpha (weights unscaled)."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    tensors, ema_used = trained_tensors(state, weights_key=weights_key, use_ema=use_ema)
    layers = {f"base_model.model.{k}": v for k, v in lora_layers(tensors).items()}  # PeftModel's key prefix
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets), lora_dropout=0.0,
                        base_model_name_or_path=base_model)
    config.save_pretrained(str(directory))
    save_file(layers, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    write_export_info(directory, {"format": "peft", "model": spec.kind, "rank": spec.rank, "alpha": spec.alpha,
                            "ema": ema_used})
    return directory


def write_export_info(directory: Path, info: dict) -> None:
    (directory / "flowrl_export.json").write_text(json.dumps(info, indent=2) + "\n")
