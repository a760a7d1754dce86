"""Parameter snapshots of the trained weights ("old", "sampling" and EMA models of the forward-process
trainers) as checkpointable state, and a way to run the model with them.

A snapshot holds a copy of the model's *trained* tensors only (the LoRA weights, or the whole denoiser
for full fine-tuning), pulled toward the current weights by ``snap <- d snap + (1 - d) theta`` with a
decay schedule ``d(s)`` over optimizer steps (``flowrl.core.snapshots``, docs/trainers.md, "Snapshots").
To predict with it, :meth:`ParamSnapshot.active` swaps in a view of the denoiser that runs
``torch.func.functional_call`` with the snapshot's tensors: the live parameters are never written, so a
snapshot forward pass may come before or after the policy's forward pass of the same backward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from flowrl.config import bounds
from flowrl.core.snapshots import DecaySchedule, update_snapshot_

__all__ = ["SnapshotConfig", "ParamSnapshot", "optimizer_steps"]


@dataclass
class SnapshotConfig:
    """A decay schedule ``d(s) = initial if s < start else min(initial + (s - start) * slope, maximum)``
    over optimizer steps ``s`` (``d = 0``: a copy of the current weights; ``d = 1``: frozen)."""

    start: int = field(default=0, metadata=bounds(ge=0))
    initial: float = field(default=0.0, metadata=bounds(ge=0, le=1))
    slope: float = field(default=0.0, metadata=bounds(ge=0))
    maximum: float = field(default=0.0, metadata=bounds(ge=0, le=1))

    def schedule(self) -> DecaySchedule:
        return DecaySchedule(start=self.start, initial=self.initial, slope=self.slope, maximum=self.maximum)


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer steps taken so far (Adam's per-parameter step count; skipped updates do not count).

    Read from the optimizer's own state, so it is checkpointed with it and a resumed run agrees."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state and "step" in state:
                return int(state["step"])
    return 0


def _is_sharded(module: nn.Module) -> bool:
    """Whether ``module``'s trained parameters are FSDP2 shards (DTensors; duck-typed: only flowrl/dist.py imports
    torch.distributed)."""
    return any(type(p).__name__ == "DTensor" for p in module.parameters() if p.requires_grad)


class _SnapshotDenoiser(nn.Module):
    """The denoiser run with the snapshot's tensors in place of its trained parameters."""

    def __init__(self, network: nn.Module, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.network = network
        object.__setattr__(self, "_tensors", tensors)  # not registered: never a parameter, never in state_dict

    def forward(self, *args, **kwargs):
        return torch.func.functional_call(self.network, self._tensors, args, kwargs, strict=False)

    def __getattr__(self, name: str):
        # Adapters may read attributes of the denoiser (e.g. its config): answer them from the network.
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["network"], name)


class ParamSnapshot:
    """A copy of a model adapter's trained tensors, updated with a decay schedule.

    Args:
        model: the :class:`flowrl.models.base.FlowModel` whose trained tensors are copied (now).
        schedule: the decay ``d(s)`` used by :meth:`update` (None: only ``update(..., decay=...)``).
        dtype: storage dtype of the copy (default float32 whatever the model's dtype: repeated EMA
            updates in bf16 would round away small steps).
    """

    def __init__(self, model, schedule: DecaySchedule | None = None, *, dtype: torch.dtype = torch.float32):
        from flowrl.models.base import unwrap

        module = unwrap(model.denoiser)
        self.schedule = schedule
        self.tensors = {name: p.detach().to(dtype=dtype).clone() for name, p in module.named_parameters()
                        if p.requires_grad}
        if not self.tensors:
            raise ValueError("the model has no trainable parameters to snapshot")

    def _params(self, model) -> list[torch.Tensor]:
        from flowrl.models.base import unwrap

        named = dict(unwrap(model.denoiser).named_parameters())
        return [named[name] for name in self.tensors]

    def update(self, model, step: int | None = None, *, decay: float | None = None) -> float:
        """Pull the snapshot toward the model's current weights; returns the decay used.

        Args:
            model: the model adapter (its trained tensors are read).
            step: optimizer steps taken so far (the schedule's ``s``).
            decay: use this decay instead of the schedule's.
        """
        if decay is None:
            if self.schedule is None or step is None:
                raise ValueError("pass decay=..., or build the snapshot with a schedule and pass step=...")
            decay = self.schedule(int(step))
        update_snapshot_(list(self.tensors.values()), self._params(model), decay)
        return decay

    @contextlib.contextmanager
    def active(self, model) -> Iterator[None]:
        """Inside this context the model predicts with the snapshot's weights (no gradient reaches them).

        Under FSDP2 (sharded parameters) the swap is made in the sharded parameters themselves: FSDP2 gathers a
        module's shards in its forward pre-hook and registers the gathered tensors, which would overwrite what
        ``functional_call`` swaps in (the "snapshot" would silently predict with the live weights). Each process
        copies its shard of the snapshot into the live shards, runs the forward, and copies the live shards back,
        so the forward must be gradient-free there (as every recipe's snapshot forward is)."""
        from flowrl.models.base import unwrap

        if _is_sharded(unwrap(model.denoiser)):
            with self._swapped_in(model):
                yield
            return
        trained = model.denoiser
        first = next(iter(self.tensors.values()))
        tensors = self.tensors
        if first.device != model.device:
            tensors = {k: v.to(model.device) for k, v in tensors.items()}
            self.tensors = tensors  # move once, stay with the model
        model.denoiser = _SnapshotDenoiser(unwrap(trained), tensors)
        try:
            yield
        finally:
            model.denoiser = trained

    @contextlib.contextmanager
    def _swapped_in(self, model) -> Iterator[None]:
        """The snapshot's shards in the live (FSDP2) parameters for the duration, the live ones restored after."""
        from flowrl.models.base import _reshard, unwrap

        if torch.is_grad_enabled():
            raise RuntimeError("a parameter snapshot under FSDP2 predicts by swapping the sharded weights, so its "
                               "forward pass must run under torch.no_grad()")
        module = unwrap(model.denoiser)
        _reshard(module)  # the shards registered again (a forward leaves the root's gathered), and read next forward
        params = self._params(model)
        with torch.no_grad():
            live = [p.detach().clone() for p in params]  # this process's shards: 1/N of the trained weights
            for param, tensor in zip(params, self.tensors.values()):
                param.copy_(tensor.to(dtype=param.dtype))
        try:
            yield
        finally:
            _reshard(module)
            with torch.no_grad():
                for param, tensor in zip(self._params(model), live):
                    param.copy_(tensor)

    def velocity_fn(self, model, guidance: float | None = None):
        """``velocity_fn(x, sigma, cond)`` of the snapshot (e.g. for ``collect_epoch(velocity_fn=...)``)."""
        inner = model.velocity_fn(guidance)

        def velocity(x: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
            with self.active(model):
                return inner(x, sigma, cond)

        return velocity

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.tensors.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        from flowrl.models.base import ModelLoadError

        if set(state) != set(self.tensors):
            missing, extra = sorted(set(self.tensors) - set(state))[:3], sorted(set(state) - set(self.tensors))[:3]
            raise ModelLoadError(f"the checkpoint's snapshot does not match the model's trainable parameters "
                                 f"(missing e.g. {missing}, unexpected e.g. {extra}); was it saved with the same "
                                 f"model and LoRA settings?")
        for name, tensor in self.tensors.items():
            tensor.copy_(state[name].to(device=tensor.device, dtype=tensor.dtype))
