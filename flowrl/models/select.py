"""Which model a command line means, for ``flowrl sample``, ``flowrl eval`` and the demo::

    --model shapes|PATH                         the shipped shapes model, a saved shapes model, or a diffusers
                                                pipeline directory (SD3 / FLUX: model_index.json)
    --model sd3|flux|qwen_image [--path DIR_OR_HUB_ID]
                                                a pipeline of a family of flowrl.models.families (default: the
                                                hub id flowrl's recipes use)
        [--lora RUN_DIR_OR_EXPORT]              plus a LoRA: a run directory of ``flowrl train`` (its newest
                                                checkpoint; the EMA when kept) or an exported folder
                                                (``flowrl export --format diffusers`` or ``peft``)
    --run RUN_DIR                               a run directory (or one of its checkpoints) as it trained,
                                                base model included
        [--dtype float32|bfloat16|float16] [--resolution PX] [--no-ema]

Mistakes (a path that is not a model, a LoRA of another model, --run with --lora) are one-line
:class:`~flowrl.cli_args.UsageError` / :class:`~flowrl.models.base.ModelLoadError`, never tracebacks.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from .base import FlowModel, ModelLoadError

__all__ = ["PIPELINE_KINDS", "pipeline_kind", "load_pipeline_model", "add_model_args", "model_from_args",
           "describe_model"]

def _pipeline_kinds() -> dict[str, str]:
    from flowrl.models.families import FAMILIES

    return {f.pipeline: f.name for f in FAMILIES.values()}


#: diffusers pipeline classes flowrl has adapters for (flowrl.models.families).
PIPELINE_KINDS = _pipeline_kinds()


def pipeline_kind(path: str | Path) -> str | None:
    """``sd3`` / ``flux`` for a diffusers pipeline directory of a kind flowrl adapts, else None.

    Raises:
        ModelLoadError: a pipeline directory of another kind (the message names it).
    """
    index = Path(path) / "model_index.json"
    if not index.is_file():
        return None
    try:
        name = json.loads(index.read_text()).get("_class_name")
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{index} is not readable JSON ({err})") from None
    if name not in PIPELINE_KINDS:
        raise ModelLoadError(f"{path} holds a {name}; flowrl adapts {', '.join(PIPELINE_KINDS)}")
    return PIPELINE_KINDS[name]


def _default_dtype(device: torch.device | str) -> str:
    """bfloat16 on a GPU (SD3.5 / FLUX in float32 hardly fit), float32 on the CPU."""
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


def load_pipeline_model(kind: str, path: str | Path | None, *, device: torch.device | str = "cpu",
                        dtype: str | None = None, resolution: int | None = None) -> FlowModel:
    """The SD3 / FLUX adapter of a pipeline directory or hub id, in eval mode.

    Raises:
        ModelLoadError: the weights cannot be found or read (the message says the fix).
    """
    from flowrl.models.registry import load_model

    found = pipeline_kind(path) if path is not None and Path(path).is_dir() else None
    if found is not None and found != kind:
        raise ModelLoadError(f"{path} is a {found} pipeline, not {kind}; give --model {found}")
    kwargs = {"device": device, "dtype": dtype or _default_dtype(device)}
    exported = Path(path) / "flowrl_export.json" if path is not None else None
    if exported is not None and exported.is_file():  # `flowrl export --format merged`: sample as the run did
        try:
            sampling = json.loads(exported.read_text()).get("sampling") or {}
        except (OSError, ValueError):
            sampling = {}
        for key, name in (("max_sequence_length", "max_sequence_length"), ("resolution", "resolution"),
                          ("default_guidance", "guidance_scale")):
            if sampling.get(key) is not None:
                kwargs[name] = sampling[key]
    if resolution is not None:
        kwargs["resolution"] = resolution
    model = load_model(kind, None if path is None else str(path), **kwargs)
    model.eval()
    return model


def _is_run(path: Path) -> bool:
    return (path / "config.yaml").is_file() or (path / "state.pt").is_file() or (path / "checkpoints").is_dir()


def _apply_lora_folder(model: FlowModel, folder: Path) -> str:
    """Load an exported LoRA folder into ``model``'s network (diffusers or PEFT format); returns its kind."""
    from flowrl.models.base import unwrap

    if (folder / "pytorch_lora_weights.safetensors").is_file():
        pipeline = getattr(model, "pipeline", None)
        if pipeline is None:
            raise ModelLoadError(f"{folder} is a diffusers LoRA folder; it loads into an SD3 / FLUX pipeline, not "
                                 f"the {type(model).__name__}")
        # The safetensors file by name: diffusers would otherwise also accept a pickled .bin.
        pipeline.load_lora_weights(str(folder), weight_name="pytorch_lora_weights.safetensors", use_safetensors=True)
        return "diffusers LoRA"
    if (folder / "adapter_config.json").is_file():
        from peft import PeftModel

        if not (folder / "adapter_model.safetensors").is_file():
            raise ModelLoadError(f"--lora {str(folder)!r} has no adapter_model.safetensors (a pickled adapter_model.bin "
                                 "can run code when loaded, so flowrl reads safetensors only); convert it once where "
                                 "you trust it: load it with peft and save_pretrained(DIR, safe_serialization=True)")
        PeftModel.from_pretrained(unwrap(model.denoiser), str(folder))  # injects the adapter in place
        return "PEFT adapter"
    raise ModelLoadError(f"--lora {str(folder)!r} is neither a run directory (config.yaml, checkpoints/) nor an "
                         "exported LoRA folder (pytorch_lora_weights.safetensors or adapter_config.json)")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The options beside ``--model`` (see the module docstring)."""
    parser.add_argument("--path", default=None,
                        help="with --model sd3|flux: a pipeline directory or hub id (default: the recipes' model)")
    parser.add_argument("--lora", default=None,
                        help="a run directory of `flowrl train` or an exported LoRA folder to apply to the base")
    parser.add_argument("--run", default=None,
                        help="a run directory (or checkpoints/epoch_<N>): the model as the run trained it")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="weights dtype of SD3 / FLUX (default: bfloat16 on a GPU, float32 on the CPU; --run: "
                             "the run's)")
    parser.add_argument("--resolution", type=int, default=None,
                        help="image size in pixels of SD3 / FLUX (default: the pipeline's, or the run's)")
    parser.add_argument("--no-ema", action="store_true", help="a run's raw trained weights even when it kept an EMA")


def model_from_args(args: argparse.Namespace, device: torch.device | str) -> FlowModel:
    """The model the options name, in eval mode, with ``model.description`` for logs and results.

    Raises:
        UsageError: contradictory options.
        ModelLoadError: nothing loadable where the options point.
    """
    from flowrl.cli_args import UsageError
    from flowrl.demo.models import load_finetuned

    spec = getattr(args, "model", "shapes")
    if args.run:
        if args.lora or args.path:
            raise UsageError("--run loads the run's own base model and weights; give --run alone, or --model, --path "
                             "and --lora to apply the run's LoRA to another copy of its base")
        model = load_finetuned(args.run, device=device, use_ema=not args.no_ema, dtype=args.dtype)
        model.description = f"run {args.run}"
        return model
    if spec in PIPELINE_KINDS.values():
        base = args.path
        if args.lora and _is_run(Path(args.lora)):
            model = load_finetuned(args.lora, device=device, use_ema=not args.no_ema, base_path=base,
                                   dtype=args.dtype or _default_dtype(device), expect=spec)
            model.description = f"{spec} {base or 'the run base'} + LoRA of run {args.lora}"
            return model
        model = load_pipeline_model(spec, base, device=device, dtype=args.dtype, resolution=args.resolution)
        model.description = f"{spec} {base or 'default'}"
        if args.lora:
            kind = _apply_lora_folder(model, Path(args.lora))
            model.description += f" + {kind} {args.lora}"
        return model
    if args.path:
        raise UsageError("--path goes with --model sd3 or --model flux (for a shapes model give --model PATH)")
    from flowrl.sample import load_model_arg

    kind = pipeline_kind(spec) if Path(spec).is_dir() else None
    if kind is not None:  # a diffusers pipeline directory: SD3 / FLUX with this command's dtype and resolution
        model = load_pipeline_model(kind, spec, device=device, dtype=args.dtype, resolution=args.resolution)
        model.description = f"{kind} {spec}"
        if args.lora:
            if _is_run(Path(args.lora)):
                raise UsageError(f"a run's LoRA goes on its base with --model {kind} --path {spec} --lora {args.lora}")
            model.description += f" + {_apply_lora_folder(model, Path(args.lora))} {args.lora}"
        return model
    if args.lora:
        lora = Path(args.lora)
        if _is_run(lora):
            model = load_finetuned(lora, device=device, use_ema=not args.no_ema, base_path=None if spec == "shapes"
                                   else spec)
            model.description = f"{spec} + LoRA of run {args.lora}"
            return model
        model = load_model_arg(spec, device=device)
        model.eval()
        model.description = f"{spec} + {_apply_lora_folder(model, lora)} {args.lora}"
        return model
    model = load_model_arg(spec, device=device)
    model.eval()
    model.description = spec
    return model


def describe_model(model: FlowModel) -> str:
    return getattr(model, "description", None) or type(model).__name__
