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
from flowrl.models.resolve import load_finetuned, read_run_config

__all__ = ["load_finetuned", "load_base", "discover_runs", "RunInfo", "ModelBank", "family_edits"]


def load_base(spec: str, *, device: str | torch.device = "cpu", path: str | None = None, dtype: str | None = None,
              resolution: int | None = None, num_frames: int | None = None) -> FlowModel:
    """The base model of ``--model`` (resolved by :func:`flowrl.models.select.model_from_args`, as ``flowrl
    sample`` resolves it): ``shapes`` (the shipped checkpoint), a saved shapes-model directory (a pretraining run
    directory works too), a diffusers pipeline directory of any family flowrl adapts (``model_index.json``: SD3,
    FLUX, Wan text-to-video, FLUX.1-Kontext editing, ...), or a family name with ``path`` (a directory or hub id).

    Args:
        dtype / resolution / num_frames: a pipeline's weights dtype, image size in px and, for video models, pixel
            frames per clip (``4 k + 1``); None: the adapter's defaults (Wan: 81 frames).

    Raises:
        ModelLoadError: nothing loadable there; the message says what to give instead.
        UsageError: ``path`` with a model that takes none, or ``num_frames`` for an image model.
    """
    import argparse

    from flowrl.models.select import model_from_args

    args = argparse.Namespace(model=spec, path=path, lora=None, run=None, dtype=dtype, resolution=resolution,
                              num_frames=num_frames, no_ema=False)
    model = model_from_args(args, device)
    model.eval()
    return model


def family_edits(family: str | None) -> bool:
    """Whether models of ``family`` (``model.name``) are editing models (their adapter's ``conditions_on_source``),
    read from the family's adapter class without loading any weights; False for an unknown family."""
    import importlib

    from flowrl.models.families import FAMILIES

    if family not in FAMILIES:
        return False
    module, cls = FAMILIES[family].adapter.split(":")
    return bool(getattr(getattr(importlib.import_module(module), cls), "conditions_on_source", False))



@dataclass(frozen=True)
class RunInfo:
    """A loadable run found under a runs directory."""

    name: str
    path: Path
    recipe: str
    family: str | None = None  # the run's model.name (shapes, wan, flux_kontext, ...)


def discover_runs(runs_dir: str | Path | None) -> list[RunInfo]:
    """Runs under ``runs_dir`` (one level deep) that hold an image model: fine-tuning runs with at least one
    checkpoint, and pretraining runs with a saved ``model/``. Unreadable directories and the runs of token
    policies (``vlm_*`` recipes: the Agent tab loads those) are skipped."""
    from flowrl.run.checkpoint_files import latest_checkpoint

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
            data = read_run_config(config)
        except ModelLoadError:
            continue
        recipe = str(data.get("recipe", "?"))
        if recipe.startswith("vlm_"):
            continue
        section = data.get("model")
        family = str(section.get("name", "shapes")) if isinstance(section, dict) else None
        if recipe == "pretrain":
            if (run / "model" / "model.json").is_file():
                found.append(RunInfo(run.name, run, recipe, "shapes"))
        elif latest_checkpoint(run) is not None:
            found.append(RunInfo(run.name, run, recipe, family))
    return found


@dataclass
class _Entry:
    name: str
    source: str
    kind: str  # base | checkpoint | run
    loader: Callable[[], FlowModel]
    family: str | None = None  # model.name when known before loading (a run's config)
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
            load_now: bool = False, family: str | None = None) -> None:
        if name in self._entries:
            raise ValueError(f"two models are named {name!r}; give them different names (NAME=PATH)")
        self._entries[name] = _Entry(name, source, kind, loader, family)
        if load_now:
            self.get(name)

    def add_model(self, name: str, model: FlowModel, *, source: str, kind: str = "base") -> None:
        """Register an already loaded model."""
        self.add(name, lambda: model, source=source, kind=kind, load_now=True)

    def names(self) -> list[str]:
        return list(self._entries)

    def kind(self, name: str) -> str:
        return self._entries[name].kind

    def family(self, name: str) -> str | None:
        """The model family of ``name``: the loaded model's, else the one given when it was added (None: unknown)."""
        entry = self._entries[name]
        if entry.model is not None:
            return getattr(entry.model, "family", None) or entry.family
        return entry.family

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
