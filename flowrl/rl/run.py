"""What every online trainer's ``main`` needs around its objective: the run directory, metrics and plots,
checkpoints and exact resume, the training-time budget, a graceful stop, the evaluation schedule, and
a checkpoint before any failure surfaces.

A recipe reads top to bottom (docs/architecture.md, "Adding a trainer")::

    run = OnlineRun(cfg, "my_recipe", dist=dist)
    model = run.prepare_model(model)
    ...                                              # optimizer, rewards, sampler: the recipe's own
    run.track(model=TrainableWeights(model), optimizer=optimizer, ...)
    run.evaluation(lambda epoch: evaluator(model, epoch, ema))
    with run:                                        # resume; SIGINT/SIGTERM; checkpoint on failure
        while run.next_epoch():
            rollouts = collect_epoch(...)
            ...
            with run.updating():                     # the weights change in here
                metrics.update(train_epoch(...))
            run.end_epoch(metrics, images=n)         # evaluate if due, log, plot, checkpoint
    return run.finish()

The checkpoint holds every tracked object's ``state_dict()`` under its name, the random generators'
states and the counters (``epoch``, ``images_sampled``, ``train_minutes``, ``wall_minutes``) in ``state.pt``;
the optimizer the recipe prepared with ``dist.prepare_training`` (and, under FSDP2 / ZeRO, the sharded weights),
the gradient scaler and every process's generators go through ``accelerator.save_state`` into ``accelerate/``
(docs/distributed.md, "Checkpoints"). Every process takes part in ``save_checkpoint`` and ``resume``.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from tqdm.auto import tqdm

from flowrl.config import bounds, save_config

__all__ = ["DataConfig", "LogConfig", "CheckpointConfig", "TrainableWeights", "OnlineRun"]


@dataclass
class DataConfig:
    train_prompts: str = "shapes:train"  # txt, jsonl or a built-in set
    eval_prompts: str = "shapes:eval"
    num_eval_prompts: int | None = field(default=600, metadata=bounds(ge=1, le=100_000))


@dataclass
class LogConfig:
    backends: list[str] = field(default_factory=list)  # tensorboard, wandb
    project: str = "flowrl"

    def check(self) -> None:
        import importlib.util

        from flowrl.config import fail

        packages = {"tensorboard": "tensorboard", "wandb": "wandb"}
        for backend in self.backends:
            if backend not in packages:
                fail("backends", f"unknown backend {backend!r}; valid: {', '.join(packages)} (metrics.jsonl and "
                     "the plots are always written)")
            if importlib.util.find_spec(packages[backend]) is None:
                fail("backends", f"{backend} is not installed: pip install {packages[backend]}, or remove it from "
                     "log.backends")


@dataclass
class CheckpointConfig:
    every_epochs: int = field(default=5, metadata=bounds(ge=1))
    keep: int = field(default=2, metadata=bounds(ge=1))


class TrainableWeights:
    """A model adapter's trained tensors (LoRA or the whole denoiser) as a checkpointable state."""

    def __init__(self, model):
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.trainable_state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_trainable_state_dict(state)


def _next_multiple(minutes: float, every: float | None) -> float | None:
    """The next multiple of ``every`` strictly after ``minutes`` (None when ``every`` is None)."""
    return None if every is None else (math.floor(minutes / every + 1e-9) + 1) * every


def peak_memory_mb() -> float:
    """Peak GPU memory allocated, or the process's peak resident memory on a CPU machine, in MiB."""
    import resource

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints", "plots", "samples", "tensorboard", "wandb",
             "error.log")


