"""Which model a name, a path, a hub id, a run folder or an export means: the one place flowrl resolves models.

- :func:`load_named_model`: ``shapes`` (the shipped checkpoint), a saved shapes-model folder (a pretraining
  run's ``model/`` too), or a diffusers pipeline folder of a kind flowrl adapts (``model_index.json``);
- :func:`load_pipeline_model`: an SD3 / FLUX adapter from a pipeline folder or a hub id (a merged export
  brings the run's sampling settings with it);
- :func:`load_finetuned`: a run folder (its newest checkpoint, the EMA when kept) or one of its checkpoints,
  rebuilt exactly as the run trained it;
- :func:`apply_lora_folder`: an exported LoRA folder (diffusers or PEFT format) applied to a loaded model.

Every failure is a one-line :class:`~flowrl.models.base.ModelLoadError` naming the cause and the fix. The
command-line options that choose among these live in :mod:`flowrl.models.select`; the demo's model bank in
:mod:`flowrl.demo.models`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .base import FlowModel, ModelLoadError

__all__ = ["PIPELINE_KINDS", "pipeline_kind", "default_dtype", "load_pipeline_model", "load_named_model",
           "is_run_dir", "apply_lora_folder", "read_run_config", "load_finetuned", "exported_student_steps"]


def _pipeline_kinds() -> dict[str, str]:
    from flowrl.models.families import FAMILIES

    return {f.pipeline: f.name for f in FAMILIES.values()}


#: diffusers pipeline classes flowrl has adapters for (flowrl.models.families), to their family name.
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


def default_dtype(device: torch.device | str) -> str:
    """bfloat16 on a GPU (SD3.5 / FLUX in float32 hardly fit), float32 on the CPU."""
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


def load_pipeline_model(kind: str, path: str | Path | None, *, device: torch.device | str = "cpu",
                        dtype: str | None = None, resolution: int | None = None,
                        num_frames: int | None = None) -> FlowModel:
    """The SD3 / FLUX adapter of a pipeline directory or hub id, in eval mode (``num_frames``: a video family's).

    Raises:
        ModelLoadError: the weights cannot be found or read (the message says the fix).
    """
    from flowrl.models.registry import load_model

    found = pipeline_kind(path) if path is not None and Path(path).is_dir() else None
    if found is not None and found != kind:
        raise ModelLoadError(f"{path} is a {found} pipeline, not {kind}; give --model {found}")
    kwargs = {"device": device, "dtype": dtype or default_dtype(device)}
    exported = Path(path) / "flowrl_export.json" if path is not None else None
    if exported is not None and exported.is_file():  # `flowrl export --format merged`: sample as the run did
        try:
            sampling = json.loads(exported.read_text()).get("sampling") or {}
        except (OSError, ValueError):
            sampling = {}
        for key, name in (("max_sequence_length", "max_sequence_length"), ("resolution", "resolution"),
                          ("default_guidance", "guidance_scale"), ("num_frames", "num_frames"),
                          ("negative_prompt", "negative_prompt")):
            if sampling.get(key) is not None:
                kwargs[name] = sampling[key]
    if resolution is not None:
        kwargs["resolution"] = resolution
    if num_frames is not None:
        from flowrl.models.config import VIDEO_FAMILIES

        if kind not in VIDEO_FAMILIES:
            raise ModelLoadError(f"--num-frames is for video models ({', '.join(VIDEO_FAMILIES)}); {kind} makes "
                                 "images, drop it")
        kwargs["num_frames"] = num_frames
    model = load_model(kind, None if path is None else str(path), **kwargs)
    model.eval()
    return model


def exported_student_steps(path: str | Path | None) -> int | None:
    """The step count of the few-step student a model folder holds: ``student_steps`` of its
    ``flowrl_export.json``, which ``flowrl export --format merged`` writes for a distillation run (DMD2, DMDR) and
    for a run trained from such an export; None for any other folder, a hub id or ``None``."""
    if path is None:
        return None
    exported = Path(path) / "flowrl_export.json"
    if not exported.is_file():
        return None
    try:
        steps = json.loads(exported.read_text()).get("student_steps")
    except (OSError, ValueError, AttributeError):
        return None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else None


def _student_steps(data: dict, base_path) -> int | None:
    """The student steps of a run: its own ``train.student_steps`` (a distillation run), else its base model's
    export's (RL on an exported student)."""
    steps = (data.get("train") or {}).get("student_steps") if isinstance(data.get("train"), dict) else None
    if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0:
        return steps
    return exported_student_steps(base_path)


def is_run_dir(path: Path) -> bool:
    return (path / "config.yaml").is_file() or (path / "state.pt").is_file() or (path / "checkpoints").is_dir()


def apply_lora_folder(model: FlowModel, folder: Path) -> str:
    """Load an exported LoRA folder into ``model``'s network (diffusers or PEFT format); returns its kind."""
    from .base import unwrap

    if (folder / "pytorch_lora_weights.safetensors").is_file():
        pipeline = getattr(model, "pipeline", None)
        if pipeline is None:
            raise ModelLoadError(f"{folder} is a diffusers LoRA folder; it loads into an SD3 / FLUX pipeline, not "
                                 f"the {type(model).__name__}")
        # The safetensors file by name: diffusers would otherwise also accept a pickled .bin.
        pipeline.load_lora_weights(str(folder), weight_name="pytorch_lora_weights.safetensors", use_safetensors=True)
        from .lora_files import EXPERT_2_WEIGHTS

        if (folder / EXPERT_2_WEIGHTS).is_file():  # Wan 2.2's low-noise expert
            if getattr(pipeline, "transformer_2", None) is None:
                raise ModelLoadError(f"{folder} holds a LoRA of a second expert ({EXPERT_2_WEIGHTS}, Wan 2.2) but "
                                     f"the {type(model).__name__}'s pipeline has no transformer_2; load it into a "
                                     "Wan 2.2 A14B pipeline")
            pipeline.load_lora_weights(str(folder), weight_name=EXPERT_2_WEIGHTS, use_safetensors=True,
                                       load_into_transformer_2=True)
        return "diffusers LoRA"
    if (folder / "adapter_config.json").is_file():
        from peft import PeftModel

        if not (folder / "adapter_model.safetensors").is_file():
            raise ModelLoadError(f"--lora {str(folder)!r} has no adapter_model.safetensors "
                                 "(a pickled adapter_model.bin can run code when loaded, so flowrl reads safetensors "
                                 "only); convert it once where you trust it: load it with peft and "
                                 "save_pretrained(DIR, safe_serialization=True)")
        PeftModel.from_pretrained(unwrap(model.denoiser), str(folder))  # injects the adapter in place
        return "PEFT adapter"
    raise ModelLoadError(f"--lora {str(folder)!r} is neither a run directory (config.yaml, checkpoints/) nor an "
                         "exported LoRA folder (pytorch_lora_weights.safetensors or adapter_config.json)")




def load_named_model(spec: str, *, device: str | torch.device = "cpu") -> FlowModel:
    """The model named on a command line: ``shapes`` (the shipped checkpoint), a saved shapes-model
    directory (also a pretraining run directory, whose ``model/`` is used), or a diffusers SD3 / FLUX pipeline
    directory (``model_index.json``; :mod:`flowrl.models.select` has the other ways to name SD3 / FLUX).

    Raises:
        ModelLoadError: nothing loadable there (the message says what to give instead).
    """
    from flowrl.models.shapes import ShapesModel

    if spec == "shapes":
        return ShapesModel.from_pretrained(None, device=device)
    path = Path(spec)
    kind = pipeline_kind(path) if path.is_dir() else None
    if kind is not None:  # a diffusers SD3 / FLUX pipeline directory
        return load_pipeline_model(kind, path, device=device)
    if path.is_dir() and not (path / "model.json").is_file() and (path / "model" / "model.json").is_file():
        path = path / "model"  # a pretraining run directory
    if not path.exists():
        raise ModelLoadError(f"no model {spec!r}: give `shapes` (the shipped model) or the directory of a saved "
                             "shapes model (written by ShapesModel.save_pretrained or by "
                             "`flowrl train configs/shapes/pretrain.yaml` as <output_dir>/model)")
    if not path.is_dir():
        raise ModelLoadError(f"model path {spec!r} is a file; give the directory of a saved shapes model")
    try:
        return ShapesModel.from_pretrained(path, device=device)
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError) as err:  # corrupt or foreign files
        raise ModelLoadError(f"cannot load a shapes model from {spec!r}: {err}") from None




