"""Prompt groups: each epoch, ``groups`` prompts, each repeated ``group_size`` times, with global
sample ids and per-sample seeds, sharded across processes.

Everything is a pure function of ``(seed, epoch)`` and the global sample index, never of the rank
(docs/architecture.md, "Conventions"): 1 process and N processes see the same samples, and a resumed run sees the
same samples as one that never stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowrl.config import ConfigError
from samplers import derive_seed, make_sample_seeds

__all__ = ["EpochBatch", "PromptGroups"]


@dataclass
class EpochBatch:
    """One process's share of an epoch's samples (``n`` of them) and the epoch's global layout.

    Attributes:
        prompts / metadata: ``[n]`` this shard's prompts and their metadata.
        group_ids: ``[n]`` int64 group of each sample (global numbering).
        sample_ids: ``[n]`` int64 global sample index.
        sample_seeds: ``[n]`` int64 per-sample seeds (initial and SDE noise).
        global_size: samples in the epoch over all processes.
        shard: ``slice`` of the global order this process holds.
    """

    prompts: list[str]
    metadata: list[dict]
    group_ids: torch.Tensor
    sample_ids: torch.Tensor
    sample_seeds: torch.Tensor
    global_size: int
    shard: slice


class PromptGroups:
    """Draws ``groups`` prompts per epoch (without replacement within an epoch when the set is large
    enough), repeats each ``group_size`` times, and gives process ``rank`` a contiguous shard.

    Args:
        prompts / metadata: the prompt set.
        groups: prompts per epoch.
        group_size: samples per prompt (k).
        seed: run seed.
        num_processes / rank: the distributed layout; ``groups * group_size`` must divide evenly.

    Raises:
        ConfigError: the epoch's samples do not split evenly over the processes.
    """

    def __init__(self, prompts: list[str], metadata: list[dict] | None, *, groups: int, group_size: int,
                 seed: int, num_processes: int = 1, rank: int = 0):
        total = groups * group_size
        if total % num_processes:
            # A config mistake (the sampling section against the launch's process count): one line, no traceback.
            raise ConfigError("sampling.groups_per_epoch", f"groups_per_epoch x group_size = {groups} x {group_size} "
                              f"= {total} samples per epoch do not split evenly over {num_processes} processes; "
                              f"make the product a multiple of {num_processes}")
        self.prompts = prompts
        self.metadata = metadata or [{} for _ in prompts]
        self.groups, self.group_size, self.seed = groups, group_size, seed
        self.num_processes, self.rank = num_processes, rank

    def epoch(self, epoch: int) -> EpochBatch:
        generator = torch.Generator().manual_seed(derive_seed(self.seed, epoch, 0x9E0))
        n_prompts = len(self.prompts)
        if self.groups <= n_prompts:
            chosen = torch.randperm(n_prompts, generator=generator)[: self.groups]
        else:
            chosen = torch.randint(n_prompts, (self.groups,), generator=generator)
        prompt_index = chosen.repeat_interleave(self.group_size)  # [N], groups contiguous
        total = prompt_index.numel()
        per_process = total // self.num_processes
        shard = slice(self.rank * per_process, (self.rank + 1) * per_process)
        sample_ids = torch.arange(total)[shard]
        local = prompt_index[shard].tolist()
        return EpochBatch(
            prompts=[self.prompts[i] for i in local],
            metadata=[dict(self.metadata[i]) for i in local],
            group_ids=(sample_ids // self.group_size).to(torch.int64),
            sample_ids=sample_ids,
            sample_seeds=make_sample_seeds(self.seed, epoch, sample_ids),
            global_size=total,
            shard=shard,
        )
