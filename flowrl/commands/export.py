"""``flowrl export``: a run's trained weights in the formats other tools read::

    flowrl export RUN_DIR [--checkpoint N] --format diffusers|peft|merged --out DIR [--no-ema] [--device D]

- ``diffusers``: a LoRA folder (``pytorch_lora_weights.safetensors``, diffusers' key names) that
  ``StableDiffusion3Pipeline`` / ``FluxPipeline``'s ``pipe.load_lora_weights(DIR)`` reads. flowrl's LoRA
  computes ``W x + (alpha / r) B A x``; the folder stores ``B`` already multiplied by ``alpha / r`` and says
  ``lora_alpha = r`` in its metadata, so every loader (diffusers with or without the metadata, other tools
  that assume ``alpha = r``) applies the update at full strength. A plain key rename would lose the factor
  ``alpha / r`` (half the effect at flowrl's default r 32, alpha 64).
- ``peft``: a PEFT adapter (``adapter_config.json`` with the run's own ``r`` and ``lora_alpha``,
  ``adapter_model.safetensors`` unscaled), for ``peft.PeftModel.from_pretrained(transformer, DIR)``.
- ``merged``: the whole pipeline with the update merged into the base weights (``save_pretrained``), which
  loads with ``StableDiffusion3Pipeline.from_pretrained(DIR)`` / ``FluxPipeline.from_pretrained(DIR)`` (the
  shapes model: ``ShapesModel.from_pretrained``). Full fine-tuning runs export only this way.

``--out`` must be new or empty; the export is written to a temporary folder beside it and renamed into place
when complete (:mod:`flowrl.atomic`), so a full disk or a crash leaves nothing under ``--out`` and the same
command can be run again.

The weights are those ``flowrl.models.resolve.load_finetuned`` uses: the EMA when the run kept one (``--no-ema``:
the raw trained weights). Every LoRA checkpoint of an SD3 / FLUX run also holds the diffusers folder
(``checkpoints/epoch_<N>/lora``), written by the run itself with the same code.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from flowrl.models.lora_files import (
    ExportError,
    lora_supported,
    spec_for,
    write_diffusers_lora,
    write_export_info,
    write_peft_adapter,
)

__all__ = ["FORMATS", "ExportError", "export", "main"]

FORMATS = ("diffusers", "peft", "merged")


# ----------------------------------------------------------------------------- whole runs


def _checkpoint_dir(run: Path, checkpoint: int | None) -> Path:
    from flowrl.run.checkpoint_files import checkpoint_number, checkpoints

    if (run / "state.pt").is_file():  # a checkpoint directory itself
        return run
    found = checkpoints(run)
    if not found:
        raise ExportError(f"{str(run)!r} has no checkpoint (expected {run}/checkpoints/epoch_<N>/state.pt); give "
                          "a run directory of `flowrl train`")
    if checkpoint is None:
        return found[0]
    wanted = [p for p in found if checkpoint_number(p) == checkpoint]
    if not wanted:
        have = ", ".join(str(checkpoint_number(p)) for p in reversed(found))
        raise ExportError(f"run {str(run)!r} has no checkpoint {checkpoint}; it has {have}")
    return wanted[0]


def _run_model_config(run_dir: Path):
    """The run's ``model`` section, read from its ``config.yaml`` (diffusers / peft exports never load the
    base weights)."""
    from flowrl.config import ConfigError, from_dict
    from flowrl.models.base import ModelLoadError
    from flowrl.models.config import ModelConfig
    from flowrl.models.resolve import read_run_config

    config = run_dir / "config.yaml"
    if not config.is_file():
        raise ExportError(f"{str(run_dir)!r} has no config.yaml; give a run directory of `flowrl train`")
    try:
        data = read_run_config(config)
        return from_dict(ModelConfig, data.get("model") or {})
    except ModelLoadError as err:
        raise ExportError(str(err)) from None
    except ConfigError as err:
        raise ExportError(f"{config}: model.{err}") from None


def export(run: str | Path, *, fmt: str, out: str | Path, checkpoint: int | None = None, use_ema: bool = True,
           device: str | torch.device = "cpu") -> Path:
    """Export a run's checkpoint (see the module docstring). Returns ``out``.

    Raises:
        ExportError: no such run or checkpoint, or a format the run's model or training cannot give.
        ModelLoadError: ``merged`` and the base model does not load.
    """
    from flowrl.run.checkpoint_files import CheckpointError, load_state

    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}")
    run = Path(run).expanduser()
    if not run.exists():
        raise ExportError(f"no run at {str(run)!r}; give a run directory of `flowrl train` (run.output_dir)")
    ckpt = _checkpoint_dir(run, checkpoint)
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else run
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {str(out)!r} exists and is not an empty directory; choose a new one")
    if fmt == "merged":
        return _written(out, lambda stage: _export_merged(ckpt, stage, use_ema=use_ema, device=device))
    cfg = _run_model_config(run_dir)
    if cfg.lora is None:
        raise ExportError(f"run {str(run_dir)!r} fine-tunes the whole model (no model.lora); export it with "
                          "--format merged")
    spec = spec_for(cfg.name, cfg.lora)
    try:
        state = load_state(ckpt, required=("model",))
    except CheckpointError as err:
        raise ExportError(str(err)) from None

    def write(stage: Path) -> None:
        if fmt == "diffusers":
            write_diffusers_lora(spec, state, stage, use_ema=use_ema)
        else:
            write_peft_adapter(spec, state, stage, use_ema=use_ema, base_model=cfg.path)
        info = json.loads((stage / "flowrl_export.json").read_text())
        info.update({"run": str(run_dir), "checkpoint": str(ckpt), "epoch": state.get("epoch")})
        write_export_info(stage, info)

    return _written(out, write)


def _written(out: Path, write) -> Path:
    """Run ``write(folder)`` on a staged folder that becomes ``out`` once complete (:mod:`flowrl.atomic`): a
    full disk or a crash leaves no partial export under ``out``, so the same command can be run again."""
    from flowrl.atomic import WRITE_ERRORS, staged_directory

    try:
        with staged_directory(out) as stage:
            write(stage)
    except WRITE_ERRORS as err:
        reason = getattr(err, "strerror", None) or " ".join(str(err).split())[:200]
        raise ExportError(f"cannot write the export to {str(out)!r} ({reason}); nothing was left there; free space "
                          "or choose another --out, then run the same command again") from None
    return out


def _export_merged(ckpt: Path, out: Path, *, use_ema: bool, device) -> Path:
    from flowrl.models.base import unwrap
    from flowrl.models.resolve import load_finetuned

    model = load_finetuned(ckpt, device=device, use_ema=use_ema)
    denoiser = unwrap(model.denoiser)
    if model.lora is not None:
        denoiser.fuse_lora(lora_scale=1.0)  # W <- W + (alpha / r) B A, in the base weights' dtype
        denoiser.unload_lora()
    out.mkdir(parents=True, exist_ok=True)
    if lora_supported(model):
        model.pipeline.save_pretrained(str(out), safe_serialization=True)
    else:
        model.save_pretrained(out)
    info = dict(model.finetune_info)
    # The run's sampling settings: flowrl loads them with the pipeline (plain diffusers takes them as arguments).
    sampling = {k: getattr(model, k) for k in ("max_sequence_length", "resolution", "default_guidance", "num_frames",
                                               "negative_prompt")
                if isinstance(getattr(model, k, None), (int, float, str, list, tuple))}
    # A few-step student (a distillation run, or a run trained from one) says so: a run that loads it warns when it
    # samples or evaluates it on another schedule (flowrl.rl.sampling.student_notes).
    student = {"student_steps": info["student_steps"]} if info.get("student_steps") else {}
    write_export_info(out, {"format": "merged",
                            **{k: info.get(k) for k in ("run", "checkpoint", "epoch", "lora", "ema")},
                            **student, "sampling": sampling})
    return out


# ----------------------------------------------------------------------------- the command


def _parser():
    from flowrl.commands.args import OneLineParser

    parser = OneLineParser(prog="flowrl export", description="Export a run's trained weights: a diffusers LoRA "
                                                             "folder, a PEFT adapter or a merged pipeline.")
    parser.add_argument("run", help="a run directory (run.output_dir of `flowrl train`) or one of its "
                                    "checkpoints/epoch_<N> directories")
    parser.add_argument("--checkpoint", type=int, default=None,
                        help="the epoch of the checkpoint (default: the newest)")
    parser.add_argument("--format", dest="fmt", choices=FORMATS, required=True,
                        help="diffusers: pipe.load_lora_weights(DIR); peft: PeftModel.from_pretrained(transformer, "
                             "DIR); merged: the whole pipeline with the update merged in")
    parser.add_argument("--out", required=True, help="output directory (new or empty)")
    parser.add_argument("--no-ema", action="store_true", help="the raw trained weights even when the run kept an EMA")
    parser.add_argument("--device", default="cpu", help="device for --format merged (default cpu)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from flowrl.commands.args import UsageError
    from flowrl.models.base import ModelLoadError

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
        out = export(args.run, fmt=args.fmt, out=args.out, checkpoint=args.checkpoint, use_ema=not args.no_ema,
                     device=args.device)
    except SystemExit as exit_:  # --help
        return int(exit_.code or 0)
    except (UsageError, ExportError, ModelLoadError) as err:
        print(f"flowrl export: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    info = json.loads((out / "flowrl_export.json").read_text())
    print(f"flowrl export: wrote {args.fmt} to {out} (epoch {info.get('epoch')}, "
          f"{'EMA' if info.get('ema') else 'raw'} weights)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
