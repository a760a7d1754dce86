"""Shared helpers of the diffusers adapters (SD3, FLUX): loading a pipeline with clear errors, dtypes,
freezing, LoRA upcasting, VAE decoding and the schedule of a diffusers flow-matching scheduler.

Loading never runs code from a model repository: weights are read from safetensors only
(``use_safetensors=True``; a component folder holding only pickled ``*.bin`` weights is a one-line error
naming the conversion), and a local pipeline folder whose ``model_index.json`` names a component outside
diffusers and transformers, or ships ``<component>/<module>.py``, is refused before diffusers sees it
unless ``trust_remote_code=True`` is passed (diffusers releases before 0.38 imported such modules even with
``trust_remote_code=False``). Every failure to find or read weights becomes a :class:`ModelLoadError` whose
message names the model, the files that are needed and how to get them.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .base import ModelLoadError
from flowrl.config import LoraConfig

__all__ = ["resolve_dtype", "load_pipeline", "load_adapter_pipeline",
           "freeze_", "upcast_trainable_", "cast_module_", "vae_decode",
           "as_lora_config", "scheduler_sigmas", "latent_hw", "is_offline"]

_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32, "32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16, "16": torch.float16,
}


def resolve_dtype(dtype: torch.dtype | str | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """A torch dtype from a dtype, a name (``"bf16"``, ``"fp16"``, ``"float32"``, ...) or None (``default``)."""
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).lower().removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of fp32, bf16, fp16 (or a torch.dtype)")
    return _DTYPES[name]


def as_lora_config(lora: LoraConfig | dict | None) -> LoraConfig | None:
    """Accept LoraConfig, a plain dict of its fields (from YAML), or None (full fine-tuning)."""
    if lora is None or isinstance(lora, LoraConfig):
        return lora
    if isinstance(lora, dict):
        return LoraConfig(**lora)
    raise TypeError(f"lora must be LoraConfig, a dict or None, got {type(lora).__name__}")


def is_offline() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE, read now (huggingface_hub reads them once at import)."""
    import huggingface_hub.constants as hub_constants

    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return flag.strip().upper() in {"1", "ON", "YES", "TRUE"} or bool(hub_constants.HF_HUB_OFFLINE)


def _looks_like_path(name: str) -> bool:
    """A string meant as a filesystem path rather than a hub id ``owner/name``."""
    return (os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1
            or (os.sep != "/" and os.sep in name) or os.path.exists(name))


def _needed_files(components: list[str]) -> str:
    return "model_index.json and the component folders " + ", ".join(f"{c}/" for c in components)


def _fix_hint(model: str) -> str:
    return (f"Fix: on a machine with internet run `huggingface-cli download {model} --local-dir DIR` "
            f"(or `hf download ...`), copy DIR here and set model.path to it, or point model.path at an "
            f"existing local copy of the pipeline. With HF_HUB_OFFLINE=1 only local directories and the "
            f"Hugging Face cache are searched.")


#: Libraries a pipeline component may come from without running code of the model folder.
COMPONENT_LIBRARIES = ("diffusers", "transformers")


def _check_components(local: Path, listed: dict, what: str, trust_remote_code: bool) -> None:
    """Refuse custom component code (unless trusted) and pickle-only weights in a local pipeline folder."""
    from flowrl.untrusted import pickle_only_weights, safetensors_conversion

    for component, entry in listed.items():
        if component.startswith("_") or not isinstance(entry, (list, tuple)) or len(entry) != 2 or entry[0] is None:
            continue
        library, class_name = str(entry[0]), str(entry[1])
        modules = sorted(p.name for p in (local / component).glob("*.py")) if (local / component).is_dir() else []
        if (library not in COMPONENT_LIBRARIES or modules) and not trust_remote_code:
            code = f"{component}/{modules[0]}" if modules else f"the module {library!r}"
            raise ModelLoadError(f"cannot load {what}: model_index.json names the component {component} as "
                                 f"[{library!r}, {class_name!r}] and the folder ships {code}; loading it would run "
                                 "code from the model folder, which flowrl never does unless trust_remote_code=True "
                                 "is passed (only for a folder whose code you have read)")
        pickles = pickle_only_weights(local / component)
        if pickles:
            raise ModelLoadError(f"cannot load {what}: {component}/ holds only pickled weights ({', '.join(pickles)}), "
                                 f"which can run code when loaded; flowrl reads safetensors only: "
                                 f"{safetensors_conversion(local / component, library, class_name)}")


