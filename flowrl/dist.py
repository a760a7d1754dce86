"""The one place (with the recipes) that touches ``accelerate`` and ``torch.distributed``.

:class:`Dist` wraps an ``accelerate.Accelerator``: rank and world size, gathers in rank order, the
backward pass with gradient synchronisation only on the last micro-batch, and a clean shutdown of
the process group (so a gloo run never aborts at exit after its work is done).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

__all__ = ["Dist"]


class Dist:
    """Distributed context of a run (a single process is world size 1).

    Args:
        mixed_precision: passed to ``Accelerator`` (``no`` on CPU).
        cpu: force CPU even when a GPU is visible.
    """

    def __init__(self, mixed_precision: str = "no", cpu: bool = False):
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs

        # Unused-parameter detection is off: every trainable parameter takes part in each backward.
        self.accelerator = Accelerator(mixed_precision=mixed_precision, cpu=cpu,
                                       kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=False)])

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
        return self.accelerator.device

    def prepare(self, *objects: Any) -> Any:
        return self.accelerator.prepare(*objects)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every process's ``tensor`` (same shape on all) along dim 0, in rank order."""
        if self.world_size == 1:
            return tensor
        return self.accelerator.gather(tensor.to(self.device).contiguous()).to(tensor.device)

    def gather_object(self, items: list) -> list:
        """Concatenate every process's list, in rank order."""
        if self.world_size == 1:
            return list(items)
        from accelerate.utils import gather_object

        return gather_object(list(items))

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

    def backward(self, loss: torch.Tensor, module: torch.nn.Module, *, sync: bool) -> None:
        """Backward pass; gradients are all-reduced across processes only when ``sync`` is True (the
        last micro-batch before an optimizer step), as gradient accumulation under DDP requires."""
        context = contextlib.nullcontext() if sync or self.world_size == 1 else self.accelerator.no_sync(module)
        with context:
            self.accelerator.backward(loss)

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        return self.accelerator.clip_grad_norm_(parameters, max_norm)

    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        with self.accelerator.main_process_first():
            yield

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
