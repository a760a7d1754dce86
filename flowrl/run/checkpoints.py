"""A run's checkpoints: every tracked object's state, the random generators and the run's counters, written by
every process together and read back for an exact resume (:class:`flowrl.run.harness.Run` uses it).

``state.pt`` holds each tracked object's ``state_dict()`` under its name (the trained weights always whole, so
export, the demo and ``load_finetuned`` can read them), the random generators' states and the counters
(``epoch``, the recipe's own, ``train_minutes``, ``wall_minutes``). The optimizer a recipe prepared with
``dist.prepare_training`` (and, under FSDP2 / ZeRO, the sharded weights), the gradient scaler and every
process's generators go through ``accelerator.save_state`` into ``accelerate/`` (docs/distributed.md,
"Checkpoints"). Every process takes part in :meth:`RunCheckpoints.save` and :meth:`RunCheckpoints.resume`.

What a resume trusts: the run folder is the user's own (``docs/security.md``); ``state.pt`` loads with
``torch.load(weights_only=True)``, and ``accelerate/`` is read by accelerate (its optimizer and sharded model
files are torch files too).
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["TrainableWeights", "RunCheckpoints"]


class TrainableWeights:
    """The trained tensors of a model adapter or a token policy (its LoRA weights, or every trained weight) as a
    checkpointable state.

    Args:
        model: a :class:`flowrl.models.base.FlowModel` or a :class:`flowrl.policies.TokenPolicy` (anything with
            ``trainable_state_dict()`` / ``load_trainable_state_dict(state)``).
        module: the network that holds the tensors when the run's distributed backend prepares it (FSDP2 / ZeRO
            may shard it): an image model's denoiser. None for a network that is never sharded (a token policy),
            whose state is always the model's own.
    """

    def __init__(self, model, *, module=None):
        self.model, self.module = model, module

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.trainable_state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_trainable_state_dict(state)


#: How long a process other than the main one waits, after a failure, for the main process's checkpoint.
MAIN_SAVE_TIMEOUT_S = 120.0

#: ``{tracked name: the name checkpoints of earlier releases stored it under}``.
LEGACY_NAMES = {"rollout_snapshot": "sampler"}  # CRD's rollout snapshot, called "sampler" before


def load_onto_live_devices(obj: Any, state: Any) -> None:
    """``obj.load_state_dict(state)`` with the restored tensors kept on the devices of the ones they replace.

    Checkpoints load to the CPU. Modules and flowrl's snapshots copy into their own tensors, but diffusers'
    ``EMAModel`` takes the loaded tensors as they are, so on a GPU its next ``step`` would mix CPU shadows with GPU
    weights (the first optimizer step of every resumed run with ``train.ema_decay``)."""
    from diffusers.training_utils import EMAModel

    if not isinstance(obj, EMAModel):
        obj.load_state_dict(state)
        return
    devices = [p.device for p in obj.shadow_params]
    obj.load_state_dict(state)
    obj.shadow_params = [p.to(device) for p, device in zip(obj.shadow_params, devices)]


class RunCheckpoints:
    """Save and restore the tracked objects of one run.

    Args:
        output_dir: the run folder (checkpoints go to ``output_dir/checkpoints``).
        dist: the run's :class:`flowrl.dist.Dist`.
        tracked: ``{name: object with state_dict() / load_state_dict()}`` (the run's, shared by reference).
        keep: how many newest checkpoints to keep.
        unit: what a checkpoint's number counts, ``epoch`` or ``step`` (its folder name says so).
        counters: names of the integer counters saved beside ``epoch`` (e.g. ``images_sampled``, ``step``).
    """

    def __init__(self, output_dir: Path, dist, tracked: dict[str, Any], *, keep: int, unit: str,
                 counters: tuple[str, ...]):
        self.output_dir, self.dist, self.tracked = Path(output_dir), dist, tracked
        self.keep, self.unit, self.counters = keep, unit, counters

    # ------------------------------------------------------------------ what goes where

    def _restored_by_accelerate(self, obj: Any) -> bool:
        """Objects whose state ``accelerator.save_state`` keeps: the prepared optimizer, and the trained weights
        when they are sharded (FSDP2 / ZeRO)."""
        if isinstance(obj, TrainableWeights):
            return self.dist.shards_weights and obj.module is not None and self.dist.manages_module(obj.module)
        return self.dist.manages(obj)

    def _in_state_file(self, obj: Any) -> bool:
        """Whether ``state.pt`` holds ``obj``: everything but the prepared optimizer."""
        return isinstance(obj, TrainableWeights) or not self.dist.manages(obj)

    def _state_of(self, obj: Any) -> Any:
        """``obj``'s state for ``state.pt``, whole (collective under FSDP2; None off the main process)."""
        if isinstance(obj, TrainableWeights) and obj.module is not None and self.dist.manages_module(obj.module):
            return self.dist.trainable_state_dict(obj.module)
        state = obj.state_dict()
        return self.dist.gather_full(state) if self.dist.shards_weights else state

    def _write_extra(self, state: dict[str, Any]) -> Callable[[Path], None] | None:
        """Files beside ``state.pt``: the LoRA of a diffusers pipeline as a diffusers LoRA folder (the weights
        ``load_finetuned`` uses: the EMA when the run keeps one), so a checkpoint loads in plain diffusers."""
        from flowrl.run.checkpoint_files import LORA_DIR

        # An image model's weights (the ones with a denoiser); a token policy's adapters are saved by the recipe.
        weights = next((obj for obj in self.tracked.values()
                        if isinstance(obj, TrainableWeights) and obj.module is not None), None)
        if weights is None or weights.model.lora is None:
            return None
        from flowrl.models.lora_files import lora_spec, lora_supported, write_diffusers_lora

        if not lora_supported(weights.model):
            return None
        name, spec = next(n for n, o in self.tracked.items() if o is weights), lora_spec(weights.model)
        return lambda directory: write_diffusers_lora(spec, state, directory / LORA_DIR, weights_key=name)

    def _number(self, counters: dict[str, Any]) -> int:
        return int(counters["step" if self.unit == "step" else "epoch"])

    # ------------------------------------------------------------------ saving

    def save(self, counters: dict[str, Any], rng: dict[str, Any] | None = None,
             extra_files: Callable[[Path], None] | None = None) -> None:
        """Checkpoint the tracked state with ``counters`` (``epoch``, ``train_minutes``, ``wall_minutes`` and the
        run's own). Every process must call it: ``accelerator.save_state`` writes each process's generators (and
        under FSDP2 / ZeRO its shards), and gathering sharded state is collective. ``extra_files(dir)`` writes
        more files into the checkpoint (main process).

        Raises:
            CheckpointError: on every process, when any process failed to write its part (nothing partial
                is left; the previous checkpoints are untouched).
        """
        from flowrl.run.checkpoint_files import (ACCELERATE_DIR, CheckpointError, abandon_checkpoint, begin_checkpoint,
                                       checkpoint_name, finish_checkpoint, rng_state)

        dist, number = self.dist, self._number(counters)
        state: dict[str, Any] = {}
        if dist.is_main or dist.shards_weights:  # gathering sharded state is collective
            for name, obj in self.tracked.items():
                if self._in_state_file(obj):
                    state[name] = self._state_of(obj)
        state.update({"rng": rng if rng is not None else rng_state(), **counters})
        token = dist.broadcast_object(os.getpid())
        tmp, error = None, None
        if dist.is_main:
            try:
                tmp = begin_checkpoint(self.output_dir, number, token, unit=self.unit)
            except CheckpointError as err:
                error = err
        if dist.any(error is not None):
            raise error or CheckpointError("the main process could not create the checkpoint directory")
        final_name = checkpoint_name(number, self.unit)
        tmp = self.output_dir / "checkpoints" / f".tmp_step_{number:07d}_{token}"
        try:
            dist.save_state(str(tmp / ACCELERATE_DIR))
        except OSError as err:
            error = CheckpointError(f"could not write checkpoint {tmp.parent / final_name}: {err.strerror or err}; "
                                    f"free space in {tmp.parent} (or point run.output_dir elsewhere) and resume "
                                    "from the last checkpoint with run.resume=true")
        saved = not dist.any(error is not None)  # every process takes part in each collective
        if dist.is_main and saved:
            write = self._combined_extra(state, extra_files)
            try:
                finish_checkpoint(tmp, number, state, write_extra=write, keep=self.keep, unit=self.unit)
            except CheckpointError as err:
                error = err
        elif dist.is_main:
            abandon_checkpoint(tmp)
        if dist.any(error is not None):
            raise error or CheckpointError(f"another process could not write checkpoint {final_name}; see its "
                                           "message above")

    def _combined_extra(self, state, extra_files):
        lora = self._write_extra(state)
        if lora is None or extra_files is None:
            return lora or extra_files
        return lambda directory: (lora(directory), extra_files(directory))

    def save_alone(self, counters: dict[str, Any], extra_files: Callable[[Path], None] | None = None, *,
                   timeout_s: float = MAIN_SAVE_TIMEOUT_S) -> None:
        """The checkpoint a failure leaves in a run of several processes. The other processes may be anywhere
        (waiting in a collective, failing too), so the main process saves alone, without collectives, what it
        holds whole: ``state.pt`` with the optimizer inside (the layout before ``accelerate/``, which resumes).
        Sharded state (FSDP2 / ZeRO) cannot be saved by one process.

        The other processes wait (at most ``timeout_s``) until the main process's checkpoint is in place:
        a launcher stops every process as soon as one exits, so one that left at once could stop the main
        process in the middle of its save.

        Raises:
            CheckpointError: sharded state, the write failed, or (off the main process) no checkpoint of this
                position appeared within ``timeout_s``.
        """
        from flowrl.run.checkpoint_files import CheckpointError, rng_state, save_checkpoint

        if self.dist.shards_weights:  # (every process says so: none waits for a save that cannot happen)
            raise CheckpointError(f"after a failure one process cannot save the sharded ({self.dist.backend}) state; "
                                  f"the last checkpoint in {self.output_dir}/checkpoints resumes with run.resume=true")
        if not self.dist.is_main:
            self._await_main_checkpoint(self._number(counters), timeout_s)
            return
        state = {name: obj.state_dict() for name, obj in self.tracked.items()}
        state.update({"rng": rng_state(), **counters})
        save_checkpoint(self.output_dir, self._number(counters), state,
                        write_extra=self._combined_extra(state, extra_files), keep=self.keep, unit=self.unit)

    def _await_main_checkpoint(self, number: int, timeout_s: float) -> None:
        """Return once checkpoint ``number`` is complete (its folder appears whole: the writer renames it into
        place), or raise CheckpointError after ``timeout_s`` seconds."""
        from flowrl.run.checkpoint_files import CheckpointError, checkpoint_name

        target = self.output_dir / "checkpoints" / checkpoint_name(number, self.unit)
        deadline = time.monotonic() + timeout_s
        while not (target / "state.pt").is_file():
            if time.monotonic() > deadline:
                raise CheckpointError(f"the main process did not save {target.name} within {timeout_s:.0f} s; the last "
                                      f"checkpoint in {self.output_dir}/checkpoints resumes with run.resume=true")
            time.sleep(0.1)

    # ------------------------------------------------------------------ resuming

    def _restore(self, checkpoint: Path, state: dict[str, Any]) -> None:
        """Load one checkpoint into every tracked object (every process)."""
        from flowrl.run.checkpoint_files import ACCELERATE_DIR, CheckpointError, set_rng_state

        accelerate_dir = checkpoint / ACCELERATE_DIR
        for name, obj in self.tracked.items():
            if self._restored_by_accelerate(obj) and accelerate_dir.is_dir():
                continue
            if name not in state:  # neither in state.pt (e.g. the optimizer) nor an accelerate/ to load it from
                raise CheckpointError(f"checkpoint {checkpoint} is incomplete (no {name}, no {ACCELERATE_DIR}/)")
            value = state[name]  # (a checkpoint written before accelerate/ existed keeps its optimizer here)
            if self.dist.shards_weights and not isinstance(obj, TrainableWeights):
                value = self.dist.shard_like(value, obj.state_dict())
            load_onto_live_devices(obj, value)
        set_rng_state(state["rng"])
        if accelerate_dir.is_dir():
            # The optimizer (and sharded weights), the scaler and each process's own random generators.
            self.dist.load_state(str(accelerate_dir))

    def resume(self) -> tuple[Path, dict[str, Any]]:
        """Load the newest checkpoint every process can read into the tracked objects; returns it and its state
        (the counters). A corrupt or partial newer checkpoint is skipped with a warning and set aside
        (``checkpoints/corrupt_<name>``), so rotation never keeps it among the newest. Every process reads the
        same files (``run.output_dir`` must be on a file system every machine sees) and all move on together.

        Raises:
            CheckpointError: the processes see different checkpoints, or none can be read.
        """
        from flowrl.run.checkpoint_files import CheckpointError, checkpoints, load_state, set_aside

        required = (tuple(name for name, obj in self.tracked.items()
                          if self._in_state_file(obj) and not self.dist.manages(obj) and name not in LEGACY_NAMES)
                    + ("rng", "epoch", "train_minutes", "wall_minutes") + self.counters)
        candidates = checkpoints(self.output_dir)
        names = self.dist.gather_object([[p.name for p in candidates]])
        if any(n != names[0] for n in names):
            seen = "; ".join(f"process {i}: {', '.join(n) or 'none'}" for i, n in enumerate(names))
            raise CheckpointError(f"the processes see different checkpoints in {self.output_dir}/checkpoints "
                                  f"({seen}): run.output_dir must be on a file system every machine shares")
        problems: list[tuple[Path, str]] = []
        for checkpoint in candidates:
            problem, state = None, None
            try:
                state = self._renamed(load_state(checkpoint, required=required), checkpoint)
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
                    self.dist.barrier()  # every process has read what it needs before anything is renamed
                    for bad, earlier in problems:
                        aside = set_aside(bad) if self.dist.is_main else None
                        self._warn(f"flowrl: warning: {earlier}; resuming from {checkpoint} instead"
                                   + (f" (the bad one is kept as {aside})" if aside else ""))
                    return checkpoint, state
            problems.append((checkpoint, problem or f"checkpoint {checkpoint} failed on another process"))
        if problems:
            raise CheckpointError("no checkpoint of " + str(self.output_dir) + " can be read: "
                                  + "; ".join(p for _, p in problems) + "; start the run again without run.resume=true")
        raise CheckpointError(f"run.resume=true but {self.output_dir}/checkpoints holds no checkpoint; run "
                              "without run.resume=true to start fresh")

    def _renamed(self, state: dict[str, Any], checkpoint: Path) -> dict[str, Any]:
        """``state`` with objects stored under an earlier release's name moved to today's (:data:`LEGACY_NAMES`).

        Raises:
            CheckpointError: a tracked object is under neither name."""
        from flowrl.run.checkpoint_files import CheckpointError

        for name, legacy in LEGACY_NAMES.items():
            if name in self.tracked and name not in state:
                if legacy not in state:
                    raise CheckpointError(f"checkpoint {checkpoint}/state.pt is incomplete (no {name}); delete that "
                                          "directory to resume from the one before it")
                state[name] = state.pop(legacy)
        return state

    def _warn(self, message: str) -> None:
        if self.dist.is_main:
            print(message, file=sys.stderr, flush=True)