def load_pipeline(pipeline_cls: type, path: str | os.PathLike, *, components: list[str], hub_id: str,
                  dtype: torch.dtype = torch.float32, revision: str | None = None, variant: str | None = None,
                  cache_dir: str | None = None, trust_remote_code: bool = False, **kwargs: Any):
    """``pipeline_cls.from_pretrained`` on a local directory or a hub id, with clear errors.

    Args:
        pipeline_cls: e.g. ``diffusers.StableDiffusion3Pipeline``.
        path: a directory written by ``save_pretrained`` / ``huggingface-cli download``, or a hub id.
        components: the component folders the adapter needs (named in error messages and checked
            before loading a local directory).
        hub_id: the model's usual hub id, named in the fix for a missing local directory.
        dtype: ``torch_dtype`` for every component.
        revision, variant, cache_dir: passed to ``from_pretrained`` (hub ids).
        trust_remote_code: allow component code shipped in the folder (off: such a folder is refused).
        **kwargs: further ``from_pretrained`` keywords.

    Raises:
        ModelLoadError: the directory or hub id cannot be found or read; the message says the fix.
    """
    name = os.fspath(path)
    what = f"{pipeline_cls.__name__} {name!r}"
    local = Path(name).expanduser()
    is_local = local.is_dir()
    if is_local:
        index = local / "model_index.json"
        if not index.is_file():
            raise ModelLoadError(
                f"cannot load {what}: the directory has no model_index.json. A diffusers pipeline directory "
                f"holds {_needed_files(components)}. {_fix_hint(hub_id)}")
        try:
            listed = json.loads(index.read_text())
        except ValueError as err:
            raise ModelLoadError(f"cannot load {what}: {index} is not valid JSON ({err})") from None
        if not isinstance(listed, dict):
            raise ModelLoadError(f"cannot load {what}: {index} is not a JSON object of components")
        _check_components(local, listed, what, trust_remote_code)
        missing = [c for c in components if not (local / c).is_dir()
                   or listed.get(c) in (None, [None, None])]
        if missing:
            raise ModelLoadError(
                f"cannot load {what}: missing component folder(s) {', '.join(m + '/' for m in missing)} "
                f"(needed: {_needed_files(components)}). The download may be incomplete. "
                f"{_fix_hint(hub_id)}")
        source = str(local)
    elif _looks_like_path(name):
        raise ModelLoadError(
            f"cannot load {what}: no such directory {str(local)!r}. Needed: a pipeline directory with "
            f"{_needed_files(components)}. {_fix_hint(hub_id)}")
    else:
        source = name

    offline = is_offline()
    try:
        with warnings.catch_warnings():
            # diffusers >= 0.36 renames torch_dtype to dtype; torch_dtype works on every supported version.
            warnings.filterwarnings("ignore", message=".*torch_dtype.*", category=FutureWarning)
            return pipeline_cls.from_pretrained(
                source, torch_dtype=dtype, revision=revision, variant=variant, cache_dir=cache_dir,
                local_files_only=True if offline else None, use_safetensors=True,
                trust_remote_code=trust_remote_code, **kwargs)
    except Exception as err:  # noqa: BLE001 - every loading failure becomes one ModelLoadError
        first_line = (str(err).strip().splitlines() or [""])[0][:300]
        cause = f"{type(err).__name__}: {first_line}"
        if is_local:  # a directory that exists but does not load
            raise ModelLoadError(f"cannot load {what} from its directory ({cause}). The files may be "
                                 f"incomplete, corrupt or from another pipeline type; needed: "
                                 f"{_needed_files(components)}.") from err
        if not _is_not_found(err):
            raise ModelLoadError(f"cannot load {what} ({cause})") from err
        gated = any(k.__name__ == "GatedRepoError" for k in type(err).__mro__) or "gated" in cause.lower()
        if offline:  # the cause only restates "not in the cache, downloads disabled"
            where = "in the Hugging Face cache, and downloads are disabled (HF_HUB_OFFLINE=1)"
        else:
            where = f"in the Hugging Face cache and could not be downloaded ({cause})"
        hint = (" The repository is gated: accept its license on huggingface.co and log in with "
                "`huggingface-cli login` before downloading." if gated else "")
        hint += f" (It is not a local directory either: {str(local.absolute())!r} does not exist.)"
        raise ModelLoadError(
            f"cannot load {what}: its weights are not {where}. Needed: "
            f"{_needed_files(components)}.{hint} {_fix_hint(name)}") from None


def _is_not_found(err: BaseException) -> bool:
    """Missing files, unknown repositories, no network or offline mode (huggingface_hub errors are
    OSErrors; EntryNotFoundError is matched by name because its base class changed across versions)."""
    return isinstance(err, OSError) or any(k.__name__.endswith("NotFoundError") for k in type(err).__mro__)


def freeze_(*modules: nn.Module | None) -> None:
    """No gradients and eval mode (no dropout) for frozen parts (VAE, text encoders)."""
    for module in modules:
        if module is not None:
            module.requires_grad_(False)
            module.eval()


def upcast_trainable_(module: nn.Module) -> None:
    """Keep trainable parameters (LoRA weights) in float32 while the frozen base runs in bf16/fp16.

    The standard mixed-precision LoRA recipe (diffusers' ``cast_training_params``): peft creates the
    adapter weights in the base layer's dtype, and an optimizer stepping bf16 weights loses small
    updates. peft casts a LoRA layer's input to the adapter's dtype and its output back, so mixed dtypes
    work in the forward pass.
    """
    for param in module.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()


