"""The run harness every recipe stands on: the run folder (guard, marker, lock: :mod:`flowrl.run.folder`),
``config.yaml``, metrics and plots, checkpoints and exact resume (:mod:`flowrl.run.checkpoints`), the training
budget in wall-clock or CPU minutes (``run.clock``), a graceful stop, the evaluation schedule, run health, and a
checkpoint before any failure surfaces.

A recipe reads top to bottom (docs/architecture.md, "The run harness")::

    run = Run(cfg.run, "my_recipe", schedule=cfg.eval, log=cfg.log, checkpoint=cfg.checkpoint,
              precision=cfg.sampling.precision, reward=str(cfg.reward.train), config=to_dict(cfg),
              plots={"loss": ["train/loss"]}, counters=("images_sampled",))
    ...                                              # model, optimizer, rewards: the recipe's own
    run.track(model=TrainableWeights(model, module=model.denoiser), optimizer=optimizer, ...)
    run.evaluation(lambda epoch, should_stop: evaluate(...))
    with run:                                        # resume; SIGINT/SIGTERM; checkpoint on failure
        while run.next_epoch():
            ...                                      # collect, compute advantages
            with run.updating():                     # the weights change in here
                metrics.update(train(...))
            run.end_epoch(metrics, images_sampled=n) # evaluate if due, log, plot, checkpoint
    return run.finish()

A recipe whose epoch is many optimizer steps (pretraining, SFT) passes ``steps_per_epoch`` and iterates
``for step in run.steps():`` inside the epoch: a stop request or a spent budget ends the epoch early, and its
checkpoints count steps (``checkpoints/step_<N>``) so that a resume continues at the exact step.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from tqdm.auto import tqdm

from flowrl.config import RunConfig, bounds, save_config

#: ``Run.finish``'s exit status for a run that trained epochs of which none had a usable reward.
NO_USABLE_REWARD = 3

__all__ = ["NO_USABLE_REWARD", "EvalSchedule", "LogConfig", "CheckpointConfig", "Run", "peak_memory_mb"]


@dataclass
class EvalSchedule:
    """When a run evaluates: before any training (``at_start``), every ``every_epochs`` epochs, every
    ``every_minutes`` training minutes (evaluation excluded; None: not by that measure), and always at its last
    epoch. Every recipe's ``eval`` section subclasses it (and may change its defaults), so these three keys mean
    the same in every recipe."""

    every_epochs: int | None = field(default=None, metadata=bounds(ge=1))
    every_minutes: float | None = field(default=None, metadata=bounds(gt=0))
    at_start: bool = True


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
    # Also checkpoint whenever this many training minutes passed since the last checkpoint (None: only by
    # epochs; a recipe with many steps per epoch checkpoints within the epoch).
    every_minutes: float | None = field(default=None, metadata=bounds(gt=0))


def _next_multiple(minutes: float, every: float | None) -> float | None:
    """The next multiple of ``every`` strictly after ``minutes`` (None when ``every`` is None)."""
    return None if every is None else (math.floor(minutes / every + 1e-9) + 1) * every


def peak_memory_mb() -> float:
    """Peak GPU memory allocated, or the process's peak resident memory on a CPU machine, in MiB."""
    import resource

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class EarlyStop:
    """``run.stop_on``'s bookkeeping, checkpointed with the run: the best value of the held-out measure and its
    epoch, evaluations since the last improvement, and the training reward at that best evaluation."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.best: float | None = None
        self.best_epoch = -1
        self.since_best = 0
        self.reward_at_best: float | None = None

    def state_dict(self) -> dict:
        return {"best": self.best, "best_epoch": self.best_epoch, "since_best": self.since_best,
                "reward_at_best": self.reward_at_best}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.best_epoch = state["best"], int(state["best_epoch"])
        self.since_best, self.reward_at_best = int(state["since_best"]), state["reward_at_best"]

    def update(self, epoch: int, metrics: dict, reward: float | None) -> tuple[bool, str | None]:
        """Record one evaluation. Returns ``(improved, reason to stop or None)``.

        Raises:
            RunError: the evaluation has no such metric (the message lists what it has)."""
        from flowrl.errors import RunError

        name = self.cfg.metric
        if name not in metrics:
            have = ", ".join(sorted(k for k in metrics if k.startswith(("eval/", "hack/"))))
            raise RunError(f"run.stop_on.metric {name!r} is not among the evaluation's metrics ({have}); name one "
                           "of those")
        value = float(metrics[name])
        sign = 1.0 if self.cfg.mode == "max" else -1.0
        if self.best is None or sign * (value - self.best) > self.cfg.min_delta:
            self.best, self.best_epoch, self.since_best, self.reward_at_best = value, epoch, 0, reward
            return True, None
        self.since_best += 1
        if self.since_best < self.cfg.patience:
            return False, None
        rising = reward is not None and self.reward_at_best is not None and reward > self.reward_at_best
        if self.cfg.while_reward_rises and not rising:
            return False, None
        return False, (f"early stop: {name} has not improved for {self.since_best} evaluations (best "
                       f"{self.best:.4g} at epoch {self.best_epoch}" + (", while the training reward rose)" if rising
                                                                         else ")")
                       + "; that epoch's checkpoint is checkpoints/best")


class Run:
    """One training run (see the module docstring for the shape of a recipe).

    Every section the harness reads is an argument, so a recipe that lacks one fails at construction (a
    ``TypeError``), not with a silent default.

    Args:
        run: the ``run`` section (:class:`flowrl.config.RunConfig`).
        recipe: the recipe's registry name (written into ``config.yaml``, used in messages).
        schedule: when to evaluate (:class:`EvalSchedule`: the recipe's ``eval`` section).
        log / checkpoint: the ``log`` (:class:`LogConfig`) and ``checkpoint`` (:class:`CheckpointConfig`) sections.
        precision: the precision the run computes in (``sampling.precision``; None: the CPU's default), which the
            reference clock's probe uses (``run.clock=reference``).
        reward: the training reward as the config names it, quoted in the run-health messages (None for a
            supervised recipe, which has none).
        config: the resolved config, as plain data (:func:`flowrl.config.to_dict`), written to ``config.yaml``
            when the run starts.
        dist: an injected :class:`flowrl.dist.Dist` (tests); by default one is created.
        plots: ``{plot name: [metric keys, prefixes or globs]}`` drawn to ``plots/<name>.png`` (the time plots
            are added); ``units``: their y-axis labels.
        counters: the recipe's integer counters, logged in every row and checkpointed (e.g. ``images_sampled``);
            :meth:`end_epoch` adds to them.
        steps_per_epoch: the optimizer steps of one epoch, for recipes that iterate :meth:`steps` (adds the
            ``step`` counter; checkpoints count steps).
    """

    def __init__(self, run: RunConfig, recipe: str, *, schedule: EvalSchedule, log: LogConfig,
                 checkpoint: CheckpointConfig, precision: str | None, reward: str | None, config: dict, dist=None,
                 plots: dict[str, list[str]] | None = None, units: dict[str, str] | None = None,
                 counters: tuple[str, ...] = (), steps_per_epoch: int | None = None):
        from flowrl.dist import Dist
        from flowrl.run.metrics import MetricsLogger
        from flowrl.run.checkpoints import RunCheckpoints
        from flowrl.run.folder import check_output_dir
        from flowrl.run.runtime import prepare_run
        from flowrl.run.updates import UpdateHealth

        if not isinstance(config, dict):  # the root config object would drag every section into the harness
            raise TypeError(f"Run(config=...) takes the resolved config as plain data (flowrl.config.to_dict), not "
                            f"a {type(config).__name__}")
        self.run_cfg, self.recipe, self.schedule, self.precision = run, recipe, schedule, precision
        self.reward_name, self.config = reward, config
        self.dist = dist or Dist(device=run.device, timeout_minutes=run.collective_timeout_minutes)
        self.steps_per_epoch = steps_per_epoch
        if self.dist.is_main:
            print(f"flowrl: {recipe} on {self.dist.describe()}", flush=True)
            for note in self.dist.notes():
                print(f"flowrl: warning: {note}", file=sys.stderr, flush=True)
        # The folder is checked now (before the model loads) and claimed only when the run starts (__enter__): a run
        # that fails to start leaves nothing that blocks the corrected command, and an overwrite deletes nothing yet.
        check_output_dir(run)
        self._lock = None
        self.output_dir = prepare_run(run)
        groups = dict(plots or {})
        groups.update({"time_per_epoch": ["time/*_s"], "time_total": ["time/*_min"]})
        units = {**(units or {}), "time_per_epoch": "seconds per epoch", "time_total": "minutes"}
        self.logger = MetricsLogger(self.output_dir, backends=log.backends, enabled=self.dist.is_main,
                                    project=log.project, plot_groups=groups, plot_units=units)
        self.health = UpdateHealth()  # updates skipped for non-finite losses or gradients
        self.epoch = 0
        names = tuple(counters) + (("step",) if steps_per_epoch else ())
        self.counters: dict[str, int] = {name: 0 for name in names}
        self.status = "finished"
        self._checkpoint_cfg = checkpoint
        self._tracked: dict[str, Any] = {}
        self.checkpoints = RunCheckpoints(self.output_dir, self.dist, self._tracked, keep=self._checkpoint_cfg.keep,
                                          unit="step" if steps_per_epoch else "epoch", counters=names)
        self._extra_files: Callable[[Path], None] | None = None
        self._degenerate_epochs = 0
        self._reward_epochs = self._usable_reward_epochs = 0
        self._evaluate: Callable[..., dict[str, float]] | None = None
        self._train_minutes_before = self._wall_minutes_before = 0.0
        self._deadline = self._stop = self._bar = None
        self._epoch_start = 0.0
        self._next_eval_minutes: float | None = None
        self._owed_eval_minutes: float | None = None  # a resumed checkpoint's pending evaluation time
        self._next_checkpoint_minutes: float | None = None
        self._updating = self._stopping = self._started = self._cut_short = self._evaluating = False
        self._early_reason: str | None = None
        self._saved_at: tuple[int, int] | None = None
        self._early_stop = EarlyStop(run.stop_on) if run.stop_on is not None else None
        self._rewards_since_eval: list[float] = []
        if self._early_stop is not None:
            self.track(early_stop=self._early_stop)

    # ------------------------------------------------------------------ setup

    def track(self, **objects: Any) -> None:
        """Checkpoint these objects (each with ``state_dict()`` / ``load_state_dict()``); None is skipped."""
        self._tracked.update({name: obj for name, obj in objects.items() if obj is not None})

    def checkpoint_files(self, write: Callable[[Path], None]) -> None:
        """``write(directory)`` adds files to every checkpoint (e.g. a loadable model folder)."""
        self._extra_files = write

    def evaluation(self, evaluate: Callable[..., dict[str, float]]) -> None:
        """``evaluate(epoch, should_stop) -> metrics``, run at the start (``eval.at_start``), every
        ``eval.every_epochs`` epochs and every ``eval.every_minutes`` training minutes, and at the last epoch.
        ``should_stop()`` turns True on SIGINT / SIGTERM: pass it to the sampler so that a long evaluation
        stops within a step (``flowrl.commands.sample.GenerationInterrupted``)."""
        self._evaluate = evaluate

    # ------------------------------------------------------------------ checkpoints

    def _counter_state(self) -> dict[str, Any]:
        state = {"epoch": self.epoch, **self.counters, "train_minutes": self.train_minutes(),
                 "wall_minutes": self.wall_minutes()}
        if self._next_eval_minutes is not None:  # an evaluation that failed or was interrupted is still owed
            state["next_eval_minutes"] = self._next_eval_minutes
        return state

    def save_checkpoint(self) -> None:
        """Checkpoint the tracked state now (once per position). Every process must call it.

        Raises:
            CheckpointError: on every process, when any process failed to write its part.
        """
        self._save(solo=False)

    def _save(self, *, solo: bool) -> None:
        position = (self.epoch, self.counters.get("step", 0))
        if self._saved_at == position:
            return
        self._saved_at = position
        if solo:
            self.checkpoints.save_alone(self._counter_state(), self._extra_files)
        else:
            self.checkpoints.save(self._counter_state(), extra_files=self._extra_files)
        self._next_checkpoint_minutes = _next_multiple(self.train_minutes(), self._checkpoint_cfg.every_minutes)

    def _resume(self) -> None:
        checkpoint, state = self.checkpoints.resume()
        self.epoch = int(state["epoch"])
        self.counters = {name: int(state[name]) for name in self.counters}
        self._train_minutes_before = float(state["train_minutes"])
        self._wall_minutes_before = float(state["wall_minutes"])
        self._saved_at = (self.epoch, self.counters.get("step", 0))
        self._owed_eval_minutes = state.get("next_eval_minutes")
        self.logger.truncate_after(self.epoch)
        if self.dist.is_main:
            where = f"step {self.counters['step']}" if self.steps_per_epoch else f"epoch {self.epoch}"
            print(f"flowrl: resumed from {checkpoint} at {where}")

    # ------------------------------------------------------------------ time

    def train_minutes(self) -> float:
        """Training minutes so far (wall-clock or CPU, ``run.clock``), earlier sessions included, evaluation
        excluded."""
        return self._deadline.elapsed_minutes() if self._deadline is not None else self._train_minutes_before

    def wall_minutes(self) -> float:
        return self._wall_minutes_before + (self._deadline.wall_minutes() if self._deadline is not None else 0.0)

    def stop_requested(self) -> bool:
        """A signal arrived or the training budget is spent (the same answer on every process)."""
        return self.dist.any(self._stop.requested or self._deadline.passed())

    # ------------------------------------------------------------------ the loop

    def __enter__(self) -> "Run":
        from flowrl.run.folder import prepare_output_dir
        from flowrl.run.runtime import GracefulStop, make_deadline

        run = self.run_cfg
        _, self._lock = prepare_output_dir(run, self.dist, self.recipe)  # lock, overwrite, marker
        if self.dist.is_main:
            save_config(self.config, self.output_dir / "config.yaml", extra={"recipe": self.recipe})
        if run.resume:
            self._resume()
        # The reference clock probes in the precision the run computes in (rollouts and training).
        self._deadline = make_deadline(run.clock, run.max_minutes, already_spent=self._train_minutes_before,
                                       scale=run.clock_scale, precision=self.precision)
        self._next_eval_minutes = _next_multiple(self._train_minutes_before, self.schedule.every_minutes)
        if self._next_eval_minutes is not None and self._owed_eval_minutes is not None:
            # The checkpoint's pending evaluation (one that failed or was stopped) comes first: the next multiple
            # of eval.every_minutes after the resumed minutes would skip it.
            self._next_eval_minutes = min(self._next_eval_minutes, float(self._owed_eval_minutes))
        self._next_checkpoint_minutes = _next_multiple(self._train_minutes_before, self._checkpoint_cfg.every_minutes)
        self._stop = GracefulStop().__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._stop.__exit__(exc_type, exc, tb)
        self._deadline.close()
        if self._bar is not None:
            self._bar.close()
        if exc is None:
            return False
        self.logger.close()
        self._release()
        raise self._failure(exc) from exc

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _failure(self, exc: BaseException) -> BaseException:
        """Save what can be saved, write the traceback to ``error.log``, and return the one-line error that
        tells the user what stopped the run and where its last checkpoint is."""
        import traceback

        from flowrl.run.checkpoint_files import CheckpointError
        from flowrl.errors import RunError, user_errors

        where = f"{self.output_dir}/checkpoints"
        if self._updating:
            # The weights are part-way through an update: no consistent state to save.
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
        during = f"evaluation of epoch {self.epoch}" if self._evaluating else f"epoch {self.epoch + 1}"
        if isinstance(exc, user_errors()):
            return RunError(f"{during}: {' '.join(str(exc).split())} {saved}")
        log = self.output_dir / "error.log"
        if self.dist.is_main:
            log.write_text("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        return RunError(f"{during}: internal error {type(exc).__name__}: "
                        f"{' '.join(str(exc).split())[:300]} {saved}; the traceback is in {log}", exit_code=1)

    def _has_row(self, epoch: int) -> bool:
        from flowrl.run.metrics import read_metrics

        return self.logger.path.is_file() and any(r.get("epoch") == epoch for r in read_metrics(self.logger.path))

    def _run_evaluation(self) -> dict[str, float] | None:
        """The evaluation's metrics, or None when a signal interrupted it (the partial result is discarded)."""
        from flowrl.eval.generate import GenerationInterrupted

        self._evaluating = True  # stays set when the evaluation fails, for the failure's message
        with self._deadline.excluded():
            try:
                metrics = self._evaluate(self.epoch, should_stop=lambda: self._stop.requested)
            except GenerationInterrupted:
                self._warn(f"flowrl: evaluation of epoch {self.epoch} interrupted by {self._stop.reason}; "
                           "its partial results are discarded")
                metrics = None
        self._evaluating = False
        return metrics

    def _warn(self, message: str) -> None:
        if self.dist.is_main:
            print(message, file=sys.stderr, flush=True)

    def next_epoch(self) -> bool:
        """Start the next epoch; False when the run is over (epochs or time spent, a stop requested).

        The first call evaluates the model before any training when ``eval.at_start`` is set (unless a
        resumed run already logged that evaluation)."""
        if not self._started:
            self._started = True
            if (self.epoch == 0 and self.counters.get("step", 0) == 0 and self.schedule.at_start
                    and self._evaluate is not None and not (self.dist.is_main and self._has_row(0))):
                metrics = self._run_evaluation()
                if metrics is None:
                    self._stopping = True
                    self.status = self._stop.reason
                    self.save_checkpoint()
                else:
                    self.logger.log({"epoch": self.epoch, **self.counters, "time/train_min": 0.0,
                                     "time/wall_min": self.wall_minutes(), **metrics})
                    self.logger.plot()
                    if self.dist.is_main:
                        print(f"epoch {self.epoch}: " + ", ".join(
                            f"{k}={v:.3f}" for k, v in metrics.items() if k.endswith(("accuracy", "mean"))))
            total = self.run_cfg.max_epochs * (self.steps_per_epoch or 1)
            self._bar = tqdm(total=total, initial=self.counters.get("step", self.epoch), desc=self.recipe,
                             disable=not self.dist.is_main, dynamic_ncols=True)
        if not self._stopping and self.dist.any(self._stop.requested):
            self._stopping = True
            self.status = self._stop.reason
            self.save_checkpoint()
        if self._stopping or self.epoch >= self.run_cfg.max_epochs:
            return False
        self._epoch_start = time.perf_counter()
        self._cut_short = False
        return True

    def steps(self) -> Iterator[int]:
        """The optimizer steps of the current epoch, from where the run stands (a resumed run continues mid-epoch).

        Before each step: a stop request or a spent budget ends the epoch early (:meth:`end_epoch` then logs
        the partial epoch, evaluates and checkpoints). After each step: the ``step`` counter advances and, with
        ``checkpoint.every_minutes``, a checkpoint is written when due."""
        if not self.steps_per_epoch:
            raise RuntimeError("Run.steps() needs steps_per_epoch")
        end = (self.epoch + 1) * self.steps_per_epoch
        while self.counters["step"] < end:
            if self.stop_requested():
                self._cut_short = True
                return
            yield self.counters["step"]
            self.counters["step"] += 1
            self._bar.update(1)
            if self._next_checkpoint_minutes is not None and self.train_minutes() >= self._next_checkpoint_minutes:
                self.save_checkpoint()

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Mark the block that changes the weights: a failure inside it saves no checkpoint (the state is
        between two epochs), a failure anywhere else saves the last completed epoch first."""
        self._updating = True
        yield  # an exception leaves the flag set: __exit__ must know the weights are part-updated
        self._updating = False

    def check_rewards(self, metrics: dict[str, Any], samples: int) -> bool:
        """Run health of an epoch's rewards (``metrics`` with ``train/nan_rewards`` and ``train/zero_std_frac``).
        Returns whether to train on them: False when every reward is NaN. Either that or rewards equal within
        every group (no learning signal, ``train/zero_std_frac`` = 1) warns, and ``run.max_degenerate_epochs``
        such epochs in a row stop the run with an error (after a checkpoint). A run in which no epoch had a
        usable reward ends with exit status 2 whatever its length (:meth:`finish`).

        Raises:
            RunError: too many degenerate epochs in a row.
        """
        from flowrl.errors import RunError

        self._reward_epochs += 1
        all_nan = metrics.get("train/nan_rewards", 0) == samples
        no_signal = not all_nan and metrics.get("train/zero_std_frac") == 1.0
        if not (all_nan or no_signal):
            self._degenerate_epochs = 0
            self._usable_reward_epochs += 1
            return True
        self._degenerate_epochs += 1
        what = ("every reward is NaN (the reward failed on every image)" if all_nan else
                "every group's rewards are equal (train/zero_std_frac = 1: no learning signal)")
        limit = self.run_cfg.max_degenerate_epochs
        if self._degenerate_epochs >= limit:
            raise RunError(f"stopped after epoch {self.epoch}: {what} in {limit} epochs in a row; check the reward "
                           f"({self.reward_name}) or raise run.max_degenerate_epochs")
        self._warn(f"flowrl: warning: epoch {self.epoch + 1}: {what}" + ("; skipping its update" if all_nan else "")
                   + f" ({self._degenerate_epochs} of {limit} allowed in a row)")
        return not all_nan

    def end_epoch(self, metrics: dict[str, Any], **counts: int) -> None:
        """Close an epoch: add ``counts`` to the counters (e.g. ``images_sampled=128``), evaluate if due, log
        ``metrics`` with the counters and timings, redraw the plots, checkpoint if due, and decide whether to
        stop. An epoch :meth:`steps` cut short is logged as a partial epoch and checkpointed at its step.

        Raises:
            RunError: ``run.max_nonfinite_updates`` optimizer updates in a row were skipped (after logging
                and checkpointing this epoch, whose weights are the last finite ones).
        """
        from flowrl.errors import RunError

        cut = self._cut_short
        if not cut:
            self.epoch += 1
        for name, value in counts.items():
            self.counters[name] = self.counters.get(name, 0) + int(value)
        row_epoch = self.epoch + 1 if cut else self.epoch
        metrics.update({"epoch": row_epoch, **self.counters, "train/skipped_updates": self.health.skipped,
                        "time/epoch_s": time.perf_counter() - self._epoch_start,
                        "time/train_min": self.train_minutes(), "memory/peak_mb": peak_memory_mb()})
        if hasattr(self._deadline, "rate"):  # run.clock=reference: reference seconds per CPU-second now
            metrics["time/clock_rate"] = self._deadline.rate()
        stopping = cut or self.stop_requested()
        keep_best = False
        if "train/reward_mean" in metrics:
            self._rewards_since_eval.append(float(metrics["train/reward_mean"]))
        run = self.run_cfg
        every_epochs = self.schedule.every_epochs
        due = (every_epochs is not None and row_epoch % every_epochs == 0) or (
            self._next_eval_minutes is not None and self.train_minutes() >= self._next_eval_minutes)
        if self._evaluate is not None and (due or stopping or self.epoch == run.max_epochs):
            try:
                evaluation = self._run_evaluation()
            except BaseException:
                self.logger.log({**metrics, "time/wall_min": self.wall_minutes()})  # the epoch's training row
                raise
            if evaluation is None:
                stopping = True
            else:
                metrics.update(evaluation)
                self._next_eval_minutes = _next_multiple(self.train_minutes(), self.schedule.every_minutes)
                keep_best, stop_reason = self._check_early_stop(metrics)
                if stop_reason is not None:
                    stopping, self._early_reason = True, stop_reason
        metrics["time/wall_min"] = self.wall_minutes()
        self.logger.log(metrics)
        self.logger.plot()
        if not self.steps_per_epoch:
            self._bar.update(1)
        postfix = {"reward": f"{metrics['train/reward_mean']:.3f}"} if "train/reward_mean" in metrics else {}
        if "train/loss" in metrics and not postfix:
            postfix["loss"] = f"{metrics['train/loss']:.4f}"
        postfix.update({"eval": f"{v:.3f}" for k, v in metrics.items() if k.startswith("eval/")
                        and k.endswith("/accuracy")})
        self._bar.set_postfix(**postfix)
        nonfinite = self.health.in_a_row >= run.max_nonfinite_updates
        if (self.epoch % self._checkpoint_cfg.every_epochs == 0 or stopping or self.epoch == run.max_epochs
                or nonfinite or keep_best):
            self.save_checkpoint()
        if keep_best:
            self._keep_best()
        if nonfinite:
            raise RunError(f"stopped after epoch {self.epoch}: {self.health.in_a_row} optimizer updates in a row had a "
                           "non-finite loss or gradient and were skipped (the weights are the last finite ones); "
                           "lower optim.lr or the guidance, or check the reward's scale")
        if stopping:
            self._stopping = True
            self.status = self._stop.reason or self._early_reason or "time budget reached"

    def _check_early_stop(self, metrics: dict[str, Any]) -> tuple[bool, str | None]:
        """``run.stop_on`` after an evaluation: whether this evaluation is the best so far (its checkpoint is kept)
        and why to stop (None: go on). The training reward compared is the mean over the epochs since the last
        evaluation."""
        if self._early_stop is None:
            return False, None
        rewards, self._rewards_since_eval = self._rewards_since_eval, []
        reward = sum(rewards) / len(rewards) if rewards else None
        return self._early_stop.update(self.epoch, metrics, reward)

    def _keep_best(self) -> None:
        """Copy the checkpoint just written to ``checkpoints/best`` (replacing the previous best atomically)."""
        import os
        import shutil

        from flowrl.run.checkpoint_files import latest_checkpoint

        if not self.dist.is_main:
            return
        source = latest_checkpoint(self.output_dir)
        root = self.output_dir / "checkpoints"
        tmp = root / f".tmp_best_{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(source, tmp)
        old = root / f".old_best_{os.getpid()}"
        if (root / "best").exists():
            os.replace(root / "best", old)
        os.replace(tmp, root / "best")
        shutil.rmtree(old, ignore_errors=True)

    def finish(self) -> int:
        """Close the logger, the lock and the process group; print where the outputs are. Returns the exit code:
        0; 130 / 143 for a run stopped by SIGINT / SIGTERM (a scheduler must not read it as done);
        :data:`NO_USABLE_REWARD` (3) when epochs ran but none had a usable reward (all NaN, or equal within every
        group): the run learned nothing, whatever its length."""
        self.logger.close()
        code = {"SIGINT": 130, "SIGTERM": 143}.get(self.status, 0)
        if self.dist.is_main:
            where = (f"step {self.counters['step']}/{self.run_cfg.max_epochs * self.steps_per_epoch}"
                     if self.steps_per_epoch else f"epoch {self.epoch}/{self.run_cfg.max_epochs}")
            print(f"flowrl: {self.recipe} stopped at {where} ({self.status}); outputs in {self.output_dir}")
        if code == 0 and self._reward_epochs and not self._usable_reward_epochs:
            code = NO_USABLE_REWARD
            if self.dist.is_main:
                print(f"flowrl {self.recipe}: error: none of the {self._reward_epochs} epochs had a usable reward "
                      "(every reward NaN, or equal within every group), so nothing was learned; check the reward",
                      file=sys.stderr, flush=True)
        self._release()
        self.dist.close()
        return code
