"""Which model a command line means, for ``flowrl sample``, ``flowrl eval`` and the demo::

    --model shapes|PATH                         the shipped shapes model, a saved shapes model, or a diffusers
                                                pipeline directory (SD3 / FLUX: model_index.json)
    --model sd3|flux|qwen_image|... [--path DIR_OR_HUB_ID]
                                                a pipeline of a family of flowrl.models.families (default: the
                                                hub id flowrl's recipes use)
        [--lora RUN_DIR_OR_EXPORT]              plus a LoRA: a run directory of ``flowrl train`` (its newest
                                                checkpoint; the EMA when kept) or an exported folder
                                                (``flowrl export --format diffusers`` or ``peft``)
    --run RUN_DIR                               a run directory (or one of its checkpoints) as it trained,
                                                base model included
        [--dtype float32|bfloat16|float16] [--resolution PX] [--num-frames N (video models)] [--no-ema]

Mistakes (a path that is not a model, a LoRA of another model, --run with --lora) are one-line
:class:`~flowrl.commands.args.UsageError` / :class:`~flowrl.models.base.ModelLoadError`, never tracebacks.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .base import FlowModel

from .resolve import (PIPELINE_KINDS, apply_lora_folder, default_dtype, is_run_dir, load_finetuned,
                      load_named_model, load_pipeline_model, pipeline_kind)

__all__ = ["add_model_args", "model_from_args", "describe_model"]


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
    parser.add_argument("--num-frames", type=int, default=None,
                        help="frames per video of a video model (wan: 4 k + 1; default the adapter's 81, or the run's)")
    parser.add_argument("--no-ema", action="store_true", help="a run's raw trained weights even when it kept an EMA")


def model_from_args(args: argparse.Namespace, device: torch.device | str) -> FlowModel:
    """The model the options name, in eval mode, with ``model.description`` for logs and results.

    Raises:
        UsageError: contradictory options.
        ModelLoadError: nothing loadable where the options point.
    """
    from flowrl.commands.args import UsageError

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
        if args.lora and is_run_dir(Path(args.lora)):
            model = load_finetuned(args.lora, device=device, use_ema=not args.no_ema, base_path=base,
                                   dtype=args.dtype or default_dtype(device), expect=spec)
            model.description = f"{spec} {base or 'the run base'} + LoRA of run {args.lora}"
            return model
        model = load_pipeline_model(spec, base, device=device, dtype=args.dtype, resolution=args.resolution,
                                    num_frames=getattr(args, "num_frames", None))
        model.description = f"{spec} {base or 'default'}"
        if args.lora:
            kind = apply_lora_folder(model, Path(args.lora))
            model.description += f" + {kind} {args.lora}"
        return model
    if args.path:
        raise UsageError("--path goes with --model sd3 or --model flux (for a shapes model give --model PATH)")
    kind = pipeline_kind(spec) if Path(spec).is_dir() else None
    if kind is not None:  # a diffusers pipeline directory: SD3 / FLUX with this command's dtype and resolution
        model = load_pipeline_model(kind, spec, device=device, dtype=args.dtype, resolution=args.resolution,
                                    num_frames=getattr(args, "num_frames", None))
        model.description = f"{kind} {spec}"
        if args.lora:
            if is_run_dir(Path(args.lora)):
                raise UsageError(f"a run's LoRA goes on its base with --model {kind} --path {spec} --lora {args.lora}")
            model.description += f" + {apply_lora_folder(model, Path(args.lora))} {args.lora}"
        return model
    if args.lora:
        lora = Path(args.lora)
        if is_run_dir(lora):
            model = load_finetuned(lora, device=device, use_ema=not args.no_ema, base_path=None if spec == "shapes"
                                   else spec)
            model.description = f"{spec} + LoRA of run {args.lora}"
            return model
        model = load_named_model(spec, device=device)
        model.eval()
        model.description = f"{spec} + {apply_lora_folder(model, lora)} {args.lora}"
        return model
    model = load_named_model(spec, device=device)
    model.eval()
    model.description = spec
    return model


def describe_model(model: FlowModel) -> str:
    return getattr(model, "description", None) or type(model).__name__