def cast_module_(module: nn.Module, dtype: torch.dtype) -> None:
    """``module.to(dtype)`` when it differs, without diffusers' warning about fp32-kept modules
    (the VAEs keep none)."""
    if next(module.parameters()).dtype == dtype:
        return
    from diffusers.utils import logging as diffusers_logging

    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        module.to(dtype=dtype)
    finally:
        diffusers_logging.set_verbosity(verbosity)


def vae_decode(vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """Latents ``[B, C, h, w]`` in the transformer's space -> images float32 ``[B, 3, H, W]`` in [0, 1].

    Undoes the pipeline's latent normalisation (``latents / scaling_factor + shift_factor``) like the
    SD3 and FLUX pipelines before ``vae.decode``, and maps [-1, 1] to [0, 1] like
    ``VaeImageProcessor.postprocess``. Runs under the caller's grad mode (reward backprop works).
    """
    config = vae.config
    shift = getattr(config, "shift_factor", None) or 0.0
    param = next(vae.parameters())
    z = latents.to(device=param.device, dtype=param.dtype) / config.scaling_factor + shift
    images = vae.decode(z, return_dict=False)[0]
    return (images.float() / 2 + 0.5).clamp(0, 1)


def vae_encode(vae: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """Images ``[B, 3, H, W]`` in [0, 1] -> latents ``[B, C, h, w]`` in the transformer's space: the mean of the
    VAE's posterior (deterministic), normalised as the SD3 and FLUX pipelines do
    (``(z - shift_factor) * scaling_factor``); the inverse of :func:`vae_decode` up to the VAE's own error."""
    config = vae.config
    shift = getattr(config, "shift_factor", None) or 0.0
    param = next(vae.parameters())
    z = vae.encode(images.to(device=param.device, dtype=param.dtype) * 2 - 1).latent_dist.mode()
    return ((z - shift) * config.scaling_factor).float()


def latent_hw(resolution: int | tuple[int, int] | list[int], vae_scale_factor: int, multiple: int) -> tuple[int, int]:
    """Latent height and width for an image ``resolution`` (int or ``(H, W)``), checked for divisibility."""
    height, width = (resolution, resolution) if isinstance(resolution, int) else tuple(resolution)
    step = vae_scale_factor * multiple
    if height <= 0 or width <= 0 or height % step or width % step:
        raise ValueError(f"resolution {height}x{width} must be positive multiples of {step} "
                         f"(VAE scale factor {vae_scale_factor} x patch size {multiple})")
    return height // vae_scale_factor, width // vae_scale_factor


_SCHEDULE_KEYS = ("shift", "use_dynamic_shifting", "base_shift", "max_shift", "base_image_seq_len",
                  "max_image_seq_len", "num_train_timesteps", "time_shift_type", "shift_terminal")


def scheduler_sigmas(scheduler_config: Any, num_steps: int, *, mu: float | None = None,
                     sigmas: Any = None) -> torch.Tensor:
    """The sigmas ``[num_steps + 1]`` a ``FlowMatchEulerDiscreteScheduler`` with this config yields after
    ``set_timesteps(num_steps, mu=mu, sigmas=sigmas)``, computed by ``samplers.diffusers_flow_sigmas``.

    Raises:
        ValueError: for scheduler options flowrl's schedules do not reproduce (Karras, exponential or
            beta sigmas, inverted sigmas).
    """
    from samplers import diffusers_flow_sigmas

    config = dict(scheduler_config)
    unsupported = [k for k in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas")
                   if config.get(k)]
    if unsupported:
        raise ValueError(f"scheduler option(s) {', '.join(unsupported)} are not supported by flowrl's schedules; "
                         f"set them to false in the scheduler config")
    kwargs = {k: config[k] for k in _SCHEDULE_KEYS if config.get(k) is not None}
    return diffusers_flow_sigmas(num_steps, mu=mu, sigmas=sigmas, **kwargs)


def load_adapter_pipeline(pipeline_cls: type, path: str | os.PathLike | None, *, components: list[str], hub_id: str,
                          dtype: torch.dtype | str | None = None, vae_dtype: torch.dtype | str | None = None,
                          device: torch.device | str | None = None, revision: str | None = None,
                          variant: str | None = None, cache_dir: str | None = None, trust_remote_code: bool = False):
    """What every pipeline adapter's ``from_pretrained`` does first: :func:`load_pipeline` in ``dtype``, moved to
    ``device`` (when given), the VAE in ``vae_dtype`` (default: ``dtype``)."""
    dtype = resolve_dtype(dtype)
    pipeline = load_pipeline(pipeline_cls, path, components=components, hub_id=hub_id, dtype=dtype, revision=revision,
                             variant=variant, cache_dir=cache_dir, trust_remote_code=trust_remote_code)
    if device is not None:
        pipeline.to(device)
    cast_module_(pipeline.vae, resolve_dtype(vae_dtype, default=dtype))
    return pipeline