def read_run_config(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ModelLoadError(f"cannot read {path}: {err}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a run config (expected a mapping with a 'model' section)")
    return data


def _locate(path: Path) -> tuple[Path, Path | None]:
    """``(run_dir, checkpoint_dir or None)`` for a run directory, a checkpoint directory or a state.pt."""
    if path.is_file() and path.name == "state.pt":
        path = path.parent
    if (path / "state.pt").is_file():
        for parent in list(path.parents)[:3]:
            if (parent / "config.yaml").is_file():
                return parent, path
        raise ModelLoadError(f"checkpoint {str(path)!r} has no config.yaml in the run directory above it; "
                             "the run's config says how to rebuild the model")
    return path, None


def load_finetuned(path: str | Path, *, device: str | torch.device = "cpu", use_ema: bool = True,
                   base_path: str | None = None, dtype: str | None = None, expect: str | None = None) -> FlowModel:
    """Rebuild a fine-tuned model from its run directory or one of its checkpoints.

    Args:
        path: a run directory (its newest checkpoint is used), a checkpoint directory
            ``<run>/checkpoints/epoch_<N>`` or its ``state.pt``; a pretraining run directory or a saved model
            directory is loaded as it is.
        device: where the model goes.
        use_ema: load the EMA weights when the run kept them (``train.ema_decay``), as the recipe's
            evaluation does; otherwise the raw trained weights.
        base_path: rebuild the base from this directory or hub id instead of the run's ``model.path`` (e.g. a
            local copy of the hub model the run trained on).
        dtype: the base's dtype instead of the run's ``model.dtype``.
        expect: the model kind the caller needs (``sd3``, ``flux``, ``shapes``); another is a ModelLoadError.

    Returns:
        The model in eval mode, with ``model.finetune_info`` = ``{"run", "checkpoint", "epoch", "lora",
        "ema", "student_steps"}`` (strings and numbers, for display; ``student_steps``: the steps of a few-step
        student, :func:`exported_student_steps`, else None).

    Raises:
        ModelLoadError: no such path, no config or checkpoint, a base model that does not load, or weights
            that do not match the rebuilt model; the message names the cause and the fix.
    """
    from flowrl.run.checkpoint_files import CheckpointError, latest_checkpoint, load_state
    from flowrl.config import ConfigError, from_dict
    from flowrl.models.config import ModelConfig, build_model

    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"no checkpoint at {str(path)!r}: give a run directory (runs/<name>), one of its "
                             "checkpoints/epoch_<N> directories, or a saved model directory")
    run_dir, checkpoint = _locate(path)
    config_path = run_dir / "config.yaml"
    if checkpoint is None and not config_path.is_file():
        if (run_dir / "model_index.json").is_file():  # a diffusers pipeline (e.g. `flowrl export --format merged`)
            model = load_named_model(str(run_dir), device=device).eval()
            model.finetune_info = {"run": str(run_dir), "checkpoint": "", "epoch": None, "lora": False, "ema": False,
                                   "student_steps": exported_student_steps(run_dir)}
            return model
        if (run_dir / "model.json").is_file() or (run_dir / "model" / "model.json").is_file():
            model = load_named_model(str(run_dir), device=device).eval()
            model.finetune_info = {"run": str(run_dir), "checkpoint": "", "epoch": None, "lora": False, "ema": False,
                                   "student_steps": exported_student_steps(run_dir)}
            return model
        raise ModelLoadError(f"{str(path)!r} is neither a run directory (no config.yaml) nor a saved model "
                             "(no model.json)")
    data = read_run_config(config_path)
    if data.get("recipe") == "pretrain" and checkpoint is None:
        model = load_named_model(str(run_dir), device=device).eval()  # uses <run>/model
        model.finetune_info = {"run": str(run_dir), "checkpoint": str(run_dir / "model"), "epoch": None,
                               "lora": False, "ema": False}
        return model
    if checkpoint is None:
        checkpoint = latest_checkpoint(run_dir)
        if checkpoint is None:
            raise ModelLoadError(f"run {str(run_dir)!r} has no checkpoint yet (nothing under "
                                 f"{run_dir / 'checkpoints'}/epoch_*/state.pt); wait for the first one")
    if not isinstance(data.get("model"), dict):
        raise ModelLoadError(f"{config_path} has no 'model' section; is it a fine-tuning run's config?")
    try:
        model_cfg = from_dict(ModelConfig, data["model"])
    except ConfigError as err:
        raise ModelLoadError(f"{config_path}: model.{err}") from None
    if expect is not None and model_cfg.name != expect:
        raise ModelLoadError(f"run {str(run_dir)!r} trained a {model_cfg.name} model, not {expect}; give --model "
                             f"{model_cfg.name}")
    if base_path is not None:
        model_cfg.path = base_path
    if dtype is not None:
        model_cfg.dtype = dtype
    if model_cfg.path and not Path(model_cfg.path).exists() and (run_dir / model_cfg.path).exists():
        model_cfg.path = str(run_dir / model_cfg.path)  # a path relative to the run directory
    try:
        model = build_model(model_cfg, torch.device(device))
    except ModelLoadError as err:
        raise ModelLoadError(f"the base model of run {str(run_dir)!r} does not load: {err}") from None
    try:
        state = load_state(checkpoint)
    except CheckpointError as err:
        raise ModelLoadError(str(err)) from None
    if "model" not in state:
        raise ModelLoadError(f"{checkpoint}/state.pt has no 'model' weights; is it a fine-tuning checkpoint?")
    model.load_trainable_state_dict(state["model"])
    ema_used = False
    shadow = (state.get("ema") or {}).get("shadow_params") if use_ema else None
    if shadow:
        params = model.trainable_parameters()
        if len(shadow) != len(params) or any(s.shape != p.shape for s, p in zip(shadow, params)):
            raise ModelLoadError(f"{checkpoint}: the EMA weights do not match the model; load with use_ema=False")
        with torch.no_grad():
            for param, value in zip(params, shadow):
                param.copy_(value.to(param.device, param.dtype))
        ema_used = True
    model.eval()
    model.finetune_info = {"run": str(run_dir), "checkpoint": str(checkpoint), "epoch": state.get("epoch"),
                           "lora": model_cfg.lora is not None, "ema": ema_used,
                           "student_steps": _student_steps(data, model_cfg.path)}
    return model
