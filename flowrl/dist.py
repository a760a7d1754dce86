"""The one place (with the recipes) that touches ``accelerate`` and ``torch.distributed``.

:class:`Dist` wraps an ``accelerate.Accelerator``: rank and world size, gathers in rank order, the backward
pass with gradient synchronisation only on the last micro-batch, sharded-safe checkpoint state, and a clean
shutdown of the process group (so a gloo run never aborts at exit after its work is done).

Backends (docs/distributed.md): one process, DDP (``MULTI_GPU`` / CPU processes), FSDP2
(``distributed_type: FSDP`` with ``fsdp_version: 2``) and DeepSpeed ZeRO (``DEEPSPEED``). The mixed
precision is the launch config's (``accelerate launch`` exports it; ``no`` without a launcher), and
:meth:`Dist.check_model_dtype` refuses a ``model.dtype`` that contradicts it.

Checkpoints: :meth:`Dist.save_state` / :meth:`Dist.load_state` are ``accelerator.save_state`` /
``load_state``: the optimizer (sharded under FSDP2 and ZeRO), the gradient scaler, every process's random
generators and, under FSDP2 / ZeRO, the model's own shards. Under DDP and on one process the model's trained
tensors are flowrl's to save (``state.pt``; :meth:`trainable_state_dict` gathers them), so accelerate is kept
from writing the whole base model next to them.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch

__all__ = ["Dist", "check_dtype_agrees"]

#: model.dtype values a launch config's mixed precision agrees with.
_AGREEING_DTYPES = {"no": None, "bf16": ("float32", "bfloat16"), "fp16": ("float32", "float16")}


class Dist:
    """Distributed context of a run (a single process is world size 1).

    Args:
        mixed_precision: ``no`` / ``bf16`` / ``fp16``; None (default) takes the launch config's
            (``accelerate launch`` exports it as ``ACCELERATE_MIXED_PRECISION``), ``no`` without a launcher.
        cpu: force CPU even when a GPU is visible.
        timeout_minutes: the process group's timeout (``run.collective_timeout_minutes``).
        device: ``run.device`` (:func:`flowrl.hardware.run_device`): ``auto`` is accelerate's choice, ``cpu`` and
            ``cuda`` accelerate's with that constraint; another device type (``mps``, the tests' fake accelerator) is
            used as given, accelerate then placing nothing itself (one process; collectives stay on the CPU).

    Raises:
        DeviceError: the device cannot be used here (the message names why and the fix).
    """

    def __init__(self, mixed_precision: str | None = None, cpu: bool = False, device: str = "auto",
                 timeout_minutes: float = 60.0):
        from datetime import timedelta

        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

        from flowrl.hardware import run_device

        wanted = run_device(device)
        # cuda is accelerate's own device (it picks this process's GPU); anything else is placed by flowrl.
        self._device = wanted if wanted is not None and wanted.type not in ("cpu", "cuda") else None
        cpu = cpu or (wanted is not None and wanted.type != "cuda")
        # Unused-parameter detection is off: every trainable parameter takes part in each backward.
        # An explicit process-group timeout: a process that waits for a collective the others never reach fails after
        # it with an error naming the collective, instead of hanging (run.collective_timeout_minutes).
        self.accelerator = Accelerator(mixed_precision=mixed_precision, cpu=cpu, device_placement=self._device is None,
                                       kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=False),
                                                        InitProcessGroupKwargs(timeout=timedelta(minutes=timeout_minutes))])
        if self._device is not None and self.accelerator.num_processes > 1:
            from flowrl.hardware import DeviceError

            raise DeviceError(f"run.device={device} runs one process; launch it without accelerate's several "
                              "processes, or use run.device=auto")
        self._prepared_modules: list[torch.nn.Module] = []
        self._prepared_optimizers: list[Any] = []
        # Under DDP / one process flowrl saves the trained tensors itself (only those: a LoRA run must not
        # write the whole frozen base at every checkpoint); accelerate keeps the optimizer, scaler and RNG.
        self.accelerator.register_save_state_pre_hook(self._skip_replicated_weights)
        self.accelerator.register_load_state_pre_hook(self._skip_replicated_weights)

    # ------------------------------------------------------------------ topology

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def device(self) -> torch.device:
        return self._device if self._device is not None else self.accelerator.device

    @property
    def mixed_precision(self) -> str:
        """``no``, ``bf16`` or ``fp16``: the autocast the prepared model runs under."""
        return str(self.accelerator.mixed_precision)

    @property
    def backend(self) -> str:
        """``single``, ``ddp``, ``fsdp2``, ``fsdp1`` or ``deepspeed``."""
        from accelerate.utils import DistributedType

        kind = self.accelerator.distributed_type
        if kind == DistributedType.FSDP:
            return "fsdp2" if getattr(self.accelerator, "is_fsdp2", False) else "fsdp1"
        if kind == DistributedType.DEEPSPEED:
            return "deepspeed"
        return "ddp" if self.world_size > 1 else "single"

    @property
    def shards_weights(self) -> bool:
        """True when the model or optimizer state is split over processes (FSDP2, ZeRO): saving and loading
        it are collective, and accelerate writes each process's shards."""
        return self.backend in ("fsdp2", "fsdp1", "deepspeed")

    def describe(self) -> str:
        """One line for logs: backend, processes, machines, mixed precision."""
        import os

        # torchrun (under accelerate launch) exports the world size and the processes on this machine.
        machines = int(os.environ.get("WORLD_SIZE", 1)) // max(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), 1)
        return (f"{self.backend}, {self.world_size} process(es), mixed precision {self.mixed_precision}, "
                f"device {self.device}" + (f", {machines} machines" if machines > 1 else ""))

    # ------------------------------------------------------------------ configuration checks

    def check_model_dtype(self, dtype: str) -> None:
        """Refuse a ``model.dtype`` that contradicts the launch config's mixed precision
        (:func:`check_dtype_agrees`).

        Raises:
            ConfigError: the two disagree; the message names both and the two ways to fix it.
        """
        check_dtype_agrees(self.mixed_precision, dtype)

    def notes(self) -> list[str]:
        """Warnings about the launch, for the run's log (e.g. an FSDP or DeepSpeed launch config that
        accelerate runs as plain DDP because there is no GPU)."""
        import os

        notes = []
        for variable, name in (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")):
            wanted = os.environ.get(variable, "false").lower() == "true"
            if wanted and self.backend in ("single", "ddp"):
                notes.append(f"the launch config asks for {name} but accelerate runs it as {self.backend} on "
                             f"{self.device.type} ({name} needs GPUs); the weights are not sharded")
        return notes

    # ------------------------------------------------------------------ preparing

    def prepare(self, *objects: Any) -> Any:
        """``accelerator.prepare``. Training state should go through :meth:`prepare_training` (FSDP2 and
        DeepSpeed need the model and its optimizer together)."""
        prepared = self.accelerator.prepare(*objects)
        for obj in prepared if isinstance(prepared, tuple) else (prepared,):
            if isinstance(obj, torch.nn.Module):
                self._prepared_modules.append(obj)
        return prepared

    def prepare_training(self, module: torch.nn.Module, optimizer, *, micro_batch_size: int,
                         grad_clip: float) -> tuple[torch.nn.Module, Any]:
        """Prepare the trained network and its optimizer together, as every backend needs.

        FSDP2 shards the module in place and swaps the optimizer's parameters for the sharded ones
        (re-read ``model.trainable_parameters()`` afterwards); DeepSpeed builds its engine from both and
        needs the per-process micro-batch size (``train.micro_batch_size``) and the clipping norm
        (``optim.grad_clip``: DeepSpeed clips inside its step).

        Returns:
            ``(module, optimizer)`` to use from now on.

        Raises:
            ConfigError: an FSDP version 1 launch config (flowrl supports FSDP2).
        """
        from flowrl.config import ConfigError

        if self.backend == "fsdp1":
            raise ConfigError("fsdp_version", "flowrl trains with FSDP2; set fsdp_version: 2 in the launch config "
                              "(configs/accelerate/fsdp.yaml)")
        if self.backend == "deepspeed":
            plugin = self.accelerator.state.deepspeed_plugin
            plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = int(micro_batch_size)
            plugin.deepspeed_config["gradient_clipping"] = float(grad_clip)
        module, optimizer = self.accelerator.prepare(module, optimizer)
        self._prepared_modules.append(module)
        self._prepared_optimizers.append(optimizer)
        return module, optimizer

    def manages(self, obj: Any) -> bool:
        """True for an optimizer prepared here: its state is saved and loaded by :meth:`save_state`."""
        return any(obj is o for o in self._prepared_optimizers)

    def manages_module(self, module: Any) -> bool:
        """True for a module prepared here."""
        return any(module is m for m in self._prepared_modules)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The prepared model's autocast, for forward passes of modules that were not prepared."""
        with self.accelerator.autocast():
            yield

    # ------------------------------------------------------------------ collectives

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every process's ``tensor`` (same shape on all) along dim 0, in rank order."""
        if self.world_size == 1:
            return tensor
        return self.accelerator.gather(tensor.to(self.device).contiguous()).to(tensor.device)

    def even_shard(self, n: int) -> tuple[list[int], int]:
        """This process's rows of ``n`` (contiguous, in rank order), padded to ``ceil(n / world_size)`` on every
        process by repeating row ``n - 1``; returns ``(rows, real)``, the first ``real`` being its own.

        Every process then runs the same number of forward passes, which FSDP2 needs (a forward all-gathers the
        shards: a process with a batch fewer would leave the others waiting until the timeout). Drop the padded rows'
        results after :meth:`gather` (``keep`` masks), at the cost of at most ``world_size - 1`` extra rows."""
        per = -(-n // self.world_size)
        start = self.rank * per
        real = max(0, min(per, n - start))
        return list(range(start, start + real)) + [n - 1] * (per - real), real

    def gather_object(self, items: list) -> list:
        """Concatenate every process's list, in rank order."""
        if self.world_size == 1:
            return list(items)
        from accelerate.utils import gather_object

        return gather_object(list(items))

    def broadcast_object(self, obj: Any) -> Any:
        """The main process's ``obj`` on every process (picklable objects)."""
        if self.world_size == 1:
            return obj
        from accelerate.utils import broadcast_object_list

        box = [obj]
        broadcast_object_list(box, from_process=0)
        return box[0]

    def all_reduce_max(self, value: float) -> float:
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], device=self.device, dtype=torch.float64)
        return float(self.accelerator.reduce(tensor, reduction="max") if hasattr(self.accelerator, "reduce")
                     else self.gather(tensor).max())

    def all_reduce_mean_(self, tensors: list[torch.Tensor | None]) -> None:
        """Average ``tensors`` across processes, in place (None entries are skipped).

        For models outside the prepared (DDP) one, e.g. a reward's discriminator head: its gradients go
        through here before its optimizer steps. One flat all-reduce for the whole list.
        """
        present = [t for t in tensors if t is not None]
        if self.world_size == 1 or not present:
            return
        flat = torch.cat([t.detach().reshape(-1).to(self.device, torch.float32) for t in present])
        flat = self.accelerator.reduce(flat, reduction="mean")
        offset = 0
        for t in present:
            t.copy_(flat[offset:offset + t.numel()].view_as(t).to(t.device, t.dtype))
            offset += t.numel()

    def any(self, flag: bool) -> bool:
        """True on every process if ``flag`` is True on any (e.g. a stop request on one rank)."""
        if self.world_size == 1:
            return flag
        return bool(self.gather(torch.tensor([float(flag)])).max() > 0)

    # ------------------------------------------------------------------ the update

    def _deepspeed_engine(self):
        wrapped = getattr(self.accelerator, "deepspeed_engine_wrapped", None)
        if wrapped is None:
            raise RuntimeError("DeepSpeed launch but no engine was prepared; call prepare_training first")
        return wrapped.engine

    def backward(self, loss: torch.Tensor, module: torch.nn.Module, *, sync: bool) -> None:
        """Backward pass; gradients are all-reduced across processes only when ``sync`` is True (the
        last micro-batch before an optimizer step), as gradient accumulation under DDP requires.

        FSDP2 reduce-scatters every micro-batch (the sharded gradients accumulate; skipping the reduction
        would keep whole unsharded gradients in memory). DeepSpeed is told where the accumulation boundary
        is and steps in :meth:`clip_grad_norm_`, not here (accelerate's own backward would step after every
        micro-batch)."""
        backend = self.backend
        if backend == "deepspeed":
            engine = self._deepspeed_engine()
            engine.set_gradient_accumulation_boundary(sync)
            engine.backward(loss)
            return
        if sync or self.world_size == 1 or backend.startswith("fsdp"):
            self.accelerator.backward(loss)
            return
        with self.accelerator.no_sync(module):
            self.accelerator.backward(loss)

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        """Clip the synchronised gradients to ``max_norm``; returns their norm before clipping.

        Under DeepSpeed this is where the engine steps (it clips to ``optim.grad_clip``, steps and zeroes the
        gradients itself; the prepared optimizer's ``step`` is then a no-op), and the norm is the engine's.
        With an fp16 gradient scaler a non-finite norm also updates the scaler (the caller skips the step,
        which would otherwise leave the scaler waiting for it)."""
        if self.backend == "deepspeed":
            engine = self._deepspeed_engine()
            engine.step()
            norm = engine.get_global_grad_norm()
            return torch.tensor(float("nan") if norm is None else float(norm))
        if self.backend == "fsdp2":
            # accelerate's clip_grad_norm_ compares the parameter list with each model's using ==, which fails
            # when a model holds both sharded (DTensor) and plain parameters; its DTensor-aware clipping (the
            # per-mesh norms combined, then clipped per mesh) is what it would call for a partial list.
            self.accelerator.unscale_gradients()
            norm = self.accelerator._clip_grad_norm_dtensor_aware(list(parameters), max_norm)
            dtensor = _dtensor_class()
            norm = norm.full_tensor() if dtensor is not None and isinstance(norm, dtensor) else norm
        else:
            norm = self.accelerator.clip_grad_norm_(parameters, max_norm)
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and not math.isfinite(float(norm)):
            scaler.update()
        return norm

    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        with self.accelerator.main_process_first():
            yield

    # ------------------------------------------------------------------ checkpoint state

    def _skip_replicated_weights(self, models: list, *rest: Any) -> None:
        """accelerate's save / load pre-hook: drop the replicated (DDP / single-process) models' weights from
        what accelerate saves or loads; sharded ones (FSDP2, ZeRO) are saved before the hook and never in
        these lists."""
        if rest and isinstance(rest[0], list):  # save: (accelerator's models, weights to write, output_dir)
            rest[0].clear()  # only the weights: the first list is the accelerator's own
        else:  # load: (models to load, input_dir), a list built for this call
            models.clear()

    def trainable_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The module's trainable tensors, whole and on the CPU, on the main process (None elsewhere).

        Collective under FSDP2 (every process must call it): the shards are gathered with
        ``torch.distributed.checkpoint``'s full state dict, frozen base weights left out.
        """
        if self.backend == "fsdp2":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
            state = get_model_state_dict(module, options=options)
            return {k: v.detach().cpu().clone() for k, v in state.items()} if self.is_main else None
        if not self.is_main:
            return None
        plain = self.accelerator.unwrap_model(module, keep_torch_compile=False)
        names = {n for n, p in plain.named_parameters() if p.requires_grad}
        return {k: v.detach().cpu().clone() for k, v in plain.state_dict().items() if k in names}

    def gather_full(self, state: Any) -> Any:
        """``state`` with every sharded tensor (DTensor) replaced by the whole tensor on the CPU.

        Collective when ``state`` holds DTensors (an EMA of FSDP2 parameters): every process calls it with
        the same structure."""
        dtensor = _dtensor_class()
        if dtensor is None:
            return state

        def whole(value):
            if isinstance(value, dtensor):
                return value.full_tensor().detach().cpu()
            if isinstance(value, dict):
                return {k: whole(v) for k, v in value.items()}
            if isinstance(value, list):
                return [whole(v) for v in value]
            return value

        return whole(state)

    def shard_like(self, loaded: Any, current: Any) -> Any:
        """``loaded`` (whole tensors, as :meth:`gather_full` saved them) placed like ``current``: where
        ``current`` holds a DTensor, the whole tensor is distributed over the same mesh and placements."""
        dtensor = _dtensor_class()
        if dtensor is None:
            return loaded
        from torch.distributed.tensor import distribute_tensor

        def place(new, old):
            if isinstance(old, dtensor) and isinstance(new, torch.Tensor) and not isinstance(new, dtensor):
                local = old.to_local()
                return distribute_tensor(new.to(device=local.device, dtype=old.dtype), old.device_mesh, old.placements)
            if isinstance(new, dict) and isinstance(old, dict):
                return {k: place(v, old.get(k)) for k, v in new.items()}
            if isinstance(new, list) and isinstance(old, list) and len(new) == len(old):
                return [place(n, o) for n, o in zip(new, old)]
            return new

        return place(loaded, current)

    def save_state(self, directory: str) -> None:
        """``accelerator.save_state(directory)`` on every process (collective under FSDP2 / ZeRO)."""
        kwargs = {"exclude_frozen_parameters": True} if self.backend == "deepspeed" else {}
        self.accelerator.save_state(directory, safe_serialization=True, **kwargs)

    def load_state(self, directory: str) -> None:
        """``accelerator.load_state(directory)`` on every process (collective under FSDP2 / ZeRO)."""
        # DeepSpeed: the frozen base is not in the checkpoint (see save_state); its weights come from the model.
        kwargs = {"load_module_strict": False} if self.backend == "deepspeed" else {}
        self.accelerator.load_state(directory, **kwargs)

    # ------------------------------------------------------------------ the end

    def close(self) -> None:
        """End the run: synchronise, then destroy the process group (clean gloo teardown)."""
        if self.world_size > 1:
            import torch.distributed as torch_dist

            self.accelerator.wait_for_everyone()
            self.accelerator.end_training()
            if torch_dist.is_available() and torch_dist.is_initialized():
                torch_dist.destroy_process_group()
        else:
            self.accelerator.end_training()


def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed support
        return None
    return DTensor


def check_dtype_agrees(mixed_precision: str, dtype: str) -> None:
    """Refuse a ``model.dtype`` that contradicts a launch config's ``mixed_precision``.

    ``bf16`` autocast runs float32 weights (classic AMP) or bfloat16 weights; ``fp16`` runs float32 or float16
    weights; without mixed precision any dtype runs as it is. A bfloat16 model under fp16 autocast (or the
    reverse) would silently compute in a third precision.

    Raises:
        ConfigError: they disagree, or a mixed precision flowrl does not run (fp8); the message says the fix.
    """
    from flowrl.config import ConfigError

    if mixed_precision not in _AGREEING_DTYPES:
        raise ConfigError("model.dtype", f"the launch config's mixed_precision {mixed_precision!r} is not supported "
                          "by flowrl; launch with mixed_precision no, bf16 or fp16")
    allowed = _AGREEING_DTYPES[mixed_precision]
    if allowed is not None and dtype not in allowed:
        other = {"bfloat16": "bf16", "float16": "fp16"}.get(dtype, "no")
        raise ConfigError("model.dtype", f"{dtype} disagrees with the launch config's mixed_precision "
                          f"{mixed_precision}; set model.dtype to {' or '.join(allowed)}, or launch with "
                          f"mixed_precision {other}")


def exit_process(code: int) -> int:
    """The exit of a process that may have joined a process group (``accelerate launch``, ``torchrun``).

    After :meth:`Dist.close` has destroyed the group, the interpreter's teardown can still abort in gloo's
    C++ threads ("terminate called without an active exception", about one exit in ten on CPU), which turns a
    finished run into a failed launch. A process started by a distributed launcher (``WORLD_SIZE`` > 1)
    therefore flushes its streams and leaves with ``os._exit(code)``; any other process gets ``code`` back.
    Call it last, after every output is written."""
    import os
    import sys

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