def prepare_output_dir(run, dist) -> Path:
    """Create ``run.output_dir`` for a fresh run, a resume or an overwrite (``run`` is a RunConfig).

    A folder that already holds a run (its config, metrics or checkpoints) is an error unless
    ``run.resume`` (continue it) or ``run.overwrite`` (delete its run files first). Stale temporary files
    of killed checkpoint writers are removed. Every process checks (so all raise the same error); the main
    process changes the folder.

    Raises:
        ConfigError: the folder is a file, cannot be created or written, or holds a run nobody asked to
            resume or overwrite.
        CheckpointError: ``run.resume`` with no checkpoint to resume from.
    """
    import shutil

    from flowrl.checkpoint import clean_stale_files
    from flowrl.config import ConfigError

    out = Path(run.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError("run.output_dir", f"{out} is a file, not a folder; choose another run.output_dir")
    holds_run = out.is_dir() and any((out / name).exists() for name in ("config.yaml", "metrics.jsonl", "checkpoints"))
    if holds_run and not run.resume and not run.overwrite:
        raise ConfigError("run.output_dir", f"{out} holds an earlier run; continue it with run.resume=true, start "
                          "over with run.overwrite=true (deletes its metrics and checkpoints), or choose another "
                          "run.output_dir")
    if run.resume:
        from flowrl.checkpoint import CheckpointError, checkpoints

        if not checkpoints(out):  # say so before a model loads
            raise CheckpointError(f"run.resume=true but {out}/checkpoints holds no checkpoint; run without "
                                  "run.resume=true to start fresh")
    dist.barrier()  # every process has looked before the main one changes anything
    if dist.is_main:
        try:
            if holds_run and run.overwrite:
                for name in RUN_FILES:
                    target = out / name
                    shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
            out.mkdir(parents=True, exist_ok=True)
            probe = out / f".write_test_{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as err:
            raise ConfigError("run.output_dir", f"cannot write to {out}: {err.strerror or err}; choose a writable "
                              "run.output_dir") from None
        clean_stale_files(out)
    dist.barrier()
    return out


class OnlineRun:
    """One online training run (see the module docstring for the shape of a recipe).

    Args:
        cfg: the recipe's config; it must have ``run``, ``eval``, ``log`` and ``checkpoint`` sections.
        recipe: the recipe's registry name (written into ``config.yaml``, used in messages).
        dist: an injected :class:`flowrl.dist.Dist` (tests); by default one is created.
        plot_groups: extra ``{plot: [metric keys or prefixes]}`` beside the standard ones.
    """

    def __init__(self, cfg, recipe: str, *, dist=None, plot_groups: dict[str, list[str]] | None = None):
        from flowrl.dist import Dist
        from flowrl.logging import MetricsLogger
        from flowrl.rl.passes import UpdateHealth
        from flowrl.runtime import prepare_run

        self.cfg, self.recipe = cfg, recipe
        self.dist = dist or Dist()
        if self.dist.is_main:
            print(f"flowrl: {recipe} on {self.dist.describe()}", flush=True)
            for note in self.dist.notes():
                print(f"flowrl: warning: {note}", file=sys.stderr, flush=True)
        prepare_output_dir(cfg.run, self.dist)
        self.output_dir = prepare_run(cfg.run)
        if self.dist.is_main:
            save_config(cfg, self.output_dir / "config.yaml", extra={"recipe": recipe})
        # What tells a user whether training works, one unit per axis.
        groups = {"reward": ["train/reward_mean"], "eval": ["eval/"], "grad_norm": ["train/grad_norm"],
                  "signal": ["train/zero_std_frac", "train/clip_frac"],
                  "policy": ["train/approx_kl", "train/kl_ref", "hack/kl_to_base"],
                  "hack_accuracy": ["hack/accuracy*", "hack/heldout/*"], "hack_objects": ["hack/extra_object*"],
                  "hack_pixels": ["hack/bg_shift", "hack/drift_pixel"], "hack_background": ["hack/bg_[rgb]*"],
                  "hack_features": ["hack/drift_feature", "hack/diversity"],
                  "time_per_epoch": ["time/*_s"], "time_total": ["time/*_min"]}
        units = {"reward": "training reward (mean +- std over the epoch)", "eval": "held-out score / accuracy",
                 "grad_norm": "gradient norm before clipping", "signal": "fraction",
                 "policy": "KL (nats per element)", "hack_accuracy": "accuracy / held-out reward",
                 "hack_objects": "extra objects per image (rate, mean count)",
                 "hack_pixels": "RGB distance (0-255)", "hack_background": "mean background colour (0-255)",
                 "hack_features": "feature cosine distance", "time_per_epoch": "seconds per epoch",
                 "time_total": "minutes"}
        groups.update(plot_groups or {})
        self.logger = MetricsLogger(self.output_dir, backends=cfg.log.backends, enabled=self.dist.is_main,
                                    project=cfg.log.project, plot_groups=groups, plot_units=units)
        self.health = UpdateHealth()  # updates skipped for non-finite losses or gradients
        self.epoch = 0
        self.images_sampled = 0
        self.status = "finished"
        self.exit_code = 0
        self._degenerate_epochs = 0
        self._tracked: dict[str, Any] = {}
        self._evaluate: Callable[..., dict[str, float]] | None = None
        self._train_minutes_before = 0.0
        self._wall_minutes_before = 0.0
        self._deadline = None
        self._stop = None
        self._bar = None
        self._epoch_start = 0.0
        self._next_eval_minutes: float | None = None
        self._updating = False
        self._stopping = False
        self._started = False
        self._saved_epoch: int | None = None

    # ------------------------------------------------------------------ setup

    def prepare_model(self, model=None):
        """Build the model of ``cfg.model`` (unless one is given), move it to this process's device and
        freeze the reference weights (full fine-tuning)."""
        model_cfg = getattr(self.cfg, "model", None)
        if isinstance(getattr(model_cfg, "dtype", None), str):
            self.dist.check_model_dtype(model_cfg.dtype)  # the launch config's mixed precision must agree
        if model is None:
            from flowrl.models.config import build_model

            model = build_model(self.cfg.model, self.dist.device)
        model.to(self.dist.device)
        model.freeze_reference()
        return model

    def track(self, **objects: Any) -> None:
        """Checkpoint these objects (each with ``state_dict()`` / ``load_state_dict()``); None is skipped."""
        self._tracked.update({name: obj for name, obj in objects.items() if obj is not None})

    def evaluation(self, evaluate: Callable[..., dict[str, float]]) -> None:
        """``evaluate(epoch, should_stop) -> metrics``, run at the start (``eval.at_start``), every
        ``eval.every_epochs`` epochs and every ``eval.every_minutes`` training minutes, and at the last
        epoch. ``should_stop()`` turns True on SIGINT / SIGTERM: pass it to the sampler so that a long
        evaluation stops within a step (``flowrl.sample.GenerationInterrupted``)."""
        self._evaluate = evaluate

    # ------------------------------------------------------------------ checkpoints

    def _restored_by_accelerate(self, obj: Any) -> bool:
        """Objects whose checkpoint state ``accelerator.save_state`` keeps: the prepared optimizer, and the
        trained weights when they are sharded (FSDP2 / ZeRO)."""
        if isinstance(obj, TrainableWeights):
            return self.dist.shards_weights and self.dist.manages_module(obj.model.denoiser)
        return self.dist.manages(obj)

    def _in_state_file(self, name: str, obj: Any) -> bool:
        """Whether ``state.pt`` holds ``obj``: everything but the prepared optimizer. The trained weights are
        always there whole (export, the demo and ``load_finetuned`` read them), sharded or not."""
        return isinstance(obj, TrainableWeights) or not self.dist.manages(obj)

    def _state_of(self, obj: Any) -> Any:
        """``obj``'s state for ``state.pt``, whole (collective under FSDP2; None off the main process)."""
        if isinstance(obj, TrainableWeights) and self.dist.manages_module(obj.model.denoiser):
            return self.dist.trainable_state_dict(obj.model.denoiser)
        state = obj.state_dict()
        return self.dist.gather_full(state) if self.dist.shards_weights else state

    def _restore(self, checkpoint: Path, state: dict[str, Any]) -> None:
        """Load one checkpoint into every tracked object (every process)."""
        from flowrl.checkpoint import ACCELERATE_DIR, CheckpointError, set_rng_state

        accelerate_dir = checkpoint / ACCELERATE_DIR
        for name, obj in self._tracked.items():
            if self._restored_by_accelerate(obj) and accelerate_dir.is_dir():
                continue
            if name not in state:  # neither in state.pt (e.g. the optimizer) nor an accelerate/ to load it from
                raise CheckpointError(f"checkpoint {checkpoint} is incomplete (no {name}, no {ACCELERATE_DIR}/)")
            value = state[name]  # (a checkpoint written before accelerate/ existed keeps its optimizer here)
            if self.dist.shards_weights and not isinstance(obj, TrainableWeights):
                value = self.dist.shard_like(value, obj.state_dict())
            obj.load_state_dict(value)
        set_rng_state(state["rng"])
        if accelerate_dir.is_dir():
            # The optimizer (and sharded weights), the scaler and each process's own random generators.
            self.dist.load_state(str(accelerate_dir))

    def _resume(self) -> None:
        """Load the newest checkpoint every process can read; a corrupt or partial newer one is skipped with
        a warning. Every process reads the same files (``run.output_dir`` must be on a file system every
        machine sees) and all move on to the next checkpoint together."""
        from flowrl.checkpoint import CheckpointError, checkpoints, load_state

        required = (tuple(name for name, obj in self._tracked.items()
                          if self._in_state_file(name, obj) and not self.dist.manages(obj))
                    + ("rng", "epoch", "images_sampled", "train_minutes", "wall_minutes"))
        candidates = checkpoints(self.output_dir)
        counts = self.dist.gather_object([len(candidates)])
        if len(set(counts)) > 1:
            raise CheckpointError(f"the processes see different checkpoints in {self.output_dir}/checkpoints "
                                  f"({', '.join(map(str, counts))} per process): run.output_dir must be on a file "
                                  "system every machine shares")
        problems: list[str] = []
        for checkpoint in candidates:
            problem, state = None, None
            try:
                state = load_state(checkpoint, required=required)
            except CheckpointError as err:
                problem = str(err).split("; delete")[0]
            if not self.dist.any(problem is not None):
                try:
                    self._restore(checkpoint, state)
                except (CheckpointError, OSError, ValueError, KeyError, RuntimeError, EOFError,
                        pickle.UnpicklingError) as err:  # a truncated or foreign file in accelerate/
                    problem = (f"cannot restore checkpoint {checkpoint}: "
                               f"{' '.join(str(err).split())[:200]}").split("; delete")[0]
                if not self.dist.any(problem is not None):
                    for earlier in problems:
                        self._warn(f"flowrl: warning: {earlier}; resuming from {checkpoint} instead")
                    break
            problems.append(problem or f"checkpoint {checkpoint} failed on another process")
        else:
            if problems:
                raise CheckpointError("no checkpoint of " + str(self.output_dir) + " can be read: "
                                      + "; ".join(problems) + "; start the run again without run.resume=true")
            raise CheckpointError(f"run.resume=true but {self.output_dir}/checkpoints holds no checkpoint; run "
                                  "without run.resume=true to start fresh")
        self.epoch, self.images_sampled = int(state["epoch"]), int(state["images_sampled"])
        self._train_minutes_before = float(state["train_minutes"])
        self._wall_minutes_before = float(state["wall_minutes"])
        self._saved_epoch = self.epoch
        self.logger.truncate_after(self.epoch)
        if self.dist.is_main:
            print(f"flowrl: resumed from {checkpoint} at epoch {self.epoch}")

    def _warn(self, message: str) -> None:
        if self.dist.is_main:
            print(message, file=sys.stderr, flush=True)

    def save_checkpoint(self) -> None:
        """Checkpoint the tracked state at the current epoch (once per epoch).

        Every process must call it: ``accelerator.save_state`` writes each process's random generators (and
        under FSDP2 / ZeRO its shards) into the checkpoint, and gathering sharded state is collective. The
        main process writes ``state.pt`` and the LoRA folder and renames the directory into place.

        Raises:
            CheckpointError: on every process, when any process failed to write its part (nothing partial
                is left; the previous checkpoints are untouched).
        """
        self._save(solo=False)

    def _save(self, *, solo: bool) -> None:
        from flowrl.checkpoint import (ACCELERATE_DIR, CheckpointError, abandon_checkpoint, begin_checkpoint,
                                       finish_checkpoint, rng_state)

        if self._saved_epoch == self.epoch:
            return
        self._saved_epoch = self.epoch
        if solo:
            self._save_alone()
            return
        dist = self.dist
        state: dict[str, Any] = {}
        if dist.is_main or dist.shards_weights:  # gathering sharded state is collective
            for name, obj in self._tracked.items():
                if self._in_state_file(name, obj):
                    state[name] = self._state_of(obj)
        state.update({"rng": rng_state(), "epoch": self.epoch, "images_sampled": self.images_sampled,
                      "train_minutes": self.train_minutes(), "wall_minutes": self.wall_minutes()})
        token = dist.broadcast_object(os.getpid())
        tmp, error = None, None
        if dist.is_main:
            try:
                tmp = begin_checkpoint(self.output_dir, self.epoch, token)
            except CheckpointError as err:
                error = err
        if dist.any(error is not None):
            raise error or CheckpointError("the main process could not create the checkpoint directory")
        tmp = Path(self.output_dir) / "checkpoints" / f".tmp_step_{self.epoch:07d}_{token}"
        try:
            dist.save_state(str(tmp / ACCELERATE_DIR))
        except OSError as err:
            error = CheckpointError(f"could not write checkpoint {tmp.parent / f'step_{self.epoch:07d}'}: "
                                    f"{err.strerror or err}; free space in {tmp.parent} (or point run.output_dir "
                                    "elsewhere) and resume from the last checkpoint with run.resume=true")
        saved = not dist.any(error is not None)  # every process takes part in each collective
        if dist.is_main and saved:
            try:
                finish_checkpoint(tmp, self.epoch, state, write_extra=self._write_extra(state),
                                  keep=self.cfg.checkpoint.keep)
            except CheckpointError as err:
                error = err
        elif dist.is_main:
            abandon_checkpoint(tmp)
        if dist.any(error is not None):
            raise error or CheckpointError(f"another process could not write checkpoint {self.epoch}; see its "
                                           "message above")

    def _save_alone(self) -> None:
        """The checkpoint a failure leaves in a run of several processes. The other processes may be anywhere
        (waiting in a collective, failing too), so the main process saves alone, without collectives, what it
        holds whole: ``state.pt`` with the optimizer inside (the layout before ``accelerate/``, which resumes).
        Sharded state (FSDP2 / ZeRO) cannot be saved by one process.

        Raises:
            CheckpointError: sharded state, or the write failed.
        """
        from flowrl.checkpoint import CheckpointError, rng_state, save_checkpoint

        if not self.dist.is_main:
            return
        if self.dist.shards_weights:
            raise CheckpointError(f"after a failure one process cannot save the sharded ({self.dist.backend}) state; "
                                  f"the last checkpoint in {self.output_dir}/checkpoints resumes with run.resume=true")
        state = {name: obj.state_dict() for name, obj in self._tracked.items()}
        state.update({"rng": rng_state(), "epoch": self.epoch, "images_sampled": self.images_sampled,
                      "train_minutes": self.train_minutes(), "wall_minutes": self.wall_minutes()})
        save_checkpoint(self.output_dir, self.epoch, state, write_extra=self._write_extra(state),
                        keep=self.cfg.checkpoint.keep)

    def _write_extra(self, state: dict[str, Any]):
        """Files beside ``state.pt``: the LoRA of a diffusers pipeline as a diffusers LoRA folder (the weights
        ``load_finetuned`` uses: the EMA when the run keeps one), so a checkpoint loads in plain diffusers."""
        from flowrl.checkpoint import LORA_DIR

        weights = next((obj for obj in self._tracked.values() if isinstance(obj, TrainableWeights)), None)
        if weights is None or getattr(weights.model, "lora", None) is None:
            return None
        from flowrl.export import lora_spec, lora_supported, write_diffusers_lora

        if not lora_supported(weights.model):
            return None
        name, spec = next(n for n, o in self._tracked.items() if o is weights), lora_spec(weights.model)
        return lambda directory: write_diffusers_lora(spec, state, directory / LORA_DIR, weights_key=name)

    # ------------------------------------------------------------------ time

    def train_minutes(self) -> float:
        """Training minutes so far, earlier sessions included, evaluation excluded."""
        return self._deadline.elapsed_minutes() if self._deadline is not None else self._train_minutes_before

    def wall_minutes(self) -> float:
        return self._wall_minutes_before + (self._deadline.wall_minutes() if self._deadline is not None else 0.0)

    # ------------------------------------------------------------------ the loop

    def __enter__(self) -> "OnlineRun":
        from flowrl.runtime import GracefulStop, make_deadline

        if self.cfg.run.resume:
            self._resume()
        self._deadline = make_deadline(self.cfg.run.clock, self.cfg.run.max_minutes,
                                       already_spent=self._train_minutes_before)
        self._next_eval_minutes = _next_multiple(self._train_minutes_before, self.cfg.eval.every_minutes)
        self._stop = GracefulStop().__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._stop.__exit__(exc_type, exc, tb)
        if self._bar is not None:
            self._bar.close()
        if exc is None:
            return False
        self.logger.close()
        raise self._failure(exc) from exc

    def _failure(self, exc: BaseException) -> BaseException:
        """Save what can be saved, write the traceback to ``error.log``, and return the one-line error that
        tells the user what stopped the run and where its last checkpoint is."""
        import traceback

        from flowrl.checkpoint import CheckpointError
        from flowrl.errors import RunError, user_errors

        where = f"{self.output_dir}/checkpoints"
        if self._updating:
            # The weights are part-way through an epoch's update: no consistent state to save.
            saved = f"(the epoch was not saved; the last checkpoint in {where} resumes with run.resume=true)"
        else:
            try:
                # Several processes: the others may not be here, so the main process saves alone.
                self._save(solo=self.dist.world_size > 1)
                saved = f"(checkpoint of epoch {self.epoch} saved in {where}; resume with run.resume=true)"
            except CheckpointError as err:
                saved = f"({err})"
        if isinstance(exc, RunError):
            return RunError(f"{exc} {saved}", exit_code=exc.exit_code)
        if isinstance(exc, user_errors()):
            return RunError(f"epoch {self.epoch + 1}: {' '.join(str(exc).split())} {saved}")
        log = self.output_dir / "error.log"
        if self.dist.is_main:
            log.write_text("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        return RunError(f"epoch {self.epoch + 1}: internal error {type(exc).__name__}: "
                        f"{' '.join(str(exc).split())[:300]} {saved}; the traceback is in {log}", exit_code=1)

    def _has_row(self, epoch: int) -> bool:
        from flowrl.logging import read_metrics

        return self.logger.path.is_file() and any(r.get("epoch") == epoch for r in read_metrics(self.logger.path))

    def _run_evaluation(self) -> dict[str, float] | None:
        """The evaluation's metrics, or None when a signal interrupted it (the partial result is discarded)."""
        from flowrl.sample import GenerationInterrupted

        with self._deadline.excluded():
            try:
                return self._evaluate(self.epoch, should_stop=lambda: self._stop.requested)
            except GenerationInterrupted:
                self._warn(f"flowrl: evaluation of epoch {self.epoch} interrupted by {self._stop.reason}; "
                           "its partial results are discarded")
                return None

    def next_epoch(self) -> bool:
        """Start the next epoch; False when the run is over (epochs or time spent, a stop requested).

        The first call evaluates the model before any training when ``eval.at_start`` is set (unless a
        resumed run already logged that evaluation)."""
        if not self._started:
            self._started = True
            if (self.epoch == 0 and self.cfg.eval.at_start and self._evaluate is not None
                    and not (self.dist.is_main and self._has_row(0))):
                metrics = self._run_evaluation()
                if metrics is None:
                    self._stopping = True
                    self.status = self._stop.reason
                    self.save_checkpoint()
                else:
                    self.logger.log({"epoch": self.epoch, "images_sampled": self.images_sampled,
                                     "time/train_min": 0.0, "time/wall_min": self.wall_minutes(), **metrics})
                    self.logger.plot()
                    if self.dist.is_main:
                        print(f"epoch {self.epoch}: " + ", ".join(
                            f"{k}={v:.3f}" for k, v in metrics.items() if k.endswith(("accuracy", "mean"))))
            self._bar = tqdm(total=self.cfg.run.max_epochs, initial=self.epoch, desc=self.recipe,
                             disable=not self.dist.is_main, dynamic_ncols=True)
        if not self._stopping and self.dist.any(self._stop.requested):
            self._stopping = True
            self.status = self._stop.reason
            self.save_checkpoint()
        if self._stopping or self.epoch >= self.cfg.run.max_epochs:
            return False
        self._epoch_start = time.perf_counter()
        return True

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Mark the block that changes the weights: a failure inside it saves no checkpoint (the state is
        between two epochs), a failure anywhere else saves the last completed epoch first."""
        self._updating = True
        yield  # an exception leaves the flag set: __exit__ must know the weights are part-updated
        self._updating = False

    def check_rewards(self, metrics: dict[str, Any], samples: int) -> bool:
        """Run health of an epoch's rewards (``metrics`` from ``compute_advantages``). Returns whether to
        train on them: False when every reward is NaN. Either that or rewards equal within every group (no
        learning signal, ``train/zero_std_frac`` = 1) warns, and ``run.max_degenerate_epochs`` such epochs
        in a row stop the run with an error (after a checkpoint).

        Raises:
            RunError: too many degenerate epochs in a row.
        """
        from flowrl.errors import RunError

        all_nan = metrics.get("train/nan_rewards", 0) == samples
        no_signal = not all_nan and metrics.get("train/zero_std_frac") == 1.0
        if not (all_nan or no_signal):
            self._degenerate_epochs = 0
            return True
        self._degenerate_epochs += 1
        what = ("every reward is NaN (the reward failed on every image)" if all_nan else
                "every group's rewards are equal (train/zero_std_frac = 1: no learning signal)")
        limit = self.cfg.run.max_degenerate_epochs
        if self._degenerate_epochs >= limit:
            reward = getattr(getattr(self.cfg, "reward", None), "train", "the reward")
            raise RunError(f"stopped after epoch {self.epoch}: {what} in {limit} epochs in a row; check the reward "
                           f"({reward}) or raise run.max_degenerate_epochs")
        self._warn(f"flowrl: warning: epoch {self.epoch + 1}: {what}" + ("; skipping its update" if all_nan else "")
                   + f" ({self._degenerate_epochs} of {limit} allowed in a row)")
        return not all_nan

    def end_epoch(self, metrics: dict[str, Any], *, images: int) -> None:
        """Close an epoch that sampled ``images`` images: evaluate if due, log ``metrics`` with the
        counters and timings, redraw the plots, checkpoint if due, and decide whether to stop.

        Raises:
            RunError: ``run.max_nonfinite_updates`` optimizer updates in a row were skipped (after logging
                and checkpointing this epoch, whose weights are the last finite ones).
        """
        from flowrl.errors import RunError

        self.epoch += 1
        self.images_sampled += images
        metrics.update({"epoch": self.epoch, "images_sampled": self.images_sampled,
                        "train/skipped_updates": self.health.skipped,
                        "time/epoch_s": time.perf_counter() - self._epoch_start,
                        "time/train_min": self.train_minutes(), "memory/peak_mb": peak_memory_mb()})
        stopping = self.dist.any(self._stop.requested or self._deadline.passed())
        cfg = self.cfg
        due = (cfg.eval.every_epochs is not None and self.epoch % cfg.eval.every_epochs == 0) or (
            self._next_eval_minutes is not None and self.train_minutes() >= self._next_eval_minutes)
        if self._evaluate is not None and (due or stopping or self.epoch == cfg.run.max_epochs):
            try:
                evaluation = self._run_evaluation()
            except BaseException:
                self.logger.log({**metrics, "time/wall_min": self.wall_minutes()})  # the epoch's training row
                raise
            if evaluation is None:
                stopping = True
            else:
                metrics.update(evaluation)
                self._next_eval_minutes = _next_multiple(self.train_minutes(), cfg.eval.every_minutes)
        metrics["time/wall_min"] = self.wall_minutes()
        self.logger.log(metrics)
        self.logger.plot()
        self._bar.update(1)
        postfix = {"reward": f"{metrics['train/reward_mean']:.3f}"} if "train/reward_mean" in metrics else {}
        postfix.update({"eval": f"{v:.3f}" for k, v in metrics.items() if k.startswith("eval/")
                        and k.endswith("/accuracy")})
        self._bar.set_postfix(**postfix)
        nonfinite = self.health.in_a_row >= cfg.run.max_nonfinite_updates
        if self.epoch % cfg.checkpoint.every_epochs == 0 or stopping or self.epoch == cfg.run.max_epochs or nonfinite:
            self.save_checkpoint()
        if nonfinite:
            raise RunError(f"stopped after epoch {self.epoch}: {self.health.in_a_row} optimizer updates in a row had a "
                           "non-finite loss or gradient and were skipped (the weights are the last finite ones); "
                           "lower optim.lr or the guidance, or check the reward's scale")
        if stopping:
            self._stopping = True
            self.status = self._stop.reason or "time budget reached"

    def finish(self) -> int:
        """Close the logger and the process group; print where the outputs are. Returns the exit code:
        0, or 130 / 143 for a run stopped by SIGINT / SIGTERM (a scheduler must not read it as done)."""
        self.logger.close()
        if self.dist.is_main:
            print(f"flowrl: {self.recipe} stopped at epoch {self.epoch}/{self.cfg.run.max_epochs} ({self.status}); "
                  f"outputs in {self.output_dir}")
        self.dist.close()
        return {"SIGINT": 130, "SIGTERM": 143}.get(self.status, 0)
