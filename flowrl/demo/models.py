"""Models of the demo: the base generator, fine-tuned checkpoints and the runs found on disk.

A fine-tuning run (``flowrl train configs/shapes/flow_grpo.yaml``, or any recipe with the same ``model``
section) writes::

    runs/<name>/config.yaml                      the resolved config (model.name / path / lora / dtype)
    runs/<name>/checkpoints/epoch_<N>/state.pt    state["model"]: the trainable tensors (the whole denoiser,
                                                 or only the LoRA weights); state["ema"]: their EMA

:func:`load_finetuned` rebuilds the base model exactly as the run did (same adapter, same LoRA settings)
and loads those tensors. A pretraining run directory (``recipe: pretrain``, with ``model/``) or a saved
model directory loads as a plain model.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from flowrl.models.base import FlowModel, ModelLoadError

__all__ = ["load_finetuned", "load_base", "discover_runs", "RunInfo", "ModelBank"]


def load_base(spec: str, *, device: str | torch.device = "cpu") -> FlowModel:
    """The base model of ``--model``: ``shapes`` (the shipped checkpoint) or a saved shapes-model directory
    (a pretraining run directory works too).

    Raises:
        ModelLoadError: nothing loadable there; the message says what to give instead.
    """
    from flowrl.sample import load_model_arg

    model = load_model_arg(spec, device=device)
    model.eval()
    return model


def _read_yaml(path: Path) -> dict:
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
        "ema"}`` (strings and numbers, for display).

    Raises:
        ModelLoadError: no such path, no config or checkpoint, a base model that does not load, or weights
            that do not match the rebuilt model; the message names the cause and the fix.
    """
    from flowrl.checkpoint import CheckpointError, latest_checkpoint, load_state
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
            model = load_base(str(run_dir), device=device)
            model.finetune_info = {"run": str(run_dir), "checkpoint": "", "epoch": None, "lora": False, "ema": False}
            return model
        if (run_dir / "model.json").is_file() or (run_dir / "model" / "model.json").is_file():
            model = load_base(str(run_dir), device=device)
            model.finetune_info = {"run": str(run_dir), "checkpoint": "", "epoch": None, "lora": False, "ema": False}
            return model
        raise ModelLoadError(f"{str(path)!r} is neither a run directory (no config.yaml) nor a saved model "
                             "(no model.json)")
    data = _read_yaml(config_path)
    if data.get("recipe") == "pretrain" and checkpoint is None:
        model = load_base(str(run_dir), device=device)  # uses <run>/model
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
                           "lora": model_cfg.lora is not None, "ema": ema_used}
    return model


@dataclass(frozen=True)
class RunInfo:
    """A loadable run found under a runs directory."""

    name: str
    path: Path
    recipe: str


def discover_runs(runs_dir: str | Path | None) -> list[RunInfo]:
    """Runs under ``runs_dir`` (one level deep) that hold an image model: fine-tuning runs with at least one
    checkpoint, and pretraining runs with a saved ``model/``. Unreadable directories and the runs of token
    policies (``vlm_*`` recipes: the Agent tab loads those) are skipped."""
    from flowrl.checkpoint import latest_checkpoint

    if not runs_dir:
        return []
    root = Path(runs_dir)
    if not root.is_dir():
        return []
    found = []
    for run in sorted(p for p in root.iterdir() if p.is_dir()):
        config = run / "config.yaml"
        if not config.is_file():
            continue
        try:
            recipe = str(_read_yaml(config).get("recipe", "?"))
        except ModelLoadError:
            continue
        if recipe.startswith("vlm_"):
            continue
        if recipe == "pretrain":
            if (run / "model" / "model.json").is_file():
                found.append(RunInfo(run.name, run, recipe))
        elif latest_checkpoint(run) is not None:
            found.append(RunInfo(run.name, run, recipe))
    return found


@dataclass
class _Entry:
    name: str
    source: str
    kind: str  # base | checkpoint | run
    loader: Callable[[], FlowModel]
    model: FlowModel | None = None
    error: str | None = None
    info: dict = field(default_factory=dict)


class ModelBank:
    """Named models, loaded on first use; at most ``max_loaded`` of them (besides the base) stay loaded.

    The base model and the checkpoints given on the command line are loaded at start-up (so a wrong path
    fails at once); runs discovered on disk load when first selected. When a load would exceed
    ``max_loaded``, the least recently used model is unloaded (it loads again when selected), so visitors
    picking run after run cannot exhaust the machine's memory.
    """

    def __init__(self, max_loaded: int | None = None):
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self.max_loaded = max_loaded
        self._recent: list[str] = []  # loaded non-base models, least recently used first

    def add(self, name: str, loader: Callable[[], FlowModel], *, source: str, kind: str,
            load_now: bool = False) -> None:
        if name in self._entries:
            raise ValueError(f"two models are named {name!r}; give them different names (NAME=PATH)")
        self._entries[name] = _Entry(name, source, kind, loader)
        if load_now:
            self.get(name)

    def add_model(self, name: str, model: FlowModel, *, source: str, kind: str = "base") -> None:
        """Register an already loaded model."""
        self.add(name, lambda: model, source=source, kind=kind, load_now=True)

    def names(self) -> list[str]:
        return list(self._entries)

    def kind(self, name: str) -> str:
        return self._entries[name].kind

    def is_loaded(self, name: str) -> bool:
        return name in self._entries and self._entries[name].model is not None

    def get(self, name: str) -> FlowModel:
        """The model called ``name``, loading it if needed.

        Raises:
            ModelLoadError: unknown name, or the model does not load (the message says why).
        """
        entry = self._entries.get(name)
        if entry is None:
            raise ModelLoadError(f"unknown model {name!r}; choose one of {', '.join(self._entries)}")
        with self._lock:
            if entry.model is None:
                try:
                    entry.model = entry.loader()
                except ModelLoadError as err:
                    entry.error = str(err)
                    raise ModelLoadError(f"model {name!r} ({entry.source}): {err}") from None
                entry.error = None
                entry.model.eval()
                entry.info = dict(getattr(entry.model, "finetune_info", {}) or {})
            model = entry.model
            if entry.kind != "base":
                if name in self._recent:
                    self._recent.remove(name)
                self._recent.append(name)
                self._unload_beyond_limit()
        return model

    def _unload_beyond_limit(self) -> None:
        if self.max_loaded is None:
            return
        freed = False
        while len(self._recent) > max(1, self.max_loaded):
            entry = self._entries[self._recent.pop(0)]
            entry.model = None  # the caller's references keep a model alive until its request is done
            freed = True
        if freed:
            import gc

            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def describe(self) -> list[dict]:
        """One row per model for display: name, kind, source, state."""
        rows = []
        for e in self._entries.values():
            state = "loaded" if e.model is not None else (f"failed: {e.error}" if e.error else
                                                          "loads when selected")
            extra = []
            if e.info.get("epoch") is not None:
                extra.append(f"epoch {e.info['epoch']}")
            if e.info.get("lora"):
                extra.append("LoRA")
            if e.info.get("ema"):
                extra.append("EMA")
            rows.append({"name": e.name, "kind": e.kind, "source": e.source,
                         "state": state + (f" ({', '.join(extra)})" if extra else "")})
        return rows
